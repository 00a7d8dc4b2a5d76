"""Invariant 1 (DESIGN §6): a request's output is the same alone, in a batch of 16, chunked,
layer-sliced, suspended and restored, or dropped and recomputed (fp32; greedy and seeded).

Every test runs on the native host forward and on the torch forward (``host_kernels`` fixture, ids
``host-on`` / ``host-off``), its solo references built in the same mode: the torch forward is what CUDA
runs, so a batching or preemption bug in either path is caught on CPU CI."""

from __future__ import annotations

import pytest

from ds4serve.engine.sampling import SamplingParams
from ds4serve.scheduler.spec import RequestSpec
from model_helpers import feed, random_ids

LENGTHS = [1, 2, 4, 5, 16, 17, 31, 33, 60, 64, 65, 100, 128, 150, 220, 300]
MAX_TOKENS = [12, 30, 7, 25, 16, 9, 40, 11, 20, 6, 33, 14, 18, 10, 24, 8]


def _params(i: int, seeded: bool) -> SamplingParams:
    if seeded:
        return SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.8, top_p=0.95, seed=1000 + i, ignore_eos=True)
    return SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0, ignore_eos=True)


def _prompts():
    return [random_ids(n, 1000, seed=700 + n) for n in LENGTHS]


def run_staggered(llm, prompts, params, every: int = 3):
    """Request i arrives at step i * every; returns outputs in request order."""
    core = llm.core
    reqs = [core.make_request(RequestSpec(p, q)) for p, q in zip(prompts, params)]
    feed(core, reqs, every)
    assert core.leaks() == "", core.leaks()
    return [list(r.output_ids) for r in reqs], core.scheduler.stats


@pytest.fixture(scope="module")
def solo(llm_factory, host_kernels):
    llm = llm_factory("A", max_seqs=1, host_kernels=host_kernels)
    out = {}
    for seeded in (False, True):
        out[seeded] = [llm.generate([p], **_kw(_params(i, seeded)))[0] for i, p in enumerate(_prompts())]
    return out


def _kw(p: SamplingParams) -> dict:
    return dict(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, seed=p.seed, ignore_eos=True)


@pytest.mark.parametrize("decode_graphs", ["off", "static"])
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_sixteen_staggered_requests_equal_solo(seeded, decode_graphs, solo, llm_factory, host_kernels):
    """Also with pure-decode steps on fixed-shape padded views (the shapes CUDA graphs replay)."""
    llm = llm_factory("A", max_seqs=16, step_tokens=96, max_prefill_tokens=128, decode_graphs=decode_graphs,
                      host_kernels=host_kernels)
    before = llm.core.executor.decode.stats["static_steps"]
    outs, stats = run_staggered(llm, _prompts(), [_params(i, seeded) for i in range(16)])
    if decode_graphs == "static":
        assert llm.core.executor.decode.stats["static_steps"] > before + 20
    for i, (got, want) in enumerate(zip(outs, solo[seeded])):
        assert got == want, f"request {i} (prompt {LENGTHS[i]} tokens) differs from its solo run"


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("host_budget,drops,decode_graphs", [("1MB", False, "off"), ("150KB", True, "off"),
                                                             ("150KB", True, "static")])
def test_tiny_pools_suspend_drop_recompute(seeded, host_budget, drops, decode_graphs, solo, llm_factory,
                                           host_kernels):
    """A pool for ~3 requests (512 tokens) and a 1 MB (or 150 KB) host budget: requests are suspended
    to host memory and, once the host budget is full, dropped and recomputed from their tokens. With
    fixed-shape decode views, padded rows write only the scratch page, which no one owns."""
    llm = llm_factory("A", max_seqs=16, kv_budget=512, host_budget=host_budget, step_tokens=64,
                      max_prefill_tokens=64, decode_graphs=decode_graphs, host_kernels=host_kernels)
    outs, stats = run_staggered(llm, _prompts(), [_params(i, seeded) for i in range(16)], every=1)
    assert stats["preempt_suspend"] > 0, stats
    if drops:
        assert stats["preempt_drop"] > 0, stats
    assert stats["resumed"] == stats["preempt_suspend"] + stats["preempt_drop"]
    assert llm.core.cache.host_used == 0
    for i, (got, want) in enumerate(zip(outs, solo[seeded])):
        assert got == want, f"request {i} (prompt {LENGTHS[i]} tokens) differs after preemption ({stats})"


def test_layer_sliced_passes_equal_solo(solo, llm_factory, host_kernels):
    """Prefill by layer slices (a pass advances a few layers per step while others decode)."""
    llm = llm_factory("A", max_seqs=16, step_tokens=48, max_prefill_tokens=300, prefill_mode="layers",
                      min_prefill_tokens=8, host_kernels=host_kernels)
    slices = []
    engine_step = llm.core.executor.step

    def spy(plan):
        slices.extend(p.layer_stop - p.layer_start for p in plan.passes)
        return engine_step(plan)

    llm.core.executor.step = spy
    try:
        outs, stats = run_staggered(llm, _prompts(), [_params(i, False) for i in range(16)], every=2)
    finally:
        llm.core.executor.step = engine_step
    assert any(n < 6 for n in slices), "no pass was layer-sliced"
    for i, (got, want) in enumerate(zip(outs, solo[False])):
        assert got == want, f"request {i} (prompt {LENGTHS[i]} tokens) differs when layer-sliced"


def test_requests_needing_the_whole_pool_make_progress(llm_factory, host_kernels):
    """Each request needs every page of a two-page pool: they run one after another (after drops)
    instead of waiting forever for a page kept free for growth that nothing running needs."""
    probe = llm_factory("A", max_seqs=1, host_kernels=host_kernels)
    page = probe.core.cache.layout.page_tokens
    prompts = [random_ids(page - 8, 1000, seed=900 + i) for i in range(4)]
    params = SamplingParams(max_tokens=page, temperature=0.0, ignore_eos=True)
    want = [probe.generate([p], max_tokens=page, temperature=0.0, ignore_eos=True)[0] for p in prompts]
    llm = llm_factory("A", max_seqs=4, kv_budget=2 * page, host_budget="1KB", step_tokens=16,
                      max_prefill_tokens=4 * page, host_kernels=host_kernels)
    assert llm.core.cache.state.n_pages == 2
    core = llm.core
    reqs = [core.make_request(RequestSpec(p, params)) for p in prompts]
    for r in reqs:
        core.add(r)
    for _ in range(50 * page):
        if not core.has_work:
            break
        core.step()
    assert not core.has_work, [(r.status.value, r.computed) for r in reqs]
    assert core.scheduler.stats["preempt_drop"] > 0, core.scheduler.stats
    assert [list(r.output_ids) for r in reqs] == want
    assert core.leaks() == ""

