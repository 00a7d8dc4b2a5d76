"""Passes: layer-sliced and token-chunked prefill against the same prompt run whole, on the native host
forward and on the torch forward CUDA runs (``host_kernels``: ``host-on`` / ``host-off``)."""

from __future__ import annotations

import torch

from ds4serve.engine.plan import DecodeRow, PassMember, PassSlice, StepPlan
from ds4serve.engine.sampling import SamplerState, SamplingParams
from model_helpers import random_ids


def _run(llm, prompt, schedule, decode_steps=6):
    """Prefill ``prompt`` per ``schedule`` (a list of steps; each step a list of (start, n, l0, l1)),
    then greedy-decode; return (tokens, logprob vectors) of every sampled row."""
    engine, cache = llm.core.executor, llm.core.cache
    slot = cache.alloc_slot()
    state = SamplerState(SamplingParams(temperature=0, logprobs=8), prompt, [])
    got = []
    try:
        assert cache.reserve({slot: len(prompt) + decode_steps + 1})
        pid = 1000
        for step_i, step in enumerate(schedule):
            slices = []
            for start, n, l0, l1 in step:
                if l0 == 0:
                    pid += 1
                member = PassMember("r", slot, start, tuple(prompt[start:start + n]),
                                    sample=start + n == len(prompt), sampler=state)
                slices.append(PassSlice(pid, l0, l1, (member,)))
            res = engine.step(StepPlan(step_i, (), tuple(slices)))
            assert res.status.value == "ok", res.error
            got += [(t.token, t.logprob, t.top_logprobs) for t in res.tokens]
        pos = len(prompt)
        for i in range(decode_steps):
            state.output_ids.append(got[-1][0])
            res = engine.step(StepPlan(100 + i, (DecodeRow("r", slot, pos, got[-1][0], state),)))
            got.append((res.tokens[0].token, res.tokens[0].logprob, res.tokens[0].top_logprobs))
            pos += 1
    finally:
        cache.drop(slot)
    assert llm.core.leaks() == ""
    return got


def test_layer_slices_are_byte_identical_to_whole(llm_factory, host_kernels):
    llm = llm_factory("A", max_prefill_tokens=256, host_kernels=host_kernels)
    prompt = random_ids(200, 1000, seed=91)
    whole = _run(llm, prompt, [[(0, 200, 0, 6)]])
    sliced = _run(llm, prompt, [[(0, 200, 0, 1)], [(0, 200, 1, 3)], [(0, 200, 3, 4)], [(0, 200, 4, 6)]])
    assert sliced == whole  # tokens and every logprob bit-for-bit


def test_token_chunks_match_whole(llm_factory, host_kernels):
    llm = llm_factory("A", max_prefill_tokens=256, host_kernels=host_kernels)
    prompt = random_ids(200, 1000, seed=92)
    whole = _run(llm, prompt, [[(0, 200, 0, 6)]])
    chunked = _run(llm, prompt, [[(0, 37, 0, 6)], [(37, 64, 0, 6)], [(101, 1, 0, 6)], [(102, 98, 0, 6)]])
    assert [t for t, _, _ in chunked] == [t for t, _, _ in whole]
    for (_, lp_a, top_a), (_, lp_b, top_b) in zip(chunked, whole):
        assert abs(lp_a - lp_b) < 1e-4
        assert [i for i, _ in top_a] == [i for i, _ in top_b]
        assert max(abs(x - y) for (_, x), (_, y) in zip(top_a, top_b)) < 1e-4


def test_chunks_mixed_with_slices(llm_factory, host_kernels):
    """A chunk run whole, then the rest as a layer-sliced pass: same answer."""
    llm = llm_factory("A", max_prefill_tokens=256, host_kernels=host_kernels)
    prompt = random_ids(150, 1000, seed=93)
    whole = _run(llm, prompt, [[(0, 150, 0, 6)]])
    mixed = _run(llm, prompt, [[(0, 70, 0, 6)], [(70, 80, 0, 2)], [(70, 80, 2, 5)], [(70, 80, 5, 6)]])
    assert [t for t, _, _ in mixed] == [t for t, _, _ in whole]


def test_staging_holds_the_pass_between_steps(llm_factory, host_kernels):
    """While a pass is sliced, other sequences decode in between; the pass result is unaffected."""
    llm = llm_factory("A", max_prefill_tokens=256, host_kernels=host_kernels)
    engine, cache = llm.core.executor, llm.core.cache
    prompt = random_ids(120, 1000, seed=94)
    alone = _run(llm, prompt, [[(0, 120, 0, 6)]], decode_steps=0)
    other = cache.alloc_slot()
    slot = cache.alloc_slot()
    try:
        assert cache.reserve({other: 64, slot: 121})
        st_other = SamplerState(SamplingParams(temperature=0), [5], [])
        st = SamplerState(SamplingParams(temperature=0, logprobs=8), prompt, [])
        member = PassMember("p", slot, 0, tuple(prompt), sample=True, sampler=st)
        toks = []
        for i, (l0, l1) in enumerate([(0, 2), (2, 4), (4, 6)]):
            dec = (DecodeRow("o", other, i, 7 + i, st_other),)
            res = engine.step(StepPlan(i, dec, (PassSlice(77, l0, l1, (member,)),)))
            toks += [(t.token, t.logprob, t.top_logprobs) for t in res.tokens if t.request_id == "p"]
        # same rows, same layers; only the lm-head GEMM shape differs (2 rows vs 1): rounding only
        assert [t for t, _, _ in toks] == [t for t, _, _ in alone]
        assert abs(toks[0][1] - alone[0][1]) < 1e-5
        assert engine.active_passes == set()
    finally:
        cache.drop(other)
        cache.drop(slot)
    # staging is uninitialised on purpose (only the rows a pass writes become resident): check those
    assert torch.isfinite(cache.staging[slot, :len(prompt)]).all()
