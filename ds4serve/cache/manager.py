"""Cache operations the scheduler may ask for (DESIGN §4), all-or-nothing, each returning a status.

* ``reserve``: grow sequences' page tables before compute; all requested growth or none.
* ``suspend``: copy a slot's whole state (rings + its pages) to host memory within a bounded host
  budget, then free the slot and its pages. ``restore`` brings it back into any free slot/pages:
  everything is addressed by absolute position, so the new slot and page numbers do not matter.
* ``drop``: free a slot and its pages; the scheduler recomputes the sequence from its retained
  input later (only allowed when the input is fully retained).

* the *prefix cache* (``prefix.py``), when enabled: snapshots that share pages with live sequences.
  Live requests win over it: a reservation that is short evicts snapshots before it fails, and the
  pages only the cache holds count as free for admission.

Also owns the per-slot *staging* buffers of prefill passes (the hidden streams ``[rows, hc, D]``
kept between layer slices), allocated at start-up like everything else fixed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .layout import StateLayout
from .prefix import PrefixCache
from .state import ModelState

log = logging.getLogger(__name__)


@dataclass
class SuspendedSeq:
    """A suspended sequence's state on the host."""

    n_tokens: int  # positions [0, n_tokens) are in the state
    n_pages: int
    rings: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per layer: name -> rows
    pools: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per layer: name -> page rows
    nbytes: int = 0


class StaleSlot(RuntimeError):
    """A handle from an earlier allocation of a slot was used after the slot was freed (a bug)."""


class SlotHandle(int):
    """A slot number that remembers which allocation it came from.

    It is an ``int`` everywhere a slot number is used (tensor rows, plan fields), and the cache
    operations check ``gen`` against the slot's current generation, so a handle kept past ``drop``
    cannot touch the sequence that reuses the slot."""

    gen: int

    def __new__(cls, index: int, gen: int) -> "SlotHandle":
        handle = super().__new__(cls, index)
        handle.gen = gen
        return handle

    def __reduce__(self):  # pickles by value (tensor-parallel ranks receive plans and cache calls)
        return SlotHandle, (int(self), self.gen)


_RINGS = ("swa", "comp_ring", "idx_ring")
_POOLS = ("comp_pool", "idx_pool")


class CacheManager:
    def __init__(self, layout: StateLayout, n_slots: int, n_pages: int, device: torch.device | str,
                 host_budget_bytes: int, staging_rows: int, prefix_budget_bytes: int = 0):
        self.layout = layout
        self.state = ModelState(layout, n_slots, n_pages, device, zero_on_handout=True)
        self.prefix = PrefixCache(layout, self.state, prefix_budget_bytes) if prefix_budget_bytes > 0 else None
        self.host_budget = int(host_budget_bytes)
        self.host_used = 0
        self._free_slots = list(range(n_slots - 1, -1, -1))
        self._gen = [0] * n_slots  # bumped on every free: older handles become stale
        cfg = layout.cfg
        self.staging_rows = staging_rows
        # uninitialised on purpose: a pass writes its rows before it reads them (executor), so only
        # the rows passes really use become resident (text-only traffic in chunk mode touches none)
        self.staging = torch.empty(n_slots, staging_rows, cfg.hc_mult, cfg.hidden_size, dtype=layout.dtype,
                                   device=self.state.device)
        log.info("allocated pass staging: %d slots x %d rows x [%d, %d] = %.1f MiB; host suspend budget %.1f MiB",
                 n_slots, staging_rows, cfg.hc_mult, cfg.hidden_size,
                 self.staging.numel() * self.staging.element_size() / 2**20, self.host_budget / 2**20)

    # ---- slots ---------------------------------------------------------------------------------
    @property
    def n_slots(self) -> int:
        return self.state.n_slots

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def free_pages(self) -> int:
        """Free pages plus those only the prefix cache holds and may evict on demand (not those of a
        snapshot a parked request pins: counting them made admission resume a request it could not run)."""
        pinned = self.prefix.pinned_pages() if self.prefix is not None else 0
        return self.state.pages.free_pages + self.state.pages.cache_only_pages - pinned

    def make_room(self, n_pages: int) -> bool:
        """Evict prefix snapshots until ``n_pages`` pages are really free (False if they cannot be)."""
        if self.state.pages.free_pages >= n_pages:
            return True
        return self.prefix is not None and self.prefix.make_room(n_pages)

    def alloc_slot(self) -> SlotHandle | None:
        if not self._free_slots:
            return None
        index = self._free_slots.pop()
        return SlotHandle(index, self._gen[index])

    def check(self, slot: int) -> None:
        """Raise ``StaleSlot`` if ``slot`` is a handle from an earlier allocation (plain ints pass)."""
        if isinstance(slot, SlotHandle) and slot.gen != self._gen[slot]:
            raise StaleSlot(f"slot {int(slot)}: handle of generation {slot.gen} used after the slot was freed "
                            f"(now generation {self._gen[slot]})")

    def drop(self, slot: int) -> None:
        """Free ``slot`` and its pages (the sequence will be recomputed, or it has ended)."""
        self.check(slot)
        if slot in self._free_slots:
            raise RuntimeError(f"slot {slot} freed twice")
        self.state.pages.release(slot)
        self._gen[slot] += 1
        self._free_slots.append(int(slot))
        if self.prefix is not None:
            self.prefix.trim()

    # ---- pages ---------------------------------------------------------------------------------
    def pages_short(self, growth: dict[int, int]) -> int:
        """How many more pages ``{slot: n_tokens}`` needs than are free (0 if it fits)."""
        need = sum(max(0, self.layout.pages_for(n) - self.state.pages.owned(s)) for s, n in growth.items())
        return max(0, need - self.free_pages)

    def reserve(self, growth: dict[int, int]) -> bool:
        """Cover positions ``[0, n)`` for every ``{slot: n}``; all of it or nothing."""
        for slot in growth:
            self.check(slot)
        if self.pages_short(growth):
            return False
        need = sum(max(0, self.layout.pages_for(n) - self.state.pages.owned(s)) for s, n in growth.items())
        if not self.make_room(need):
            return False
        for slot, n in growth.items():
            had = self.state.pages.owned(slot)
            ok = self.state.pages.reserve(slot, self.layout.pages_for(n))
            if not ok:  # cannot happen after the check above; never leave a half-done reservation
                raise RuntimeError(f"page reservation for slot {slot} failed after a successful check")
            self.state.zero_fresh(self.state.pages.table(slot)[had:])
        return True

    def block_table(self, slot: int) -> list[int]:
        self.check(slot)
        return self.state.pages.table(slot)

    # ---- suspend / restore ---------------------------------------------------------------------
    def snapshot_bytes(self, slot: int) -> int:
        return self.layout.bytes_per_slot() + self.state.pages.owned(slot) * self.layout.bytes_per_page()

    def suspend(self, slot: int, n_tokens: int) -> SuspendedSeq | None:
        """Copy ``slot`` to host and free it; ``None`` (nothing changed) if the host budget is short."""
        self.check(slot)
        size = self.snapshot_bytes(slot)
        if self.host_used + size > self.host_budget:
            return None
        snap = SuspendedSeq(n_tokens=n_tokens, n_pages=self.state.pages.owned(slot), nbytes=size)
        rows = self._ring_rows(slot)
        pool_idx = self._pool_rows(slot)
        for li, st in enumerate(self.state.layers):
            snap.rings.append({n: getattr(st, n)[rows[n][li]].to("cpu", copy=True)
                               for n in _RINGS if getattr(st, n) is not None})
            snap.pools.append({n: getattr(st, n)[pool_idx[li]].to("cpu", copy=True)
                               for n in _POOLS if getattr(st, n) is not None})
        self.host_used += size
        self.drop(slot)
        return snap

    def restore(self, snap: SuspendedSeq) -> SlotHandle | None:
        """Bring a snapshot back into a free slot with fresh pages; ``None`` if either is short."""
        if not self._free_slots or not self.make_room(snap.n_pages):
            return None
        slot = self.alloc_slot()
        if not self.state.pages.reserve(slot, snap.n_pages):
            self._free_slots.append(int(slot))
            return None
        self.state.zero_fresh(self.state.pages.table(slot))
        rows = self._ring_rows(slot)
        pool_idx = self._pool_rows(slot)
        for li, st in enumerate(self.state.layers):
            for n, t in snap.rings[li].items():
                getattr(st, n)[rows[n][li]] = t.to(st.swa.device)
            for n, t in snap.pools[li].items():
                getattr(st, n)[pool_idx[li]] = t.to(st.swa.device)
        self.release_suspended(snap)
        return slot

    def release_suspended(self, snap: SuspendedSeq) -> None:
        self.host_used -= snap.nbytes
        snap.rings, snap.pools, snap.nbytes = [], [], 0

    def _ring_rows(self, slot: int) -> dict[str, list[slice]]:
        out: dict[str, list[slice]] = {n: [] for n in _RINGS}
        for ly in self.layout.layers:
            out["swa"].append(slice(slot * ly.window, (slot + 1) * ly.window))
            span = ly.span or 1
            out["comp_ring"].append(slice(slot * span, (slot + 1) * span))
            out["idx_ring"].append(slice(slot * span, (slot + 1) * span))
        return out

    def _pool_rows(self, slot: int) -> list[torch.Tensor]:
        table = torch.tensor(self.state.pages.table(slot), dtype=torch.long)
        out = []
        for ly in self.layout.layers:
            if not ly.ratio:
                out.append(torch.zeros(0, dtype=torch.long))
                continue
            rpp = self.layout.rows_per_page(ly.ratio)
            rows = (table.unsqueeze(1) * rpp + torch.arange(rpp)).reshape(-1)
            out.append(rows.to(self.state.device))
        return out

    # ---- accounting ----------------------------------------------------------------------------
    def leaks(self, live_slots: set[int] | None = None) -> str:
        """'' when only ``live_slots`` hold slots/pages (default: nothing is held)."""
        live = live_slots or set()
        problems = []
        held = set(range(self.n_slots)) - set(self._free_slots)
        if held != live:
            problems.append(f"slots held {sorted(held)}, expected {sorted(live)}")
        owners = set(self.state.pages.owners()) - live
        if owners:
            problems.append(f"pages owned by freed slots {sorted(owners)}")
        cached = self.state.pages.cache_only_pages
        if not live and self.state.pages.used_pages != cached:
            problems.append(f"{self.state.pages.used_pages} pages in use, {cached} of them held by the prefix cache")
        problems += self.state.pages.problems(self.prefix.holds() if self.prefix is not None else {})
        if self.prefix is not None:
            problems += self.prefix.problems()
        return "; ".join(problems)

    def close(self) -> None:
        """Shutdown: the prefix cache persists its snapshots to its disk tier (when it has one)."""
        if self.prefix is not None:
            self.prefix.close()
