"""Memory pressure, the scheduler's side: room for admission, preemption, resume, and prefix pins.

The rules (DESIGN §4, §6 invariant 7): a request is admitted or resumed only when a slot and pages for
its next chunk (plus a small watermark for the others' growth) are really free; when pages run short,
the cheapest running request to rebuild gives way (suspend to host memory > drop for an exact
recompute > fail alone, loudly); parked requests come back oldest first; and pages that parked
requests' pinned prefix snapshots keep never stall the requests that are running.

A mixin of ``Scheduler`` (kept apart so the planning loop reads as phases): it uses the scheduler's
queues (``running``, ``parked``, ``waiting``), its cache, prefix reuse and statistics, and its
``_finish`` / ``_enter_running`` / ``_images``.
"""

from __future__ import annotations

import logging

from .request import Request, RequestStatus

log = logging.getLogger("ds4serve.scheduler.scheduler")  # one logger name for the scheduler's decisions


class MemoryPressure:
    def _release_a_pin(self) -> bool:
        """Free pages that pinned prefix snapshots keep from running requests (DESIGN §6 invariant 7).

        A request that skipped images through a prefix hit pins that snapshot so that a recompute can
        come back through it; while it is parked the pinned pages are no one's to use, and if the oldest
        running request needs them nobody would move again. Newest first: a suspended request gives its
        pin up (its host snapshot restores it; it is no longer droppable then); a dropped one cannot come
        back without it and fails alone, loudly."""
        pinned = [r for r in self.parked if r.prefix is not None and r.prefix.pinned is not None]
        if not pinned:
            return False
        suspended = [r for r in pinned if r.status is RequestStatus.SUSPENDED]
        victim = max(suspended or pinned, key=lambda r: r.arrival)
        if victim.status is RequestStatus.SUSPENDED:
            self.reuse.release(victim)
            log.info("released the prefix pin of suspended %s: running requests need its pages", victim.request_id)
        else:
            log.warning("failing parked %s: its recompute needs a pinned prefix snapshot whose pages running "
                        "requests need", victim.request_id)
            self._finish(victim, RequestStatus.FINISHED_ERROR,
                         error="out of cache memory: this request's images were served from the prefix cache, "
                               "and the cached state it needs to resume had to be given to older requests")
        return True

    def _resume_parked(self) -> None:
        for req in list(self.parked):
            if self.waiting and self.waiting[0].arrival < req.arrival:
                break
            if not self._resume(req):
                break

    def _resume(self, req: Request) -> bool:
        if req.status is RequestStatus.SUSPENDED:
            if self.cache.free_pages < req.suspended.n_pages + self._watermark():
                return False
            slot = self.cache.restore(req.suspended)
            if slot is None:
                return False
            req.suspended = None
        else:
            if not self._has_room_for(req):
                return False
            req.slot = slot = self.cache.alloc_slot()
            # a recompute may come back through the prefix cache; one whose images were skipped by its
            # first hit must (their rows were never made): it waits until its pinned snapshot attaches
            if not self.reuse.attach(req, first=False) and req.first_image:
                self.cache.drop(slot)
                req.slot = None
                return False
        req.slot = slot
        req.proposal_at = -1  # a model drafter's block belongs to the slot it was drafted in (model_drafts.take)
        req.unfollowed_at = -1  # its rings are rebuilt or checked afresh in the new slot (ModelDrafts' ready)
        self.parked.remove(req)
        self._enter_running(req)
        self.stats["resumed"] += 1
        return True

    def _has_room_for(self, req: Request) -> bool:
        """A slot, and pages for its first chunk plus a small watermark (see ``_watermark``). Admission
        is optimistic like vLLM's: growth beyond that is handled by preemption."""
        if self.cache.free_slots == 0:
            return False
        if req.images and not req.images_submitted and \
                self.image_bytes_used + req.image_bytes > self.limits.image_rows_budget:
            return False
        first = min(req.pending, self.limits.max_prefill_tokens) + req.computed
        return self.cache.layout.pages_for(first) + self._watermark() <= self.cache.free_pages

    def recomputable(self, req: Request) -> bool:
        """Whether dropping ``req`` loses nothing (see ``Request.recomputable_from``): images a prefix hit
        skipped come back only through the snapshot it pins, so without that pin it is not."""
        if req.first_image and (req.prefix is None or req.prefix.pinned is None):
            return False
        return req.recomputable_from(self._images(req))

    def _watermark(self) -> int:
        """Pages kept free for the running requests' growth: 1% of the pool, at least one page. With
        nothing running there is no growth to protect, and keeping the page would strand a request
        that needs the whole pool (admission allows that) in the queue forever."""
        return max(1, self.cache.state.n_pages // 100) if self.running else 0

    def _preempt(self, holding_pages: bool = False, among: list[Request] | None = None) -> bool:
        """Free one running request's slot and pages (suspend > drop > fail alone). Never a request
        inside a pass (its staged layers would be lost mid-pass). For page growth the victim is the
        cheapest to rebuild: text before image requests, then the newest. With ``holding_pages``
        (page starvation, DESIGN §6 invariant 7) it is the newest of ``among`` that owns pages."""
        victims = [r for r in (self.running if among is None else among)
                   if r.pass_id is None and self.cache.state.pages.owned(r.slot) > 0]  # else nothing is freed
        if holding_pages:
            if len(victims) < 2:
                return False  # a lone holder can always get the rest of the pool: keep it
            victim = max(victims, key=lambda r: r.arrival)
        elif victims:
            victim = min(victims, key=lambda r: (bool(r.images), -r.arrival))
        else:
            return False
        self.running.remove(victim)
        victim.preemptions += 1
        snap = self.cache.suspend(victim.slot, victim.computed)
        if snap is not None:
            victim.suspended, victim.status = snap, RequestStatus.SUSPENDED
            self.stats["preempt_suspend"] += 1
        elif self.recomputable(victim):
            self.cache.drop(victim.slot)
            victim.computed, victim.status = 0, RequestStatus.PARKED
            self.stats["preempt_drop"] += 1
        else:
            self.running.append(victim)  # _finish frees it
            self.stats["preempt_fail"] += 1
            self._finish(victim, RequestStatus.FINISHED_ERROR,
                         error="out of cache memory: this request holds image rows that are not retained, so it "
                               "can neither be suspended (host budget full) nor recomputed")
            return True
        log.info("preempted %s (%s) to free pages", victim.request_id, victim.status.value)
        victim.slot = None
        self.parked.append(victim)
        self.parked.sort(key=lambda r: r.arrival)
        return True
