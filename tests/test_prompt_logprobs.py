"""Prompt logprobs computed in the engine's batched steps, exact against ``LLM.prompt_logits``.

A request with ``prompt_logprobs`` has every prompt row scored in the prefill steps that compute it
(token chunks, whole passes, layer-sliced passes, beside decoders), never from a prefix-cache hit, and
delivered once with its first output; ``max_tokens == 0`` finishes after the prefill with no token.
Every test runs on the native forward (bit-equal to the engine's own full-prompt logits, rows being
computed each on its own there) and on the torch forward (within 1e-5 of the torch reference)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ds4serve.engine.plan import PassMember, PassProgress, PassSlice, PromptLogprobs, StepPlan, StepResult
from ds4serve.engine.plan import validate_step_result
from ds4serve.engine.sampling import SamplingParams
from ds4serve.scheduler.spec import RequestSpec
from model_helpers import random_ids

TOP = 3


def _reference(llm, ids: list[int], host_kernels: str) -> torch.Tensor:
    """log_softmax of the full prompt's logits: the engine's own forward on the native path (bit-equal
    expected), the torch reference otherwise."""
    return torch.log_softmax(llm.prompt_logits(ids, engine=host_kernels == "on"), dim=-1)


def _check(got: list, ids: list[int], ref: torch.Tensor, host_kernels: str, top: int = TOP) -> None:
    """``got`` (one request's prompt logprobs) against the reference logprobs ``ref [len(ids), V]``:
    bit-equal on the native forward, within 1e-5 (ranks and top ids up to near-ties) on the torch one."""
    assert len(got) == len(ids) and got[0] is None
    target = ref[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    lp = torch.tensor([e[0] for e in got[1:]])
    exact = host_kernels == "on"
    tol = 0.0 if exact else 1e-5
    torch.testing.assert_close(lp, target, rtol=0, atol=tol)
    lo = (ref[:-1] > (target + tol).unsqueeze(1)).sum(1) + 1
    hi = (ref[:-1] > (target - tol).unsqueeze(1)).sum(1) + 1
    tv, ti = torch.topk(ref[:-1], top, dim=-1)
    for i, e in enumerate(got[1:]):
        assert int(lo[i]) <= e[1] <= int(hi[i]), f"position {i + 1}: rank {e[1]} outside [{lo[i]}, {hi[i]}]"
        assert len(e[2]) == top
        if top:
            torch.testing.assert_close(torch.tensor([v for _, v in e[2]]), tv[i], rtol=0, atol=tol)
        if exact:
            assert [t for t, _ in e[2]] == ti[i].tolist()


def _run(llm, prompts, params, every: int = 2):
    """Request i arrives at step i * every; returns (requests, prompt logprobs by request, outputs seen)."""
    core = llm.core
    reqs = [core.make_request(RequestSpec(p, q)) for p, q in zip(prompts, params)]
    pending, step, scored, outputs = list(reqs), 0, {}, []
    while pending or core.has_work:
        while pending and step >= every * (len(reqs) - len(pending)):
            core.add(pending.pop(0))
        for out in core.step():
            outputs.append(out)
            assert out.finish_reason != "error", out.error
            if out.prompt_logprobs is not None:
                assert out.request_id not in scored, "prompt logprobs delivered twice"
                scored[out.request_id] = list(out.prompt_logprobs)
        step += 1
    assert core.leaks() == "", core.leaks()
    return reqs, scored, outputs


def test_chunked_prompt_equals_full_prompt_logits(llm_factory, host_kernels):
    """A prompt of 70 tokens in chunks of 16 (five steps) scores exactly what one full forward gives."""
    llm = llm_factory("A", max_seqs=2, max_prefill_tokens=16, step_tokens=16, min_prefill_tokens=8,
                      host_kernels=host_kernels)
    ids = random_ids(70, 1000, seed=11)
    got = llm.score_prompts([ids], top=TOP)[0]
    _check(got, ids, _reference(llm, ids, host_kernels), host_kernels)


@pytest.mark.parametrize("mode", ["chunk", "layers"])
def test_scored_beside_decoders_and_outputs_unchanged(llm_factory, host_kernels, mode):
    """Scored prompts arrive while others decode (token chunks, or layer-sliced passes): their logprobs
    are exact, and every request's generated tokens equal those of a batch without scoring."""
    llm = llm_factory("A", max_seqs=4, step_tokens=48, max_prefill_tokens=64, min_prefill_tokens=8,
                      prefill_mode=mode, host_kernels=host_kernels)
    prompts = [random_ids(n, 1000, seed=50 + n) for n in (40, 90, 33, 130)]
    plain = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True) for _ in prompts]
    scoring = [dataclasses.replace(p, prompt_logprobs=TOP) if i % 2 else p for i, p in enumerate(plain)]
    slices = []
    step = llm.core.executor.step

    def spy(plan):
        slices.extend(p.layer_stop - p.layer_start for p in plan.passes)
        return step(plan)

    llm.core.executor.step = spy
    try:
        base, none, _ = _run(llm, prompts, plain)
        reqs, scored, _ = _run(llm, prompts, scoring)
    finally:
        llm.core.executor.step = step
    assert not none and set(scored) == {reqs[1].request_id, reqs[3].request_id}
    assert [r.output_ids for r in reqs] == [r.output_ids for r in base]
    if mode == "layers":
        assert any(n < llm.cfg.num_layers for n in slices), "no pass was layer-sliced"
    for i in (1, 3):
        _check(scored[reqs[i].request_id], prompts[i], _reference(llm, prompts[i], host_kernels), host_kernels)


def test_max_tokens_zero_finishes_after_prefill(llm_factory, host_kernels):
    """``max_tokens=0``: one output, finished (length), no token; a one-token prompt gets ``[None]``."""
    llm = llm_factory("A", max_seqs=2, max_prefill_tokens=16, step_tokens=16, min_prefill_tokens=8,
                      host_kernels=host_kernels)
    ids = random_ids(37, 1000, seed=5)
    params = SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=0)
    reqs, scored, outs = _run(llm, [ids, ids[:1], ids[:20]], [params, params, SamplingParams(max_tokens=0)])
    assert [r.output_ids for r in reqs] == [[], [], []]
    assert sorted((o.request_id, o.finished, o.finish_reason, o.new_token_ids) for o in outs) == sorted(
        (r.request_id, True, "length", ()) for r in reqs)
    assert scored[reqs[1].request_id] == [None] and reqs[2].request_id not in scored
    _check(scored[reqs[0].request_id], ids, _reference(llm, ids, host_kernels), host_kernels, top=0)


def test_prefix_cache_never_skips_scored_positions(llm_factory, host_kernels):
    """The same prompt again, now cached: a plain request hits, a scoring one computes every position."""
    llm = llm_factory("A", max_seqs=2, max_prefill_tokens=64, prefix_interval=16, host_kernels=host_kernels)
    ids = random_ids(80, 1000, seed=9)
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    _run(llm, [ids], [warm])
    reqs, scored, outs = _run(llm, [ids, ids], [warm, dataclasses.replace(warm, prompt_logprobs=TOP)], every=100)
    cached = {o.request_id: o.cached_tokens for o in outs}
    assert cached[reqs[0].request_id] > 0 and cached[reqs[1].request_id] == 0
    assert reqs[0].output_ids == reqs[1].output_ids
    _check(scored[reqs[1].request_id], ids, _reference(llm, ids, host_kernels), host_kernels)


def _scoring_plan() -> StepPlan:
    m = PassMember("r", 3, 10, (5, 6, 7), sample=False, prompt_logprobs=1, targets=(6, 7))
    return StepPlan(step_id=1, decodes=(), passes=(PassSlice(1, 0, 2, (m,)),))


def test_step_result_must_answer_scored_members():
    """``validate_step_result`` holds the engine to the members that asked, row for row."""
    plan = _scoring_plan()
    entry = (-1.0, 2, ((9, -0.5),))
    ok = PromptLogprobs("r", 3, 10, (entry, entry))

    def result(*pls):
        return StepResult(1, (), (PassProgress(1, 2, True),), prompt_logprobs=pls)

    assert validate_step_result(plan, result(ok), 2) == ""
    assert "missing" in validate_step_result(plan, result(), 2)
    assert "scored rows" in validate_step_result(plan, result(dataclasses.replace(ok, entries=(entry,))), 2)
    assert "start" in validate_step_result(plan, result(dataclasses.replace(ok, start=11)), 2)
    assert "alternatives" in validate_step_result(plan, result(dataclasses.replace(ok, entries=(entry, entry[:2] + ((),)))), 2)
    assert "unplanned" in validate_step_result(plan, result(ok, dataclasses.replace(ok, slot=4)), 2)
    assert "twice" in validate_step_result(plan, result(ok, ok), 2)
    # a slice that does not complete the pass reports nothing yet
    sliced = StepPlan(1, (), (PassSlice(1, 0, 1, plan.passes[0].members),))
    assert validate_step_result(sliced, StepResult(1, (), (PassProgress(1, 1, False),)), 2) == ""
    assert "unplanned" in validate_step_result(sliced, StepResult(1, (), (PassProgress(1, 1, False),),
                                                                  prompt_logprobs=(ok,)), 2)


def test_non_finite_prompt_logits_fail_that_request_alone(llm_factory, monkeypatch):
    """Rows whose logits are not finite fail the scoring request alone (an error, never a NaN answer);
    a plain request in the same steps finishes normally and nothing leaks."""
    llm = llm_factory("A", max_seqs=2, max_prefill_tokens=16, step_tokens=16, min_prefill_tokens=8)
    engine = llm.core.executor
    real = engine.head

    def head(streams):  # NaN logits for blocks with more than one row: prompt scoring, never a sampled row here
        out = real(streams)
        return out if streams.shape[0] == 1 else torch.full_like(out, float("nan"))

    monkeypatch.setattr(engine, "head", head)
    ids = random_ids(30, 1000, seed=3)
    core = llm.core
    bad = core.make_request(RequestSpec(ids, SamplingParams(max_tokens=0, prompt_logprobs=1)))
    good = core.make_request(RequestSpec(ids[:10], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)))
    outs = []
    for r in (bad, good):
        core.add(r)
    while core.has_work:
        outs += core.step()
    last = {o.request_id: o for o in outs}
    assert last[bad.request_id].finish_reason == "error" and "non-finite" in last[bad.request_id].error
    assert last[good.request_id].finish_reason == "length" and len(good.output_ids) == 3
    assert core.leaks() == "", core.leaks()
