"""What a checkpoint drafter's time is charged to (issue 28).

The bug this pins: the first block after a prompt was charged the drafter reading the whole prompt (the
commit of its rows), ~3x a steady block for the bundled model's 240-token bench prompt. The scheduler's
cost rule then priced a verified draft row above what any acceptance rate could pay (the bar past
``FOLLOW_LIMIT``), stopped following the request, and, with no block ever drafted again, never learnt
the drafter's real cost: drafting stayed off for good on some runs, on with 1.3x on others.
"""

from __future__ import annotations

import pytest
import torch

from ds4serve.engine import model_drafts
from ds4serve.engine.model_drafts import Ask, Block, Fed, ModelDrafts
from ds4serve.engine.capture import CapturePlan
from ds4serve.engine.sampling import SamplerState, SamplingParams
from ds4serve.scheduler.drafting import FOLLOW_LIMIT, DraftPolicy
from ds4serve.scheduler.request import Request
from ds4serve.scheduler.step_costs import StepCosts

COMMIT_ROW_S = 3e-6  # the fake drafter's seconds to commit one row
BLOCK_S = 1.5e-4  # ... and to draft one block


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class SlowReader:
    """A drafter whose commit costs ``COMMIT_ROW_S`` a row and whose block costs ``BLOCK_S``, on ``clock``."""

    plan = CapturePlan((0,), mean_hc=True)
    block = 4
    keep_rows = 128

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.committed = 0

    def new_state(self) -> object:
        return object()

    def release(self, state: object) -> None:
        pass

    def commit(self, states, positions, tokens, hidden, owners) -> None:
        self.committed += positions.shape[0]
        self.clock.now += COMMIT_ROW_S * positions.shape[0]

    def ready(self, states, last) -> list[bool]:
        return [True] * len(states)

    def draft(self, states, anchors, anchor_positions, pick) -> Block:
        self.clock.now += BLOCK_S
        n = anchors.shape[0]
        return Block(torch.full((n, self.block), 9), None, torch.ones(n, self.block))


def ask(position: int, index: int) -> Ask:
    sampler = SamplerState(SamplingParams(temperature=0.0), [], [])
    return Ask("r", 0, 5, position, sampler, index)


def test_a_prompt_read_by_the_drafter_is_not_charged_to_its_blocks(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(model_drafts.time, "perf_counter", clock)
    model = SlowReader(clock)
    drafts = ModelDrafts(model)
    prompt = 240
    # the prompt's last chunk (no decoder of its own: not in ``kept``), then the block after it
    drafts.commit([Fed("r", 0, 0, tuple(range(prompt)), 0)], torch.zeros(prompt, 8), {})
    assert drafts.propose([ask(prompt, 1)])
    assert model.committed == prompt  # one chunk: kept whole (the backlog drops whole chunks only)
    assert drafts.timing.prompt_s == pytest.approx(COMMIT_ROW_S * prompt)
    assert drafts.timing.block_s == pytest.approx(BLOCK_S)
    # a decoder's step: its token and 2 accepted drafts, none of it the prompt's
    drafts.commit([Fed("r", 0, prompt, (5, 9, 9, 9, 9), 0)], torch.zeros(5, 8), {0: 3})
    assert drafts.propose([ask(prompt + 3, 4)])
    assert drafts.timing.prompt_s == 0.0 and drafts.timing.block_s == pytest.approx(BLOCK_S)
    # a backlog that mixes both: the prompt's share of the commit by rows
    drafts.drop(0)
    drafts.commit([Fed("r", 0, 0, tuple(range(6)), 0)], torch.zeros(6, 8), {})
    drafts.commit([Fed("r", 0, 6, (5, 9), 0)], torch.zeros(2, 8), {0: 2})
    assert drafts.propose([ask(8, 3)])
    assert drafts.timing.prompt_s == pytest.approx(6 * COMMIT_ROW_S)


def test_a_slow_first_read_does_not_turn_drafting_off():
    """The bundled model's figures on the machine that showed it: a 0.56 ms plain step, 53 us a draft row,
    the prompt's commit 0.72 ms and the first block 0.36 ms (cold)."""
    costs = (5.6e-4, 0.0, 5.3e-5)
    policy = DraftPolicy(k=4, min_n=1, max_n=3, window=512, max_rows=7, vocab_size=1000, source="model")
    req = Request.__new__(Request)
    req.draft_rate = 1.0
    charged_all = StepCosts(costs)  # what the scheduler did: the whole propose charged to the block
    charged_all.observe_blocks(0.72e-3 + 0.36e-3, 1)
    assert not policy.follows(req, 1, costs, charged_all.draft_cost, 512)  # the bug: drafting off
    assert policy.bar(req, 1, costs, charged_all.draft_cost, 512) > FOLLOW_LIMIT
    charged_blocks = StepCosts(costs)  # the prompt's read left out, the block's own forward its cost
    charged_blocks.observe_blocks(0.36e-3, 1, block_seconds=0.36e-3)
    assert charged_blocks.block_cost == 0.36e-3
    assert policy.follows(req, 1, costs, charged_blocks.draft_cost, 512)
    # rows committed beside a block are charged to drafting, not to the block's own cost
    charged_blocks.observe_blocks(0.2e-3, 1, verified=4, block_seconds=0.15e-3)
    assert abs(charged_blocks.block_cost - (0.9 * 0.36e-3 + 0.1 * 0.15e-3)) < 1e-12
    # a stalled block is clamped (SPIKE), and only the block's part of the time with it
    before = charged_blocks.block_cost
    charged_blocks.observe_blocks(1.0 + 0.05e-3, 1, verified=4, block_seconds=1.0)
    assert charged_blocks.block_cost < before * 1.2


def test_the_engine_keeps_drafting_after_a_slow_prompt_read():
    """The bundled model with its DSpark drafter, whose reading of prompt rows is made slow (1 ms a row,
    a sleep in the commit): the scheduler charges that read to nobody's blocks, so the request drafts
    from its first decode step on, and the drafter's block cost is its forward's."""
    import json
    import time

    from ds4serve.bench.spec_bench import TINY, prompts
    from ds4serve.llm import LLM

    llm = LLM(TINY, max_seqs=1, speculative=json.dumps({"method": "dspark"}))
    llm.core.executor.overlap_drafts = False  # the commit in place, where a sleep can slow it (test_draft_overlap)
    model = llm.core.executor.drafts.model
    for name in ("commit_entries", "commit"):  # whichever path the engine takes for this drafter
        inner = getattr(model, name, None)
        if inner is None:
            continue

        def slow(*args, _inner=inner, **kw):
            rows = sum(len(e[2]) for e in args[0]) if _inner.__name__ == "commit_entries" else args[1].shape[0]
            if rows > 16:  # a prompt's chunk (a decode step commits a handful)
                time.sleep(1e-3 * rows)
            return _inner(*args, **kw)

        setattr(model, name, slow)
    got = llm.generate(prompts(1, llm.core.cfg.vocab_size), max_tokens=48, temperature=0.0, ignore_eos=True)
    assert len(got[0]) == 48
    figures = llm.core.stats.speculation
    assert figures.get("drafted_tokens", 0) > 0, dict(figures)
    assert llm.core.scheduler.step_costs.block_cost < 0.05  # the blocks' forward, not the 0.24 s read


def _pinned_run(tokens: int, priced_out, from_step: int = 0) -> tuple[list[bool], list[bool], list[int]]:
    """The bundled model with its DSpark drafter, one greedy request of ``tokens`` tokens, the costs the rule
    reads pinned (a timed fit would make the test the host's): no draft can pay on the steps where
    ``priced_out(step)``, a cheap drafter pays elsewhere. Checks the output is plain decoding's and returns
    the prompt members' follow flags, and from step ``from_step`` on whether each step followed (or asked
    for a block) and how many draft rows it carried."""
    import json

    from ds4serve.bench.spec_bench import TINY, prompts
    from ds4serve.llm import LLM

    llm = LLM(TINY, max_seqs=1, speculative=json.dumps({"method": "dspark"}))
    plain = LLM(TINY, max_seqs=1)
    sched = llm.core.scheduler

    class Pinned(StepCosts):
        draft_cost = 0.05e-3
        per_draft = 0.1e-3

        def costs(self):
            return (1e-3, 0.0, 1.0) if priced_out(sched._schedules) else (0.6e-3, 0.0, 0.05e-3)

    sched.step_costs.__class__ = Pinned
    prefilled: list[bool] = []
    followed: list[bool] = []
    drafted: list[int] = []
    apply = sched.apply

    def counting(plan, result):
        prefilled.extend(m.follow for p in plan.passes for m in p.members)
        if sched._schedules >= from_step:
            followed.append(any(d.follow or d.propose for d in plan.decodes))
            drafted.append(sum(len(d.draft) for d in plan.decodes))
        return apply(plan, result)

    sched.apply = counting
    prompt = prompts(1, llm.core.cfg.vocab_size)
    got = llm.generate(prompt, max_tokens=tokens, temperature=0.0, ignore_eos=True)
    assert got == plain.generate(prompt, max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return prefilled, followed, drafted


@pytest.mark.parametrize("tokens, drafts_after", [(64, False), (320, True)])
def test_a_request_is_followed_again_only_where_its_rings_can_catch_up(tokens, drafts_after):
    """For steps 4-9 the step costs say no draft could pay, so those steps run without the drafter capturing
    (a gap in the request's rings, whole again 128 positions later). A 64-token answer ends before that: it
    is not followed again (no capture, no block). A 320-token one catches up and drafts again."""
    _, followed, drafted = _pinned_run(tokens, lambda step: 4 <= step < 10, from_step=10)
    assert any(followed) is drafts_after and (sum(drafted) > 0) is drafts_after, (followed, drafted)


@pytest.mark.parametrize("tokens, drafts_after", [(64, False), (320, True)])
def test_a_prompt_the_drafter_did_not_read_is_followed_only_where_its_rings_can_catch_up(tokens, drafts_after):
    """While the prompt prefills the step costs say no draft could pay, so the prompt's pass runs without the
    drafter capturing (its window lacks the prompt's end, whole again 128 positions later). A 64-token answer
    ends before that: no decode step follows it or asks for a block (before, it was followed and probed to
    the end, every probe's block refused as not ready). A 320-token one catches up and drafts."""
    prefilled, followed, drafted = _pinned_run(tokens, lambda step: step <= 1)
    assert prefilled and not any(prefilled)  # the prompt ran without the drafter
    assert any(followed) is drafts_after and (sum(drafted) > 0) is drafts_after, (followed, drafted)
