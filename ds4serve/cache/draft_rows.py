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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .state import ModelState

RINGS = ("swa", "comp_ring", "idx_ring")


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
        for st in state.layers:
            layer = {}
            for name in RINGS:
                ring = getattr(st, name)
                if ring is not None:
                    layer[name] = ring.index_select(0, self._index(ring.shape[0] // state.n_slots))
            self.saved.append(layer)

    def _index(self, per: int) -> torch.Tensor:
        """Ring rows of every draft position, spans in order, for rings of ``per`` rows a slot."""
        if per not in self._rows:
            for s in self.spans:
                if s.n >= per:
                    raise ValueError(f"a draft of {s.n} rows does not fit a ring of {per} rows (max_draft)")
            rows = [s.slot * per + (s.first + i) % per for s in self.spans for i in range(s.n)]
            self._rows[per] = torch.tensor(rows, dtype=torch.long, device=self.state.device)
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
