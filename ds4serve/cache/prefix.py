"""The prefix cache: content-keyed shared pages plus ring snapshots, exact for DS4 (DESIGN §4).

A snapshot at position ``H`` of a sequence holds (a) references on the sequence's full pages below
``H`` (compressed and indexer rows are append-only, so those pages never change again and are
shared, not copied) and (b) a copy, in the snapshot arena, of what pages cannot share: the sliding
rings, the open compressor windows and the partial page of ``[H - H % page_tokens, H)``.

A hit at ``H`` puts the snapshot's rings into the new sequence's slot, starts its block table with
the shared pages and copies the partial page into a fresh one. The sequence then holds exactly the
state a cold run holds after computing ``[0, H)``, so what it computes next is what a cold run whose
prefill is cut at ``H`` computes: nothing is recomputed, nothing is approximated.

Eviction is LRU over snapshots that no live request pins; a page goes back to the pool when neither
a table nor a snapshot references it, so snapshots always go before the pages under them. Live
requests win over the cache: a reservation that is short evicts snapshots first (``make_room``).

With lower tiers (``tiers.py``: host memory, then disk) an evicted snapshot is copied out before it
goes, and a lookup the pool answers short (or not at all) asks them for a longer prefix; a hit there is
*promoted*: its rings and partial page go into a fresh arena entry and its full pages into fresh pool
pages held by the cache, and it is then an ordinary device snapshot, attached the ordinary way.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from .layout import StateLayout
from .pages import PageAllocator
from .prefix_keys import BLOCK, PrefixKeys
from .snapshots import SnapshotArena
from .spilled import Spilled
from .state import ModelState
from .tiers import TierStore

log = logging.getLogger(__name__)

_PROMOTING = -1  # page-table owner of a snapshot's pages while it is promoted (never a slot number)


@dataclass(eq=False)
class Snapshot:
    key: bytes
    anchor: bytes  # boundary key of the BLOCK below ``position`` (the lookup index)
    position: int  # the state covers input positions [0, position)
    pages: tuple[int, ...]  # full pages below ``position``, shared
    tail: bool  # ``position`` is inside a page: the arena entry holds that partial page
    index: int  # arena entry
    pins: int = 0  # live requests whose recompute relies on this snapshot (never evicted while > 0)


@dataclass
class PrefixStats:
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    queried_tokens: int = 0
    stored: int = 0
    evictions: int = 0


class PrefixCache:
    def __init__(self, layout: StateLayout, state: ModelState, budget_bytes: int, min_tokens: int = 64):
        self.layout, self.state = layout, state
        self.pages: PageAllocator = state.pages
        self.arena = SnapshotArena(layout, max(1, budget_bytes // self._snap_bytes(layout)), state.device)
        for li, st in enumerate(state.layers):  # forwards capture rings into the arena (RingCapture)
            st.snap = self.arena.rings(li)
        self.budget = int(budget_bytes)
        self.min_tokens = min_tokens
        self._free = list(range(self.arena.n - 1, -1, -1))
        self._lru: OrderedDict[bytes, Snapshot] = OrderedDict()
        self._by_anchor: dict[bytes, dict[bytes, Snapshot]] = {}  # anchor -> key -> snapshot
        self._holds: dict[int, int] = {}
        self.stats = PrefixStats()
        self.tiers: TierStore | None = None  # lower tiers, when the runtime gives some (use_tiers)

    def use_tiers(self, tiers: TierStore) -> None:
        """Spill evicted snapshots to ``tiers`` and look there on a short lookup (set before serving)."""
        self.tiers = tiers if tiers.enabled else None

    @staticmethod
    def _snap_bytes(layout: StateLayout) -> int:
        return layout.bytes_per_slot() + layout.bytes_per_page()

    # ---- accounting ----------------------------------------------------------------------------
    @property
    def snapshots(self) -> int:
        return len(self._lru)

    def bytes_used(self) -> int:
        """Arena entries in use (snapshots and captures in flight) plus the pages only the cache keeps."""
        entries = self.arena.n - len(self._free)
        return entries * self.arena.bytes_each() + self.pages.cache_only_pages * self.layout.bytes_per_page()

    def summary(self) -> dict[str, int]:
        tiers = self.tiers.summary() if self.tiers is not None else {}
        return {**vars(self.stats), "snapshots": self.snapshots, "cached_pages": self.pages.cache_only_pages,
                "cached_bytes": self.bytes_used(), "budget_bytes": self.budget, **tiers}

    # ---- lookup and attach -----------------------------------------------------------------------
    def lookup(self, keys: PrefixKeys, limit: int) -> Snapshot | None:
        """The longest stored prefix of ``keys``' sequence ending at or before ``limit``: in the pool, or
        longer on a lower tier (then promoted into the pool first)."""
        snap = self._lookup_pool(keys, limit)
        if self.tiers is None:
            return snap
        floor = snap.position if snap is not None else self.min_tokens - 1
        found = self.tiers.find(keys, floor, limit)
        if found is None:
            return snap
        if snap is not None:
            snap.pins += 1  # promoting makes room: never at the cost of the hit we already have
        try:
            promoted = self._promote(found[0])
        finally:
            if snap is not None:
                snap.pins -= 1
        if promoted is None:
            return snap
        self.tiers.promoted(found[0], found[1])
        return promoted

    def _lookup_pool(self, keys: PrefixKeys, limit: int) -> Snapshot | None:
        for j in range(limit // BLOCK, -1, -1):
            found = self._by_anchor.get(keys.boundary(j))
            if not found:
                continue
            for snap in sorted((s for s in found.values() if s.position <= limit), key=lambda s: -s.position):
                if keys.key(snap.position) == snap.key:
                    self._lru.move_to_end(snap.key)
                    return snap
        return None

    def attach(self, snap: Snapshot, slot: int) -> bool:
        """Give the empty ``slot`` the state of ``snap``; False (nothing changed) if no page is free for
        the partial page."""
        if snap.tail:
            snap.pins += 1  # making room must not evict the very snapshot being attached
            room = self.make_room(1)
            snap.pins -= 1
            if not room:
                return False
        self.pages.adopt(slot, snap.pages)
        if snap.tail:
            if not self.pages.reserve(slot, len(snap.pages) + 1):  # cannot fail after make_room
                raise RuntimeError("prefix hit: the partial page vanished after make_room")
            tail = self.pages.table(slot)[-1]
            self.state.zero_fresh([tail])
        else:
            tail = None
        self.arena.load(snap.index, self.state, slot, tail)
        self._lru.move_to_end(snap.key)
        return True

    # ---- store ---------------------------------------------------------------------------------
    def take_entry(self) -> int | None:
        """An arena entry for a new snapshot (evicting the least recently used), or None."""
        if not self._free and not self._evict_one():
            return None
        while self.bytes_used() + self.arena.bytes_each() > self.budget:
            if not self._evict_one():
                return None
        return self._free.pop()

    def give_back(self, index: int) -> None:
        self._free.append(index)

    def store(self, keys: PrefixKeys, position: int, slot: int) -> bool:
        """Snapshot ``slot`` (whose state covers exactly ``[0, position)``); False if it did not fit."""
        if position < self.min_tokens:
            return False
        key = keys.key(position)
        if self._known(key):
            return True
        index = self.take_entry()
        if index is None:
            return False
        self.arena.save_rings(self.state, slot, index)  # _add copies the partial page
        return self._add(keys, key, position, slot, index)

    def commit(self, keys: PrefixKeys, position: int, slot: int, index: int) -> bool:
        """Arena entry ``index`` holds ``slot``'s rings as they stood at ``position`` (captured by a
        forward), and the slot's pages below ``position`` are final: make it a snapshot (or give the
        entry back if that prefix is cached already)."""
        key = keys.key(position)
        if self._known(key):
            self.give_back(index)
            return True
        return self._add(keys, key, position, slot, index)

    def _known(self, key: bytes) -> bool:
        if key in self._lru:
            self._lru.move_to_end(key)
            return True
        return False

    def _add(self, keys: PrefixKeys, key: bytes, position: int, slot: int, index: int) -> bool:
        pt = self.layout.page_tokens
        table = self.pages.table(slot)
        full, tail = position // pt, position % pt != 0
        if len(table) < full + tail:
            raise RuntimeError(f"snapshot at {position}: slot {slot} holds only {len(table)} pages")
        if tail:  # rows of windows closing after ``position`` come along: never read before rewritten
            self.arena.save_tail(self.state, table[full], index)
        snap = Snapshot(key=key, anchor=keys.anchor(position), position=position, pages=tuple(table[:full]),
                        tail=tail, index=index)
        self._register(snap)
        self.stats.stored += 1
        return True

    def _register(self, snap: Snapshot) -> None:
        self.pages.hold(snap.pages)
        for p in snap.pages:
            self._holds[p] = self._holds.get(p, 0) + 1
        self._lru[snap.key] = snap
        self._by_anchor.setdefault(snap.anchor, {})[snap.key] = snap

    # ---- lower tiers ---------------------------------------------------------------------------
    def _spilled(self, snap: Snapshot) -> Spilled:
        return Spilled(key=snap.key, anchor=snap.anchor, position=snap.position, n_full=len(snap.pages),
                       tail=snap.tail, tensors=self.arena.export(snap.index, self.state, snap.pages, snap.tail))

    def _promote(self, sp: Spilled) -> Snapshot | None:
        """``sp`` as a device snapshot (arena entry + cache-held pages); None if the pool has no room."""
        if sp.key in self._lru:
            return self._lru[sp.key]
        if not self.make_room(sp.n_full):
            return None
        index = self.take_entry()  # evicts only: the pages made free above stay free
        if index is None:
            return None
        owner = _PROMOTING
        if not self.pages.reserve(owner, sp.n_full):
            self.give_back(index)
            return None
        table = list(self.pages.table(owner))
        self.state.zero_fresh(table)
        try:
            self.arena.import_(sp.tensors, index, self.state, table, sp.tail)
        except ValueError as exc:  # a checked file of this fingerprint cannot disagree; never use it if it does
            log.warning("prefix cache: a lower-tier snapshot at %d does not fit the state: %s", sp.position, exc)
            self.pages.release(owner)
            self.give_back(index)
            return None
        snap = Snapshot(key=sp.key, anchor=sp.anchor, position=sp.position, pages=tuple(table), tail=sp.tail,
                        index=index)
        self._register(snap)
        self.pages.release(owner)  # the cache's hold keeps them
        return snap

    def close(self) -> None:
        """Persist the pool's snapshots to the disk tier (if any) and stop its writer (shutdown)."""
        if self.tiers is None:
            return
        disk = self.tiers.disk
        keep = [self._spilled(s) for s in self._lru.values() if disk is not None and not disk.has(s.key)]
        self.tiers.close(keep)

    # ---- eviction ------------------------------------------------------------------------------
    def _evict_one(self) -> bool:
        victim = next((s for s in self._lru.values() if s.pins == 0), None)
        if victim is None:
            return False
        if self.tiers is not None:
            self.tiers.spill(self._spilled(victim))
        self._remove(victim)
        self.stats.evictions += 1
        return True

    def _remove(self, snap: Snapshot) -> None:
        del self._lru[snap.key]
        by = self._by_anchor[snap.anchor]
        del by[snap.key]
        if not by:
            del self._by_anchor[snap.anchor]
        self.pages.unhold(snap.pages)
        for p in snap.pages:
            self._holds[p] -= 1
            if not self._holds[p]:
                del self._holds[p]
        self._free.append(snap.index)

    def make_room(self, n_pages: int) -> bool:
        """Evict unpinned snapshots until ``n_pages`` pages are free; False if even that is short."""
        while self.pages.free_pages < n_pages:
            if not self._evict_one():
                return False
        return True

    def trim(self) -> None:
        """Back under the budget (pages become cache-only when the requests using them end)."""
        while self.bytes_used() > self.budget and self._evict_one():
            pass

    def reset(self) -> int:
        """Drop every snapshot no live request pins, on every tier (disk files of this model included);
        returns how many were dropped."""
        victims = [s for s in self._lru.values() if s.pins == 0]
        for s in victims:
            self._remove(s)
        return len(victims) + (self.tiers.clear() if self.tiers is not None else 0)

    def pin(self, snap: Snapshot) -> None:
        snap.pins += 1

    def unpin(self, snap: Snapshot) -> None:
        if snap.pins <= 0:
            raise RuntimeError("prefix snapshot unpinned more often than pinned")
        snap.pins -= 1

    def pinned_pages(self) -> int:
        """Pages only the cache holds that a pinned snapshot keeps: no eviction frees them."""
        return len({p for s in self._lru.values() if s.pins for p in s.pages if self.pages.cache_only(p)})

    def holds(self) -> dict[int, int]:
        return dict(self._holds)

    def problems(self) -> list[str]:
        out = []
        if len(self._free) + len(self._lru) != self.arena.n:
            out.append(f"arena entries: {len(self._free)} free + {len(self._lru)} used != {self.arena.n}")
        pinned = [s.position for s in self._lru.values() if s.pins]
        if pinned:
            out.append(f"snapshots still pinned at positions {pinned[:8]}")
        return out
