"""The engine's model state: fixed per-slot rings plus paged pools, allocated once.

``ModelState`` owns every state tensor of every layer for ``n_slots`` sequences and a page pool
of ``n_pages`` pages. Nothing is allocated lazily at run time: the sizes are fixed at start-up
and logged. Slots and pages are handed out by the engine; the model sees them only through
``LayerState`` tensors and a ``BatchView``.

Under the ``CacheManager`` (``zero_on_handout``) the pools are reserved uninitialised and each page
is zeroed the first time it is handed out (``zero_fresh``): on the host an untouched page costs no
resident memory, so a pool sized for 16 full-length sequences costs what the traffic uses (the
Flash-shaped checkpoint's 1,024-page pool: 162 MiB reserved, ~8 MiB touched by 16 streams of 384
tokens), and a page is still zero, as it always was, when a sequence first gets it.
"""

from __future__ import annotations

import logging

import torch

from ..model.batch import LayerState
from .layout import StateLayout
from .pages import PageAllocator

log = logging.getLogger(__name__)


class ModelState:
    def __init__(self, layout: StateLayout, n_slots: int, n_pages: int, device: torch.device | str,
                 zero_on_handout: bool = False):
        if n_slots < 1:
            raise ValueError("at least one sequence slot is required")
        self.layout = layout
        self.n_slots = n_slots
        self.device = torch.device(device)
        self.pages = PageAllocator(n_pages)
        # 1 once a page's pool rows are zero; all of them at once unless the owner of the page
        # allocator (CacheManager) promises to call ``zero_fresh`` on every page it hands out
        self._zeroed = bytearray(n_pages) if zero_on_handout else bytearray(b"\x01" * n_pages)
        self.layers: list[LayerState] = [self._alloc_layer(sh, n_slots, n_pages) for sh in self.shapes(layout)]
        log.info(
            "allocated model state: %d slots x %.3f MiB fixed = %.1f MiB; %d pages x %.1f KiB = %.1f MiB "
            "(%d tokens of compressed state), plus one scratch page for padded decode rows",
            n_slots, layout.bytes_per_slot() / 2**20, n_slots * layout.bytes_per_slot() / 2**20,
            n_pages, layout.bytes_per_page() / 1024, n_pages * layout.bytes_per_page() / 2**20,
            n_pages * layout.page_tokens,
        )

    @staticmethod
    def shapes(layout: StateLayout) -> list[dict[str, tuple[int, int, torch.dtype]]]:
        """Per layer: tensor name -> (rows per slot for rings / per page for pools, width, dtype)."""
        out = []
        for ly in layout.layers:
            shape = {"swa": (ly.window, ly.head_dim, layout.dtype)}
            if ly.ratio:
                rpp = layout.rows_per_page(ly.ratio)
                shape["comp_ring"] = (ly.span, ly.comp_width, torch.float32)
                shape["comp_pool"] = (rpp, ly.head_dim, layout.dtype)
                if ly.overlap:
                    shape["idx_ring"] = (ly.span, ly.idx_width, torch.float32)
                    shape["idx_pool"] = (rpp, ly.index_head_dim, layout.dtype)
            out.append(shape)
        return out

    def _alloc_layer(self, shape: dict[str, tuple[int, int, torch.dtype]], n_slots: int, n_pages: int) -> LayerState:
        dev = self.device
        tensors = {}
        for name, (per, width, dtype) in shape.items():
            if name.endswith("_pool"):
                # one page past the budget: the scratch page that padded rows of fixed-shape decode
                # forwards write to (never handed out, never read)
                tensors[name] = self._fresh_pool((n_pages + 1) * per, width, dtype)
            else:
                tensors[name] = torch.zeros(n_slots * per, width, dtype=dtype, device=dev)
        return LayerState(**tensors)

    def _fresh_pool(self, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """Pool rows uninitialised except the scratch page (written by padded rows, never read)."""
        if all(self._zeroed):
            return torch.zeros(rows, width, dtype=dtype, device=self.device)
        pool = torch.empty(rows, width, dtype=dtype, device=self.device)
        pool[rows - rows // (self.pages.n_pages + 1):].zero_()
        return pool

    def zero_fresh(self, pages: list[int]) -> None:
        """Zero the pool rows of every page in ``pages`` that was never handed out before."""
        fresh = [p for p in pages if not self._zeroed[p]]
        if not fresh:
            return
        for p in fresh:
            self._zeroed[p] = 1
        for lo, hi in _runs(sorted(fresh)):
            for ly, st in zip(self.layout.layers, self.layers):
                if not ly.ratio:
                    continue
                rpp = self.layout.rows_per_page(ly.ratio)
                for pool in (st.comp_pool, st.idx_pool):
                    if pool is not None:
                        pool[lo * rpp:hi * rpp].zero_()

    @property
    def n_pages(self) -> int:
        return self.pages.n_pages

    def scratch_row(self, ratio: int) -> int:
        """First pool row of the scratch page for layers of compress ``ratio``."""
        return self.n_pages * self.layout.rows_per_page(ratio)

    def allocated_bytes(self) -> int:
        total = 0
        for st in self.layers:
            for t in (st.swa, st.comp_ring, st.comp_pool, st.idx_ring, st.idx_pool):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total


def _runs(pages: list[int]) -> list[tuple[int, int]]:
    """Sorted page numbers as half-open runs ``[lo, hi)`` of consecutive pages."""
    runs: list[tuple[int, int]] = []
    for p in pages:
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs
