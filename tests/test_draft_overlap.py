"""A checkpoint drafter's blocks drafted on the host pool's worker while the engine applies the step
(``ModelDrafts.propose_later``, ``EngineCore._settle``): the same blocks as drafted in place, nothing read
before it is done, and a worker that keeps starting late is not waited for."""

from __future__ import annotations

import json
import logging
import time

import pytest

from ds4serve.engine import model_drafts
from ds4serve.engine.model_drafts import LATE_PAUSE, Ask, ModelDrafts
from ds4serve.engine.sampling import SamplerState, SamplingParams
from ds4serve.model.host_forward import library
from ds4serve.scheduler import step_costs
from ds4serve.scheduler.spec import RequestSpec
from ds4serve.scheduler.step_costs import StepCosts


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_pooled_job_runs_once_beside_loops_that_run_meanwhile(threads):
    lib = library()
    if lib is None:
        pytest.skip("no native host forward here")
    on_worker = lib.ds4_pool_job_check(200, 37, threads)
    assert on_worker >= 0  # every job ran exactly once, every item of the loops in between too
    if threads == 1:
        assert on_worker == 0  # no worker: each job ran where it was submitted


class _Pinned(StepCosts):
    """Costs under which every block pays, so both engines plan the same steps whatever the timing."""

    draft_cost = 0.0
    per_draft = 0.0

    def costs(self):
        return (1e-3, 0.0, 1e-6)


def _engine(overlap: bool, max_seqs: int = 3):
    from ds4serve.bench.spec_bench import TINY
    from ds4serve.llm import LLM

    llm = LLM(TINY, max_seqs=max_seqs, speculative=json.dumps({"method": "dspark"}))
    sched = llm.core.scheduler
    sched.step_costs.__class__ = _Pinned
    sched.draft_guard.allows = lambda width: True
    sched.draft_guard.baseline = lambda width, step: False
    llm.core.executor.overlap_drafts = overlap
    return llm


def _record_blocks(drafts: ModelDrafts) -> dict:
    """Every block the drafter hands out, by (slot, position), whichever way it was drafted."""
    seen: dict = {}
    propose, settle = drafts.propose, drafts.settle

    def recording_propose(asks):
        out = propose(asks)
        seen.update({(slot, p.position): p.tokens for slot, p in out.items()})
        return out

    def recording_settle():
        out = settle()
        seen.update({(slot, p.position): p.tokens for slot, p in out.items()})
        return out

    drafts.propose, drafts.settle = recording_propose, recording_settle
    return seen


def test_blocks_drafted_on_the_worker_are_the_blocks_drafted_in_place():
    from ds4serve.bench.spec_bench import prompts
    from ds4serve.llm import LLM

    runs = {}
    for overlap in (False, True):
        llm = _engine(overlap)
        blocks = _record_blocks(llm.core.executor.drafts)
        ps = prompts(3, llm.core.cfg.vocab_size)
        out = llm.generate(ps, max_tokens=60, temperature=0.0, ignore_eos=True)
        runs[overlap] = (out, blocks, dict(llm.core.stats.speculation), llm.core.executor.drafts.later)
    plain = LLM(__import__("ds4serve.bench.spec_bench", fromlist=["TINY"]).TINY, max_seqs=3)
    want = plain.generate(prompts(3, plain.core.cfg.vocab_size), max_tokens=60, temperature=0.0, ignore_eos=True)
    assert runs[False][0] == runs[True][0] == want
    assert runs[True][1] == runs[False][1] and runs[True][1]  # the same blocks, at the same positions
    assert runs[True][2] == runs[False][2]  # so the same drafts were verified and accepted
    assert runs[True][3] > 0 and runs[False][3] == 0


def test_a_request_aborted_while_its_block_is_drafted_leaves_the_others_exact():
    from ds4serve.bench.spec_bench import prompts

    llm = _engine(True)
    core = llm.core
    ps = prompts(2, core.cfg.vocab_size)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    reqs = [core.make_request(RequestSpec(p, params)) for p in ps]
    for r in reqs:
        core.add(r)
    outs: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    aborted = False
    while core.has_work:
        for o in core.step():
            outs[o.request_id] += o.new_token_ids
        if not aborted and core._drafting is not None and len(outs[reqs[0].request_id]) > 8:
            assert core.abort(reqs[0].request_id)  # its next block is still being drafted
            aborted = True
    assert aborted
    assert core.leaks() == ""
    solo = _engine(False, max_seqs=1).generate([ps[1]], max_tokens=40, temperature=0.0, ignore_eos=True)[0]
    assert outs[reqs[1].request_id] == solo


def test_a_drafter_that_fails_at_its_wait_costs_its_blocks_not_the_requests(caplog):
    from ds4serve.bench.spec_bench import prompts

    llm = _engine(True, max_seqs=2)
    ex = llm.core.executor
    settle, failed = ex.settle_drafts, []

    def failing():
        if not failed and ex.drafts._later is not None:
            settle()
            failed.append(True)
            raise MemoryError("native DSpark drafter: out of memory")
        return settle()

    ex.settle_drafts = failing
    ps = prompts(2, llm.core.cfg.vocab_size)
    with caplog.at_level(logging.ERROR, logger="ds4serve.runtime.core"):
        got = llm.generate(ps, max_tokens=30, temperature=0.0, ignore_eos=True)
    assert failed and "decode without drafts" in caplog.text
    assert got == _engine(False, max_seqs=2).generate(ps, max_tokens=30, temperature=0.0, ignore_eos=True)


class _Job:
    """A finished native job as ``settle`` sees it: its own seconds, and a wait that takes ``wait_s``."""

    def __init__(self, wait_s: float, commit_s: float, blocks_s: float):
        self.wait_s, self.seconds, self.on_worker = wait_s, (commit_s, blocks_s), True

    def wait(self):
        time.sleep(self.wait_s)
        return [True], [[9, 9]], [[0.9, 0.8]]


class _Native:
    keep_rows = 8

    def __init__(self, job: _Job):
        self.job = job

    def new_state(self):
        return object()

    def release(self, state):
        pass

    def start_greedy(self, entries, states, anchors, positions, threads):
        return self.job


def _ask(position: int) -> Ask:
    return Ask("r", 0, 5, position, SamplerState(SamplingParams(temperature=0.0), [], []), 1)


def _started(job: _Job) -> ModelDrafts:
    import torch

    from ds4serve.engine.model_drafts import Fed

    drafts = ModelDrafts(_Native(job))
    drafts.commit([Fed("r", 0, 0, tuple(range(6)), 0)], torch.zeros(6, 8), {})  # a prompt's six rows
    drafts.commit([Fed("r", 0, 6, (5, 9), 0)], torch.zeros(2, 8), {0: 2})  # and two of a decode step
    assert drafts.propose_later([_ask(8)], threads=2)
    return drafts


def test_the_engines_own_seconds_on_a_pooled_proposal_split_as_its_job_ran(monkeypatch):
    """``settle``'s timing: what the engine spent (starting the job and waiting for it) split between the
    prompt's read and the blocks as the job's own commit and block seconds split, the commit by rows."""
    now = [0.0]
    monkeypatch.setattr(model_drafts.time, "perf_counter", lambda: now[0])
    job = _Job(0.0, commit_s=3e-4, blocks_s=1e-4)
    drafts = _started(job)
    job.wait = lambda: (now.__setitem__(0, now[0] + 2e-4), ([True], [[9, 9]], [[0.9, 0.8]]))[1]
    out = drafts.settle()
    assert out[0].tokens == (9, 9) and out[0].survival == (0.9, 0.8) and drafts.pending[0].position == 8
    assert drafts.timing.block_s == pytest.approx(2e-4 * 0.25)
    assert drafts.timing.prompt_s == pytest.approx(2e-4 * 0.75 * 6 / 8)
    assert drafts.settle() == {}  # settled once


def test_a_worker_that_keeps_starting_late_is_not_waited_for(caplog):
    """Waits longer than the job ran (its core busy with another job): after a run of them the blocks are
    drafted in place for ``LATE_PAUSE`` proposals; waits shorter than the job keep the worker."""
    quick = _started(_Job(0.0, commit_s=1e-3, blocks_s=1e-3))
    for _ in range(40):
        quick.settle()
        assert quick.propose_later([_ask(8)], threads=2)
    late = _started(_Job(2e-3, commit_s=1e-4, blocks_s=1e-4))
    with caplog.at_level(logging.INFO, logger="ds4serve.engine.model_drafts"):
        for _ in range(40):
            late.settle()
            if not late.propose_later([_ask(8)], threads=2):
                break
    assert "started late" in caplog.text
    assert all(not late.propose_later([_ask(8)], threads=2) for _ in range(LATE_PAUSE - 1))
    assert late.propose_later([_ask(8)], threads=2)  # tried again
    assert not quick.propose_later([_ask(8)], threads=1)  # one thread: nothing to run beside


def test_the_wait_for_pooled_blocks_counts_for_the_step_not_the_loops_gap(monkeypatch):
    now = [10.0]
    monkeypatch.setattr(step_costs.time, "perf_counter", lambda: now[0])
    costs = StepCosts((1e-3, 0.0, 1e-4))
    costs.applied()
    now[0] += 5e-4  # the engine waited 0.3 ms for the blocks, then the loop took 0.2 ms
    costs.settled(3e-4)
    costs.planned()
    assert costs.gap == pytest.approx(2e-4)
