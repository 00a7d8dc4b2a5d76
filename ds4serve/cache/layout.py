"""Shapes and byte sizes of the per-sequence model state (spec ds4-text §10).

Two kinds of state per sequence:

* *fixed* (per slot, allocated once at start-up): the raw sliding-window ring of every layer and
  the compressor rings (per-token ``[C | Z+ape]`` of the last ``span`` positions, fp32) of every
  compressed layer (and of the CSA indexer's compressor);
* *growing* (paged): compressed rows (one per ``ratio`` tokens per compressed layer) and indexer
  key rows (CSA). A page covers ``page_tokens`` raw positions of *every* compressed layer, so one
  block table per sequence addresses all of them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..config import AttnKind, ModelConfig, lcm_of


@dataclass(frozen=True)
class LayerLayout:
    kind: AttnKind
    ratio: int  # 0 for sliding layers
    overlap: bool
    window: int
    head_dim: int
    index_head_dim: int

    @property
    def span(self) -> int:
        """Raw positions a compressed row pools (ring length of the compressor state)."""
        return self.ratio * (2 if self.overlap else 1)

    @property
    def comp_width(self) -> int:
        return 2 * self.head_dim * (2 if self.overlap else 1)

    @property
    def idx_width(self) -> int:
        return 4 * self.index_head_dim


@dataclass(frozen=True)
class StateLayout:
    cfg: ModelConfig
    dtype: torch.dtype
    page_tokens: int
    layers: tuple[LayerLayout, ...]

    @classmethod
    def build(cls, cfg: ModelConfig, dtype: torch.dtype, page_tokens: int | None = None) -> "StateLayout":
        ratios = cfg.distinct_ratios
        base = lcm_of(ratios) if ratios else 64
        if page_tokens is None:
            page_tokens = base * max(1, -(-64 // base))  # smallest multiple of the LCM that is >= 64
        if page_tokens % base:
            raise ValueError(f"page_tokens ({page_tokens}) must be a multiple of every compress ratio (LCM {base})")
        layers = tuple(
            LayerLayout(kind=k, ratio=r, overlap=k is AttnKind.CSA, window=cfg.sliding_window,
                        head_dim=cfg.head_dim, index_head_dim=cfg.index_head_dim)
            for k, r in zip(cfg.attn_kinds, cfg.compress_ratios)
        )
        return cls(cfg=cfg, dtype=dtype, page_tokens=page_tokens, layers=layers)

    @functools.cached_property  # read by every step's figures (``bytes_per_*``): worked out once
    def elem(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def rows_per_page(self, ratio: int) -> int:
        return self.page_tokens // ratio

    def bytes_per_slot(self) -> int:
        """Fixed state of one sequence slot: sliding rings plus compressor rings (fp32)."""
        return self._sizes[0]

    @functools.cached_property
    def _sizes(self) -> tuple[int, int]:
        """``(bytes_per_slot, bytes_per_page)``: the accounting asks for them every step."""
        return self._slot_bytes(), self._page_bytes()

    def _slot_bytes(self) -> int:
        total = 0
        for ly in self.layers:
            total += ly.window * ly.head_dim * self.elem
            if ly.ratio:
                total += ly.span * ly.comp_width * 4
                if ly.overlap:
                    total += ly.span * ly.idx_width * 4
        return total

    def bytes_per_token(self) -> float:
        """Average growth of the paged state per raw token (compressed + indexer rows)."""
        total = 0.0
        for ly in self.layers:
            if ly.ratio:
                row = ly.head_dim + (ly.index_head_dim if ly.overlap else 0)
                total += row * self.elem / ly.ratio
        return total

    def bytes_per_page(self) -> int:
        return self._sizes[1]

    def _page_bytes(self) -> int:
        total = 0
        for ly in self.layers:
            if ly.ratio:
                row = ly.head_dim + (ly.index_head_dim if ly.overlap else 0)
                total += self.rows_per_page(ly.ratio) * row * self.elem
        return total

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_tokens)

    def describe(self) -> str:
        return (
            f"state layout ({self.dtype}): {self.bytes_per_slot() / 2**20:.3f} MiB fixed per slot, "
            f"{self.bytes_per_token():.1f} B per token, page = {self.page_tokens} tokens = "
            f"{self.bytes_per_page() / 1024:.1f} KiB"
        )
