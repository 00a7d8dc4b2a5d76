"""Server-side image preparation: rendered chat prompt -> expanded ids + image records.

This is the step between ``render_chat`` (which leaves one ``<｜deepseek_image｜>`` placeholder per
image) and the engine (which needs every image block spelled out as sentinel ids at known absolute
positions, plus the patches to encode). The order is chosen so that the cheapest refusals come first
and nothing big is decoded before the request has passed its byte limits (spec ds4-vision §6.2, §7.1):

1. count the images and check the placeholders match them (no I/O);
2. read every image's URL and ``detail`` (bad ``detail`` values fail before any fetch);
3. get the encoded bytes (``data:`` URLs, or the SSRF-safe fetcher when the operator enabled remote
   images), checking the per-request byte total as it grows;
4. per image: decode (pixel limit checked from the header), plan the reference resize, cut patches,
   hash — the decoded image is dropped as soon as its patches exist;
5. expand the placeholders left to right. The block's lead pads depend on its *absolute* start
   (spec §3.2), so each block's start is the running length of the already-expanded output
   (spec §6.1 "Expansion order"); expanding out of order would misplace every later block.

A pipeline holds only immutable configuration, so one instance serves all preprocessing worker
threads at once.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from PIL import Image

from .fetch import FetchPolicy, fetch_image_bytes
from .images import ImageError, ImageLimits, check_request_images, decode_image, parse_data_url
from .layout import ImageBlock, image_block
from .records import ImageInput, sentinel_ids
from .resize import DETAIL_LEVELS, ImageGeometry, plan_resize, preprocess

__all__ = ["ImagePipeline", "PreparedPrompt"]

log = logging.getLogger("ds4serve.multimodal")

_HASH_STRIP_BYTES = 4 * 2**20  # hash decoded pixels in strips so a 64 MP image is not copied whole


class RenderedLike(Protocol):
    """What ``prepare`` needs from ``chat.template.RenderedPrompt``."""

    ids: list[int]
    images: list[dict[str, Any]]
    image_positions: list[int]


@dataclass
class PreparedPrompt:
    """A prompt ready for the engine: sentinel ids in place of placeholders, one record per image."""

    ids: list[int]
    images: list[ImageInput] = field(default_factory=list)

    @property
    def blocks(self) -> list[tuple[int, int]]:
        """Half-open ``[start, end)`` spans of the image blocks, in prompt order (sorted, disjoint)."""
        return [(img.span.start, img.span.end) for img in self.images]


@dataclass(frozen=True)
class _Decoded:
    """One image after preprocessing, before it has a position in the prompt."""

    patches: torch.Tensor
    geom: ImageGeometry
    content_hash: str


@contextmanager
def _about_image(k: int) -> Iterator[None]:
    """Prefix ImageErrors with the (1-based) image number so the user knows which one to fix."""
    try:
        yield
    except ImageError as exc:
        raise ImageError(f"image {k}: {exc}") from None


def _image_source(part: Any) -> tuple[str, str]:
    """``(url, detail)`` of one content part.

    Accepts the Chat Completions shape ``{"image_url": {"url", "detail"}}`` and the flatter
    Responses/``image`` shapes ``{"image_url": "<url>", "detail": ...}`` / ``{"image": ...}``,
    because ``render_chat`` turns all of them into placeholders.
    """
    if not isinstance(part, Mapping):
        raise ImageError("is not an image content part")
    ref = part.get("image_url", part.get("image"))
    detail = part.get("detail")
    if isinstance(ref, Mapping):
        detail = ref.get("detail", detail)
        ref = ref.get("url")
    if not isinstance(ref, str) or not ref.strip():
        raise ImageError("has no image URL; send {\"type\": \"image_url\", \"image_url\": {\"url\": "
                         "\"data:image/png;base64,...\"}}")
    detail = "auto" if detail is None else detail
    if detail not in DETAIL_LEVELS:
        raise ImageError(f"unknown detail {detail!r}; use one of {', '.join(DETAIL_LEVELS)}")
    return ref.strip(), detail


def _hash_image(img: Image.Image, geom: ImageGeometry, patch: int) -> str:
    """sha256 of the decoded RGB pixels plus everything that shapes the patches.

    Two different images of the same size expand to identical ids (spec §7.4), so caches need this
    content key; the geometry is included so that the same pixels at another detail level (another
    canvas) never share an encoder-cache entry.
    """
    h = hashlib.sha256(f"ds4v-rgb {img.mode} {img.width}x{img.height}\n".encode())
    rows = max(1, _HASH_STRIP_BYTES // max(1, 3 * img.width))
    for top in range(0, img.height, rows):
        h.update(img.crop((0, top, img.width, min(img.height, top + rows))).tobytes())
    h.update((f"\npatch={patch} canvas={geom.canvas_w}x{geom.canvas_h} vit={geom.vit_h}x{geom.vit_w} "
              f"llm={geom.llm_h}x{geom.llm_w} stretch={int(geom.stretch)}").encode())
    return h.hexdigest()


class ImagePipeline:
    """Turns a rendered prompt with image placeholders into a :class:`PreparedPrompt`.

    ``max_block_tokens`` is the engine's largest single prefill pass: an image block must be
    prefilled in one pass (it is never split, spec §4.2), so a wider block could never run.
    """

    def __init__(self, vision_cfg: Any, vocab_size: int, image_token_id: int,
                 limits: ImageLimits = ImageLimits(), fetch: FetchPolicy = FetchPolicy(),
                 max_block_tokens: int | None = None):
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if max_block_tokens is not None and max_block_tokens < 1:
            raise ValueError(f"max_block_tokens must be >= 1 or None, got {max_block_tokens}")
        self.vision = vision_cfg
        self.vocab_size = vocab_size
        self.image_token_id = image_token_id
        self.limits = limits
        self.fetch = fetch
        self.max_block_tokens = max_block_tokens
        if max_block_tokens is not None and max_block_tokens < vision_cfg.max_n_token:
            log.warning("max prefill pass (%d tokens) is below the image block cap (%d); larger images will be "
                        "refused", max_block_tokens, vision_cfg.max_n_token)

    @classmethod
    def for_engine(cls, core: Any, tokenizer: Any, fetch: FetchPolicy | None = None,
                   limits: ImageLimits | None = None) -> ImagePipeline:
        """Build from a running engine core and its tokenizer (the ids ``render_chat`` emits);
        ``fetch`` is the operator's remote-image policy (default: ``data:`` URLs only), ``limits`` the
        per-request image limits (default: ``ImageLimits()``)."""
        return cls.for_model(core.cfg, tokenizer, core.settings.max_prefill_tokens, fetch, limits)

    @classmethod
    def for_model(cls, cfg: Any, tokenizer: Any, max_block_tokens: int | None, fetch: FetchPolicy | None = None,
                  limits: ImageLimits | None = None) -> ImagePipeline:
        """Build from the served model's config (``ModelConfig``), its tokenizer and the engine's largest
        prefill pass (``max_block_tokens``): what the server knows without a core."""
        image_id = tokenizer.image_id if tokenizer.image_id is not None else cfg.vision.image_token_id
        return cls(cfg.vision, cfg.vocab_size, image_id, limits=limits or ImageLimits(), fetch=fetch or FetchPolicy(),
                   max_block_tokens=max_block_tokens)

    # --- public entry point -----------------------------------------------------------------

    def prepare(self, rendered: RenderedLike) -> PreparedPrompt:
        """Validate, fetch, decode, resize and patchify every image, then expand the placeholders.

        Raises ImageError (a 400 for the client) naming the offending image. Thread-safe: all
        state is local to the call.
        """
        parts = list(rendered.images)
        self._check_count(len(parts))
        positions = self._placeholder_positions(rendered.ids, rendered.image_positions, len(parts))
        sources = []
        for k, part in enumerate(parts, 1):
            with _about_image(k):
                sources.append(_image_source(part))
        payloads = self._gather_bytes([url for url, _ in sources])
        decoded = []
        for k, (data, (_, detail)) in enumerate(zip(payloads, sources), 1):
            with _about_image(k):
                decoded.append(self._decode(data, detail))
            payloads[k - 1] = b""  # release the encoded bytes as soon as the patches exist
        prepared = self._expand(rendered.ids, positions, decoded)
        log.debug("image pipeline: received %d images, expanded %d placeholders (%d -> %d prompt tokens)",
                  len(parts), len(prepared.images), len(rendered.ids), len(prepared.ids))
        return prepared

    # --- steps --------------------------------------------------------------------------------

    def _check_count(self, n: int) -> None:
        """Refuse too many images before touching any of them."""
        if n > self.limits.max_images:
            raise ImageError(f"request has {n} images; at most {self.limits.max_images} are allowed per request")

    def _placeholder_positions(self, ids: Sequence[int], positions: Sequence[int], n_images: int) -> list[int]:
        """Check that placeholders and images pair up one to one, in order.

        A stray placeholder would reach the model as a raw token, and a sentinel id already in the
        input would be mistaken for part of an image block (spec §7.10), so both are refused.
        """
        found = sum(1 for t in ids if t == self.image_token_id)
        if found != n_images or len(positions) != n_images:
            raise ImageError(f"the prompt has {found} image placeholders but {n_images} images were sent; every "
                             "image must be its own image_url content part")
        out = [int(p) for p in positions]
        if any(not 0 <= p < len(ids) or ids[p] != self.image_token_id for p in out) or out != sorted(set(out)):
            raise ImageError("image placeholder positions do not match the prompt")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise ImageError("the prompt contains token ids outside the vocabulary (reserved for image blocks)")
        return out

    def _gather_bytes(self, urls: list[str]) -> list[bytes]:
        """Encoded bytes of every image, with the request byte total checked as it grows.

        Checking the running total stops a request of many large remote images after the first one
        that crosses the limit instead of downloading all of them first.
        """
        payloads: list[bytes] = []
        for k, url in enumerate(urls, 1):
            with _about_image(k):
                payloads.append(self._image_bytes(url))
            check_request_images([len(p) for p in payloads], self.limits)
        return payloads

    def _image_bytes(self, url: str) -> bytes:
        """``data:`` URLs inline, ``http(s)`` through the fetcher, anything else refused."""
        scheme = url.split(":", 1)[0].strip().lower() if ":" in url else ""
        if scheme in ("http", "https"):
            cap = min(self.fetch.max_bytes, self.limits.max_bytes)  # never download more than we would decode
            return fetch_image_bytes(url, replace(self.fetch, max_bytes=cap))
        return parse_data_url(url, self.limits)  # refuses other schemes with a message saying what to send

    def _decode(self, data: bytes, detail: str) -> _Decoded:
        """Bytes -> reference geometry, patches and content hash for one image."""
        img = decode_image(data, self.limits)
        v = self.vision
        geom = plan_resize(img.width, img.height, patch=v.patch_size, min_pixels=v.min_pixels,
                           max_n_token=v.max_n_token, max_wh_ratio=v.max_wh_ratio,
                           downsample=v.downsample_ratio, detail=detail)
        patches = preprocess(img, geom, patch=v.patch_size)
        return _Decoded(patches, geom, _hash_image(img, geom, v.patch_size))

    def _expand(self, ids: Sequence[int], positions: list[int], decoded: list[_Decoded]) -> PreparedPrompt:
        """Replace placeholders left to right; each block starts at the current output length."""
        out: list[int] = []
        images: list[ImageInput] = []
        cursor = 0
        for k, (pos, item) in enumerate(zip(positions, decoded), 1):
            out.extend(ids[cursor:pos])
            block = image_block(item.geom.llm_h, item.geom.llm_w, len(out))
            with _about_image(k):
                self._check_block(block, item)
            out.extend(sentinel_ids(block, self.vocab_size))
            images.append(ImageInput(patches=item.patches, vit_h=item.geom.vit_h, vit_w=item.geom.vit_w,
                                     block=block, content_hash=item.content_hash))
            cursor = pos + 1
        out.extend(ids[cursor:])
        return PreparedPrompt(ids=out, images=images)

    def _check_block(self, block: ImageBlock, item: _Decoded) -> None:
        """The block must fit one prefill pass, and it must agree with the image it stands for.

        The second group are internal invariants (a mismatch means the sizing and the layout code
        disagree, which would feed the wrong rows into the block), so they raise RuntimeError (a
        server bug), not ImageError (a client mistake).
        """
        if self.max_block_tokens is not None and block.length > self.max_block_tokens:
            raise ImageError(f"the image needs a {block.length}-token block, more than this server's "
                             f"{self.max_block_tokens}-token prefill pass, so it is too large for this server's "
                             "prefill pass; send a smaller image or use detail \"low\"")
        geom, ds = item.geom, self.vision.downsample_ratio
        consistent = ((block.n_h, block.n_w) == (geom.llm_h, geom.llm_w)
                      and (-(-geom.vit_h // ds), -(-geom.vit_w // ds)) == (geom.llm_h, geom.llm_w)
                      and item.patches.shape[0] == geom.vit_h * geom.vit_w
                      and block.length <= self.vision.max_n_token)
        if not consistent:
            raise RuntimeError(f"image block {block.n_h}x{block.n_w} (length {block.length}) does not match the "
                               f"image geometry {geom} / patches {tuple(item.patches.shape)}")
