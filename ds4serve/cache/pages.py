"""Page allocator for the growing (compressed + indexer) state, with a hard budget and refcounts.

Pages are integers into the pool tensors. ``reserve`` is all-or-nothing: it either grows a
sequence's block table to cover the requested length or changes nothing and reports failure, so a
step can be planned, checked against memory and only then executed.

A page may be referenced by several block tables and by the prefix cache at once: compressed and
indexer rows are append-only, so a full page below a sequence's position never changes again and
can be shared without copy-on-write (DESIGN §4). Each page counts its references from tables
(``seq``) and from the cache (``held``); it returns to the free list when both are zero. Pages that
only the cache holds are *reclaimable*: live requests win over the cache, so the cache manager
evicts snapshots to free them when a reservation is short.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class PageAllocator:
    n_pages: int
    _free: list[int] = field(init=False)
    _tables: dict[int, list[int]] = field(init=False, default_factory=dict)
    _seq: list[int] = field(init=False)  # references from block tables
    _held: list[int] = field(init=False)  # references from the prefix cache
    _cache_only: int = field(init=False, default=0)  # pages with held > 0 and seq == 0

    def __post_init__(self) -> None:
        if self.n_pages < 1:
            raise ValueError("the page pool needs at least one page")
        # pop() from the end hands out low page numbers first (easier to read in logs)
        self._free = list(range(self.n_pages - 1, -1, -1))
        self._seq = [0] * self.n_pages
        self._held = [0] * self.n_pages

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.n_pages - len(self._free)

    @property
    def cache_only_pages(self) -> int:
        """Pages held by the prefix cache alone (freed when the snapshots holding them go)."""
        return self._cache_only

    def table(self, owner: int) -> list[int]:
        return self._tables.get(owner, [])

    def owned(self, owner: int) -> int:
        return len(self._tables.get(owner, ()))

    def cache_only(self, page: int) -> bool:
        """Whether only the prefix cache holds ``page`` (no sequence's table has it)."""
        return self._held[page] > 0 and self._seq[page] == 0

    def shared(self, page: int) -> bool:
        """Whether anybody besides one table references ``page`` (a write to it would be a bug)."""
        return self._seq[page] + self._held[page] > 1

    def _change(self, page: int, d_seq: int, d_held: int) -> None:
        before = self._held[page] > 0 and self._seq[page] == 0
        self._seq[page] += d_seq
        self._held[page] += d_held
        if self._seq[page] < 0 or self._held[page] < 0:
            raise RuntimeError(f"page {page}: reference count below zero (seq {self._seq[page]}, "
                               f"held {self._held[page]})")
        after = self._held[page] > 0 and self._seq[page] == 0
        self._cache_only += int(after) - int(before)
        if self._seq[page] == 0 and self._held[page] == 0:
            self._free.append(page)

    def reserve(self, owner: int, n_pages_total: int) -> bool:
        """Grow ``owner``'s table to ``n_pages_total`` pages; all-or-nothing."""
        table = self._tables.setdefault(owner, [])
        need = n_pages_total - len(table)
        if need <= 0:
            return True
        if need > len(self._free):
            if not table:
                del self._tables[owner]
            return False
        for _ in range(need):
            page = self._free.pop()
            self._seq[page] = 1
            table.append(page)
        return True

    def adopt(self, owner: int, pages: Iterable[int]) -> None:
        """Start ``owner``'s (empty) table with shared ``pages`` (a prefix-cache hit)."""
        if self._tables.get(owner):
            raise RuntimeError(f"owner {owner} already has pages; shared pages only start a table")
        table = list(pages)
        for page in table:
            if self._seq[page] + self._held[page] == 0:
                raise RuntimeError(f"page {page} is free; only referenced pages can be shared")
            self._change(page, 1, 0)
        self._tables[owner] = table

    def release(self, owner: int) -> int:
        """Drop every reference of ``owner``; returns how many pages became free."""
        table = self._tables.pop(owner, [])
        before = len(self._free)
        for page in reversed(table):
            self._change(page, -1, 0)
        return len(self._free) - before

    def hold(self, pages: Iterable[int]) -> None:
        """The prefix cache takes a reference on each of ``pages``."""
        for page in pages:
            if self._seq[page] + self._held[page] == 0:
                raise RuntimeError(f"page {page} is free; the cache can only hold pages in use")
            self._change(page, 0, 1)

    def unhold(self, pages: Iterable[int]) -> int:
        """The prefix cache drops its references; returns how many pages became free."""
        before = len(self._free)
        for page in pages:
            self._change(page, 0, -1)
        return len(self._free) - before

    def owners(self) -> list[int]:
        return list(self._tables)

    def problems(self, holds: dict[int, int]) -> list[str]:
        """Reference counts against the tables and the cache's own tally (``holds``: page -> count)."""
        seq = [0] * self.n_pages
        for table in self._tables.values():
            for page in table:
                seq[page] += 1
        out = []
        bad = [p for p in range(self.n_pages) if seq[p] != self._seq[p] or holds.get(p, 0) != self._held[p]]
        if bad:
            out.append(f"reference counts differ from the tables / cache on pages {bad[:8]}")
        free = set(self._free)
        wrong = [p for p in range(self.n_pages) if (p in free) != (seq[p] + holds.get(p, 0) == 0)]
        if wrong or len(free) != len(self._free):
            out.append(f"free list disagrees with the reference counts on pages {wrong[:8]}")
        return out
