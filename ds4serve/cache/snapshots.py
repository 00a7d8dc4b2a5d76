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

    def rings(self, li: int) -> dict[str, torch.Tensor]:
        """Layer ``li``'s ring tensors of the arena (entry ``i`` = rows ``[i * R, (i + 1) * R)``)."""
        return {n: t for n, t in self.layers[li].items() if n in _RINGS}

    def save_rings(self, state: ModelState, slot: int, index: int) -> None:
        """Copy ``slot``'s rings into arena entry ``index``."""
        for mine, live in self._pairs(state, slot, None, index):
            mine.copy_(live)

    def save_tail(self, state: ModelState, page: int, index: int) -> None:
        """Copy the rows of ``page`` (a snapshot's partial page) into entry ``index``."""
        for mine, live in self._pairs(state, None, page, index):
            mine.copy_(live)

    def load(self, index: int, state: ModelState, slot: int, tail_page: int | None) -> None:
        """Copy arena entry ``index`` into ``slot``'s rings (and into ``tail_page``)."""
        for mine, live in self._pairs(state, slot, tail_page, index):
            live.copy_(mine)

    def _pairs(self, state: ModelState, slot: int | None, page: int | None, index: int):
        """(arena rows, live rows) views: every ring of ``slot`` and every pool row of ``page`` (each
        skipped when None), against arena entry ``index``."""
        for li, (ly, st) in enumerate(zip(self.layout.layers, state.layers)):
            for name, mine in self.layers[li].items():
                live = getattr(st, name)
                per = mine.shape[0] // self.n  # rows per entry: a ring's length, or a page's rows
                if name in _POOLS:
                    if page is None:
                        continue
                    at = page
                else:
                    if slot is None:
                        continue
                    at = slot
                yield mine[index * per:(index + 1) * per], live[at * per:(at + 1) * per]

    # ---- lower tiers (host memory, disk): a snapshot as plain host tensors --------------------
    def export(self, index: int, state: ModelState, pages: tuple[int, ...],
               tail: bool) -> list[dict[str, torch.Tensor]]:
        """Host copies of a snapshot: entry ``index``'s rings, and the pool rows of ``pages`` (its full
        pages) followed by the entry's partial page when ``tail``."""
        out = []
        for li, st in enumerate(state.layers):
            layer = {}
            for name, mine in self.layers[li].items():
                per = mine.shape[0] // self.n
                own = mine[index * per:(index + 1) * per]
                if name not in _POOLS:
                    layer[name] = own.to("cpu", copy=True)
                    continue
                live = getattr(st, name)
                parts = [live[p * per:(p + 1) * per] for p in pages] + ([own] if tail else [])
                layer[name] = torch.cat(parts).to("cpu") if parts else own[:0].to("cpu", copy=True)
            out.append(layer)
        return out

    def import_(self, tensors: list[dict[str, torch.Tensor]], index: int, state: ModelState,
                pages: list[int], tail: bool) -> None:
        """The reverse of ``export``: rings and partial page into entry ``index``, full-page rows into
        ``pages`` of the pool. Shapes are checked first (ValueError, nothing written, if they differ)."""
        want = len(pages) + int(tail)
        if len(tensors) != len(self.layers):
            raise ValueError(f"{len(tensors)} layers, the state has {len(self.layers)}")
        for li, mine_layer in enumerate(self.layers):
            if set(tensors[li]) != set(mine_layer):
                raise ValueError(f"layer {li}: tensors {sorted(tensors[li])}, expected {sorted(mine_layer)}")
            for name, mine in mine_layer.items():
                per = mine.shape[0] // self.n
                rows = per * want if name in _POOLS else per
                got = tensors[li][name]
                if tuple(got.shape) != (rows, mine.shape[1]) or got.dtype != mine.dtype:
                    raise ValueError(f"layer {li} {name}: {tuple(got.shape)} {got.dtype}, expected "
                                     f"{(rows, mine.shape[1])} {mine.dtype}")
        for li, st in enumerate(state.layers):
            for name, mine in self.layers[li].items():
                per = mine.shape[0] // self.n
                src = tensors[li][name].to(mine.device)
                if name not in _POOLS:
                    mine[index * per:(index + 1) * per].copy_(src)
                    continue
                live = getattr(st, name)
                for i, p in enumerate(pages):
                    live[p * per:(p + 1) * per].copy_(src[i * per:(i + 1) * per])
                if tail:
                    mine[index * per:(index + 1) * per].copy_(src[len(pages) * per:])
