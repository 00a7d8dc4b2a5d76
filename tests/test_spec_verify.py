"""Verification of drafted tokens (issue 28 item 2; shared/spec/ds4-speculative.md §5).

* an oracle written from the spec in plain Python loops (it reads values out of tensors and does all
  of the arithmetic itself) against the batched ``verify_rows``;
* greedy: committed tokens (and logprobs) equal step-by-step plain decoding, penalties and bans included;
* an empty draft is ``sample_rows`` bit for bit; a fully accepted draft's bonus is ``sample_rows``' draw
  of that index;
* determinism whatever the batch around a request and its order;
* statistics: the committed tokens follow the target (chi-square at p = 0.001, fixed seeds), for a dense
  q, a point-mass q and a two-token Markov chain, each with negative controls that must fail
  (residual from p instead of max(p - q, 0); drafts not drawn from q).
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4serve.engine import spec_verify
from ds4serve.engine.ngram import propose
from ds4serve.engine.sampling import (SamplerState, SamplingParams, _apply_penalties, _filtered_probs, sample_rows,
                                      token_seed)
from ds4serve.engine.spec_verify import (ACCEPT_DOMAIN, BAD_DRAFT, NON_FINITE, Draft, accept_uniform, draft_probs,
                                         draw_drafts, greedy_drafts, request_seed, verify_rows)

CHI2_999 = {5: 20.515, 35: 66.619}  # chi-square critical values at p = 0.001 (upper tail)


def state(out=(), prompt=(1, 2), eos=(0,), **kw) -> SamplerState:
    return SamplerState(SamplingParams(**kw), list(prompt), list(out), tuple(eos))


# ---- the oracle: spec §5 in plain loops ---------------------------------------------------------------

def _argmax_first(values: list) -> int:
    best = 0
    for v in range(1, len(values)):
        if values[v] > values[best]:
            best = v
    return best


def _noise(base: int, index: int, vocab: int, dtype: torch.dtype) -> list[float]:
    """The exponential noise of output index ``index`` (the generator plain sampling uses), as values."""
    g = torch.Generator().manual_seed(token_seed(base, index))
    return torch.empty(vocab, dtype=dtype).exponential_(generator=g).tolist()


def oracle(work: list[list[float]], probs: list[list[float]] | None, finite: list[bool], drafts: list[int],
           q: list[list[float]] | None, greedy: bool, base: int, k0: int) -> tuple[bool, int, tuple[int, ...]]:
    """(ok, accepted, committed tokens) of one request: row i is the target at index k0 + i, draft i is
    checked against row i, the bonus comes from the stop row (spec §5.1, §5.2)."""
    vocab, n_drafts = len(work[0]), len(drafts)
    if not greedy and q is not None and any(not math.isfinite(x) or x < 0 for row in q for x in row):
        return False, 0, ()
    out: list[int] = []
    for i in range(n_drafts + 1):
        if not finite[i]:
            return False, 0, ()
        if greedy:
            top = _argmax_first(work[i])
            if i < n_drafts and drafts[i] == top:
                out.append(drafts[i])
                continue
            return True, i, tuple(out + [top])
        if i < n_drafts:
            d = drafts[i]
            q_row = q[i] if q is not None else [1.0 if v == d else 0.0 for v in range(vocab)]
            u = (token_seed(token_seed(base, k0 + i), ACCEPT_DOMAIN) >> 10) / 2**53
            if q_row[d] > 0 and probs[i][d] > u * q_row[d]:
                out.append(d)
                continue
            residual = [max(pv - qv, 0.0) for pv, qv in zip(probs[i], q_row)]
            if not any(x > 0 for x in residual):
                residual = list(probs[i])
            noise = _noise(base, k0 + i, vocab, torch.float64)
            return True, i, tuple(out + [_argmax_first([r / e for r, e in zip(residual, noise)])])
        noise = _noise(base, k0 + i, vocab, torch.float32)
        ratios = [np.float32(p) / np.float32(e) for p, e in zip(probs[i], noise)]  # the race in fp32
        return True, i, tuple(out + [_argmax_first(ratios)])
    raise AssertionError("unreachable")


def _random_request(rnd: random.Random, g: torch.Generator, vocab: int):
    """A state, its verify rows, and a draft: dense, point-mass, q = p, sparse q or broken q."""
    n = rnd.randint(0, 4)
    greedy = rnd.random() < 0.3
    params = SamplingParams(temperature=0.0 if greedy else rnd.choice([0.5, 1.0, 2.0]),
                            top_k=rnd.choice([0, 0, 2, 3]), top_p=rnd.choice([1.0, 1.0, 0.7]),
                            min_p=rnd.choice([0.0, 0.0, 0.1]), seed=rnd.randrange(2**40))
    s = SamplerState(params, [1], [rnd.randrange(vocab) for _ in range(rnd.randint(0, 5))], ())
    logits = torch.randn(n + 1, vocab, generator=g) * rnd.choice([0.5, 2.0, 5.0])
    if rnd.random() < 0.1:
        logits[rnd.randrange(n + 1), rnd.randrange(vocab)] = float(rnd.choice(["nan", "inf"]))
    mode = rnd.choice(["point", "dense", "dense", "target", "sparse", "broken"] if n else ["point"])
    q = None
    if mode != "point":
        q = torch.softmax(torch.randn(n, vocab, generator=g) * 2, dim=-1)
        if mode == "target":
            q = _filtered_probs(torch.nan_to_num(logits[:n], nan=0.0, posinf=0.0), [params] * n)
        if mode == "sparse":
            q = q * (torch.rand(n, vocab, generator=g) < 0.5)
            q = q / q.sum(-1, keepdim=True).clamp(min=1e-30)
        if mode == "broken":
            q[rnd.randrange(n), rnd.randrange(vocab)] = float("nan")
    if q is not None and mode != "broken" and rnd.random() < 0.7 and bool((q.sum(-1) > 0).all()):
        seed = request_seed(s)
        tokens = tuple(int(t) for t in draw_drafts(q, [seed] * n, [len(s.output_ids) + i for i in range(n)]))
    else:
        tokens = tuple(rnd.randrange(vocab) for _ in range(n))
    return s, logits, Draft(tokens, q)


def _oracle_of(s: SamplerState, logits: torch.Tensor, d: Draft):
    finite = torch.isfinite(logits).all(-1)
    clean = torch.where(finite.unsqueeze(-1), logits, torch.zeros_like(logits))
    probs = None if s.params.greedy else _filtered_probs(clean, [s.params] * len(clean)).tolist()
    return oracle(clean.tolist(), probs, finite.tolist(), list(d.tokens),
                  None if d.probs is None else d.probs.tolist(), s.params.greedy, request_seed(s),
                  len(s.output_ids))


def _outcome(s: SamplerState, d: Draft, ok: bool, accepted: int) -> set:
    """Which kind of case this was (the test below must reach every kind, or it proves little)."""
    kind = "greedy" if s.params.greedy else "point" if d.probs is None else "dense"
    seen = {(kind, "fail" if not ok else "all" if accepted == len(d.tokens) else "reject")}
    if ok and d.probs is not None and accepted < len(d.tokens) and not s.params.greedy:
        seen.add(("q(d)=0", float(d.probs[accepted, d.tokens[accepted]]) == 0.0))
    return seen


def test_verify_matches_the_oracle():
    """150 seeded batches of 1-4 requests (vocab 2-8, 0-4 drafts, filters, NaN rows, every q shape)."""
    seen = set()
    for seed in range(150):
        rnd, g = random.Random(seed), torch.Generator().manual_seed(seed)
        vocab = rnd.randint(2, 8)
        reqs = [_random_request(rnd, g, vocab) for _ in range(rnd.randint(1, 4))]
        verdicts = verify_rows(torch.cat([x[1] for x in reqs]), [x[0] for x in reqs], [x[2] for x in reqs])
        for (s, logits, d), v in zip(reqs, verdicts):
            ok, accepted, tokens = _oracle_of(s, logits, d)
            assert (v.ok, v.tokens) == (ok, tokens), f"seed {seed}"
            assert v.accepted == accepted if ok else v.error in (NON_FINITE, BAD_DRAFT)
            seen |= _outcome(s, d, ok, accepted)
    assert {(k, o) for k in ("greedy", "point", "dense") for o in ("all", "reject")} <= seen
    assert ("dense", "fail") in seen and ("greedy", "fail") in seen and ("q(d)=0", True) in seen


# ---- greedy: token for token plain decoding -----------------------------------------------------------

VOCAB = 12


def toy_logits(context: list[int]) -> torch.Tensor:
    """A deterministic 'model': logits from the last three tokens (so text repeats and drafts can pass)."""
    key = 7
    for t in context[-3:]:
        key = (key * 1_000_003 + t + 1) % 2**61
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(key)) * 2
    logits[0] += 1.0  # EOS (id 0) is often the argmax: min_tokens bans matter
    return logits


GREEDY_PARAMS = [dict(temperature=0.0, logprobs=2), dict(temperature=0.0, repetition_penalty=1.4),
                 dict(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.4, logprobs=0),
                 dict(temperature=0.8, top_k=1, min_tokens=6)]


def _plain(prompt: list[int], kw: dict, n: int):
    s = state(prompt=prompt, **kw)
    draws = []
    for _ in range(n):
        d = sample_rows(toy_logits(prompt + s.output_ids).unsqueeze(0), [s])[0]
        s.output_ids.append(d.token)
        draws.append(d)
    return draws


def test_greedy_commits_exactly_plain_decoding():
    n, rnd = 24, random.Random(5)
    prompts = [[(3 * r + i) % VOCAB for i in range(5)] for r in range(len(GREEDY_PARAMS))]
    plain = [_plain(p, kw, n) for p, kw in zip(prompts, GREEDY_PARAMS)]
    states = [state(prompt=p, **kw) for p, kw in zip(prompts, GREEDY_PARAMS)]
    got = [[] for _ in states]
    accepted_total = rejected_total = 0
    while any(len(x) < n for x in got):
        live = [r for r in range(len(states)) if len(got[r]) < n]
        drafts = []
        for r in live:  # half the requests draft the truth with corruptions, half draft n-grams
            k0, truth = len(states[r].output_ids), [d.token for d in plain[r]]
            if r % 2:
                tokens = [t if rnd.random() < 0.7 else rnd.randrange(VOCAB) for t in truth[k0:k0 + rnd.randint(0, 4)]]
            else:
                tokens = list(propose(prompts[r] + states[r].output_ids, 4, 1, 3))
            drafts.append(Draft(tuple(tokens)))
        rows = [toy_logits(prompts[r] + states[r].output_ids + list(d.tokens[:i]))
                for r, d in zip(live, drafts) for i in range(len(d.tokens) + 1)]
        for r, d, v in zip(live, drafts, verify_rows(torch.stack(rows), [states[r] for r in live], drafts)):
            assert v.ok
            accepted_total += v.accepted
            rejected_total += v.accepted < len(d.tokens)
            states[r].output_ids.extend(v.tokens)
            got[r].extend(v.draws)
    for r in range(len(states)):
        assert [d.token for d in got[r][:n]] == [d.token for d in plain[r]], f"request {r}"
        assert [(d.logprob, d.top_logprobs) for d in got[r][:n]] == [(d.logprob, d.top_logprobs) for d in plain[r]]
    assert accepted_total > 20 and rejected_total > 5  # the drafts really were tested both ways


def test_greedy_ties_take_the_first_argmax():
    logits = torch.zeros(2, 5)  # every token ties: argmax is 0
    v = verify_rows(logits, [state(temperature=0.0)], [Draft((3,))])[0]
    assert (v.accepted, v.tokens) == (0, (0,))
    v = verify_rows(logits, [state(temperature=0.0)], [Draft((0,))])[0]
    assert (v.accepted, v.tokens) == (1, (0, 0))


# ---- sampled: an empty draft is plain sampling, a full acceptance draws the bonus as plain sampling ---

def _mixed_states(rnd: random.Random, n: int) -> list[dict]:
    pool = [dict(temperature=0.7, logprobs=3), dict(temperature=0.0, logprobs=1), dict(temperature=1.3, top_k=4),
            dict(temperature=1.0, top_p=0.5, min_p=0.05), dict(temperature=1.0, repetition_penalty=1.5, logprobs=0),
            dict(temperature=0.9, presence_penalty=1.0, frequency_penalty=0.5), dict(temperature=1.0, min_tokens=8)]
    return [dict(rnd.choice(pool), seed=rnd.choice([None, rnd.randrange(2**31)])) for _ in range(n)]


@given(st.integers(0, 2**31 - 1))
@settings(max_examples=60, deadline=None)
def test_an_empty_draft_is_sample_rows_bit_for_bit(seed):
    rnd, g = random.Random(seed), torch.Generator().manual_seed(seed)
    kws = _mixed_states(rnd, rnd.randint(1, 6))
    outs = [[rnd.randrange(30) for _ in range(rnd.randint(0, 10))] for _ in kws]
    logits = torch.randn(len(kws), 30, generator=g) * 3
    if rnd.random() < 0.3:
        logits[rnd.randrange(len(kws)), 0] = float("nan")
    plain_states = [state(out=o, **kw) for o, kw in zip(outs, kws)]
    plain = sample_rows(logits, plain_states)
    spec_states = [state(out=o, **kw) for o, kw in zip(outs, kws)]
    for a, b in zip(plain_states, spec_states):
        b.base_seed = request_seed(a)  # unseeded requests: the same per-request seed
    verdicts = verify_rows(logits, spec_states, [Draft() for _ in kws])
    for d, v in zip(plain, verdicts):
        assert v.ok == d.ok
        if d.ok:
            assert v.accepted == 0 and v.draws == (d,)


def test_a_fully_accepted_draft_draws_the_bonus_as_plain_decoding():
    """With q = p every draft passes; the bonus is sample_rows' draw for index k0 + L with the drafts
    in the history (penalties included)."""
    g = torch.Generator().manual_seed(3)
    for seed in range(20):
        kw = dict(temperature=1.0, seed=seed, repetition_penalty=1.0 + (seed % 3) * 0.3)
        n, logits = 3, torch.randn(4, 40, generator=g) * 2
        tokens, q = [], []
        for i in range(n):  # q_i = the target's processed row i (its history: the drafts so far)
            row_state = state(out=[4, 5, *tokens], **kw)
            q.append(_filtered_probs(_apply_penalties(logits[i:i + 1], [row_state]), [row_state.params])[0])
            tokens.append(int(draw_drafts(q[-1].unsqueeze(0), [seed], [2 + i])[0]))
        v = verify_rows(logits, [state(out=[4, 5], **kw)], [Draft(tuple(tokens), torch.stack(q))])[0]
        assert v.accepted == n
        plain = sample_rows(logits[n:], [state(out=[4, 5, *tokens], **kw)])[0]
        assert v.draws[-1] == plain


# ---- determinism --------------------------------------------------------------------------------------

def test_a_request_verifies_the_same_in_any_batch():
    rnd, g = random.Random(11), torch.Generator().manual_seed(11)
    reqs = [_random_request(rnd, g, 9) for _ in range(8)]
    alone = [verify_rows(lg, [s], [d])[0] for s, lg, d in reqs]
    assert len({v.tokens for v in alone}) > 3
    for trial in range(4):
        order = list(range(len(reqs)))
        random.Random(trial).shuffle(order)
        order = order[:rnd.randint(2, len(reqs))]
        batch = verify_rows(torch.cat([reqs[i][1] for i in order]), [reqs[i][0] for i in order],
                            [reqs[i][2] for i in order])
        assert [v.tokens for v in batch] == [alone[i].tokens for i in order]
    again = [verify_rows(lg, [s], [d])[0] for s, lg, d in reqs]  # a retried step: the same again
    assert again == alone


# ---- edge cases -----------------------------------------------------------------------------------------

def test_rows_past_the_stop_are_never_read_but_a_needed_row_fails_the_request():
    logits = torch.full((3, 6), -5.0)
    logits[:, 2] = 5.0  # argmax 2 everywhere
    bad_after = logits.clone()
    bad_after[2, 0] = float("nan")
    v = verify_rows(bad_after, [state(temperature=0.0)], [Draft((4, 2))])[0]  # rejected at row 0
    assert v.ok and v.tokens == (2,)
    v = verify_rows(bad_after, [state(temperature=0.0)], [Draft((2, 2))])[0]  # row 2 needed: fails
    assert (v.ok, v.error, v.draws) == (False, NON_FINITE, ())
    broken = Draft((1, 1), torch.tensor([[float("nan")] * 6, [1 / 6] * 6]))
    assert verify_rows(logits, [state(seed=1)], [broken])[0].error == BAD_DRAFT
    assert verify_rows(logits, [state(temperature=0.0)], [broken])[0].ok  # greedy never reads q


def test_impossible_drafts_are_rejected():
    logits = torch.zeros(2, 4)  # p uniform
    q_without_d = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    for seed in range(50):  # q(d) = 0: the drafter could not have drawn d
        v = verify_rows(logits[:2], [state(seed=seed)], [Draft((3,), q_without_d)])[0]
        assert v.accepted == 0 and v.tokens[0] in (2, 3)  # the residual max(p - q, 0) lives on 2 and 3
    filtered = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 2)
    for seed in range(50):  # p(d) = 0: top-k leaves only tokens 0 and 1
        v = verify_rows(filtered, [state(seed=seed, top_k=2)], [Draft((2,))])[0]
        assert v.accepted == 0 and v.tokens[0] in (0, 1)
    for seed in range(50):  # p(d) = 0 by min_tokens: the stop id may not come yet
        v = verify_rows(torch.zeros(2, 4), [state(seed=seed, eos=(2,), min_tokens=3)], [Draft((2,))])[0]
        assert v.accepted == 0 and v.tokens[0] != 2


def test_grammar_rows_need_a_mask_and_the_mask_is_applied():
    logits = torch.zeros(2, 5)
    logits[:, 3] = 4.0
    s = state(temperature=0.0)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, 3] = False
    v = verify_rows(logits, [s], [Draft((3,))], grammar_mask=mask)[0]
    assert v.accepted == 0 and v.tokens != (3,)
    s.constraint = object()
    with pytest.raises(ValueError):
        verify_rows(logits, [s], [Draft((3,))])
    with pytest.raises(ValueError):
        verify_rows(logits, [state()], [Draft((3, 3))])  # three rows needed, two given


# ---- drafter helpers ------------------------------------------------------------------------------------

def test_draft_probs_and_draws():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5), SamplingParams(top_p=0.5)]
    q = draft_probs(logits, params)
    assert torch.equal(q[0], torch.nn.functional.one_hot(logits[0].argmax(), 20).float())
    assert torch.equal(q[1:], _filtered_probs(logits[1:], params[1:]))
    assert torch.equal(greedy_drafts(logits), logits.argmax(-1))
    a = draw_drafts(q, [5, 5, 5], [0, 1, 2])
    assert torch.equal(a, draw_drafts(q, [5, 5, 5], [0, 1, 2])) and int(a[0]) == int(logits[0].argmax())
    assert all(float(q[i, int(a[i])]) > 0 for i in range(3))  # only tokens q allows
    # the draft domain is not plain sampling's: the same (seed, index) gives different noise streams
    plain = [sample_rows(torch.log(q[2:]), [state(out=[0] * i, seed=5, top_p=0.5)])[0].token for i in range(40)]
    drafted = draw_drafts(q[2:].expand(40, 20), [5] * 40, list(range(40))).tolist()
    assert plain != drafted


@given(st.integers(0, 2**62), st.integers(0, 10**6))
@settings(max_examples=200, deadline=None)
def test_acceptance_uniforms(base, index):
    u = accept_uniform(base, index)
    assert 0.0 <= u < 1.0
    assert u != accept_uniform(base, index + 1)
    assert u * 2**53 == int(u * 2**53)  # 53 bits exactly: float64 holds it without rounding


@given(st.lists(st.floats(0, 1), min_size=2, max_size=8), st.lists(st.floats(0, 1), min_size=2, max_size=8))
@settings(max_examples=200, deadline=None)
def test_residual(p, q):
    n = min(len(p), len(q))
    pt, qt = torch.tensor(p[:n], dtype=torch.float64), torch.tensor(q[:n], dtype=torch.float64)
    r = spec_verify._residual(pt.unsqueeze(0), qt.unsqueeze(0))[0].tolist()
    expected = [max(a - b, 0.0) for a, b in zip(p[:n], q[:n])]
    assert r == (expected if any(x > 0 for x in expected) else p[:n])


# ---- statistics: the committed tokens follow the target ------------------------------------------------

P = torch.tensor([0.30, 0.25, 0.15, 0.12, 0.10, 0.08])
Q = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.25, 0.25])
N = 20_000
N_CONTROL = 4_000  # a mutant's statistic is in the thousands at 20k seeds; 4k is plenty to see it


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs))


def _first_tokens(n_drafts: int, point_mass: bool, greedy_q: bool = False, n: int = N) -> list[int]:
    """Counts of the first committed token over n seeds: target P at every row, drafts from Q (or a
    point mass: token 0 first, so residual-from-p over-weights it; a mixture of point masses over all
    tokens would hide that mutant in the marginal)."""
    states = [state(seed=s, prompt=(), eos=()) for s in range(n)]
    seeds = [request_seed(s) for s in states]
    if point_mass:
        tokens = [(0, *((s + i) % 6 for i in range(1, n_drafts))) for s in range(n)]
    elif greedy_q:  # the ds4 #482 bug: greedy drafts verified against a dense q
        tokens = [(int(Q.argmax()),) * n_drafts] * n
    else:
        cols = [draw_drafts(Q.expand(n, 6), seeds, [i] * n).tolist() for i in range(n_drafts)]
        tokens = list(zip(*cols))
    q = None if point_mass else Q.expand(n_drafts, 6)
    logits = P.log().expand(n * (n_drafts + 1), 6).contiguous()
    verdicts = verify_rows(logits, states, [Draft(t, q) for t in tokens])
    counts = [0] * 6
    for v in verdicts:
        counts[v.tokens[0]] += 1
    return counts


@pytest.mark.parametrize("point_mass", [False, True], ids=["dense-q", "point-mass"])
def test_first_committed_token_follows_the_target(point_mass, monkeypatch):
    counts = _first_tokens(2, point_mass)
    assert chi_square(counts, P.tolist()) < CHI2_999[5], counts
    monkeypatch.setattr(spec_verify, "_residual", lambda p, q: p)  # the mutant: residual from p
    assert chi_square(_first_tokens(2, point_mass, n=N_CONTROL), P.tolist()) > CHI2_999[5]


def test_drafts_not_drawn_from_q_are_caught():
    assert chi_square(_first_tokens(2, False, greedy_q=True, n=N_CONTROL), P.tolist()) > CHI2_999[5]


MARKOV_P = torch.tensor([[0.30, 0.25, 0.15, 0.12, 0.10, 0.08], [0.10, 0.40, 0.20, 0.10, 0.10, 0.10],
                         [0.15, 0.15, 0.30, 0.15, 0.15, 0.10], [0.08, 0.12, 0.20, 0.35, 0.15, 0.10],
                         [0.20, 0.10, 0.10, 0.10, 0.40, 0.10], [0.10, 0.10, 0.10, 0.20, 0.20, 0.30]])
MARKOV_Q = torch.tensor([[0.05, 0.10, 0.15, 0.20, 0.25, 0.25], [0.40, 0.10, 0.10, 0.10, 0.20, 0.10],
                         [0.10, 0.10, 0.10, 0.50, 0.10, 0.10], [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
                         [0.10, 0.10, 0.40, 0.10, 0.10, 0.20], [0.20, 0.20, 0.20, 0.20, 0.10, 0.10]])


def _markov_pairs(n: int) -> list[int]:
    """Counts of the first two output tokens of n requests decoding a Markov chain (target MARKOV_P,
    drafter MARKOV_Q drafting 2 tokens a step, chained on its own draws), anchor token 0."""
    states = [state(seed=s, prompt=(0,), eos=()) for s in range(n)]
    seeds = [request_seed(s) for s in states]
    while True:
        live = [r for r, s in enumerate(states) if len(s.output_ids) < 2]
        if not live:
            break
        prev = torch.tensor([(states[r].prompt_ids + states[r].output_ids)[-1] for r in live])
        d1 = draw_drafts(MARKOV_Q[prev], [seeds[r] for r in live], [len(states[r].output_ids) for r in live])
        d2 = draw_drafts(MARKOV_Q[d1], [seeds[r] for r in live], [len(states[r].output_ids) + 1 for r in live])
        logits = torch.stack([MARKOV_P[prev], MARKOV_P[d1], MARKOV_P[d2]], dim=1).log().reshape(-1, 6)
        drafts = [Draft((int(a), int(b)), torch.stack([MARKOV_Q[int(p)], MARKOV_Q[int(a)]]))
                  for p, a, b in zip(prev.tolist(), d1.tolist(), d2.tolist())]
        for r, v in zip(live, verify_rows(logits, [states[r] for r in live], drafts)):
            states[r].output_ids.extend(v.tokens)
    counts = [0] * 36
    for s in states:
        counts[6 * s.output_ids[0] + s.output_ids[1]] += 1
    return counts


def test_sampled_stream_follows_the_target_chain(monkeypatch):
    """Two steps deep: the pair of first tokens is distributed as MARKOV_P[0][a] * MARKOV_P[a][b]."""
    expected = [float(MARKOV_P[0, a] * MARKOV_P[a, b]) for a in range(6) for b in range(6)]
    assert chi_square(_markov_pairs(10_000), expected) < CHI2_999[35]  # fewest expected in a cell: 64
    monkeypatch.setattr(spec_verify, "_residual", lambda p, q: p)
    assert chi_square(_markov_pairs(N_CONTROL), expected) > CHI2_999[35]
