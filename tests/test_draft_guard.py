"""``scheduler/draft_guard.py``: drafting stops at a width whose drafting steps really get fewer tokens a
second than its plain ones, whatever the cost rule believes, and is tried again later."""

from __future__ import annotations

import json
import time

import pytest

from ds4serve.scheduler.draft_guard import MIN_STEPS, RETRY, DraftGuard
from ds4serve.scheduler.step_costs import StepCosts


def _feed(guard: DraftGuard, width: int, steps: int, plain_rate: float, drafting_rate: float) -> None:
    """Alternate plain and drafting steps of ``width`` decoders at the given tokens per second."""
    for i in range(steps):
        drafting = i % 2 == 1
        tokens = width + (2 if drafting else 0)
        guard.observe(width, drafting, tokens, tokens / (drafting_rate if drafting else plain_rate))


def test_a_width_whose_drafting_steps_lose_is_turned_off_and_tried_again():
    guard = DraftGuard()
    _feed(guard, 4, int(MIN_STEPS), plain_rate=5000.0, drafting_rate=4000.0)
    assert guard.allows(4)  # not judged before both kinds have MIN_STEPS (decayed) steps
    for _ in range(int(2 * MIN_STEPS)):  # a step at a time, until it is judged
        _feed(guard, 4, 2, plain_rate=5000.0, drafting_rate=4000.0)
        if not guard.allows(4):
            break
    assert not guard.allows(4)
    guard.observe(4, False, 4, 4 / 5000.0)  # the step that turned it off may have been the first of the pair
    assert guard.allows(1) and guard.allows(16)  # other widths are their own
    for _ in range(RETRY - 3):
        guard.observe(4, False, 4, 4 / 5000.0)
    assert not guard.allows(4)
    for _ in range(3):
        guard.observe(4, False, 4, 4 / 5000.0)
    assert guard.allows(4)  # tried again, from a clean drafting record


def test_the_drafters_time_in_a_plain_step_counts_for_drafting():
    """Blocks drafted in a plain step (for the next step's drafts) cost drafting, not the plain step: drafting
    steps that look faster on their own lose once those blocks are charged to them."""
    guard = DraftGuard()
    for i in range(60):
        if i % 2:
            guard.observe(2, True, 4, 4 / 3000.0)  # 1.5x the plain rate on their own
        else:
            guard.observe(2, False, 2, 2 / 2000.0 + 2e-3, drafter_s=2e-3)  # a 2 ms block drafted beside
    assert not guard.allows(2)


def test_a_width_whose_drafting_steps_win_stays_on():
    guard = DraftGuard()
    _feed(guard, 1, 200, plain_rate=1600.0, drafting_rate=2300.0)
    assert guard.allows(1)
    guard.observe(1, True, 1, float("nan"))  # nonsense is ignored
    guard.observe(0, True, 3, 1e-3)
    assert guard.allows(1)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("slow", [False, True])
def test_the_engine_stops_drafting_where_its_drafter_makes_steps_slower(slow, overlap):
    """The bundled model with its DSpark drafter at one stream, the costs the rule reads pinned so that it
    always drafts: with the drafter slowed to 4 ms a block the guard finds the drafting steps losing (once it
    has timed a few plain steps, which it asks for) and turns drafting off; at its own speed drafting goes
    on. Greedy output is plain decoding's either way. ``overlap``: the blocks drafted on the pool's worker
    while the step is applied (``ModelDrafts.propose_later``), the slowness then in the engine's wait for
    them."""
    from ds4serve.bench.spec_bench import TINY, prompts
    from ds4serve.llm import LLM

    llm = LLM(TINY, max_seqs=1, speculative=json.dumps({"method": "dspark"}))
    plain = LLM(TINY, max_seqs=1)
    sched = llm.core.scheduler

    class Pinned(StepCosts):
        draft_cost = 0.0
        per_draft = 0.0

        def costs(self):
            return (1e-3, 0.0, 1e-6)

    sched.step_costs.__class__ = Pinned
    drafts = llm.core.executor.drafts
    llm.core.executor.overlap_drafts = overlap
    if slow:
        propose, settle = drafts.propose, drafts.settle

        def slow_propose(asks):
            time.sleep(0.004)
            return propose(asks)

        def slow_settle():
            if drafts._later is not None:
                time.sleep(0.004)
            return settle()

        drafts.propose, drafts.settle = slow_propose, slow_settle
    drafted: list[int] = []
    apply = sched.apply

    def counting(plan, result):
        drafted.append(sum(len(d.draft) for d in plan.decodes))
        return apply(plan, result)

    sched.apply = counting
    prompt = prompts(1, llm.core.cfg.vocab_size)
    got = llm.generate(prompt, max_tokens=400, temperature=0.0, ignore_eos=True)
    assert got == plain.generate(prompt, max_tokens=400, temperature=0.0, ignore_eos=True)
    late = drafted[2 * len(drafted) // 3:]  # the guard needs a few plain steps to compare with first
    assert (sum(late) == 0) is slow, drafted
    assert not sched.draft_guard.allows(1) is slow
    assert (drafts.later > 0) is overlap


def test_a_drafter_that_follows_without_drafting_is_turned_off():
    """Once the drafter drafts blocks, a width where it goes on following step after step with no draft ever
    verified pays for the following and gets nothing: turned off after IDLE_STEPS such steps. A draft verified
    now and then keeps it on, and following while no block is drafted (the drafter's window filling again
    after a gap) does not count."""
    from ds4serve.scheduler.draft_guard import IDLE_STEPS

    guard = DraftGuard()
    for _ in range(3 * IDLE_STEPS):  # catching up: following, no block drafted
        guard.observe(4, False, 4, 1e-3, followed=True)
    assert guard.allows(4)
    guard.observe(4, False, 4, 1e-3, followed=True, blocks=4)  # a probe's blocks, refused next step
    for _ in range(IDLE_STEPS - 2):
        guard.observe(4, False, 4, 1e-3, followed=True)
    assert guard.allows(4)
    guard.observe(4, False, 4, 1e-3, followed=True)
    assert not guard.allows(4)
    busy = DraftGuard()
    for i in range(4 * IDLE_STEPS):
        verified = i % 20 == 0
        busy.observe(1, verified, 3 if verified else 1, 1e-3 if verified else 0.5e-3, followed=True, blocks=int(i % 20 == 19))
    assert busy.allows(1)
