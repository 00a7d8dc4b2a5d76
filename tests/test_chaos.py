"""The seeded chaos storm (short in CI), and proof that it catches the classic faults."""

from __future__ import annotations

import time

import pytest

from ds4serve.bench.chaos import CHAOS_SETTINGS, run_chaos
from ds4serve.server.inprocess import serve


def test_chaos_storm_200_requests(random_ckpt, tmp_path):
    with serve(random_ckpt, settings=CHAOS_SETTINGS) as srv:
        report = run_chaos(srv, seed=7, n=200, log_path=tmp_path / "chaos.jsonl")
    print(report.counts, report.engine_stats)
    assert report.ok, "\n".join(report.problems)
    assert report.counts.get("completed", 0) > 80
    assert report.counts.get("aborted", 0) > 10 and report.counts.get("rejected", 0) > 10
    stats = report.engine_stats
    assert stats["preempt_suspend"] > 0 and stats["resumed"] > 0, stats
    assert stats["aborted_in_pass"] > 0, stats  # hang-ups really landed inside image passes
    assert len((tmp_path / "chaos.jsonl").read_text().splitlines()) == 200


def _fault_leaked_slot_on_image_abort(monkeypatch):
    """A request aborted while its image pass is in flight keeps its slot (the classic leak)."""
    from ds4serve.scheduler.scheduler import Scheduler

    original = Scheduler._finish

    def leaky(self, req, status, error=None, new=None):
        if req.pass_id is not None and req in self.running:  # ending mid-pass: its slot is never freed
            slot = req.slot
            self.cache.drop = (lambda s, _orig=self.cache.drop: None if s == slot else _orig(s))
        original(self, req, status, error, new)

    monkeypatch.setattr(Scheduler, "_finish", leaky)


def _fault_encoder_outlives_request(monkeypatch):
    """Cancelling a retired request's image encoding is skipped."""
    from ds4serve.engine.encoder import EncoderWorker

    monkeypatch.setattr(EncoderWorker, "cancel", lambda self, rid: None)


def _fault_stall_after_suspend(monkeypatch):
    """Preempted (suspended or dropped) requests are never resumed: their streams stall."""
    from ds4serve.scheduler.scheduler import Scheduler

    monkeypatch.setattr(Scheduler, "_resume", lambda self, req: False)
    _steps_wait_for_a_burst(monkeypatch, CHAOS_SETTINGS["max_seqs"] * 2)


def _steps_wait_for_a_burst(monkeypatch, n: int, quiet_s: float = 0.5) -> None:
    """While requests keep arriving, no step runs until ``n`` are in flight: on a loaded machine the
    client sends its burst slower than the engine answers it, the pool never fills, nothing is
    preempted, and a fault in preemption is never reached (this failed with the cores busy). A lone
    request (the storm's solo reference runs, one at a time) steps once ``quiet_s`` passed without a new
    arrival."""
    from ds4serve.runtime.core import EngineCore

    step, seen = EngineCore.step, [-1, 0.0]  # the added count last seen, and when it changed

    def gated(self):
        now, added = time.monotonic(), self.scheduler.stats["added"]
        if added != seen[0]:
            seen[:] = [added, now]
        if self.scheduler.in_flight < n and now - seen[1] < quiet_s:
            time.sleep(0.002)
            return []
        return step(self)

    monkeypatch.setattr(EngineCore, "step", gated)


# Each fault gets a burst that is sure to reach the code it breaks, whatever the machine's speed:
# image requests that hang up while their pass is in flight, or more long answers at once than the KV
# pool holds (so some must be suspended). The pressure burst arrives all at once: spread over even
# 0.3 s, a fast engine finishes the first answers before the pool fills, and nothing is suspended.
IMAGE_ABORTS = {"abort_image": 6, "complete_stream": 2}
PRESSURE = {"complete_stream": 1, "complete": 1}
# With CHAOS_SETTINGS' 64-token pages no text prompt of the table crosses a page while it decodes, so
# whether anything was preempted hung on how many image prompts the first six admitted held (it once
# was none, and the stall fault went unseen). 16-token pages in an 8-page pool: every request needs at
# least 2 pages by its end (shortest prompt 21 tokens + its answer), and the six admitted together need
# at least 12, so growth must preempt whatever the order of arrival.
PRESSURE_SETTINGS = {**CHAOS_SETTINGS, "page_tokens": 16, "kv_budget": 128}


@pytest.mark.parametrize("fault,needle,mix,spread_s,settings", [
    (_fault_leaked_slot_on_image_abort, "leaks", IMAGE_ABORTS, 0.3, CHAOS_SETTINGS),
    (_fault_encoder_outlives_request, "encoder work for retired requests", IMAGE_ABORTS, 0.3, CHAOS_SETTINGS),
    (_fault_stall_after_suspend, "stalled", PRESSURE, 0.0, PRESSURE_SETTINGS),
])
def test_chaos_catches_classic_faults(fault, needle, mix, spread_s, settings, random_ckpt, monkeypatch):
    fault(monkeypatch)
    with serve(random_ckpt, settings=settings) as srv:
        report = run_chaos(srv, seed=11, n=60, spread_s=spread_s, timeout_s=8.0, mix=mix)
    print(report.counts, report.engine_stats)
    assert not report.ok, report.engine_stats  # e.g. nothing was preempted: the fault was never reached
    assert any(needle in p for p in report.problems), report.problems


def test_pressure_burst_preempts_and_recovers(random_ckpt, monkeypatch):
    """The stall fault's burst, with no fault: it really preempts (so the fault is reached), and every
    preempted request comes back to its exact answer (so "stalled" above is the fault's, not the burst's)."""
    _steps_wait_for_a_burst(monkeypatch, CHAOS_SETTINGS["max_seqs"] * 2)
    with serve(random_ckpt, settings=PRESSURE_SETTINGS) as srv:
        report = run_chaos(srv, seed=11, n=60, spread_s=0.0, timeout_s=8.0, mix=PRESSURE)
    print(report.counts, report.engine_stats)
    assert report.ok, report.problems
    stats = report.engine_stats
    assert stats["preempt_suspend"] + stats["preempt_drop"] > 0 and stats["resumed"] > 0, stats
    assert report.counts.get("completed", 0) == 60, report.counts
