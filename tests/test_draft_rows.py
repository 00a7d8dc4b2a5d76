"""SavedRings puts back exactly the ring rows of rejected draft positions (oracle: plain loops)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ds4serve.cache.draft_rows import DraftSpan, SavedRings


def _state(n_slots: int, sizes: dict[str, int], layers: int = 2, width: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return SimpleNamespace(n_slots=n_slots, device=torch.device("cpu"), layers=[
        SimpleNamespace(**{name: (torch.randn(n_slots * per, width, generator=gen) if per else None)
                           for name, per in sizes.items()}) for _ in range(layers)])


@pytest.mark.parametrize("spans, accepted", [
    ([DraftSpan(1, 10, 4)], [1]),  # one draft: its rejected tail is one run
    ([DraftSpan(1, 10, 4)], [4]),  # all accepted: nothing to put back
    ([DraftSpan(0, 5, 3), DraftSpan(2, 7, 2)], [1, 0]),  # two drafts: two runs
    ([DraftSpan(0, 6, 3), DraftSpan(1, 2, 3)], [3, 0]),  # the second wraps around its ring
])
def test_rejected_positions_get_their_rows_back(spans, accepted):
    state = _state(3, {"swa": 8, "comp_ring": 5, "idx_ring": 0})
    before = [{n: getattr(st, n).clone() for n in ("swa", "comp_ring")} for st in state.layers]
    saved = SavedRings(state, spans)
    for st in state.layers:  # the verify forward writes every draft position's row
        for name in ("swa", "comp_ring"):
            ring, per = getattr(st, name), getattr(st, name).shape[0] // 3
            for s in spans:
                for i in range(s.n):
                    ring[s.slot * per + (s.first + i) % per] = 1000.0 + s.first + i
    written = [{n: getattr(st, n).clone() for n in ("swa", "comp_ring")} for st in state.layers]
    saved.restore(accepted)
    for st, old, new in zip(state.layers, before, written):
        for name in ("swa", "comp_ring"):
            per = old[name].shape[0] // 3
            want = new[name].clone()
            for s, a in zip(spans, accepted):
                for i in range(a, s.n):  # rejected: the row as it was before the forward
                    row = s.slot * per + (s.first + i) % per
                    want[row] = old[name][row]
            assert torch.equal(getattr(st, name), want)


def test_a_draft_as_long_as_a_ring_is_refused():
    state = _state(1, {"swa": 4, "comp_ring": 0, "idx_ring": 0})
    with pytest.raises(ValueError, match="does not fit"):
        SavedRings(state, [DraftSpan(0, 3, 4)])
