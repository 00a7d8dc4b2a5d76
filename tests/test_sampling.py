"""Per-request sampling: filters, penalties, bans, logprobs, seeds and per-row failure."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4serve.engine.sampling import SamplerState, SamplingError, SamplingParams, _filtered_probs, sample_rows


def state(prompt=(1, 2), out=None, eos=(0,), **kw) -> SamplerState:
    return SamplerState(SamplingParams(**kw), list(prompt), list(out or []), tuple(eos))


def test_greedy_is_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    draws = sample_rows(logits, [state(temperature=0) for _ in range(5)])
    assert [d.token for d in draws] == logits.argmax(-1).tolist()


def test_top_k_one_is_greedy_even_with_temperature():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    draws = sample_rows(logits, [state(temperature=1.5, top_k=1, seed=i) for i in range(3)])
    assert [d.token for d in draws] == logits.argmax(-1).tolist()


def _accepting(logits: torch.Tensor, states: list[SamplerState], row: int, n: int) -> list[int]:
    """Draw ``n`` tokens, accepting each into every state's history as the scheduler does."""
    out = []
    for _ in range(n):
        draws = sample_rows(logits, states)
        for s, d in zip(states, draws):
            s.output_ids.append(d.token)
        out.append(draws[row].token)
    return out


def test_seed_decides_only_its_own_tokens():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(2))
    alone, batched = state(temperature=1.0, seed=42), state(temperature=1.0, seed=42)
    neighbour = state(temperature=1.0, seed=7)
    a = _accepting(logits, [alone], 0, 30)
    b = _accepting(torch.cat([logits, logits]), [neighbour, batched], 1, 30)
    assert a == b
    assert len(set(a)) > 3  # it really samples


def test_a_draw_not_accepted_is_drawn_again_identically():
    """A failed step may have drawn for a request; the retry (or recompute) must draw the same token,
    and an unseeded request keeps one base seed for its whole life."""
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(4))
    for seed in (11, None):
        s = state(temperature=1.0, seed=seed)
        first = [sample_rows(logits, [s])[0].token for _ in range(5)]
        assert len(set(first)) == 1  # nothing accepted: the same token every time
        stream = _accepting(logits, [s], 0, 20)
        assert stream[0] == first[0] and len(set(stream)) > 3


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    s = state(temperature=1.0, seed=3)
    counts = torch.zeros(4)
    for tok in _accepting(probs.log().unsqueeze(0), [s], 0, 4000):
        counts[tok] += 1
    assert torch.allclose(counts / 4000, probs, atol=0.03)


@given(st.integers(0, 2**31 - 1), st.integers(1, 30), st.floats(0.05, 1.0), st.floats(0.0, 0.9),
       st.floats(0.2, 3.0))
@settings(max_examples=60, deadline=None)
def test_filtered_probs_properties(seed, top_k, top_p, min_p, temp):
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(seed)) * 3
    params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
    p = _filtered_probs(logits, [params])[0]
    assert math.isclose(float(p.sum()), 1.0, rel_tol=1e-5)
    assert p[logits[0].argmax()] > 0  # the best token always survives
    kept = int((p > 0).sum())
    assert kept <= top_k
    full = torch.softmax(logits[0] / temp, -1)
    order = torch.argsort(full, descending=True)
    mass_before_last = float(full[order[: kept - 1]].sum())
    assert mass_before_last < top_p + 1e-6  # nucleus is minimal
    assert float(full[p > 0].min()) >= min_p * float(full.max()) - 1e-6


def test_repetition_and_presence_penalties():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.4, 0.0]])
    s = state(prompt=(2,), out=[3, 3], temperature=0, repetition_penalty=2.0)
    # token 2: 0.5 -> 0.25, token 3: 0.4 -> 0.2; token 0 stays the argmax
    assert sample_rows(logits, [s])[0].token == 0
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    s = state(out=[0], temperature=0, presence_penalty=0.5)
    assert sample_rows(logits, [s])[0].token == 1
    s = state(out=[1, 1, 1], temperature=0, frequency_penalty=0.1)
    assert sample_rows(torch.tensor([[1.0, 1.2, 0.0]]), [s])[0].token == 0


def test_min_tokens_bans_eos_and_stop_ids():
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0]])
    s = state(eos=(0,), temperature=0, min_tokens=2, stop_token_ids=(1,))
    assert sample_rows(logits, [s])[0].token == 2
    s.output_ids.extend([7, 7])
    assert sample_rows(logits, [s])[0].token == 0
    ignore = state(eos=(0,), temperature=0, ignore_eos=True, min_tokens=1)
    assert sample_rows(logits, [ignore])[0].token == 0  # ignore_eos: EOS is an ordinary token


def test_logprobs_are_raw_log_softmax():
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(4))
    d = sample_rows(logits, [state(temperature=0, logprobs=3), state(temperature=0)])
    ref = torch.log_softmax(logits[0], -1)
    assert d[0].logprob == pytest.approx(float(ref.max()), abs=1e-6)
    assert [t for t, _ in d[0].top_logprobs] == torch.topk(ref, 3).indices.tolist()
    assert d[1].logprob is None


def test_non_finite_row_fails_alone():
    logits = torch.randn(3, 10)
    logits[1, 4] = float("nan")
    d = sample_rows(logits, [state(temperature=0), state(temperature=0), state(temperature=0.7, seed=1)])
    assert d[0].ok and d[2].ok
    assert not d[1].ok and "non-finite" in d[1].error


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_k=-5), dict(min_p=2),
                                dict(presence_penalty=3), dict(repetition_penalty=0), dict(max_tokens=-1),
                                dict(min_tokens=5, max_tokens=2), dict(logprobs=21),
                                dict(prompt_logprobs=21), dict(prompt_logprobs=-1)])
def test_bad_params_are_rejected(kw):
    with pytest.raises(SamplingError):
        SamplingParams(**kw)


@given(st.integers(1, 6), st.integers(1, 40), st.integers(0, 2**31), st.integers(0, 5), st.booleans())
@settings(max_examples=120, deadline=None)
def test_the_greedy_fast_path_draws_what_the_general_path_draws(rows, vocab, seed, ties, bad_row):
    """``sample_rows`` over plain greedy rows (numpy's argmax) equals its general path (torch ops) bit for bit:
    the first largest value on ties (rows of repeated values), a non-finite row failing alone."""
    from ds4serve.engine import sampling

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen)
    if ties:  # a few values repeated across the row: argmax must take the first of them
        logits = torch.round(logits * ties) / max(ties, 1)
    if bad_row:
        logits[rows // 2, vocab // 2] = float("nan") if seed % 2 else float("inf")
    states = [state(temperature=0) for _ in range(rows)]
    fast = sample_rows(logits, states)
    assert sampling._greedy_draws(logits, states) == fast
    original, sampling._greedy_draws = sampling._greedy_draws, lambda logits, states: None
    try:
        general = sample_rows(logits, states)
    finally:
        sampling._greedy_draws = original
    assert fast == general


def test_rows_that_are_not_plain_greedy_take_the_general_path():
    from ds4serve.engine import sampling

    logits = torch.tensor([[0.0, 1.0, 2.0]])
    for kw in (dict(logprobs=1), dict(logit_bias=((0, 5.0),)), dict(min_tokens=2), dict(presence_penalty=0.5),
               dict(temperature=0.7, seed=1)):
        assert sampling._greedy_draws(logits, [state(**{"temperature": 0, **kw})]) is None, kw
    assert sampling._greedy_draws(logits.double(), [state(temperature=0)]) is None
    assert sampling._greedy_draws(logits, [state(temperature=0)]) == [sampling.Draw(token=2, ok=True)]
