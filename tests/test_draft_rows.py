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


@pytest.fixture(params=["native", "torch"])
def copies(request, monkeypatch):
    """Both forms of the copies: one C call over every ring (``csrc/rings.c``), and torch's ops."""
    from ds4serve.cache import draft_rows

    if request.param == "torch":
        monkeypatch.setattr(draft_rows, "_plan", lambda state: None)
    elif draft_rows._library.get() is None:
        pytest.skip(f"no native ring copies here: {draft_rows._library.failure}")
    return request.param


@pytest.mark.parametrize("spans, accepted", [
    ([DraftSpan(1, 10, 4)], [1]),  # one draft: its rejected tail is one run
    ([DraftSpan(1, 10, 4)], [4]),  # all accepted: nothing to put back
    ([DraftSpan(0, 5, 3), DraftSpan(2, 7, 2)], [1, 0]),  # two drafts: two runs
    ([DraftSpan(0, 6, 3), DraftSpan(1, 2, 3)], [3, 0]),  # the second wraps around its ring
])
def test_rejected_positions_get_their_rows_back(spans, accepted, copies):
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


def test_a_draft_as_long_as_a_ring_is_refused(copies):
    state = _state(1, {"swa": 4, "comp_ring": 0, "idx_ring": 0})
    with pytest.raises(ValueError, match="does not fit"):
        SavedRings(state, [DraftSpan(0, 3, 4)])


def test_the_native_plan_follows_a_replaced_ring():
    """The C copies address the ring tensors by pointer: a state whose ring tensor was replaced since the
    last plan gets a new one (never a copy into freed memory)."""
    from ds4serve.cache import draft_rows

    if draft_rows._library.get() is None:
        pytest.skip(f"no native ring copies here: {draft_rows._library.failure}")

    class State:  # weakly referenceable, as ModelState is: its plan is kept between steps
        def __init__(self, inner):
            self.__dict__.update(vars(inner))

    state = State(_state(2, {"swa": 8, "comp_ring": 5, "idx_ring": 0}))
    SavedRings(state, [DraftSpan(1, 3, 2)])
    state.layers[1].swa = state.layers[1].swa.clone()
    fresh = state.layers[1].swa
    saved = SavedRings(state, [DraftSpan(1, 3, 2)])
    fresh[1 * 8 + 3] = -7.0
    fresh[1 * 8 + 4] = -7.0
    saved.restore([0])
    assert not (fresh == -7.0).any()
