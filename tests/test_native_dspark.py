"""The DSpark drafter's C forward (``model/native_dspark.py``, ``csrc/host_dspark.c``) against the torch
drafter (``model/dspark.py``, itself pinned to the spec's loop oracles in ``test_dspark_drafter.py``) on a
seeded random three-stage drafter: the same ring rows, base logits and hidden states within fp32
rounding, the same greedy Markov tokens and confidences; drafts that are deterministic and do not depend
on the batch (bit for bit); sampled blocks drawn by the engine's pick from the C logits; and the engine
choosing it beside the host forward, with greedy output unchanged. fp32 throughout."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from dspark_checkpoint import build_trunk, drafter_tensors, dspark_config, write_checkpoint
from ds4serve.engine.checkpoint_drafters import DSparkDrafts, NativeDSparkDrafts, dspark_drafts
from ds4serve.llm import LLM
from ds4serve.model import dspark as D
from ds4serve.model.dspark_weights import load_dspark
from ds4serve.model.loader import load_model
from ds4serve.model.native_dspark import NativeDSpark, library

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler here: the torch drafter runs")


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    root = tmp_path_factory.mktemp("native_dspark")
    config = dspark_config()
    path = write_checkpoint(root / "ckpt", build_trunk(root), drafter_tensors(config, seed=11).stored, config)
    _, model = load_model(path, progress=False)
    return dict(path=path, weights=load_dspark(path), model=model)


def _argmax(logits: torch.Tensor, i: int):
    top = logits.argmax(dim=-1)
    return top, F.one_hot(top, logits.shape[-1]).float()


def _histories(weights, lengths, seed=3):
    """Two pools, torch's and the C forward's, fed the same committed rows (one commit call)."""
    gen = torch.Generator().manual_seed(seed)
    pos = torch.cat([torch.arange(n) for n in lengths])
    owners = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    captured = torch.randn(pos.shape[0], len(weights.config.target_layer_ids), weights.config.trunk.hidden_size,
                           generator=gen)
    pools = [D.DSparkRings(weights.config, len(lengths)) for _ in range(2)]
    states = [[p.new_state() for _ in lengths] for p in pools]
    D.commit(weights, states[0], pos, captured, owners)
    return pools, states, (pos, captured, owners)


def _native(ck, pool, model=None):
    return NativeDSpark(ck["weights"], model if model is not None else ck["model"], pool)


def test_commit_writes_the_torch_drafters_ring_rows(ck):
    """Rows at pos % window for the last window positions of each request (one request wraps its ring)."""
    w = ck["weights"]
    window = w.config.window
    lengths = [window + 7, 5, window]
    (ref, got), states, (pos, captured, owners) = _histories(w, lengths)
    slots = torch.tensor([s.slot for s in states[1]]).index_select(0, owners)
    _native(ck, got).commit(slots, pos, captured)
    real = slice(0, len(lengths))  # the scratch slot holds torch's dropped rows, the C forward skips them
    assert torch.equal(ref.pos[real], got.pos[real])
    torch.testing.assert_close(got.kv[real], ref.kv[real], atol=1e-5, rtol=1e-5)
    assert bool((got.pos[0] >= 7).all())  # the wrapped ring keeps the newest window rows


def test_a_later_commit_never_replaces_a_newer_row(ck):
    w = ck["weights"]
    pool = D.DSparkRings(w.config, 1)
    state = pool.new_state()
    nat = _native(ck, pool)
    slot = torch.tensor([state.slot])
    width = len(w.config.target_layer_ids) * w.config.trunk.hidden_size
    nat.commit(slot, torch.tensor([w.config.window + 2]), torch.ones(1, width))
    before = pool.kv.clone()
    nat.commit(slot, torch.tensor([2]), torch.zeros(1, width))  # same ring row, older position
    assert torch.equal(pool.kv, before) and int(pool.pos[state.slot, 2]) == w.config.window + 2


@pytest.mark.parametrize("host_layout", [False, True])
def test_block_logits_hidden_and_greedy_tokens_match_the_torch_drafter(ck, host_layout):
    """Base logits and hidden states within 1e-4 (three stages of sums in another order), the same greedy
    tokens and confidences; with the LM head as the host forward stores it ([D, V] in place) and as torch
    does ([V, D])."""
    w = ck["weights"]
    model = LLM(ck["path"], host_kernels="on", warmup=False).core.executor.model if host_layout else ck["model"]
    lengths = [w.config.window + 3, 6, 1]
    (pool, got), states, (pos, captured, owners) = _histories(w, lengths)
    nat = _native(ck, got, model)
    nat.commit(torch.tensor([s.slot for s in states[1]]).index_select(0, owners), pos, captured)
    anchors, at = torch.tensor([4, 250, 17]), torch.tensor(lengths)
    ref = D.draft(w, states[0], anchors, at, D.SharedHead.from_target(model), sampler=_argmax)
    base, hidden, tokens, conf = nat.draft(torch.tensor([s.slot for s in states[1]]), anchors, at, True)
    torch.testing.assert_close(base, ref.base_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hidden, ref.hidden, atol=1e-4, rtol=1e-4)
    assert torch.equal(tokens, ref.tokens)
    torch.testing.assert_close(conf, ref.confidence, atol=1e-5, rtol=1e-5)


def test_drafts_are_deterministic_and_batch_invariant(ck):
    """A request's block alone equals its block beside others, bit for bit, and a repeat equals the first."""
    w = ck["weights"]
    lengths = [9, 30, 14]
    (_, got), states, (pos, captured, owners) = _histories(w, lengths)
    nat = _native(ck, got)
    slots = torch.tensor([s.slot for s in states[1]])
    nat.commit(slots.index_select(0, owners), pos, captured)
    anchors, at = torch.tensor([40, 41, 42]), torch.tensor(lengths)
    batch = nat.draft(slots, anchors, at, True)
    again = nat.draft(slots, anchors, at, True)
    for r in range(3):
        alone = nat.draft(slots[r:r + 1], anchors[r:r + 1], at[r:r + 1], True)
        for a, b, c in zip(alone, batch, again):
            assert torch.equal(a[0], b[r]) and torch.equal(b[r], c[r])


def test_sampled_blocks_are_drawn_by_pick_over_the_c_logits(ck):
    """A sampled block runs the torch Markov head over the C forward's logits with the engine's own
    draws: the tokens torch's drafter draws from the same uniforms, and q the softmax of the corrected
    logits."""
    w, model = ck["weights"], ck["model"]
    drafts = NativeDSparkDrafts(w, model, 2)
    states = [drafts.new_state(), drafts.new_state()]
    ref_drafts = DSparkDrafts(w, model, 2)
    ref_states = [ref_drafts.new_state(), ref_drafts.new_state()]
    gen = torch.Generator().manual_seed(9)
    pos = torch.cat([torch.arange(12), torch.arange(20)])
    owners = torch.cat([torch.zeros(12, dtype=torch.long), torch.ones(20, dtype=torch.long)])
    captured = torch.randn(32, len(w.config.target_layer_ids) * w.config.trunk.hidden_size, generator=gen)
    for d, s in ((drafts, states), (ref_drafts, ref_states)):
        d.commit(s, pos, pos, captured, owners)
    uniforms = torch.rand(2, w.config.block_size, generator=gen)

    def pick(logits, i):
        q = torch.softmax(logits, dim=-1)
        return D.inverse_cdf(q, uniforms[:, i]), q

    got = drafts.draft(states, torch.tensor([3, 8]), torch.tensor([12, 20]), pick)
    want = ref_drafts.draft(ref_states, torch.tensor([3, 8]), torch.tensor([12, 20]), pick)
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.q, want.q, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.survival, want.survival, atol=1e-5, rtol=1e-5)
    assert drafts.ready(states, torch.tensor([11, 19])) == ref_drafts.rings.complete(
        ref_states, torch.tensor([11, 19])).tolist() == [True, True]


def test_a_greedy_pick_stays_in_c_and_gives_q_only_when_asked(ck):
    """With ``pick.greedy`` the C Markov head draws (pick is never called): the torch adapter's argmax
    tokens, a one-hot q when ``pick.needs_q``, none otherwise (coupled acceptance reads none)."""
    w, model = ck["weights"], ck["model"]
    drafts, ref_drafts = NativeDSparkDrafts(w, model, 1), DSparkDrafts(w, model, 1)
    states, ref_states = [drafts.new_state()], [ref_drafts.new_state()]
    pos = torch.arange(15)
    captured = torch.randn(15, len(w.config.target_layer_ids) * w.config.trunk.hidden_size,
                           generator=torch.Generator().manual_seed(4))
    for d, s in ((drafts, states), (ref_drafts, ref_states)):
        d.commit(s, pos, pos, captured, torch.zeros(15, dtype=torch.long))

    def never(logits, i):
        raise AssertionError("a greedy block must not call pick")

    want = ref_drafts.draft(ref_states, torch.tensor([21]), torch.tensor([15]), _argmax)
    for needs_q in (True, False):
        never.greedy, never.needs_q = True, needs_q
        got = drafts.draft(states, torch.tensor([21]), torch.tensor([15]), never)
        assert torch.equal(got.tokens, want.tokens)
        torch.testing.assert_close(got.survival, want.survival, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.q, want.q) if needs_q else got.q is None


def test_the_engine_takes_the_c_drafter_beside_the_host_forward(ck):
    """``dspark_drafts`` picks the C forward for a host-forward target and the torch one otherwise; with
    it the engine's greedy output is plain decoding's, and it drafts."""
    assert isinstance(dspark_drafts(ck["weights"], ck["model"], 1, True), NativeDSparkDrafts)
    assert type(dspark_drafts(ck["weights"], ck["model"], 1, False)) is DSparkDrafts
    spec = json.dumps({"method": "dspark", "num_speculative_tokens": 4})
    plain = LLM(ck["path"], max_seqs=2, host_kernels="on", warmup=False)
    drafted = LLM(ck["path"], max_seqs=2, host_kernels="on", warmup=False, speculative=spec)
    assert isinstance(drafted.core.executor.drafts.model, NativeDSparkDrafts)
    prompts = [[5 + (7 * j) % 50 for j in range(20)], [9, 8, 7, 6] * 4]
    want = plain.generate(prompts, max_tokens=20, temperature=0.0, ignore_eos=True)
    assert drafted.generate(prompts, max_tokens=20, temperature=0.0, ignore_eos=True) == want
    assert drafted.core.stats.speculation.get("drafted_tokens", 0) > 0


def test_ready_agrees_with_the_rings_completeness_after_gaps_and_hits(ck):
    """``NativeDSparkDrafts.ready`` (in C, from the rings' addressing) answers what
    ``DSparkRings.complete`` answers, for rings committed with gaps, from a later start (a prefix hit),
    emptied, and at every anchor position around and past the window."""
    import random

    drafts = NativeDSparkDrafts(ck["weights"], ck["model"], capacity=4)
    window = ck["weights"].config.window
    rnd = random.Random(5)
    for trial in range(40):
        states = [drafts.new_state() for _ in range(3)]
        for s in states:
            start = rnd.choice((0, 0, rnd.randrange(1, 2 * window)))
            count = rnd.randrange(0, 2 * window)
            positions = [q for q in range(start, start + count) if rnd.random() > (0.05 if trial % 2 else 0.0)]
            if positions:
                pos = torch.tensor(positions)
                hidden = torch.randn(len(positions), len(ck["weights"].config.target_layer_ids),
                                     ck["weights"].config.trunk.hidden_size)
                drafts.commit([s], pos, pos, hidden, torch.zeros(len(positions), dtype=torch.long))
        for p in range(-1, 3 * window, 3):
            last = torch.full((3,), p)
            whole = drafts.rings.complete(states, last).tolist()
            assert drafts.ready(states, last) == whole, (trial, p)
            # the engine's one-call greedy proposal decides readiness the same way (in C)
            assert drafts.propose_greedy(states, [5, 6, 7], [p + 1] * 3)[0] == whole, (trial, p)
        for s in states:
            drafts.release(s)


def test_the_engines_one_call_paths_equal_commit_ready_draft_and_cumprod(ck):
    """``commit_entries`` (the engine's backlog chunks by address) writes the rings ``commit`` writes, and
    ``propose_greedy`` (readiness, greedy block and survival in one C call) gives what ``ready``, ``draft``
    with a greedy pick and ``torch.cumprod`` give, bit for bit, for requests ready and not."""
    w, model = ck["weights"], ck["model"]
    width = len(w.config.target_layer_ids) * w.config.trunk.hidden_size
    one, ref = NativeDSparkDrafts(w, model, 3), NativeDSparkDrafts(w, model, 3)
    states, ref_states = [one.new_state() for _ in range(3)], [ref.new_state() for _ in range(3)]
    gen = torch.Generator().manual_seed(9)
    chunks = [(0, 0, 7), (1, 0, 3), (0, 7, 1), (2, 4, 5), (1, 3, 2), (0, 8, 3)]  # (request, start, rows)
    entries = []
    for r, start, n in chunks:
        hidden = torch.randn(n, width, generator=gen)
        entries.append((states[r], start, tuple(range(start, start + n)), hidden))
        pos = torch.arange(start, start + n)
        ref.commit([ref_states[r]], pos, pos, hidden, torch.zeros(n, dtype=torch.long))
    one.commit_entries(entries)
    assert torch.equal(one.rings.kv, ref.rings.kv) and torch.equal(one.rings.pos, ref.rings.pos)
    anchors, at = [21, 3, 17], [11, 5, 9]  # request 2 holds positions 4-8 only: its window is not whole
    ready, tokens, survival = one.propose_greedy(states, anchors, at)
    want_ready = ref.ready(ref_states, torch.tensor(at) - 1)
    assert ready == want_ready == [True, True, False]

    def greedy(logits, i):
        raise AssertionError("a greedy block must not call pick")

    greedy.greedy, greedy.needs_q = True, False
    live = [i for i, ok in enumerate(want_ready) if ok]
    want = ref.draft([ref_states[i] for i in live], torch.tensor([anchors[i] for i in live]),
                     torch.tensor([at[i] for i in live]), greedy)
    assert [tokens[i] for i in live] == want.tokens.tolist()
    assert torch.equal(torch.tensor([survival[i] for i in live]), want.survival)
