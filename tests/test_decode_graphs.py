"""Fixed-shape decode views (``cache/static_view``) and the decode runner (``engine/decode_graphs``).

The padded view is what a captured CUDA graph replays, so it is checked on any device: the same
hidden states as the ordinary view, the same state rows written (padding writes only the scratch
page), and bucket arithmetic as properties. The CUDA capture itself runs only where CUDA is present.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4serve.cache import SeqChunk
from ds4serve.cache.static_view import batch_buckets, bucket_for, static_decode_view, view_key, width_bucket
from ds4serve.config import ConfigError
from ds4serve.engine.decode_graphs import DecodeRunner, resolve_mode
from ds4serve.runtime import check_decode_graphs
from model_helpers import random_ids


@settings(derandomize=True, deadline=None)
@given(st.integers(1, 300))
def test_buckets_cover_every_batch(max_rows):
    buckets = batch_buckets(max_rows)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_rows and buckets[0] == 1
    for n in range(1, max_rows + 1):
        b = bucket_for(n, buckets)
        assert b >= n and all(x < n for x in buckets if x < b)
    assert bucket_for(max_rows + 1, buckets) is None


@settings(derandomize=True, deadline=None)
@given(st.integers(0, 10**6))
def test_width_buckets_are_powers_of_two(n):
    w = width_bucket(n)
    assert w >= max(n, 16) and w & (w - 1) == 0 and (w == 16 or w // 2 < n)


def test_modes():
    assert resolve_mode("auto", torch.device("cpu")) == "off"
    assert resolve_mode("static", torch.device("cpu")) == "static"
    with pytest.raises(ValueError, match="CUDA"):
        resolve_mode("cuda", torch.device("cpu"))
    with pytest.raises(ConfigError, match="decode_graphs"):  # the runtime checks against MODES
        check_decode_graphs("fast")


def _snapshot(layers):
    return [{k: getattr(st_, k).clone() for k in ("swa", "comp_ring", "comp_pool", "idx_ring", "idx_pool")
             if getattr(st_, k) is not None} for st_ in layers]


def _restore(layers, snap):
    for st_, saved in zip(layers, snap):
        for k, t in saved.items():
            getattr(st_, k).copy_(t)


def test_padded_decode_view_matches_the_ordinary_one(llm_factory):
    """Eight sequences at positions on and off window boundaries decode one token: the padded view
    (bucket 16) gives the same hidden states and writes the same state rows; its padding writes
    only the scratch page."""
    llm = llm_factory("A", max_seqs=16)
    core, model = llm.core, llm.model
    cache, engine = core.cache, core.executor
    lengths = [1, 3, 4, 15, 16, 31, 63, 64]  # ratio 4 / 16 windows close at some of them
    slots = []
    try:
        for i, n in enumerate(lengths):
            slot = cache.alloc_slot()
            slots.append(slot)
            assert cache.reserve({slot: n + 1})
            llm.reference.forward([SeqChunk(slot, 0, random_ids(n, 1000, seed=40 + i), cache.block_table(slot))])
        chunks = [SeqChunk(s, n, [5 + i], cache.block_table(s)) for i, (s, n) in enumerate(zip(slots, lengths))]
        view = engine._view(chunks)
        layers = cache.state.layers
        before = _snapshot(layers)
        with torch.inference_mode():
            want = engine._decode_forward(view)
            after_want = _snapshot(layers)
            _restore(layers, before)
            scratch = {m: cache.state.scratch_row(m) for m in model.cfg.distinct_ratios}
            fixed = static_decode_view(view, 16, model.cfg.sliding_window, scratch, view.num_tokens)
            got = engine._decode_forward(fixed)
        assert fixed.num_tokens == 16 and view_key(fixed)[0] == (16,)
        torch.testing.assert_close(got[:8], want, rtol=1e-5, atol=1e-5)
        after_got = _snapshot(layers)
        for li, (a, b) in enumerate(zip(after_got, after_want)):
            for k in a:
                if k.endswith("pool"):
                    rpp = cache.layout.rows_per_page(cache.layout.layers[li].ratio)
                    real = cache.state.n_pages * rpp
                    pages = torch.tensor(sorted({p for s in slots for p in cache.block_table(s)}))
                    used = (pages.unsqueeze(1) * rpp + torch.arange(rpp)).reshape(-1)
                    torch.testing.assert_close(a[k][used], b[k][used], rtol=1e-5, atol=1e-5)
                    # pages never handed out hold uninitialised bytes (cache/state.py): untouched, bit for bit
                    spare = torch.ones(real, dtype=torch.bool)
                    spare[used] = False
                    assert torch.equal(a[k][:real][spare].view(torch.uint8), before[li][k][:real][spare].view(torch.uint8))
                    assert not torch.equal(a[k][real:], before[li][k][real:]), f"layer {li} {k}: scratch unused"
                else:
                    torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5)
    finally:
        for s in slots:
            cache.drop(s)
    assert core.leaks() == ""


def test_views_that_do_not_qualify_are_refused(llm_factory):
    llm = llm_factory("A", max_seqs=16)
    cache, engine = llm.core.cache, llm.core.executor
    slot = cache.alloc_slot()
    try:
        assert cache.reserve({slot: 8})
        prefill = engine._view([SeqChunk(slot, 0, [3, 4, 5], cache.block_table(slot))])
        with pytest.raises(ValueError, match="decode view"):
            static_decode_view(prefill, 4, llm.cfg.sliding_window, {4: 0, 16: 0}, n_seqs=1)
        one = engine._view([SeqChunk(slot, 3, [6], cache.block_table(slot))])
        with pytest.raises(ValueError, match="bucket"):
            static_decode_view(one, 0, llm.cfg.sliding_window, {4: 0, 16: 0}, n_seqs=1)
    finally:
        cache.drop(slot)


def test_a_failing_capture_turns_graphs_off_and_stays_correct(llm_factory, caplog):
    """Graph mode falls back to the eager step, loudly, when capture fails (forced here on CPU)."""
    llm = llm_factory("A", max_seqs=4)
    engine, cache = llm.core.executor, llm.core.cache
    runner = DecodeRunner("cuda", engine._decode_forward, 4, llm.cfg.sliding_window,
                          {m: cache.state.scratch_row(m) for m in llm.cfg.distinct_ratios})

    def broken_capture(fixed):
        raise RuntimeError("operation not permitted when stream is capturing")

    runner._capture = broken_capture
    slot = cache.alloc_slot()
    try:
        assert cache.reserve({slot: 8})
        with torch.inference_mode():
            llm.reference.forward([SeqChunk(slot, 0, [3, 4, 5], cache.block_table(slot))])
            view = engine._view([SeqChunk(slot, 3, [6], cache.block_table(slot))])
            with caplog.at_level("ERROR"):
                out = runner.run(view, view.num_tokens)
            assert runner.disabled and "capturing" in runner.disabled and "turned off" in caplog.text
            assert out.shape[0] == 1 and torch.isfinite(out).all()
            assert runner.run(view, view.num_tokens) is None  # later steps: the ordinary forward, no new capture attempt
            assert runner.stats["captures"] == 0
    finally:
        cache.drop(slot)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_decode_equals_eager(ckpt_factory):
    from ds4serve.llm import LLM

    _, path = ckpt_factory("A")
    prompts = [random_ids(n, 1000, seed=300 + n) for n in (1, 7, 33, 64, 100)]
    want = LLM(path, device="cuda", max_seqs=8, decode_graphs="off").generate(prompts, max_tokens=40)
    llm = LLM(path, device="cuda", max_seqs=8, decode_graphs="cuda")
    assert llm.generate(prompts, max_tokens=40) == want
    runner = llm.core.executor.decode
    assert runner.disabled is None, runner.disabled
    assert runner.stats["captures"] > 0 and runner.stats["replays"] > runner.stats["captures"]


def test_a_decode_forward_is_idempotent(llm_factory):
    """The graph self-check replays a step on the inputs it just ran: that is only sound if a decode
    forward rewrites the same state rows with the same values and reads nothing it wrote."""
    llm = llm_factory("A", max_seqs=4)
    cache, engine = llm.core.cache, llm.core.executor
    slots = [cache.alloc_slot() for _ in range(3)]
    try:
        for i, (s, n) in enumerate(zip(slots, (15, 31, 64))):
            assert cache.reserve({s: n + 1})
            llm.reference.forward([SeqChunk(s, 0, random_ids(n, 1000, seed=60 + i), cache.block_table(s))])
        view = engine._view([SeqChunk(s, n, [9], cache.block_table(s)) for s, n in zip(slots, (15, 31, 64))])
        fixed = static_decode_view(view, 4, llm.cfg.sliding_window,
                                   {m: cache.state.scratch_row(m) for m in llm.cfg.distinct_ratios}, n_seqs=3)
        with torch.inference_mode():
            first = engine._decode_forward(fixed)
            state = _snapshot(cache.state.layers)
            second = engine._decode_forward(fixed)
        assert torch.equal(first, second)
        for a, b in zip(state, _snapshot(cache.state.layers)):  # bit for bit (pages never handed out hold
            assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)  # raw bytes)
    finally:
        for s in slots:
            cache.drop(s)


class _ReplayOnCPU:
    """Test double with CUDAGraph's contract (a replay recomputes from the static inputs into the
    static output), so the runner's bookkeeping runs on CPU: inputs copied before every replay, one
    capture per shape, the self-check."""

    def __init__(self, forward, inputs, output):
        self.forward, self.inputs, self.output = forward, inputs, output

    def replay(self):
        self.output.copy_(self.forward(self.inputs))


def test_runner_replays_with_fresh_inputs(llm_factory, ckpt_factory):
    from ds4serve.cache.static_view import clone_view
    from ds4serve.engine.decode_graphs import _Graph

    prompts = [random_ids(n, 1000, seed=500 + n) for n in (1, 9, 30, 64)]
    want = llm_factory("A", max_seqs=4).generate(prompts, max_tokens=24)
    llm = llm_factory("A", max_seqs=4, decode_graphs="static")
    engine, cache = llm.core.executor, llm.core.cache
    runner = DecodeRunner("cuda", engine._decode_forward, 4, llm.cfg.sliding_window,
                          {m: cache.state.scratch_row(m) for m in llm.cfg.distinct_ratios})

    def capture(fixed):
        inputs = clone_view(fixed)
        output = engine._decode_forward(inputs).clone()
        return _Graph(graph=_ReplayOnCPU(engine._decode_forward, inputs, output), inputs=inputs, output=output)

    runner._capture = capture
    saved, engine.decode = engine.decode, runner
    try:
        assert llm.generate(prompts, max_tokens=24) == want
    finally:
        engine.decode = saved
    assert runner.disabled is None and runner.stats["captures"] >= 2
    assert runner.stats["replays"] > 3 * runner.stats["captures"]
