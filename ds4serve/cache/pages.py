"""Page allocator for the growing (compressed + indexer) state, with a hard budget.

Pages are integers into the pool tensors. ``reserve`` is all-or-nothing: it either grows a
sequence's block table to cover the requested length or changes nothing and reports failure, so a
step can be planned, checked against memory and only then executed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class PoolExhausted(RuntimeError):
    """Raised when a caller insists on pages the budget cannot give."""


@dataclass
class PageAllocator:
    n_pages: int
    _free: list[int] = field(init=False)
    _tables: dict[int, list[int]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.n_pages < 1:
            raise ValueError("the page pool needs at least one page")
        # pop() from the end hands out low page numbers first (easier to read in logs)
        self._free = list(range(self.n_pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.n_pages - len(self._free)

    def table(self, owner: int) -> list[int]:
        return self._tables.get(owner, [])

    def owned(self, owner: int) -> int:
        return len(self._tables.get(owner, ()))

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
        table.extend(self._free.pop() for _ in range(need))
        return True

    def release(self, owner: int) -> int:
        """Free every page of ``owner``; returns how many were freed."""
        table = self._tables.pop(owner, [])
        self._free.extend(reversed(table))
        return len(table)

    def owners(self) -> list[int]:
        return list(self._tables)
