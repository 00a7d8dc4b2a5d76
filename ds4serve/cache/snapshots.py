"""Snapshot arena: copies of what pages cannot share (sliding rings, open compressor windows).

A prefix-cache snapshot at position ``H`` is everything of a sequence's state that is not a full
page below ``H``: the sliding-window ring of every layer, the compressor (and indexer) rings, and
the partial page that holds the rows of ``[H - H % page_tokens, H)``. Every snapshot has the same
size, so the arena is laid out like the slots of ``ModelState`` (one ring set and one tail page per
arena slot), reserved once when the cache is built (uninitialised: on the host only the slots in
use become resident) and logged with its size.
"""

from __future__ import annotations

import logging

import torch

from .layout import StateLayout
from .state import ModelState

log = logging.getLogger(__name__)

_RINGS = ("swa", "comp_ring", "idx_ring")
_POOLS = ("comp_pool", "idx_pool")


class SnapshotArena:
    def __init__(self, layout: StateLayout, n: int, device: torch.device):
        self.layout, self.n = layout, n
        self.layers: list[dict[str, torch.Tensor]] = []
        for ly, ref in zip(layout.layers, ModelState.shapes(layout)):
            tensors = {}
            for name, (rows_per, width, dtype) in ref.items():
                tensors[name] = torch.empty(n * rows_per, width, dtype=dtype, device=device)
            self.layers.append(tensors)
        log.info("prefix cache: snapshot arena of %d snapshots x %.3f MiB = %.1f MiB (reserved, touched as used)",
                 n, self.bytes_each() / 2**20, n * self.bytes_each() / 2**20)

    def bytes_each(self) -> int:
        return self.layout.bytes_per_slot() + self.layout.bytes_per_page()

    def _rows(self, name: str, li: int, index: int) -> slice:
        t = self.layers[li][name]
        per = t.shape[0] // self.n
        return slice(index * per, (index + 1) * per)

    def rings(self, li: int) -> dict[str, torch.Tensor]:
        """Layer ``li``'s ring tensors of the arena (entry ``i`` = rows ``[i * R, (i + 1) * R)``)."""
        return {n: t for n, t in self.layers[li].items() if n in _RINGS}

    def save_tail(self, state: ModelState, page: int, index: int) -> None:
        """Copy the rows of ``page`` (a snapshot's partial page) into entry ``index``."""
        for li, (ly, st) in enumerate(zip(self.layout.layers, state.layers)):
            if not ly.ratio:
                continue
            rpp = self.layout.rows_per_page(ly.ratio)
            for name in _POOLS:
                if name in self.layers[li]:
                    self.layers[li][name][index * rpp:(index + 1) * rpp].copy_(
                        getattr(st, name)[page * rpp:(page + 1) * rpp])

    def save(self, state: ModelState, slot: int, tail_page: int | None, index: int) -> None:
        """Copy ``slot``'s rings (and ``tail_page``'s rows) into arena entry ``index``."""
        self._copy(state, slot, tail_page, index, into_arena=True)

    def load(self, index: int, state: ModelState, slot: int, tail_page: int | None) -> None:
        """Copy arena entry ``index`` into ``slot``'s rings (and ``tail_page``)."""
        self._copy(state, slot, tail_page, index, into_arena=False)

    def _copy(self, state: ModelState, slot: int, tail_page: int | None, index: int, into_arena: bool) -> None:
        for li, (ly, st) in enumerate(zip(self.layout.layers, state.layers)):
            for name in _RINGS + _POOLS:
                if name not in self.layers[li]:
                    continue
                live = getattr(st, name)
                if name in _POOLS:
                    if tail_page is None:
                        continue
                    rpp = self.layout.rows_per_page(ly.ratio)
                    live_rows = slice(tail_page * rpp, (tail_page + 1) * rpp)
                else:
                    per = live.shape[0] // state.n_slots
                    live_rows = slice(slot * per, (slot + 1) * per)
                mine = self.layers[li][name][self._rows(name, li, index)]
                if into_arena:
                    mine.copy_(live[live_rows])
                else:
                    live[live_rows].copy_(mine)
