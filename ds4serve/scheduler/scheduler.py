"""Policy: admission, queueing, chunk planning, passes, preemption and fairness.

Each iteration ``schedule()`` builds one ``StepPlan`` in phases (each one helper):

1. resume parked/suspended requests, oldest first, then admit waiting ones (FIFO) while a slot and pages are free;
2. plan every decoder of the step's *lane* exactly once, reserving its page growth; when pages are short,
   escalate on the cheapest running request to rebuild (text before images, then the newest; never one
   inside a pass): suspend it to host memory, else drop it for recompute (only if its whole input is
   retained), else fail it alone with a clear error;
3. spend what is left of the step budget (row-layers) on prefill: passes in flight advance by layer slices,
   new text prefill advances by token chunks (or starts a layer-sliced pass); with no decoder live a
   prefill runs whole.

The lane is everybody, except after a failed step: then suspects run in steps of their own (see
``isolation.py``). ``apply(result)`` folds a step's result back into request state and returns the outputs
to stream; a failed step is undone there. Only this class changes a request's status.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, deque

from ..cache.manager import CacheManager
from ..engine.encoder import EncoderWorker, ImageState
from ..multimodal.chunking import next_chunk
from ..engine.plan import (DecodeRow, PassMember, PassSlice, RowStatus, StepPlan, StepResult,
                           StepStatus)
from .drafting import DraftPolicy, count_draft
from .draft_guard import DraftGuard
from .step_costs import StepCosts
from .admission import FitLimits, QueueFull, RequestTooLarge, SchedulerLimits, fit, image_bytes
from .isolation import Quarantine
from .passes import PassTable
from . import prompt_scores
from .pressure import MemoryPressure
from .speculation import Speculation
from .request import Request, RequestOutput, RequestStatus
from .reuse import PrefixReuse

log = logging.getLogger(__name__)

__all__ = ["QueueFull", "RequestTooLarge", "Scheduler", "SchedulerLimits"]  # refusals live in admission


class Scheduler(MemoryPressure, Speculation):
    def __init__(self, limits: SchedulerLimits, cache: CacheManager, encoder: EncoderWorker | None = None,
                 drafting: DraftPolicy | None = None):
        self.limits = limits
        self.drafting = drafting  # speculative decoding's drafter and limits; None: no drafts
        self.step_costs = StepCosts(limits.step_costs)  # what a decode step costs, learnt as it runs
        self.draft_guard = DraftGuard()  # whether drafting steps really beat plain ones, per width
        self._planned_at = time.perf_counter()
        self._unobserved: float | None = None  # seconds of a step whose drafter blocks are pending (``settle_drafts``)
        self._schedules = 0
        self.cache = cache
        self.encoder = encoder  # DS4V checkpoints: asked which images are ready (``ready``), else None
        self.image_bytes_used = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # hold a slot, in arrival order
        self.parked: list[Request] = []  # SUSPENDED or PARKED, in arrival order
        self.requests: dict[str, Request] = {}
        self.passes = PassTable(limits.num_layers)
        self._step_ids = itertools.count(1)
        self._outputs: list[RequestOutput] = []
        self.quarantine = Quarantine()
        self.reuse = PrefixReuse(cache, limits.prefix_interval)
        self.stats = {"added": 0, "preempt_suspend": 0, "preempt_drop": 0, "preempt_fail": 0, "rejected": 0,
                      "resumed": 0, "completed": 0, "aborted": 0, "failed": 0, "aborted_in_pass": 0,
                      "step_failures": 0, "recomputed_after_failure": 0, "isolated_failures": 0,
                      "refused_before_compute": 0}
        self._page_starved = False  # set by planning when a prefill chunk could not get its pages
        self.spec: Counter[str] = Counter()  # drafted / accepted tokens, in total and per draft position

    # ---- intake --------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue ``req``; ``RequestTooLarge`` when ``fit`` says it can never run here, ``QueueFull`` at the
        bound (both counted as rejected), ``ValueError`` for a duplicate id."""
        problem = fit(req.spec, self.fit_limits)
        if problem:
            self.stats["rejected"] += 1
            raise RequestTooLarge(problem)
        if self.in_flight >= self.cache.n_slots + self.limits.max_queue:
            self.stats["rejected"] += 1
            raise QueueFull(f"the queue is full ({self.limits.max_queue} waiting requests)")
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id}")
        req.image_bytes = image_bytes(req.images, self.fit_limits)
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self.stats["added"] += 1

    @property
    def in_flight(self) -> int:
        """Requests admitted and not finished. The bound is ``max_seqs + max_queue`` of these (the
        loop's up-front check counts the same), not ``max_queue`` of ``waiting``: requests that arrive
        together, before a step moves them to free slots, all sit in ``waiting`` for a moment, and a
        burst must not be refused while slots are free."""
        return len(self.running) + len(self.parked) + len(self.waiting)

    @property
    def fit_limits(self) -> FitLimits:
        """The numbers ``fit`` decides by, from the limits, cache and encoder this scheduler has now
        (derived on each call, so a test that swaps in other limits or an encoder is asked consistently)."""
        return FitLimits(max_model_len=self.limits.max_model_len, page_tokens=self.cache.layout.page_tokens,
                         n_pages=self.cache.state.n_pages, max_prefill_tokens=self.limits.max_prefill_tokens,
                         image_rows_budget=self.limits.image_rows_budget,
                         image_row_bytes=self.encoder.row_bytes(1) if self.encoder is not None else 0)

    def abort(self, request_id: str, reason: str | None = None) -> bool:
        """Cancel a request at any point; its slot, pages, snapshot or pass are freed now."""
        req = self.requests.get(request_id)
        if req is None or req.status.finished:
            return False
        status = RequestStatus.FINISHED_ABORT if reason is None else RequestStatus.FINISHED_ERROR
        self._finish(req, status, error=reason)
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.parked or self.passes.retiring)

    @property
    def retiring(self) -> set[int]:
        """Passes left without members that the next plan retires."""
        return self.passes.retiring

    def take_outputs(self) -> list[RequestOutput]:
        out, self._outputs = self._outputs, []
        return out

    # ---- planning ------------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        self._planned_at = self.step_costs.planned()  # a decode step's cost runs from here to the end of apply
        self._schedules += 1  # drafting probes on multiples of PROBE_EVERY of this count
        self._resume_parked()
        self._admit_waiting()
        decodes, passes = [], []
        for lane in self.quarantine.lanes():
            decodes, passes = self._plan_lane(lane)
            if decodes or passes:
                break
        self._note_unfollowed(decodes, passes)
        retired = self.passes.take_retired()
        plan = StepPlan(step_id=next(self._step_ids), decodes=tuple(decodes), passes=tuple(passes),
                        retired=retired)
        return None if plan.is_empty else plan

    def _lane(self, lane: int | None) -> list[Request]:
        """Running requests that may share this step: everybody but suspects, or one suspect group."""
        return [r for r in self.running if r.suspect == lane]

    def _plan_lane(self, lane: int | None) -> tuple[list[DecodeRow], list[PassSlice]]:
        while True:
            self._page_starved = False
            decodes = self._plan_decodes(lane)
            passes = self._plan_prefill(sum(d.rows for d in decodes), lane)
            holders = self._lane(lane)
            if decodes or passes or not self._page_starved:
                return decodes, passes
            # every running request is prefilling and none can get pages for its next chunk: nobody
            # would ever move again (each holds pages the others need). Free the newest so the
            # oldest goes on; nothing was reserved by the empty plan, so planning again is safe.
            if len(holders) >= 2 and self._preempt(holding_pages=True, among=holders):
                continue
            # a lone page holder is starved only by pages that parked requests' pinned snapshots keep
            if not self._release_a_pin():
                return decodes, passes

    def _admit_waiting(self) -> None:
        while self.waiting and not self.parked and self._has_room_for(self.waiting[0]):
            req = self.waiting.popleft()
            req.slot = self.cache.alloc_slot()
            self.reuse.attach(req, first=True)
            if req.images:
                self.encoder.submit(req.request_id, req.images[req.first_image:])  # admission order
                req.images_submitted = True
                self.image_bytes_used += req.image_bytes
            self._enter_running(req)

    def _images(self, req: Request) -> tuple[ImageState, ...]:
        """The one question asked of the encoder: where each of this request's images stands."""
        return self.encoder.ready(req.request_id) if req.images_submitted else ()

    def _enter_running(self, req: Request) -> None:
        req.status = RequestStatus.DECODING if req.pending == 1 else RequestStatus.PREFILLING
        self.running.append(req)
        self.running.sort(key=lambda r: r.arrival)
        if prompt_scores.prompt_only_done(req):  # max_tokens 0 with nothing to compute (a one-token prompt)
            self._finish(req, RequestStatus.FINISHED_LENGTH)

    def _plan_decodes(self, lane: int | None) -> list[DecodeRow]:
        while True:
            decoders = [r for r in self._lane(lane) if r.status is RequestStatus.DECODING]
            drafts = self._drafts(decoders, lane)
            growth = {r.slot: r.computed + 1 + len(drafts.get(r.request_id, ())) for r in decoders}
            reserved = bool(drafts) and self.cache.reserve(growth)
            if drafts and not reserved:  # no pages for the drafts: decode without them
                drafts, growth = {}, {r.slot: r.computed + 1 for r in decoders}
            if reserved or self.cache.reserve(growth):
                break
            if not self._preempt():
                break
        return [DecodeRow(r.request_id, r.slot, r.computed, r.output_ids[-1] if r.output_ids else r.prompt_ids[-1],
                          r.sampler, drafts.get(r.request_id, ()), *turn)
                for r, turn in zip(decoders, self._turns(decoders, len(decoders)))]

    def _plan_prefill(self, decode_rows: int, lane: int | None = None) -> list[PassSlice]:
        """``decode_rows``: the decoders' rows this step (drafts included; a draft row costs a decode row)."""
        L = self.limits.num_layers
        idle = decode_rows == 0
        budget = max(0, self.limits.prefill_tokens(decode_rows) * L)
        floor = self.limits.min_prefill_tokens * L  # progress guaranteed even under a full decode budget
        slices = []
        for p in self.passes.in_flight(lane):
            layers = L - p.cursor if idle else max(1, min(L - p.cursor, max(budget, floor) // p.rows))
            slices.append(PassSlice(p.pass_id, p.cursor, p.cursor + layers, p.members))
            budget -= p.rows * layers
            floor = 0
        tokens_left = self.limits.max_prefill_tokens if idle else max(budget, floor) // L
        by_layers = self.limits.prefill_mode == "layers" and not idle
        group: list[tuple[Request, PassMember]] = []
        for req in [r for r in self._lane(lane) if r.status is RequestStatus.PREFILLING and r.pass_id is None]:
            if req.images:
                n, with_block = self._image_chunk(req, self.limits.max_prefill_tokens if idle else tokens_left)
                if n == 0:
                    continue  # its next block's image is still encoding (or it just failed)
                if with_block:  # whole blocks go through a shared image pass
                    rows = sum(len(m.ids) for _, m in group)
                    if group and rows + n > self.limits.max_prefill_tokens:
                        continue
                    if self.cache.reserve({req.slot: req.computed + n}):
                        group.append((req, self._member(req, n)))
                    else:
                        self._page_starved = True
                    continue
                n = min(n, tokens_left)  # a text stretch before the next block: an ordinary chunk
            else:
                if tokens_left <= 0 or (by_layers and max(budget, floor) <= 0):
                    continue
                # token chunking: as many tokens as the budget holds, all layers now; layer slicing:
                # one whole chunk as a pass, as many layers as the budget holds
                n = min(req.pending, self.limits.max_prefill_tokens, self.limits.max_prefill_tokens if by_layers
                        else tokens_left)
            if n <= 0:
                continue
            if not self.cache.reserve({req.slot: req.computed + n}):
                self._page_starved = True
                continue
            layers = max(1, min(L, max(budget, floor) // n)) if by_layers else L
            slices.append(self.passes.start([req], (self._member(req, n),), layers))
            tokens_left -= n
            budget -= n * layers
            floor = 0
        if group:
            rows = sum(len(m.ids) for _, m in group)
            layers = L if idle else max(1, min(L, max(budget, floor) // rows))
            slices.append(self.passes.start([r for r, _ in group], tuple(m for _, m in group), layers))
        return slices

    def _member(self, req: Request, n: int) -> PassMember:
        lo, hi = req.computed, req.computed + n
        images = ()
        if req.images:
            images = tuple(im.rows for im, sp in zip(self._images(req), req.live_spans)
                           if lo <= sp.start and sp.end <= hi)
        return PassMember(req.request_id, req.slot, lo, req.input_ids(lo, hi), sample=prompt_scores.samples(req, n),
                          sampler=req.sampler, spans=req.spans, image_rows=images, captures=self.reuse.captures(req, lo, hi),
                          follow=self._turns([req], len(self.running))[0][1], **prompt_scores.scoring(req, lo, hi))

    def _image_chunk(self, req: Request, budget: int) -> tuple[int, bool]:
        """Next chunk of an image request: whole blocks only, and only blocks whose rows are ready.

        ``budget``: the step's prefill tokens (all of ``max_prefill_tokens`` when nothing decodes). Beside
        decoders a chunk that reaches a block ends with it (the planner swallows the block and stops): the
        text after the block follows as ordinary token chunks, so the layer-sliced pass holds the block,
        not the question after it, and one of its slices stays near a decode step's length.
        Returns ``(n, contains_a_block)``; ``n == 0`` means wait (or the request just failed)."""
        spans = req.spans
        blocks = [(sp.start, sp.end) for sp in spans]
        lo = req.computed
        budget = max(1, min(budget, self.limits.max_prefill_tokens))
        n = next_chunk(lo, req.total_len, budget, blocks, self.limits.min_prefill_tokens)
        hi = lo + n
        for im, sp in zip(self._images(req), req.live_spans):
            if sp.end <= lo or sp.start >= hi:
                continue
            if not im.ready:
                hi = sp.start  # take what precedes the unready block (a block boundary)
                break
            if im.error is not None:
                self._finish(req, RequestStatus.FINISHED_ERROR, error=im.error)
                return 0, False
        with_block = any(lo <= sp.start and sp.end <= hi for sp in spans)
        return max(0, hi - lo), with_block

    # ---- applying results ------------------------------------------------------------------------
    def apply(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        if result.status is StepStatus.FAILED:
            self._undo_failed_step(plan, result.error or "unknown error")
            return self.take_outputs()
        # prompt logprobs before anything emits: they go out with the request's first output
        bad = {pl.request_id: err for pl in result.prompt_logprobs
               if (err := prompt_scores.fold(self.requests[pl.request_id], pl)) is not None}
        accepted = {t.slot: len(t.accepted) for t in result.tokens}
        for d in plan.decodes:  # its token and the accepted part of its draft are in the cache now
            req = self.requests[d.request_id]
            req.computed += 1 + accepted.get(d.slot, 0)
            if d.draft:
                count_draft(req, d.draft, accepted.get(d.slot, 0), self.spec)
        advanced = [r for p in plan.passes for r in self._advance_pass(p, bad)]
        for rid, err in bad.items():  # its pass is folded in (nothing of it is left in flight): fail it alone
            self._finish(self.requests[rid], RequestStatus.FINISHED_ERROR, error=err)
        for tok in result.tokens:
            req = self.requests.get(tok.request_id)
            if req is None:  # failed just above
                continue
            if tok.status is RowStatus.FAILED:
                self._finish(req, RequestStatus.FINISHED_ERROR, error=tok.error)
                continue
            last = (tok.logprob, tok.top_logprobs or ()) if tok.logprob is not None else None
            self._accept(req, (*tok.accepted, tok.token), (*tok.accepted_logprobs, last))
            req.proposal, req.proposal_at = tok.proposal, req.computed  # drafted for its next decode row
            req.proposal_survival = tok.proposal_survival
        for req in advanced:
            if not req.status.finished:  # finished ones were snapshotted (or not, on errors) by _finish
                self.reuse.after_prefill(req)
        for rid in plan.request_ids:
            req = self.requests.get(rid)
            if req is not None and req.suspect is not None and req.computed >= req.clear_at:
                self.quarantine.clear(req)
        if self.drafting is not None:
            seconds = time.perf_counter() - self._planned_at
            if result.drafting:  # observed once its blocks are in (``settle_drafts``)
                self._unobserved = seconds
            else:
                self._observe_step(plan, result, seconds)
        self.step_costs.applied()
        return self.take_outputs()

    def refuse(self, plan: StepPlan, problems: dict[str, str]) -> list[RequestOutput]:
        """Members of ``plan`` were refused before compute: fail those requests alone. Nothing of the
        plan ran and nothing was advanced, so the others are simply planned again next step."""
        self.passes.retire_later(plan.retired)
        for rid, why in problems.items():
            req = self.requests.get(rid)
            if req is not None:
                log.error("request %s refused before compute: %s", rid, why)
                self.stats["refused_before_compute"] += 1
                self._finish(req, RequestStatus.FINISHED_ERROR, error=f"internal error: refused before compute: {why}")
        return self.take_outputs()

    def _undo_failed_step(self, plan: StepPlan, error: str) -> None:
        """The step raised: its members' state is suspect. Drop and recompute them (their whole input
        is retained; sampling is counter-based, so nothing else advanced), as suspects that run apart
        from everybody else until cleared; fail alone only one that fails again on its own."""
        self.stats["step_failures"] += 1
        for rid in plan.request_ids:
            if rid in self.requests:
                self.reuse.drop_pending(self.requests[rid])  # their snapshot copies are suspect too
        for p in plan.passes:
            self.passes.forget(p.pass_id)  # the engine forgot them when the step failed
        members = sorted((self.requests[rid] for rid in plan.request_ids if rid in self.requests),
                         key=lambda r: r.arrival)
        if not members:
            return
        ends = {d.request_id: d.position + 1 for d in plan.decodes}
        ends.update({m.request_id: m.start + len(m.ids) for p in plan.passes for m in p.members})
        lane = members[0].suspect
        log.error("step %d failed (%s); undoing it for %d request(s)%s: %s", plan.step_id, error, len(members),
                  "" if lane is None else f" of suspect group {lane}", ", ".join(r.request_id for r in members))
        alone = self.quarantine.suspect(members, lane)
        for r in members:
            if r in alone:
                self.stats["isolated_failures"] += 1
                self._finish(r, RequestStatus.FINISHED_ERROR,
                             error=f"internal error: this request's step failed again when it ran alone: {error}")
            else:
                self._recompute_after_failure(r, ends[r.request_id], error)

    def _recompute_after_failure(self, req: Request, end: int, error: str) -> None:
        req.clear_at = max(req.clear_at, end)
        if not self.recomputable(req):
            self.quarantine.clear(req)
            self._finish(req, RequestStatus.FINISHED_ERROR,
                         error=f"internal error in a step ({error}); this request cannot be recomputed because its "
                               f"image rows are not retained")
            return
        self.running.remove(req)
        req.pass_id = None
        self.cache.drop(req.slot)
        req.slot, req.computed, req.status = None, 0, RequestStatus.PARKED
        self.parked.append(req)
        self.parked.sort(key=lambda r: r.arrival)
        self.stats["recomputed_after_failure"] += 1

    def _advance_pass(self, p: PassSlice, bad: dict[str, str]) -> list[Request]:
        """Fold a slice in; returns the members whose pass completed (their chunk is in the cache).
        ``bad``: members whose prompt logprobs failed (``apply`` fails them next; none finishes here)."""
        if not self.passes.advanced(p):
            return []
        done = []
        for m in p.members:
            req = self.requests[m.request_id]
            req.pass_id = None
            req.computed += len(m.ids)
            done.append(req)
            if req.status.finished:
                continue
            if prompt_scores.prompt_only_done(req) and req.request_id not in bad:
                self._finish(req, RequestStatus.FINISHED_LENGTH)
            elif req.pending == 1 and not m.sample:
                req.status = RequestStatus.DECODING
        return done

    def _accept(self, req: Request, tokens: tuple[int, ...], lps: tuple) -> None:
        """Commit a decoder's tokens of this step: its draft's accepted run, then its own token (``lps``:
        each one's ``(logprob, top)`` or None). A stop id or the length limit inside the run ends the
        request there; what was committed goes out as one output (a drafted run streams as one chunk: one
        output a token cost the serving loop a detokenize and a message each)."""
        if req.status.finished:
            return
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        p = req.params
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_ids))
        status, n = RequestStatus.DECODING, 0
        for token, lp in zip(tokens, lps):
            req.output_ids.append(token)
            req.output_logprobs.append(lp)
            n += 1
            n_out = len(req.output_ids)
            if token in stop_ids and n_out >= p.min_tokens:
                status = RequestStatus.FINISHED_STOP
                break
            if n_out >= p.max_tokens or req.total_len >= self.limits.max_model_len:
                status = RequestStatus.FINISHED_LENGTH
                break
        new = (tuple(tokens[:n]), tuple(lps[:n]) if all(lp is not None for lp in lps[:n]) else None)
        if status is RequestStatus.DECODING:
            req.status = status
            self._emit(req, *new)
        else:
            self._finish(req, status, new=new)

    def _emit(self, req: Request, tokens: tuple[int, ...], logprobs) -> None:
        self._outputs.append(RequestOutput(
            request_id=req.request_id, new_token_ids=tokens, logprobs=logprobs, finished=req.status.finished,
            finish_reason=req.status.finish_reason, error=req.error, prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids), cached_tokens=req.cached_tokens,
            prompt_logprobs=prompt_scores.take(req)))

    def _finish(self, req: Request, status: RequestStatus, error: str | None = None, new=None) -> None:
        """End a request and free everything it holds (slot, pages, snapshot, pass, image rows)."""
        self.reuse.at_finish(req, completed=status in (RequestStatus.FINISHED_STOP, RequestStatus.FINISHED_LENGTH)
                             and req in self.running)
        if req.images_submitted:
            self.encoder.cancel(req.request_id)
            self.image_bytes_used -= req.image_bytes
            req.images_submitted = False
        if req in self.running:
            self.running.remove(req)
            if req.pass_id is not None:
                self.stats["aborted_in_pass"] += status is RequestStatus.FINISHED_ABORT
                self.passes.leave(req)
            self.cache.drop(req.slot)
            req.slot = None
        elif req in self.parked:
            self.parked.remove(req)
            if req.suspended is not None:
                self.cache.release_suspended(req.suspended)
                req.suspended = None
        elif req in self.waiting:
            self.waiting.remove(req)
        self.quarantine.clear(req)
        req.status, req.error = status, error
        key = {RequestStatus.FINISHED_ABORT: "aborted", RequestStatus.FINISHED_ERROR: "failed"}.get(status, "completed")
        self.stats[key] += 1
        if new is None:
            self._emit(req, (), None)
        else:  # the tokens committed in the step that ended it, and their logprobs (None: not asked)
            self._emit(req, *new)
        self.requests.pop(req.request_id, None)

    # ---- introspection ---------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        by = {s: 0 for s in RequestStatus if not s.finished}
        for r in self.running + self.parked + list(self.waiting):
            by[r.status] += 1
        return {s.value: n for s, n in by.items()} | {"passes": len(self.passes)}

    def live_slots(self) -> set[int]:
        return {r.slot for r in self.running}
