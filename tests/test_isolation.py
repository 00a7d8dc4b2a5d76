"""One request never takes down another (DESIGN §6 invariant 5), at the scheduler level.

A fake engine (no network, tokens from (request, position)) fails every step that contains a
poisoned request, or fails one step at random once. The scheduler must undo failed steps (drop and
recompute the members), find the culprit by bisection instead of re-running everyone alone, fail
only the culprit, and give every other request exactly the tokens it gets without any fault.
Real-engine faults (sampler, image rows, a pass slice) are in ``test_isolation_engine.py``.
"""

from __future__ import annotations

import math

import pytest
from test_step_contract import FakeEngine, expected_tokens, make_core

from ds4serve.cache.manager import StaleSlot
from ds4serve.engine.plan import StepResult, StepStatus
from ds4serve.engine.sampling import SamplingParams
from ds4serve.scheduler.spec import RequestSpec
from ds4serve.scheduler.request import RequestStatus


class FailsWith(FakeEngine):
    """Fails every step whose plan holds ``poisoned`` (after writing nothing), like a forward that raises."""

    poisoned: set[str] = set()
    transient: int = 0  # fail this many steps regardless of who is in them, then behave

    def step(self, plan):
        if plan.request_ids & self.poisoned or self.transient > 0:
            self.transient -= 1
            self.plans.append(plan)
            self.active_passes -= {p.pass_id for p in plan.passes} | set(plan.retired)
            return StepResult(plan.step_id, (), (), status=StepStatus.FAILED, error="RuntimeError: injected")
        return super().step(plan)


def _engine(poisoned=(), transient=0):
    return type("Executor", (FailsWith,), {"poisoned": set(poisoned), "transient": transient})


def _requests(core, n: int):
    reqs = [core.make_request(RequestSpec(list(range(1, 2 + (i * 7) % 40)),
                                          SamplingParams(max_tokens=6 + i % 5, temperature=0)))
            for i in range(n)]
    for r in reqs:
        core.add(r)
    return reqs


@pytest.mark.parametrize("mode", ["chunk", "layers"])
def test_a_poisoned_request_fails_alone_and_the_rest_equal_solo(mode):
    core = make_core(engine=_engine(poisoned={"req-11"}), max_seqs=16, prefill_mode=mode, step_tokens=64)
    reqs = _requests(core, 16)
    core.run_until_idle()
    bad = reqs[10]
    assert bad.request_id == "req-11" and bad.status is RequestStatus.FINISHED_ERROR
    assert "failed again when it ran alone" in bad.error and "injected" in bad.error
    for r in reqs:
        if r is not bad:
            assert r.status is RequestStatus.FINISHED_LENGTH, (r.request_id, r.error)
            assert r.output_ids == expected_tokens(r.request_id, len(r.prompt_ids), r.params.max_tokens)
    st = core.scheduler.stats
    # bisection: the culprit is found in about log2(16) + 1 failed probes, not 16 solo re-runs
    assert 2 <= st["step_failures"] <= math.ceil(math.log2(16)) + 2
    first_failed = next(p for p in core.executor.plans if "req-11" in p.request_ids)
    assert st["isolated_failures"] == 1 and st["recomputed_after_failure"] >= len(first_failed.request_ids) - 1
    assert len(first_failed.request_ids) >= 4  # the fault really hit a shared step
    assert not core.scheduler.quarantine and core.leaks() == ""


def test_probe_steps_never_mix_suspects_with_others():
    core = make_core(engine=_engine(poisoned={"req-3"}), max_seqs=8)
    _requests(core, 8)
    core.run_until_idle()
    failed = [p for p in core.executor.plans if p.request_ids & {"req-3"}]
    # after the first failure, the culprit only ever runs with fellow suspects: each failing step is
    # at most half the size of the one before, down to the culprit alone
    sizes = [len(p.request_ids) for p in failed]
    assert sizes[-1] == 1
    assert all(b <= (a + 1) // 2 for a, b in zip(sizes, sizes[1:])), sizes


def test_a_transient_failure_clears_everybody():
    core = make_core(engine=_engine(transient=1), max_seqs=8)
    reqs = _requests(core, 8)
    core.run_until_idle()
    for r in reqs:
        assert r.status is RequestStatus.FINISHED_LENGTH, r.error
        assert r.output_ids == expected_tokens(r.request_id, len(r.prompt_ids), r.params.max_tokens)
    assert core.scheduler.stats["step_failures"] == 1 and core.scheduler.stats["isolated_failures"] == 0
    assert core.leaks() == ""


def test_a_lone_request_whose_step_fails_twice_fails_with_an_error():
    core = make_core(engine=_engine(poisoned={"req-1"}))
    (r,) = _requests(core, 1)
    core.run_until_idle()
    assert r.status is RequestStatus.FINISHED_ERROR and "failed again" in r.error
    assert core.scheduler.stats["step_failures"] == 2 and core.leaks() == ""


def test_a_stale_slot_handle_cannot_touch_the_reused_slot():
    core = make_core(max_seqs=1)
    cache = core.cache
    old = cache.alloc_slot()
    assert cache.reserve({old: 10})
    cache.drop(old)
    new = cache.alloc_slot()
    assert int(new) == int(old) and new.gen != old.gen
    for touch in (lambda: cache.drop(old), lambda: cache.reserve({old: 20}), lambda: cache.block_table(old),
                  lambda: cache.suspend(old, 1)):
        with pytest.raises(StaleSlot):
            touch()
    assert cache.reserve({new: 10}) and cache.block_table(new)
    cache.drop(new)
    assert cache.leaks() == ""


def test_image_slots_must_carry_exactly_their_rows():
    """A chunk whose IMAGE slots lack rows (or whose rows sit elsewhere) is refused before compute,
    naming the member: embedding it would silently use the sentinel vector instead of the image."""
    import torch

    from ds4serve.engine.plan import PassMember, PassSlice, StepPlan, member_problems

    image = 102  # the IMAGE sentinel id of a 100-token vocabulary (vocab_size + 2)
    ids = (5, 101, 100, image, image, 103, 104)  # text, PAD, START, two IMAGE slots, NEWLINE, END
    rows = torch.zeros(2, 8)

    def plan(images) -> StepPlan:
        m = PassMember("r", 0, 10, ids, sample=True, image_rows=images)
        return StepPlan(1, (), (PassSlice(1, 0, 4, (m,)),))

    assert member_problems(plan((((13, 14), rows),)), staging_rows=64, image_slot_id=image) == {}
    for images in ((), (((14, 15), rows),), (((13, 13), rows),)):  # none, shifted, one slot twice
        problems = member_problems(plan(images), staging_rows=64, image_slot_id=image)
        assert "image rows missing or misplaced" in problems["r"], images
    assert "rows" in member_problems(plan((((13, 14), rows[:1]),)), 64, image)["r"]  # count mismatch
    assert "staging" in member_problems(plan((((13, 14), rows),)), staging_rows=4, image_slot_id=image)["r"]
    assert member_problems(plan(()), staging_rows=64, image_slot_id=None) == {}  # text-only model
