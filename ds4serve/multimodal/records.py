"""What a prepared image is, as it travels from the HTTP handler to the engine.

The server decodes and resizes an image in a worker thread and expands its placeholder into an
image block at a known absolute position; the result is an ``ImageInput`` (pixels as patches plus
the block layout). The engine's encoder worker turns the patches into aligner rows (``[n_h * n_w,
hidden]``) and publishes them; a prefill pass places them into the IMAGE slots of the block through
``block.perm``. Block token ids are out-of-vocabulary sentinels ``vocab_size + TokenType``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import ImageBlock


@dataclass(frozen=True)
class ImageInput:
    patches: torch.Tensor  # [vit_h * vit_w, 3, patch, patch] float32, CPU
    vit_h: int
    vit_w: int
    block: ImageBlock  # absolute positions in the prompt; block.n_h / n_w are the LLM grid
    content_hash: str  # sha256 of the decoded image bytes + geometry (for logs and caches)

    @property
    def n_rows(self) -> int:
        return self.block.n_h * self.block.n_w

    @property
    def span(self) -> tuple[int, int]:
        """Half-open block range ``[start, end)`` (lead pads included)."""
        return self.block.start, self.block.end

    @property
    def patch_bytes(self) -> int:
        return self.patches.numel() * self.patches.element_size()


def sentinel_ids(block: ImageBlock, vocab_size: int) -> list[int]:
    """Token ids of a block: ``vocab_size + type`` for every token (the reference scheme)."""
    return [vocab_size + int(t) for t in block.types]
