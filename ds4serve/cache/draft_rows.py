"""Undoing the rejected tail of a verified draft: the ring rows a verify pass overwrote, saved and put back.

A decoder with a draft feeds ``[token, d_1 .. d_L]`` at positions ``p .. p+L`` in one forward (speculative
decoding, issue 28). The forward writes every row's state like any chunk: paged compressed rows by
position, and one row per position into each fixed ring (the sliding window, the compressor and indexer
rings), at ``slot * R + position % R`` for a ring of ``R`` rows. Only ``token`` and the accepted prefix
``d_1 .. d_j`` are committed. What the rejected positions ``p+j+1 .. p+L`` wrote must leave no trace:

* paged rows are addressed by position; a compressed row completed by a rejected token sits past the
  committed length, where no reader looks (visibility is ``(position + 1) // ratio`` of the reading
  query), and the committed token at that position rewrites it before anybody can read it;
* ring rows are addressed modulo ``R``: position ``q`` overwrote the row of ``q - R``, which the window
  still needs after the rollback. Those rows are saved before the forward and written back for the
  rejected positions afterwards, so every ring holds exactly what it held after a plain decode of the
  accepted prefix (the CSA overlap half lives in the compressor ring, so it comes back too).

The draft must be shorter than the smallest ring (``max_draft``): then the positions ``p .. p+L`` fall in
distinct ring rows and each saved row is the last committed content of its row.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from collections.abc import Sequence
from ctypes import POINTER, c_int, c_int64, c_void_p
from dataclasses import dataclass
from pathlib import Path

import torch

from ..environment import cache_root, native_build
from ..native_build import OnceLibrary, build_library, sanitized
from .state import ModelState

RINGS = ("swa", "comp_ring", "idx_ring")
log = logging.getLogger(__name__)


class _RingRef(ctypes.Structure):
    _fields_ = [("ring", c_void_p), ("row_bytes", c_int64), ("list", c_int64)]


def _load() -> ctypes.CDLL:
    source = (Path(__file__).with_name("csrc") / "rings.c").read_text()
    path = build_library(cache_root() / "native", "rings", source,
                         sanitized(["-O2", "-fPIC", "-shared"], native_build().sanitize), [])
    lib = ctypes.CDLL(str(path))
    lib.ds4_ring_rows.argtypes = [c_int64, POINTER(_RingRef), c_void_p, c_int64, c_void_p, c_void_p, c_int64, c_int64]
    lib.ds4_ring_rows.restype = c_int
    return lib


_library = OnceLibrary(_load, log, "native ring copies unavailable (%s); draft rows are saved with torch ops")
_plans: "weakref.WeakKeyDictionary[object, _Plan]" = weakref.WeakKeyDictionary()


@dataclass
class _Plan:
    """Every ring of a state, for the native copies: ``rings`` (layer, name, tensor), the ring lengths
    (one row list each), and the C descriptors. Checked against the state before each use (a ring
    tensor replaced since makes a new plan)."""

    rings: list[tuple[int, str, torch.Tensor]]
    lengths: list[int]
    refs: ctypes.Array
    row_bytes: int  # of one draft position, over every ring

    def current(self, state) -> bool:
        return all(getattr(state.layers[li], name) is t for li, name, t in self.rings)


def _plan(state) -> _Plan | None:
    """The native copy plan of ``state``'s rings, or None where the torch form applies (no library,
    a ring off the host or not contiguous)."""
    if _library.get() is None:
        return None
    try:
        plan = _plans.get(state)
    except TypeError:  # a state that cannot be weakly referenced: planned each time
        plan = None
    if plan is not None and plan.current(state):
        return plan
    rings = [(li, name, getattr(st, name)) for li, st in enumerate(state.layers) for name in RINGS
             if getattr(st, name) is not None]
    if any(t.device.type != "cpu" or not t.is_contiguous() or t.dim() != 2 for _, _, t in rings):
        return None
    lengths = sorted({t.shape[0] // state.n_slots for _, _, t in rings})
    refs = (_RingRef * len(rings))(*[_RingRef(t.data_ptr(), t.shape[1] * t.element_size(),
                                              lengths.index(t.shape[0] // state.n_slots)) for _, _, t in rings])
    plan = _Plan(rings, lengths, refs, sum(t.shape[1] * t.element_size() for _, _, t in rings))
    try:
        _plans[state] = plan
    except TypeError:
        pass
    return plan


def max_draft(state: ModelState) -> int:
    """The longest draft a verify pass may carry: one less than the smallest ring of any layer."""
    rows = min(getattr(st, name).shape[0] // state.n_slots
               for st in state.layers for name in RINGS if getattr(st, name) is not None)
    return rows - 1


@dataclass(frozen=True)
class DraftSpan:
    """A decoder's draft positions: ``n`` rows from ``first`` (= its position + 1) in ``slot``."""

    slot: int
    first: int
    n: int


class SavedRings:
    """The ring rows that the draft positions of ``spans`` are about to overwrite, in every layer."""

    def __init__(self, state: ModelState, spans: Sequence[DraftSpan]):
        self.state, self.spans = state, tuple(spans)
        self._rows: dict[int, torch.Tensor] = {}  # ring length -> the ring rows of every draft position
        self.saved: list[dict[str, torch.Tensor]] = []
        self._native = _plan(state)
        if self._native is not None:  # one C call copies every ring's rows into one buffer
            # indexes as plain lists in ctypes arrays, the buffer a ctypes one: in a decode step each small
            # torch op (a tensor, a cat, an empty) cost 10-40 us, more than the copy
            plan = self._native
            index = [i for per in plan.lengths for i in self._rows_of(per)]
            self._index_all = (c_int64 * len(index))(*index)
            self._n = sum(s.n for s in self.spans)
            self._buf = ctypes.create_string_buffer(self._n * plan.row_bytes)
            _library.get().ds4_ring_rows(len(plan.rings), plan.refs, self._index_all, self._n, self._buf, None, 0, 0)
            return
        for st in state.layers:
            layer = {}
            for name in RINGS:
                ring = getattr(st, name)
                if ring is not None:
                    layer[name] = ring.index_select(0, self._index(ring.shape[0] // state.n_slots))
            self.saved.append(layer)

    def _rows_of(self, per: int) -> list[int]:
        """Ring rows of every draft position, spans in order, for rings of ``per`` rows a slot."""
        for s in self.spans:
            if s.n >= per:
                raise ValueError(f"a draft of {s.n} rows does not fit a ring of {per} rows (max_draft)")
        return [s.slot * per + (s.first + i) % per for s in self.spans for i in range(s.n)]

    def _index(self, per: int) -> torch.Tensor:
        """``_rows_of`` as a tensor on the state's device (the torch form)."""
        if per not in self._rows:
            self._rows[per] = torch.tensor(self._rows_of(per), dtype=torch.long, device=self.state.device)
        return self._rows[per]

    def restore(self, accepted: Sequence[int]) -> None:
        """Put back the rows of every rejected position: span ``i`` keeps its first ``accepted[i]`` rows."""
        if len(accepted) != len(self.spans):
            raise ValueError(f"{len(accepted)} accepted counts for {len(self.spans)} drafts")
        picks, offset = [], 0
        for s, a in zip(self.spans, accepted):
            if not 0 <= a <= s.n:
                raise ValueError(f"accepted {a} of a draft of {s.n}")
            picks.extend(range(offset + a, offset + s.n))
            offset += s.n
        if not picks:
            return
        if self._native is not None:
            plan = self._native
            _library.get().ds4_ring_rows(len(plan.rings), plan.refs, self._index_all, self._n, self._buf,
                                         (c_int64 * len(picks))(*picks), len(picks), 1)
            return
        # one contiguous run (a single draft's rejected tail, the usual case): slices, not gathers
        run = picks[-1] - picks[0] + 1 == len(picks)
        pick = None if run else torch.tensor(picks, dtype=torch.long, device=self.state.device)
        cut = slice(picks[0], picks[-1] + 1)
        wheres: dict[int, torch.Tensor] = {}  # ring length -> the ring rows to put back (shared by rings)
        for st, layer in zip(self.state.layers, self.saved):
            for name, rows in layer.items():
                ring = getattr(st, name)
                per = ring.shape[0] // self.state.n_slots
                if per not in wheres:
                    wheres[per] = self._index(per)[cut] if run else self._index(per).index_select(0, pick)
                ring.index_copy_(0, wheres[per], rows[cut] if run else rows.index_select(0, pick))
