"""The batched sampler's filters against plain-loop references written from their definitions.

``top_p`` keeps the smallest prefix (by descending probability) whose mass reaches ``top_p``, the
token that crosses it included; ``min_p`` keeps tokens with ``p >= min_p * p_max``; the order is the
module's documented one (temperature -> top-k -> top-p -> min-p). ``repetition_penalty`` follows
transformers / vLLM: every id seen in the prompt *or* the output has its logit divided by the penalty
when positive and multiplied when negative. The references are loops over Python floats (float64),
so they share nothing with the vectorised code they check; random cases whose cut lies within
float32 rounding of a threshold are skipped, since either answer is then right.
"""

from __future__ import annotations

import math

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ds4serve.engine.sampling import SamplerState, SamplingParams, _apply_penalties, _filtered_probs

MARGIN = 1e-4  # relative distance from a threshold below which float32 rounding may decide the cut


def _softmax(xs: list[float]) -> list[float]:
    top = max(xs)
    ex = [math.exp(x - top) if x != -math.inf else 0.0 for x in xs]
    total = sum(ex)
    return [e / total for e in ex]


def reference_kept(logits: list[float], p: SamplingParams) -> tuple[set[int], bool]:
    """The ids the filters keep, and whether every cut is clear of float32 rounding."""
    probs = _softmax([x / p.temperature for x in logits])
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    if p.top_k > 0:
        order = order[:p.top_k]
    mass = sum(probs[i] for i in order)
    renorm = {i: probs[i] / mass for i in order}
    clear = True
    kept: list[int] = []
    running = 0.0
    for i in order:  # top-p: take tokens until the mass taken reaches top_p (the crossing one included)
        kept.append(i)
        if p.top_p >= 1.0:
            continue  # the whole distribution (only rounding could make a prefix 'reach' 1)
        running += renorm[i]
        clear &= abs(running - p.top_p) > MARGIN
        if running >= p.top_p:
            break
    p_max = renorm[order[0]]
    final = set()
    for i in kept:  # min-p: relative to the most likely token
        clear &= abs(renorm[i] - p.min_p * p_max) > MARGIN * p_max
        if renorm[i] >= p.min_p * p_max:
            final.add(i)
    return final | {order[0]}, clear


def _distinct(logits: torch.Tensor) -> bool:
    """No two probabilities within rounding of each other (a tie makes the kept set ambiguous)."""
    s = sorted(logits.tolist())
    return all(b - a > 1e-4 for a, b in zip(s, s[1:]))


@given(st.integers(0, 2**31 - 1), st.integers(2, 40), st.sampled_from([0, 0, 1, 3, 10]),
       st.floats(0.05, 1.0), st.sampled_from([0.0, 0.0, 0.02, 0.1, 0.5]), st.floats(0.3, 2.5))
@settings(max_examples=300, deadline=None)
def test_kept_set_matches_the_definitions(seed: int, vocab: int, top_k: int, top_p: float, min_p: float,
                                          temp: float) -> None:
    """The tokens with non-zero filtered probability are exactly the reference's, and their
    probabilities are the raw (temperature) distribution renormalised over them."""
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2.5
    assume(_distinct(logits))
    params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
    want, clear = reference_kept(logits.tolist(), params)
    assume(clear)
    got = _filtered_probs(logits.unsqueeze(0), [params])[0]
    assert {i for i in range(vocab) if got[i] > 0} == want
    raw = _softmax([x / temp for x in logits.tolist()])
    mass = sum(raw[i] for i in want)
    for i in want:
        assert math.isclose(float(got[i]), raw[i] / mass, rel_tol=1e-4)


def test_top_p_includes_the_crossing_token() -> None:
    """Mass 0.3 + 0.25 crosses 0.5 at the second token: both stay, nothing else."""
    probs = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1])
    got = _filtered_probs(probs.log().unsqueeze(0), [SamplingParams(top_p=0.5)])[0]
    assert (got > 0).tolist() == [True, True, False, False, False]


def test_top_p_reached_exactly_stops_there() -> None:
    """Four equal tokens (probabilities exactly 0.25): mass 0.5 is reached by two, so two stay."""
    for top_p, n in ((0.5, 2), (0.25, 1), (0.75, 3), (0.51, 3), (1.0, 4)):
        got = _filtered_probs(torch.zeros(1, 4), [SamplingParams(top_p=top_p)])[0]
        assert int((got > 0).sum()) == n, (top_p, got)


def test_min_p_is_relative_to_the_top_token() -> None:
    """p_max = 0.4: min_p 0.5 keeps p >= 0.2 (three tokens), whatever the absolute scale."""
    probs = torch.tensor([0.4, 0.25, 0.2 + 1e-3, 0.1, 0.05 - 1e-3])
    got = _filtered_probs(probs.log().unsqueeze(0), [SamplingParams(min_p=0.5)])[0]
    assert (got > 0).tolist() == [True, True, True, False, False]


def test_filters_apply_per_row_in_a_batch() -> None:
    """Each row of a batch is filtered with its own parameters (row 1's top_p must not leak)."""
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(5)) * 2
    params = [SamplingParams(top_p=0.3), SamplingParams(min_p=0.2, top_k=5), SamplingParams(temperature=0.7)]
    got = _filtered_probs(logits, params)
    for row, p in enumerate(params):
        want, clear = reference_kept(logits[row].tolist(), p)
        assert clear
        assert {i for i in range(12) if got[row, i] > 0} == want


def reference_repetition(logits: list[float], seen: list[int], penalty: float) -> list[float]:
    """transformers' RepetitionPenaltyLogitsProcessor, once per distinct seen id."""
    out = list(logits)
    for i in set(seen):
        if 0 <= i < len(out):
            out[i] = out[i] / penalty if out[i] > 0 else out[i] * penalty
    return out


@given(st.integers(0, 2**31 - 1), st.lists(st.integers(0, 29), max_size=12),
       st.lists(st.integers(0, 29), max_size=12), st.floats(0.2, 5.0))
@settings(max_examples=200, deadline=None)
def test_repetition_penalty_over_prompt_and_output(seed: int, prompt: list[int], output: list[int],
                                                   penalty: float) -> None:
    """Penalised logits equal the reference: prompt and output ids both count, each id once, and the
    sign of the logit decides divide or multiply."""
    assume(penalty != 1.0)
    logits = torch.randn(30, generator=torch.Generator().manual_seed(seed)) * 3
    state = SamplerState(SamplingParams(repetition_penalty=penalty), prompt_ids=prompt, output_ids=list(output))
    got = _apply_penalties(logits.unsqueeze(0), [state])[0]
    want = reference_repetition(logits.tolist(), prompt + output, penalty)
    for g, w in zip(got.tolist(), want):
        assert math.isclose(g, w, rel_tol=1e-6, abs_tol=1e-7)


def test_repetition_penalty_signs_and_prompt_ids() -> None:
    """A positive logit shrinks, a negative one grows more negative; a prompt-only id is penalised."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    state = SamplerState(SamplingParams(repetition_penalty=2.0), prompt_ids=[0, 1], output_ids=[2])
    assert _apply_penalties(logits, [state])[0].tolist() == [1.0, -2.0, 0.25, 3.0]
