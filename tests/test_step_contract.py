"""The step contract: the scheduler against a fake engine, and deliberately broken engines.

These tests import nothing from ``ds4serve.model``: the fake engine produces deterministic tokens
from (request, position) without any network, so scheduling policy is tested on its own.
"""

from __future__ import annotations

import dataclasses

import pytest

from ds4serve.config import ModelConfig
from ds4serve.engine.plan import (PassProgress, RowStatus, SampledToken, StepPlan, StepResult, validate_plan,
                                  validate_step_result)
from ds4serve.engine.sampling import SamplingParams
from ds4serve.scheduler.spec import RequestSpec
from ds4serve.runtime import EngineCore, FatalStepError, assemble_core
from ds4serve.scheduler.request import RequestStatus
from ds4serve.settings import EngineSettings

TINY = {
    "vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 4, "num_attention_heads": 2, "head_dim": 8,
    "qk_rope_head_dim": 4, "q_lora_rank": 8, "o_groups": 1, "o_lora_rank": 8, "sliding_window": 8,
    "compress_ratios": [0, 4, 8, 4], "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "num_hash_layers": 1,
    "hc_mult": 2, "max_position_embeddings": 4096, "eos_token_id": None,
}


def fake_token(request_id: str, position: int) -> int:
    return (sum(map(ord, request_id)) * 31 + position * 7) % 60 + 2


class FakeEngine:
    """Honours the contract: one token per decoder and per finishing sampled pass member."""

    def __init__(self, cfg, model, cache):
        self.cache = cache
        self.L = cfg.num_layers
        self.active_passes: set[int] = set()
        self.plans: list[StepPlan] = []

    def cancel_pass(self, pass_id):
        self.active_passes.discard(pass_id)

    def step(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        self.active_passes -= set(plan.retired)
        toks = [SampledToken(d.request_id, d.slot, fake_token(d.request_id, d.position + 1)) for d in plan.decodes]
        progress = []
        for p in plan.passes:
            done = p.layer_stop == self.L
            (self.active_passes.discard if done else self.active_passes.add)(p.pass_id)
            progress.append(PassProgress(p.pass_id, p.layer_stop, done))
            if done:
                toks += [SampledToken(m.request_id, m.slot, fake_token(m.request_id, m.start + len(m.ids)))
                         for m in p.members if m.sample]
        return StepResult(plan.step_id, tuple(toks), tuple(progress))


class OmitsDecoder(FakeEngine):
    def step(self, plan):
        res = super().step(plan)
        if plan.decodes:
            res = dataclasses.replace(res, tokens=tuple(t for t in res.tokens if t.slot != plan.decodes[0].slot))
        return res


class DuplicatesRow(FakeEngine):
    def step(self, plan):
        res = super().step(plan)
        return dataclasses.replace(res, tokens=res.tokens + res.tokens[:1]) if res.tokens else res


class UnplannedSlot(FakeEngine):
    def step(self, plan):
        res = super().step(plan)
        planned = {d.slot for d in plan.decodes} | {m.slot for p in plan.passes for m in p.members}
        free = next(s for s in range(self.cache.n_slots) if s not in planned)
        return dataclasses.replace(res, tokens=res.tokens + (SampledToken("ghost", free, 5),))


class WrongCursor(FakeEngine):
    def step(self, plan):
        res = super().step(plan)
        return dataclasses.replace(res, passes=tuple(dataclasses.replace(p, layer_cursor=p.layer_cursor - 1)
                                                     for p in res.passes))


class WrongRequest(FakeEngine):
    """Reports the token of a planned slot under another planned request's id."""

    def step(self, plan):
        res = super().step(plan)
        if len(res.tokens) < 2:
            return res
        first, second = res.tokens[0], res.tokens[1]
        return dataclasses.replace(res, tokens=(dataclasses.replace(first, request_id=second.request_id),)
                                   + res.tokens[1:])


class DropsPassProgress(FakeEngine):
    """Runs every pass but reports no progress for them."""

    def step(self, plan):
        return dataclasses.replace(super().step(plan), passes=())


def make_core(engine=FakeEngine, **settings) -> EngineCore:
    s = EngineSettings(**{"max_seqs": 4, "warmup": False, "max_prefill_tokens": 32, "step_tokens": 24, **settings})
    return assemble_core(ModelConfig.from_dict(TINY), None, s, engine_factory=engine)


def expected_tokens(rid: str, prompt_len: int, n: int) -> list[int]:
    return [fake_token(rid, prompt_len + i) for i in range(n)]


@pytest.mark.parametrize("mode", ["chunk", "layers"])
def test_fake_engine_serves_everything(mode):
    core = make_core(prefill_mode=mode)
    reqs = [core.make_request(RequestSpec(list(range(1, n + 1)), SamplingParams(max_tokens=k, temperature=0)))
            for n, k in [(1, 5), (7, 3), (40, 9), (100, 2), (3, 12), (65, 4)]]
    for r in reqs:
        core.add(r)
    core.run_until_idle()
    for r in reqs:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_ids == expected_tokens(r.request_id, len(r.prompt_ids), r.params.max_tokens)
    assert core.leaks() == ""
    plans = core.executor.plans
    assert all(validate_plan(p, 4) == "" for p in plans)
    if mode == "layers":
        assert any(p.layer_stop - p.layer_start < 4 for plan in plans for p in plan.passes), "no layer slicing"


def test_every_decoder_planned_exactly_once_per_step():
    core = make_core()
    for n in (3, 5, 9, 2):
        core.add(core.make_request(RequestSpec(list(range(2, n + 2)), SamplingParams(max_tokens=6, temperature=0))))
    seen_decoding = set()
    while core.has_work:
        decoding = {r.slot for r in core.scheduler.running if r.status is RequestStatus.DECODING}
        core.step()
        plan = core.executor.plans[-1]
        assert {d.slot for d in plan.decodes} == decoding
        seen_decoding |= decoding
    assert len(seen_decoding) >= 2


@pytest.mark.parametrize("broken,needle", [
    (OmitsDecoder, "without a token"),
    (DuplicatesRow, "duplicate row"),
    (UnplannedSlot, "unplanned slot"),
    (WrongCursor, "cursor"),
    (WrongRequest, "token for req-"),
    (DropsPassProgress, "passes without progress"),
])
def test_broken_engines_are_caught(broken, needle):
    core = make_core(engine=broken, prefill_mode="layers", step_tokens=4, min_prefill_tokens=4)
    reqs = [core.make_request(RequestSpec([1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=8, temperature=0)))
            for _ in range(3)]
    for r in reqs:
        core.add(r)
    with pytest.raises(FatalStepError, match=needle):
        core.run_until_idle()
    assert core.broken
    assert all(r.status is RequestStatus.FINISHED_ERROR and "fatal step error" in r.error for r in reqs)
    with pytest.raises(FatalStepError):
        core.step()


def test_validator_accepts_honest_results_and_names_problems():
    core = make_core()
    core.add(core.make_request(RequestSpec([1, 2, 3], SamplingParams(max_tokens=3, temperature=0))))
    plan = core.scheduler.schedule()
    res = core.executor.step(plan)
    assert validate_step_result(plan, res, 4) == ""
    wrong_id = dataclasses.replace(res, step_id=res.step_id + 1)
    assert "answers plan" in validate_step_result(plan, wrong_id, 4)
    bad_token = dataclasses.replace(res, tokens=(dataclasses.replace(res.tokens[0], token=-3),))
    assert "invalid token" in validate_step_result(plan, bad_token, 4)
    failed_row = dataclasses.replace(res, tokens=(dataclasses.replace(res.tokens[0], status=RowStatus.FAILED),))
    assert validate_step_result(plan, failed_row, 4) == ""


def test_abort_at_any_point_frees_before_next_step():
    core = make_core(prefill_mode="layers", step_tokens=8, min_prefill_tokens=4)
    reqs = [core.make_request(RequestSpec(list(range(1, 30)), SamplingParams(max_tokens=20, temperature=0)))
            for _ in range(4)]
    for r in reqs:
        core.add(r)
    core.step()
    core.step()
    victims = {r.request_id: r.slot for r in core.scheduler.running}
    assert any(r.pass_id is not None for r in core.scheduler.running), "expected a pass in flight"
    for rid in victims:
        core.abort(rid)
    assert core.leaks() == ""  # slots and pages are free now; the emptied pass is being retired
    assert core.has_work  # ... by the next plan, which carries only that retirement
    core.step()
    assert core.executor.plans[-1].retired and core.executor.plans[-1].is_empty is False
    assert core.executor.active_passes == set() and not core.has_work
    before = len(core.executor.plans)
    late = core.make_request(RequestSpec([5, 6, 7], SamplingParams(max_tokens=2, temperature=0)))
    core.add(late)
    core.step()
    for plan in core.executor.plans[before:]:
        assert not plan.request_ids & set(victims)
    core.run_until_idle()
    assert late.status is RequestStatus.FINISHED_LENGTH
    assert core.leaks() == ""


def test_queue_bound_and_too_large():
    from ds4serve.scheduler.scheduler import QueueFull, RequestTooLarge

    core = make_core(max_queue=2, max_seqs=1, max_model_len=64)
    with pytest.raises(RequestTooLarge, match="context limit of 64"):
        core.add(core.make_request(RequestSpec(list(range(60)), SamplingParams(max_tokens=10))))
    for _ in range(3):  # max_seqs + max_queue in flight
        core.add(core.make_request(RequestSpec([1], SamplingParams(max_tokens=2))))
    with pytest.raises(QueueFull):
        core.add(core.make_request(RequestSpec([1], SamplingParams(max_tokens=2))))
