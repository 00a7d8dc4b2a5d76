"""The engine's model state: fixed per-slot rings plus paged pools, allocated once.

``ModelState`` owns every state tensor of every layer for ``n_slots`` sequences and a page pool
of ``n_pages`` pages. Nothing is allocated lazily at run time: the sizes are fixed at start-up
and logged. Slots and pages are handed out by the engine; the model sees them only through
``LayerState`` tensors and a ``BatchView``.
"""

from __future__ import annotations

import logging

import torch

from ..model.batch import LayerState
from .layout import StateLayout
from .pages import PageAllocator

log = logging.getLogger(__name__)


class ModelState:
    def __init__(self, layout: StateLayout, n_slots: int, n_pages: int, device: torch.device | str):
        if n_slots < 1:
            raise ValueError("at least one sequence slot is required")
        self.layout = layout
        self.n_slots = n_slots
        self.device = torch.device(device)
        self.pages = PageAllocator(n_pages)
        self.layers: list[LayerState] = [self._alloc_layer(ly, n_slots, n_pages) for ly in layout.layers]
        log.info(
            "allocated model state: %d slots x %.3f MiB fixed = %.1f MiB; %d pages x %.1f KiB = %.1f MiB "
            "(%d tokens of compressed state), plus one scratch page for padded decode rows",
            n_slots, layout.bytes_per_slot() / 2**20, n_slots * layout.bytes_per_slot() / 2**20,
            n_pages, layout.bytes_per_page() / 1024, n_pages * layout.bytes_per_page() / 2**20,
            n_pages * layout.page_tokens,
        )

    def _alloc_layer(self, ly, n_slots: int, n_pages: int) -> LayerState:
        dev, dt = self.device, self.layout.dtype
        st = LayerState(swa=torch.zeros(n_slots * ly.window, ly.head_dim, dtype=dt, device=dev))
        if ly.ratio:
            # one page past the budget: the scratch page that padded rows of fixed-shape decode
            # forwards write to (never handed out, never read)
            rows = (n_pages + 1) * self.layout.rows_per_page(ly.ratio)
            st.comp_ring = torch.zeros(n_slots * ly.span, ly.comp_width, dtype=torch.float32, device=dev)
            st.comp_pool = torch.zeros(rows, ly.head_dim, dtype=dt, device=dev)
            if ly.overlap:
                st.idx_ring = torch.zeros(n_slots * ly.span, ly.idx_width, dtype=torch.float32, device=dev)
                st.idx_pool = torch.zeros(rows, ly.index_head_dim, dtype=dt, device=dev)
        return st

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
