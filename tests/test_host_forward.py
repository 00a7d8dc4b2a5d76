"""The native host forward (model/host_forward.py) computes what the torch path computes.

Two engines on the same checkpoint, one native and one on the torch path, run the same forwards (prefill
chunks of several sequences across window / ratio boundaries, then decode rows, then prefill chunks
with prefix snapshots inside them) on their own state; every forward's hidden states, the LM head and,
at the end, every state row the sequences own must agree (fp32; the two paths add in different
orders, so within 1e-4 rather than bit for bit). Chunks start mid-sequence too, at odd offsets around
every compress ratio and the window, and so do chunks holding snapshots: a chunk from position 0 reads
no ring row written before it, and a snapshot inside it takes no row from the live ring, so those alone
would leave both paths' ring reads (and the snapshot's ``old_*`` copies) untested.
"""

from __future__ import annotations

import logging

import pytest
import torch

from ds4serve.cache import SeqChunk
from ds4serve.llm import LLM
from ds4serve import native_build
from ds4serve.model import host_forward, native
from model_helpers import random_ids, write_random_text_checkpoint

ATOL = 1e-4


def _pair(ckpt_factory, name: str, **kw):
    _, path = ckpt_factory(name)
    fast = LLM(path, max_seqs=4, host_kernels="on", **kw)
    slow = LLM(path, max_seqs=4, host_kernels="off", **kw)
    assert fast.core.executor.host is not None and slow.core.executor.host is None
    return fast, slow


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    scale = max(1.0, float(a.abs().max()))
    diff = float((a - b).abs().max())
    assert diff <= ATOL * scale, f"{what}: differs by {diff:.3g} (scale {scale:.3g})"


def _owned_rows(llm, slots):
    """Every ring row of every slot and every pool row of the pages those slots own, per layer."""
    cache, out = llm.core.cache, []
    layout = cache.layout
    for li, (ly, st) in enumerate(zip(layout.layers, cache.state.layers)):
        for name in ("swa", "comp_ring", "idx_ring", "comp_pool", "idx_pool"):
            t = getattr(st, name)
            if t is None:
                continue
            if name.endswith("_pool"):
                rpp = layout.rows_per_page(ly.ratio)
                rows = [p * rpp + r for s in slots for p in cache.block_table(s) for r in range(rpp)]
            else:
                per = t.shape[0] // cache.n_slots
                rows = [s * per + r for s in slots for r in range(per)]
            out.append((f"layer {li} {name}", t[rows]))
    return out


def _run_both(fast, slow, steps) -> None:
    """``steps``: lists of (slot index, start, ids, captures) chunks; each list is one forward."""
    pairs = []
    for llm in (fast, slow):
        cache = llm.core.cache
        for st in cache.state.layers:  # rows the start-up self-check left behind: never read, but compared
            for t in (st.swa, st.comp_ring, st.idx_ring, st.comp_pool, st.idx_pool):
                if t is not None:
                    t.zero_()
        slots = [cache.alloc_slot() for _ in range(3)]
        pairs.append((llm, slots))
    try:
        for chunks in steps:
            outs = []
            for llm, slots in pairs:
                cache, engine = llm.core.cache, llm.core.executor
                for i, start, ids, _ in chunks:
                    assert cache.reserve({slots[i]: start + len(ids) + 1})
                view = engine._view([SeqChunk(slots[i], start, ids, cache.block_table(slots[i]), captures=caps)
                                     for i, start, ids, caps in chunks])
                with torch.inference_mode():
                    streams = engine._forward(view)
                    logits = engine.host.logits(streams) if engine.host else llm.model.logits(streams)
                outs.append((streams, logits))
            what = f"forward of {[(i, s, len(ids)) for i, s, ids, _ in chunks]}"
            _close(outs[1][0], outs[0][0], what + " hidden states")
            _close(outs[1][1], outs[0][1], what + " logits")
        for (name, a), (_, b) in zip(_owned_rows(*pairs[1]), _owned_rows(*pairs[0])):
            _close(a, b, name)
    finally:
        for llm, slots in pairs:
            for s in slots:
                llm.core.cache.drop(s)


def _decode_steps(prompts: list[list[int]], n: int, vocab: int):
    """n decode steps of every sequence after its prompt (fed tokens: fixed pseudo-random ids)."""
    steps = []
    for k in range(n):
        steps.append([(i, len(p) + k, [2 + (7 * k + 3 * i) % (vocab - 2)], ()) for i, p in enumerate(prompts)])
    return steps


@pytest.mark.parametrize("name", ["A", "B", "C"])
def test_native_forward_equals_torch_on_chunks_and_decode_rows(ckpt_factory, name):
    fast, slow = _pair(ckpt_factory, name)
    cfg = fast.cfg
    w = cfg.sliding_window
    lengths = [w + 3, 2 * w + 11, 37]
    prompts = [random_ids(n, cfg.vocab_size, seed=40 + i) for i, n in enumerate(lengths)]
    steps = [
        [(0, 0, prompts[0][:5], ()), (1, 0, prompts[1][:w - 1], ())],  # two sequences in one forward
        [(0, 5, prompts[0][5:], ()), (1, w - 1, prompts[1][w - 1:w + 17], ()), (2, 0, prompts[2], ())],
        [(1, w + 16, prompts[1][w + 16:], ())],
    ]
    steps += _decode_steps(prompts, 2 * max(cfg.distinct_ratios) + 3, cfg.vocab_size)
    _run_both(fast, slow, steps)


def _cuts(cfg) -> tuple[int, list[list[int]]]:
    """A prompt length past the window, twice the largest ratio and the indexer's top-k rows, and
    where each of three sequences' prefill chunks end: just before / after every ratio's first two
    boundaries and the window's (odd offsets), exactly on them, and in chunks of 1-5 tokens from an
    odd start (short chunks each reading the rings the previous one wrote) until past the window and
    the largest ratio."""
    w, ratios = cfg.sliding_window, cfg.distinct_ratios
    n = max(3 * w, 2 * max(ratios) + w, cfg.index_topk * min(ratios) + w) + 13
    around = {k * r + d for r in ratios + (w,) for k in (1, 2) for d in (-1, 1)}
    exact = {k * r for r in ratios + (w,) for k in (1, 2, 3)}
    short, pos = [], 7
    while pos < min(n, w + max(ratios) + 2):  # past one window and the largest ratio; then one chunk
        short.append(pos)
        pos += (1, 2, 3, 5)[len(short) % 4]
    return n, [sorted(c for c in cuts if 0 < c < n) for cuts in (around, exact, short)]


@pytest.mark.parametrize("name", ["A", "B", "C"])
def test_chunks_starting_mid_sequence_at_ratio_and_window_edges(ckpt_factory, name):
    """Three sequences prefilled together, forward k holding each one's k-th chunk (so chunks of
    different starts and lengths share forwards), then decode rows past the largest ratio."""
    fast, slow = _pair(ckpt_factory, name)
    cfg = fast.cfg
    n, cuts = _cuts(cfg)
    prompts = [random_ids(n - 2 * i, cfg.vocab_size, seed=50 + i) for i in range(3)]
    bounds = [[0] + [c for c in cs if c < len(p)] + [len(p)] for p, cs in zip(prompts, cuts)]
    assert all(any(s % 2 for s in b[1:-1]) for b in (bounds[0], bounds[2])), "no chunk starts at an odd position"
    steps = []
    for k in range(max(len(b) for b in bounds) - 1):
        steps.append([(i, b[k], prompts[i][b[k]:b[k + 1]], ()) for i, b in enumerate(bounds) if k + 1 < len(b)])
    steps += _decode_steps(prompts, max(cfg.distinct_ratios) + 3, cfg.vocab_size)
    _run_both(fast, slow, steps)


def test_snapshots_inside_a_chunk_are_the_same(ckpt_factory):
    fast, slow = _pair(ckpt_factory, "B", enable_prefix_caching=True)
    cfg = fast.cfg
    prompt = random_ids(3 * cfg.sliding_window + 5, cfg.vocab_size, seed=7)
    inside = [(cfg.sliding_window + 2, 0), (2 * cfg.sliding_window + 1, 1)]
    _unwritten_arena(fast, slow)
    _run_both(fast, slow, [[(0, 0, prompt, tuple(inside))]])
    for (name, a), (_, b) in zip(_arena(slow, 2), _arena(fast, 2)):
        _close(a, b, f"snapshot arena {name}")


@pytest.mark.parametrize("name", ["A", "B", "C"])
def test_snapshots_inside_a_chunk_starting_mid_sequence_are_the_same(ckpt_factory, name):
    """Snapshots inside chunks that start at odd positions past the window (ring wrapped) and just past
    a compress boundary, two sequences in one forward: a snapshot close after the chunk's start takes
    most ring rows from the live ring as it stood before the forward (``RingCapture.old_*``), one more
    than a ring length in takes only this forward's rows; every ring length (window, compressor spans)
    sees both. All eight arena entries (``MAX_CAPTURES``) are written in the one forward."""
    fast, slow = _pair(ckpt_factory, name, enable_prefix_caching=True)
    cfg = fast.cfg
    w, spans = cfg.sliding_window, sorted({ly.span for ly in fast.core.cache.layout.layers if ly.ratio})
    a0, a1 = w + 3, 2 * max(cfg.distinct_ratios) + 1
    hs0 = sorted({a0 + 1, a0 + 2, a0 + spans[0] - 1, a0 + w - 1, a0 + max(spans + [w]) + 1})
    hs1 = sorted({a1 + 1, a1 + spans[-1] - 1, a1 + w + 2})
    hs0 += [hs0[-1] + 3 * (i + 1) for i in range(host_forward.MAX_CAPTURES - len(hs0) - len(hs1))]  # fill up
    n0, n1 = hs0[-1] + 5, hs1[-1] + 3
    p0, p1 = random_ids(n0, cfg.vocab_size, seed=8), random_ids(n1, cfg.vocab_size, seed=9)
    caps0 = tuple((h, e) for e, h in enumerate(hs0))
    caps1 = tuple((h, len(hs0) + e) for e, h in enumerate(hs1))
    assert len(caps0) + len(caps1) == host_forward.MAX_CAPTURES == fast.core.cache.prefix.arena.n
    steps = [[(0, 0, p0[:a0], ()), (1, 0, p1[:a1 - 2], ())],
             [(1, a1 - 2, p1[a1 - 2:a1], ())],  # seq 1 reaches a1 by a short chunk: its rings are mixed
             [(0, a0, p0[a0:], caps0), (1, a1, p1[a1:], caps1)]]
    _unwritten_arena(fast, slow)
    _run_both(fast, slow, steps)
    for (what, a), (_, b) in zip(_arena(slow, 8), _arena(fast, 8)):
        _close(a, b, f"snapshot arena {what}")


def _unwritten_arena(*llms) -> None:
    """NaN in every arena ring row, so a row a capture should write and does not fails the comparison
    (the arena is reserved uninitialised: two untouched copies could agree by chance, e.g. as zeros)."""
    for llm in llms:
        arena = llm.core.cache.prefix.arena
        for li in range(len(arena.layers)):
            for t in arena.rings(li).values():
                t.fill_(float("nan"))


def _arena(llm, entries: int):
    """The first ``entries`` snapshot arena entries' ring rows, per layer and ring."""
    arena = llm.core.cache.prefix.arena
    for li in range(len(arena.layers)):
        for name, t in arena.rings(li).items():
            per = t.shape[0] // arena.n
            yield f"layer {li} {name}", t[:entries * per]


def test_greedy_generation_is_the_same_on_both_paths(ckpt_factory):
    fast, slow = _pair(ckpt_factory, "A")
    prompts = [random_ids(n, 1000, seed=60 + n) for n in (3, 40, 75, 130)]
    assert fast.generate(prompts, max_tokens=30, ignore_eos=True) == slow.generate(prompts, max_tokens=30,
                                                                                    ignore_eos=True)


def test_native_rows_are_batch_invariant_bit_for_bit(ckpt_factory):
    """Each row's products and sums run in the same order whatever else is in the batch."""
    _, path = ckpt_factory("A")
    llm = LLM(path, max_seqs=4, host_kernels="on")
    prompts = [random_ids(n, 1000, seed=80 + n) for n in (9, 33, 70)]
    solo = [llm.generate_with_logprobs([p], max_tokens=12, ignore_eos=True, logprobs=3)[0] for p in prompts]
    together = llm.generate_with_logprobs(prompts, max_tokens=12, ignore_eos=True, logprobs=3)
    assert all(len(lps) == 12 for _, lps in solo)  # the float logprobs are compared, not only the tokens
    assert together == solo


def test_where_it_does_not_apply_the_torch_path_runs(ckpt_factory, caplog):
    _, path = ckpt_factory("A")
    with caplog.at_level(logging.INFO, logger="ds4serve.engine.executor"):
        llm = LLM(path, max_seqs=2, dtype="bfloat16")
    assert llm.core.executor.host is None
    assert "weights or state not in float32" in caplog.text
    with pytest.raises(RuntimeError, match="host_kernels='on'"):
        LLM(path, max_seqs=2, dtype="bfloat16", host_kernels="on")
    fp32 = LLM(path, max_seqs=2, host_kernels="off")
    assert host_forward.unsupported(fp32.cfg, fp32.model, fp32.core.cache.state.layers) is None
    fp32.model.model.layers[0].self_attn.reduce = lambda t: t  # a tensor-parallel shard
    assert host_forward.unsupported(fp32.cfg, fp32.model, fp32.core.cache.state.layers) == "tensor / expert parallel"


def test_no_compiler_means_the_torch_path_logged_once(ckpt_factory, monkeypatch, tmp_path, caplog):
    _, path = ckpt_factory("C")
    monkeypatch.setattr(host_forward, "_library", host_forward._library.fresh())
    monkeypatch.setattr(native_build.shutil, "which", lambda name: None)
    monkeypatch.setattr(host_forward, "cache_root", lambda: tmp_path)
    with caplog.at_level(logging.WARNING, logger="ds4serve.model.host_forward"):
        a = LLM(path, max_seqs=2)
        b = LLM(path, max_seqs=2)
    assert a.core.executor.host is None and b.core.executor.host is None
    assert caplog.text.count("host decode kernels unavailable") == 1
    assert a.generate([[5, 6, 7]], max_tokens=4, ignore_eos=True)


def test_a_token_outside_the_vocabulary_fails_the_forward_and_writes_nothing(ckpt_factory):
    fast, _ = _pair(ckpt_factory, "C")
    cache, engine = fast.core.cache, fast.core.executor
    slot = cache.alloc_slot()
    try:
        assert cache.reserve({slot: 8})
        before = [t.clone() for t in (cache.state.layers[0].swa,)]
        view = engine._view([SeqChunk(slot, 0, [3, fast.cfg.vocab_size + 40, 4], cache.block_table(slot))])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.host.forward(view)
        assert torch.equal(before[0], cache.state.layers[0].swa)
    finally:
        cache.drop(slot)


def test_the_start_up_self_check_turns_a_wrong_native_forward_off(ckpt_factory, monkeypatch, caplog):
    _, path = ckpt_factory("C")
    real = host_forward.HostForward.forward

    def off_by_a_bit(self, view, start=0, stop=None, streams=None):
        return real(self, view, start, stop, streams) + 0.01

    monkeypatch.setattr(host_forward.HostForward, "forward", off_by_a_bit)
    with caplog.at_level(logging.ERROR):
        llm = LLM(path, max_seqs=2)
    assert llm.core.executor.host is None
    assert "native host forward turned off" in caplog.text and "hidden states of a prefill chunk differ" in caplog.text
    with pytest.raises(RuntimeError, match="disagrees with the torch path"):
        LLM(path, max_seqs=2, host_kernels="on")


def test_image_prompts_are_the_same_on_both_paths(random_ckpt):
    """A random DS4V checkpoint (sentinel rows, aligner rows in IMAGE slots, image tokens routed with a
    non-zero ``bias_vl``, also on its hash layer, bidirectional spans; the bundled model's ``bias_vl`` is
    all zero, so it could not tell): one- and two-image prompts, batched, give the torch path's tokens
    and logprobs. (The start-up self-check covers text only.)"""
    from ds4serve.chat import Tokenizer
    from ds4serve.engine.sampling import SamplingParams
    from ds4serve.scheduler.spec import RequestSpec
    from image_helpers import image_prompt

    tok = Tokenizer(random_ckpt)
    outs = {}
    for mode in ("on", "off"):
        core = LLM(random_ckpt, max_seqs=4, host_kernels=mode).core
        reqs = []
        for text, seeds in (("What colour is the circle?", [1]), ("Which image has more shapes?", [2, 3]),
                            ("How many shapes are there?", [4])):
            ids, images = image_prompt(core, tok, text, seeds)
            params = SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)
            reqs.append(core.make_request(RequestSpec(ids, params, images=images)))
        for r in reqs:
            core.add(r)
        core.run_until_idle()
        outs[mode] = reqs
        assert (core.executor.host is not None) == (mode == "on")
    for a, b in zip(outs["on"], outs["off"]):
        assert a.output_ids == b.output_ids
        assert max(abs(x[0] - y[0]) for x, y in zip(a.output_logprobs, b.output_logprobs)) < 1e-4


def test_the_thread_pool_runs_every_item_of_every_loop_once():
    """The work-claiming pool (csrc/host_pool.c): thousands of back-to-back loops of a few chunks each
    (workers waking late, loops following each other within microseconds), at several thread counts,
    also while a second thread calls in (it runs its loops alone): every item exactly once per loop."""
    import threading

    lib = host_forward.library()
    assert lib is not None
    for threads in (1, 2, 3, 5):
        assert lib.ds4_pool_check(3000, 37, threads) == 0, threads
    results = []
    callers = [threading.Thread(target=lambda: results.append(lib.ds4_pool_check(2000, 23, 2))) for _ in range(2)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert results == [0, 0]


def test_products_over_more_than_one_block_of_weight_rows_keep_rows_invariant(tmp_path):
    """A hidden size over 512 (the kernels' block of weight rows, ``KN_KBLOCK``): the 6-row tiles then
    run over the weights in two passes, the second continuing from the outputs the first stored, while
    1-3 rows take the row panels in one pass. Both must give a row the same bits, and the torch path's
    numbers within fp32 rounding."""
    write_random_text_checkpoint(tmp_path, hidden_size=640, num_hidden_layers=2, compress_ratios=[0, 4])
    llm = LLM(tmp_path, max_seqs=6, host_kernels="on")
    prompts = [random_ids(n, 1000, seed=90 + n) for n in (5, 12, 30, 7, 19, 44)]
    solo = [llm.generate_with_logprobs([p], max_tokens=6, ignore_eos=True, logprobs=3)[0] for p in prompts]
    assert llm.generate_with_logprobs(prompts, max_tokens=6, ignore_eos=True, logprobs=3) == solo
    reference = LLM(tmp_path, max_seqs=2, host_kernels="off")
    ids = random_ids(40, 1000, seed=7)
    torch.testing.assert_close(llm.prompt_logits(ids), reference.prompt_logits(ids), rtol=1e-4, atol=1e-4)


def test_a_model_without_a_shared_expert(tmp_path):
    """No shared expert (``n_shared_experts`` 0): the routed experts' gate/up and down products run in
    their own pool loops, in that order, with nothing beside them; prefill logits and greedy decode
    agree with the torch path, and rows stay batch invariant."""
    write_random_text_checkpoint(tmp_path, num_hidden_layers=2, compress_ratios=[0, 4], n_shared_experts=0)
    llm = LLM(tmp_path, max_seqs=4, host_kernels="on")
    reference = LLM(tmp_path, max_seqs=2, host_kernels="off")
    assert llm.core.executor.host is not None
    ids = random_ids(40, 1000, seed=11)
    torch.testing.assert_close(llm.prompt_logits(ids), reference.prompt_logits(ids), rtol=1e-4, atol=1e-4)
    prompts = [random_ids(n, 1000, seed=60 + n) for n in (6, 17, 33)]
    solo = [llm.generate_with_logprobs([p], max_tokens=5, ignore_eos=True, logprobs=2)[0] for p in prompts]
    assert llm.generate_with_logprobs(prompts, max_tokens=5, ignore_eos=True, logprobs=2) == solo
    assert llm.generate(prompts, max_tokens=5, ignore_eos=True) == reference.generate(prompts, max_tokens=5,
                                                                                     ignore_eos=True)
