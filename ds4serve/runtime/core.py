"""EngineCore: one step of scheduler + engine + cache, on one thread.

A core is constructed from finished parts: ``assemble.py`` resolves the sizes, builds the cache,
the engine and the encoder worker (``parts.EngineParts``), warms them up and calibrates the step
budget on them, then hands them over with the final ``SchedulerLimits``; the core adds the scheduler.
``assemble.assemble_core`` (a loaded model) and ``assemble.load_core`` (a checkpoint) are the ways in.

``step()`` is one iteration: schedule a plan, check it, execute it, check the result against the
plan, fold it back. Used synchronously by ``LLM.generate`` and from the engine-loop thread by
``EngineLoop``: the same code either way. Only that one thread touches a core after start-up; what
other threads may read is ``stats``, the ``EngineStats`` snapshot the core publishes at construction
and after every step, add, abort and prefix reset (``stats.py``).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Mapping

from ..engine.parallel_executor import RankFailure
from ..engine.model_drafts import ProposeTiming
from ..engine.plan import StepPlan, StepResult, member_problems, validate_plan, validate_step_result
from ..multimodal.layout import TokenType
from ..scheduler.admission import FitLimits, fit
from ..scheduler.drafting import DraftPolicy
from ..scheduler.request import Request, RequestOutput
from ..scheduler.scheduler import Scheduler, SchedulerLimits
from ..scheduler.spec import RequestSpec
from .parts import EngineParts
from .sizing import Resolved
from .stats import EngineStats, StepRecord, StepTally, frozen

log = logging.getLogger(__name__)

_NO_PREFIX = {"enabled": False, "hits": 0, "misses": 0, "hit_tokens": 0, "queried_tokens": 0, "stored": 0,
              "evictions": 0, "snapshots": 0, "cached_pages": 0, "cached_bytes": 0, "budget_bytes": 0}


class FatalStepError(RuntimeError):
    """The engine broke the step contract; the core refuses further work (state may be corrupt)."""


class EngineCore:
    def __init__(self, parts: EngineParts, limits: SchedulerLimits, startup: Mapping[str, float] | None = None,
                 drafting: DraftPolicy | None = None):
        """``parts``: built, warmed up and calibrated by ``assemble``; ``limits``: final (calibrated);
        ``startup``: seconds per start-up phase so far (see ``describe_startup``); ``drafting``: the
        speculative drafter (``runtime/speculation.py``), None for none."""
        self.cfg, self.settings, self.device = parts.cfg, parts.settings, parts.device
        self.resolved: Resolved = parts.resolved
        self.cache, self.executor, self.encoder = parts.cache, parts.executor, parts.encoder
        self.parallel, self.eos_ids = parts.parallel, parts.eos_ids
        self.limits = limits
        self.scheduler = Scheduler(limits, self.cache, self.encoder, drafting)
        self.startup: dict[str, float] = dict(startup or {})
        self.image_slot_id = self.cfg.vocab_size + int(TokenType.IMAGE) if self.cfg.vision.enabled else None
        self.broken: str | None = None
        self.history: deque[StepRecord] = deque(maxlen=4096)
        self._parts = parts
        self._ids = itertools.count(1)
        self._tally = StepTally()
        self._drafting: tuple[StepPlan, StepResult] | None = None  # a step whose drafter blocks are pending
        self.executor.overlap_drafts = True  # this core settles them (``_settle``) before it plans again
        self.stats: EngineStats = self._snapshot()

    # ---- requests ------------------------------------------------------------------------------
    def make_request(self, spec: RequestSpec, request_id: str | None = None) -> Request:
        """The scheduler's ``Request`` for ``spec`` (an id is made up when none is given)."""
        return Request(request_id or f"req-{next(self._ids)}", spec, eos_ids=self.eos_ids)

    @property
    def fit_limits(self) -> FitLimits:
        """The numbers every fit check reads (the scheduler's; any thread may ask)."""
        return self.scheduler.fit_limits

    def fit(self, spec: RequestSpec) -> str | None:
        """Why ``spec`` can never run here (None: it can): ``admission.fit``, as ``Scheduler.add`` asks it."""
        return fit(spec, self.fit_limits)

    def add(self, req: Request) -> None:
        if self.broken:
            raise FatalStepError(self.broken)
        try:
            self.scheduler.add(req)
        finally:  # a refusal counts too
            self.stats = self._snapshot()

    def abort(self, request_id: str, reason: str | None = None) -> bool:
        """Cancel a request now: its slot, pages and snapshot are free on return; a pass left without
        members is retired by the next plan (``has_work`` stays true until then)."""
        found = self.scheduler.abort(request_id, reason)
        self.stats = self._snapshot()
        return found

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ---- one iteration -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.broken:
            raise FatalStepError(self.broken)
        self._settle()
        record = None
        try:
            outs, record = self._step()
            return outs
        finally:
            self._tally.count(record)
            self.stats = self._snapshot()
            if not self.scheduler.has_work:  # nobody left to plan for: no job left on the worker either
                self._settle()

    def _settle(self) -> None:
        """Collect the blocks the last step's drafter drafted on the host pool's worker while the step was
        applied and handed out (``Executor.settle_drafts``), before anything plans with them. A drafter
        that fails there leaves those requests without a block (they decode plainly), logged."""
        if self._drafting is None:
            return
        plan, result = self._drafting
        self._drafting = None
        t0 = time.perf_counter()
        try:
            proposals, timing = self.executor.settle_drafts()
        except Exception:  # noqa: BLE001 - a drafter's failure costs its blocks, not the requests
            log.exception("step %d: the drafter's next blocks failed; those requests decode without drafts",
                          plan.step_id)
            proposals, timing = {}, ProposeTiming()
        self.scheduler.settle_drafts(plan, result, proposals, time.perf_counter() - t0, timing)

    def _step(self) -> tuple[list[RequestOutput], StepRecord | None]:
        plan = self.scheduler.schedule()
        if plan is None:
            return self.scheduler.take_outputs(), None
        problem = validate_plan(plan, self.cfg.num_layers)
        if problem:
            self._break(f"scheduler produced an invalid plan: {problem}")
        refused = member_problems(plan, self.cache.staging_rows, self.image_slot_id)
        if refused:  # confined to those members: they fail alone, the rest is planned again
            return self.scheduler.refuse(plan, refused), None
        try:
            result = self.executor.step(plan)
        except RankFailure as exc:  # a tensor-parallel rank died or hangs: nothing can be agreed any more
            self._break(str(exc))
        problem = validate_step_result(plan, result, self.cfg.num_layers)
        if problem:
            self._break(f"step {plan.step_id}: result does not match its plan: {problem}")
        record = StepRecord(plan.step_id, len(plan.decodes), sum(p.rows for p in plan.passes),
                            plan.row_layers(self.cfg.num_layers), result.elapsed_s)
        self.history.append(record)
        outs = self.scheduler.apply(plan, result)
        if result.drafting:
            self._drafting = (plan, result)
        return outs, record

    def _break(self, why: str) -> None:
        log.critical("fatal step error: %s", why)
        self.broken = why
        for rid in list(self.scheduler.requests):
            self.scheduler.abort(rid, reason=f"engine stopped after a fatal step error: {why}")
        raise FatalStepError(why)

    def run_until_idle(self, max_steps: int = 10**9) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        for _ in range(max_steps):
            if not self.has_work:
                break
            outs.extend(self.step())
        outs.extend(self.scheduler.take_outputs())
        return outs

    def describe_startup(self) -> str:
        """How long start-up took, per phase (load, engine, self-check, warm-up, calibration)."""
        parts = ", ".join(f"{name} {sec:.1f} s" for name, sec in self.startup.items())
        return f"start-up took {sum(self.startup.values()):.1f} s: {parts}"

    def close(self) -> None:
        """Stop the encoder worker and the other ranks (the engine loop owns everything else)."""
        self._settle()
        self._parts.close()

    # ---- the prefix cache and the published figures ----------------------------------------
    def reset_prefix_cache(self) -> int:
        """Empty the prefix cache (snapshots pinned by live requests stay); returns how many went."""
        prefix = self.cache.prefix
        dropped = prefix.reset() if prefix is not None else 0
        self.stats = self._snapshot()
        return dropped

    def prefix_stats(self) -> dict:
        """Prefix-cache counters for metrics and logs (``enabled`` False: caching is off)."""
        prefix = self.cache.prefix
        return dict(_NO_PREFIX) if prefix is None else {"enabled": True, **prefix.summary()}

    def _snapshot(self) -> EngineStats:
        """The figures as they stand now (this core's thread; published as ``stats``)."""
        cache, tally = self.cache, self._tally
        return EngineStats(
            requests=frozen(self.scheduler.counts()), counters=frozen(self.scheduler.stats),
            slots_in_use=cache.n_slots - cache.free_slots, slots_total=cache.n_slots,
            pages_in_use=cache.state.pages.used_pages, pages_total=cache.state.n_pages, host_used=cache.host_used,
            prefix=frozen(self.prefix_stats()), steps=tally.steps, decode_steps=tally.decode_steps,
            decode_rows=tally.decode_rows, prefill_rows=tally.prefill_rows, decode_width=tally.width,
            speculation=frozen(self.scheduler.spec))

    def leaks(self) -> str:
        """'' if every slot, page, snapshot byte and pass is accounted for by live requests."""
        self._settle()
        sched = self.scheduler
        holders = [r for r in sched.requests.values() if r.images_submitted]
        problems = self._parts.leaks(
            live_slots=sched.live_slots(),
            live_passes={r.pass_id for r in sched.running if r.pass_id is not None} | set(sched.retiring),
            live_encodes={r.request_id for r in holders},
            snapshot_bytes=sum(r.suspended.nbytes for r in sched.parked if r.suspended is not None))
        held = sum(r.image_bytes for r in holders)
        if self.encoder is not None and held != sched.image_bytes_used:
            problems.append(f"image rows accounted {sched.image_bytes_used} B, held {held} B")
        return "; ".join(problems)


__all__ = ["EngineCore", "FatalStepError", "Resolved", "StepRecord"]
