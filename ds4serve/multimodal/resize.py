"""Reference image sizing (spec ds4-vision §2.3), detail levels (§2.5) and patchification.

DS4V has no Python reference package, so the sizing math is the contract and must be reproduced
bit for bit: the token-count table of spec §2.4 is the test. The steps, in the reference order:

1. Sizing-only clamp: a width above ``max_wh_ratio × height`` is cut to that (tall images are
   *not* clamped). Small images are then scaled up to about ``min_pixels`` (``int()`` truncation).
2. Both sides are rounded *up* to multiples of the patch size, giving the candidate canvas.
3. If that canvas's LLM grid needs more body tokens than ``max_n_token - 3`` (three tokens are
   reserved for the worst-case lead pads, so the whole block is always ``<= max_n_token``), the
   grid solver is called with a budget ``b`` that is decremented until the result fits.
4. The pixels are either stretched (only when the *original* width ``>= max_wh_ratio × height``)
   or letterboxed with grey (127,127,127), then normalised to [-1, 1] and cut into 14×14 tiles.

The float arithmetic (``math.sqrt``, ``int`` and ``floor``, and the operation order) follows the
reference on purpose: a different but "equivalent" formula can move a canvas by one patch on some
inputs and change the token count, which desynchronises the prompt layout from the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps

from ds4serve.multimodal.layout import COMPRESS_ALIGN, block_length, body_tokens

__all__ = [
    "DETAIL_LEVELS",
    "LOW_DETAIL_PIXELS",
    "LETTERBOX_FILL",
    "ImageGeometry",
    "plan_resize",
    "low_detail_size",
    "preprocess",
]

DETAIL_LEVELS = ("auto", "high", "original", "low")
LOW_DETAIL_PIXELS = 512 * 512  # the first-party client's low-detail budget (spec §2.5)
LETTERBOX_FILL = (127, 127, 127)


@dataclass(frozen=True)
class ImageGeometry:
    """Everything the engine needs to know about one image before running the encoder.

    ``canvas_w × canvas_h`` is the resized pixel canvas (multiples of the patch size),
    ``vit_h × vit_w`` the ViT patch grid and ``llm_h × llm_w`` the aligner grid
    (``ceil(vit / downsample)``). ``stretch`` says whether the pixels are stretched onto the
    canvas (very wide originals) or letterboxed (everything else).
    """

    canvas_w: int
    canvas_h: int
    vit_h: int
    vit_w: int
    llm_h: int
    llm_w: int
    stretch: bool

    @property
    def n_image_rows(self) -> int:
        """Aligner output rows, i.e. IMAGE slots in the block."""
        return self.llm_h * self.llm_w

    @property
    def body_tokens(self) -> int:
        """Block tokens excluding the position-dependent lead pads (spec §2.4)."""
        return body_tokens(self.llm_h, self.llm_w)

    def block_length(self, start_pos: int) -> int:
        """Whole block length if the placeholder sits at absolute position ``start_pos``."""
        return block_length(self.llm_h, self.llm_w, start_pos)


def _ceil_div(a: int, b: int) -> int:
    """Exact integer ceiling division (no float rounding for large sides)."""
    return -(-a // b)


def _llm_grid(canvas_h: int, canvas_w: int, patch: int, downsample: int) -> tuple[int, int]:
    """Aligner grid for a canvas: ViT grid, then ceil-divided by the unshuffle factor."""
    return _ceil_div(canvas_h // patch, downsample), _ceil_div(canvas_w // patch, downsample)


def _canvas_tokens(canvas_h: int, canvas_w: int, patch: int, downsample: int) -> int:
    """Body tokens of the block a canvas would produce."""
    return body_tokens(*_llm_grid(canvas_h, canvas_w, patch, downsample))


def _solve(height: int, width: int, b: int, patch: int, downsample: int) -> tuple[int, int]:
    """Biggest canvas ``(h, w)`` whose grid roughly fits ``b`` tokens at this aspect ratio.

    ``w* = sqrt((b-2)/r + 1/4) - 1/2`` is the real root of ``r·w·(w+1) = b-2`` with
    ``r = H/W``: a grid of ``h = r·w`` rows of ``w + 1`` tokens plus START/END. The caller
    re-checks the exact token count (parity row and pads are not in this estimate) and retries
    with ``b - 1``, which is why this may overshoot slightly.
    """
    cell = patch * downsample
    r = height / width
    w_star = math.sqrt((b - 2) / r + 0.25) - 0.5
    h_star = w_star * r
    if w_star < 1.0:  # very tall: one column of an even number of rows
        n_h = (b - 2) // 2
        n_h -= n_h % 2
        if n_h < 2:
            raise ValueError(f"image token budget {b} is too small for a one-column grid")
        return n_h * cell, cell
    if h_star < 2.0:  # very wide: two rows
        n_w = (b - 2) // 2 - 1
        if n_w < 1:
            raise ValueError(f"image token budget {b} is too small for a two-row grid")
        return 2 * cell, n_w * cell
    n_w = math.floor(w_star)
    n_h = math.floor(h_star)
    n_h -= n_h % 2
    beta = min(n_w * patch * downsample / width, n_h * patch * downsample / height)
    return math.floor(height * beta / patch) * patch, math.floor(width * beta / patch) * patch


def _sizing_dims(width: int, height: int, max_wh_ratio: int, min_pixels: int) -> tuple[int, int]:
    """The (W, H) the solver sees: wide images clamped to the ratio, small ones scaled up."""
    if width > height * max_wh_ratio:
        width = int(height * max_wh_ratio)
    if width * height < min_pixels:
        s = math.sqrt(min_pixels / (width * height))
        width, height = int(width * s), int(height * s)
    return width, height


def low_detail_size(width: int, height: int, max_pixels: int = LOW_DETAIL_PIXELS) -> tuple[int, int]:
    """Aspect-preserving downscale to at most ``max_pixels`` (identity when already small enough).

    Each side is ``floor(side · sqrt(max_pixels / (W·H)))`` computed exactly with integer square
    roots, so ``1920×1080 → 682×384`` comes out exact instead of ``383.999…`` truncating to 383.
    """
    if width * height <= max_pixels:
        return width, height
    new_w = math.isqrt(width * max_pixels // height)
    new_h = math.isqrt(height * max_pixels // width)
    return max(1, new_w), max(1, new_h)


def _check_args(width: int, height: int, patch: int, max_n_token: int,
                max_wh_ratio: int, downsample: int, min_pixels: int) -> None:
    """Reject arguments for which the reference math is undefined (division by zero, empty grid)."""
    if width < 1 or height < 1:
        raise ValueError(f"image size must be at least 1x1, got {width}x{height}")
    if patch < 1 or downsample < 1 or max_wh_ratio < 1 or min_pixels < 0:
        raise ValueError(
            f"bad vision config: patch={patch}, downsample={downsample}, "
            f"max_wh_ratio={max_wh_ratio}, min_pixels={min_pixels}")
    if max_n_token - (COMPRESS_ALIGN - 1) < body_tokens(1, 1):
        raise ValueError(f"max_n_token={max_n_token} cannot hold even a 1x1 image block")


def plan_resize(
    width: int,
    height: int,
    *,
    patch: int = 14,
    min_pixels: int = 147456,
    max_n_token: int = 384,
    max_wh_ratio: int = 8,
    downsample: int = 3,
    detail: str = "auto",
) -> ImageGeometry:
    """Reference ``safe_resize`` for an image of ``width × height`` pixels (spec §2.3, §2.5).

    ``detail`` is "auto", "high" or "original" (all the reference as is) or "low" (downscale to at
    most 262,144 pixels first, then the reference; the sizing *and* the stretch decision see the
    downscaled size, as if the client had downscaled before sending). A lower ``max_n_token`` is
    the operator knob; never raise it above the checkpoint's 384.
    """
    if detail not in DETAIL_LEVELS:
        raise ValueError(f"unknown image detail {detail!r}; use one of {', '.join(DETAIL_LEVELS)}")
    _check_args(width, height, patch, max_n_token, max_wh_ratio, downsample, min_pixels)
    if detail == "low":
        width, height = low_detail_size(width, height)
    w, h = _sizing_dims(width, height, max_wh_ratio, min_pixels)
    canvas_h, canvas_w = _ceil_div(h, patch) * patch, _ceil_div(w, patch) * patch
    budget = max_n_token - (COMPRESS_ALIGN - 1)
    b = budget
    while _canvas_tokens(canvas_h, canvas_w, patch, downsample) > budget:
        canvas_h, canvas_w = _solve(h, w, b, patch, downsample)
        b -= 1
    vit_h, vit_w = canvas_h // patch, canvas_w // patch
    llm_h, llm_w = _llm_grid(canvas_h, canvas_w, patch, downsample)
    return ImageGeometry(
        canvas_w=canvas_w, canvas_h=canvas_h, vit_h=vit_h, vit_w=vit_w,
        llm_h=llm_h, llm_w=llm_w, stretch=width >= max_wh_ratio * height,
    )


def _fit_canvas(img: Image.Image, geom: ImageGeometry) -> Image.Image:
    """Stretch or letterbox onto the canvas exactly as the reference does (Pillow bicubic)."""
    size = (geom.canvas_w, geom.canvas_h)
    if geom.stretch:
        return img.resize(size, Image.BICUBIC)
    return ImageOps.pad(img, size, method=Image.BICUBIC, color=LETTERBOX_FILL, centering=(0.5, 0.5))


def preprocess(img: Image.Image, geom: ImageGeometry, patch: int = 14) -> torch.Tensor:
    """Pixels → float32 patches ``[vit_h·vit_w, 3, patch, patch]`` in row-major tile order.

    No EXIF transpose and alpha is dropped (not composited), as in the reference. The result is
    float32 so the caller chooses the encoder dtype (the reference casts to bf16).
    """
    if geom.canvas_h != geom.vit_h * patch or geom.canvas_w != geom.vit_w * patch:
        raise ValueError(f"geometry {geom} does not match patch size {patch}")
    canvas = _fit_canvas(img.convert("RGB"), geom)
    pixels = torch.from_numpy(np.asarray(canvas, dtype=np.float32).copy())  # [H, W, 3]
    x = (pixels.permute(2, 0, 1) / 255.0 - 0.5) / 0.5
    return (
        x.reshape(3, geom.vit_h, patch, geom.vit_w, patch)
        .permute(1, 3, 0, 2, 4)
        .reshape(geom.vit_h * geom.vit_w, 3, patch, patch)
        .contiguous()
    )
