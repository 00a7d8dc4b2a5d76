"""The image records, one per stage, as an image travels from the HTTP handler to the forward.

The server decodes and resizes an image in a worker thread and expands its placeholder into an
image block at a known absolute position; the result is an ``ImageInput`` (pixels as patches plus
the block layout). Everything below the server sees the image through two records derived from it
here, and only here:

* ``ImageSpan``: where the block lies (masks, chunk cuts, prefix-cache cuts never split it);
* ``ImageRows``: the encoder's aligner rows in *stream order* (aligner rows permuted by
  ``block.perm``) with the absolute positions of the IMAGE slots they fill.

Block token ids are out-of-vocabulary sentinels ``vocab_size + TokenType``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .layout import ImageBlock


@dataclass(frozen=True)
class ImageSpan:
    """An image block of a sequence, in absolute positions (what masks and split checks need)."""

    start: int  # first token of the block (lead pads included)
    end: int  # one past IMAGE_END
    visible_start: int  # IMAGE_START
    visible_end: int  # IMAGE_END (inclusive)

    @classmethod
    def of(cls, block: ImageBlock) -> ImageSpan:
        """The span of a laid-out block: the one place a span is built."""
        return cls(block.start, block.end, block.visible_start, block.visible_end)


class ImageRows(NamedTuple):
    """One image's encoded rows, ready to be placed into its block's IMAGE slots.

    A tuple on purpose: the step contract and the view unpack it as ``positions, rows``."""

    positions: tuple[int, ...]  # absolute positions of the IMAGE slots, stream order
    rows: torch.Tensor | None  # [len(positions), hidden] in stream order; None: not retained (refused)


@dataclass(frozen=True)
class ImageInput:
    """A prepared image: patches to encode and the block it fills in the prompt."""

    patches: torch.Tensor  # [vit_h * vit_w, 3, patch, patch] float32, CPU
    vit_h: int
    vit_w: int
    block: ImageBlock  # absolute positions in the prompt; block.n_h / n_w are the LLM grid
    content_hash: str  # sha256 of the decoded image bytes + geometry (for logs and caches)

    @property
    def n_rows(self) -> int:
        return self.block.n_h * self.block.n_w

    @property
    def span(self) -> ImageSpan:
        return ImageSpan.of(self.block)


def sentinel_ids(block: ImageBlock, vocab_size: int) -> list[int]:
    """Token ids of a block: ``vocab_size + type`` for every token (the reference scheme)."""
    return [vocab_size + int(t) for t in block.types]
