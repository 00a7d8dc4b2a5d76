"""Speculative drafts, the scheduler's side: which decoders carry a draft this step, and what the drafter
does next (``drafting.DraftPolicy`` decides; this asks it with the step's figures).

Drafts take only the rows the step's prefill leaves. The cost rule (``step_costs``) times decode-only
steps, where a draft row competes with the other decode rows alone; beside a prompt that is still
prefilling, a draft row displaces a prompt token instead, and that delays the prompt's whole answer (its
first token and every token after it), a cost no decode-step fit sees (a Zen 4 measured 16 streams of
n-gram drafts on the bundled model, all prompts arriving at once, at 0.98x decode but 0.84x end to end;
on an Intel Xeon the same bench lost 0.93x end to end with or without this rule, and the loss there was
the drafts' later rows: ``drafting.rows_that_pay``). A binary rule (no drafts while any prompt
prefills) was tried before and starves drafting where prompts are short and slots turn over fast; the
rows left over beside small prompts are free.

A mixin of ``Scheduler`` (its ``drafting``, ``limits``, ``step_costs``, ``passes``, ``requests``, ``_lane``,
``_images`` and step count).
"""

from __future__ import annotations

from typing import NamedTuple

from ..engine.plan import drafter_captures
from .request import Request, RequestStatus


class Drafter(NamedTuple):
    """A step's checkpoint-drafter figures: its seconds (the prompt rows' read and the blocks' own forward
    among them), the blocks asked for and the blocks drafted."""

    seconds: float
    prompt_s: float
    block_s: float
    proposals: int
    blocks: int


class Speculation:
    def _turns(self, reqs: list[Request], n: int) -> list[tuple[bool, bool]]:
        """``(propose, follow)`` of each of ``reqs`` beside ``n`` decoders (``DraftPolicy.turns``); no block
        is drafted for a step that will run plain (``StepCosts.baseline``), none where drafting steps got
        fewer tokens a second than plain ones (``DraftGuard``)."""
        if self.drafting is None or not self.draft_guard.allows(n):
            return [(False, False)] * len(reqs)
        return self.drafting.turns(reqs, n, self.step_costs.costs(), self.step_costs.draft_cost, self._schedules,
                                   plain_next=self._plain_step(n, self._schedules + 1), per_draft=self.step_costs.per_draft)

    def _plain_step(self, n: int, step: int) -> bool:
        """Whether step ``step`` of ``n`` decoders runs without drafts, to time a plain step of that width
        (``StepCosts.baseline`` for its fit, ``DraftGuard.baseline`` for its comparison)."""
        return self.step_costs.baseline(n, step) or self.draft_guard.baseline(n, step)

    def _drafts(self, decoders: list[Request], lane: int | None = None) -> dict[str, tuple[int, ...]]:
        """Speculative drafts for this step (``drafting.DraftPolicy``), none without a drafter, within the
        rows the prefill of ``lane`` leaves (the module docstring)."""
        if self.drafting is None or not decoders or self._plain_step(len(decoders), self._schedules) \
                or not self.draft_guard.allows(len(decoders)):
            return {}
        return self.drafting.plan(decoders, self.limits, self.step_costs.costs(), self.step_costs.draft_cost,
                                  self._schedules, prefill=lambda: self._prefill_demand(lane),
                                  per_draft=self.step_costs.per_draft)

    def settle_drafts(self, plan, result, proposals: dict, waited: float, timing) -> None:
        """The next blocks of a step whose drafter ran beside its apply (``StepResult.drafting``;
        ``EngineCore._settle``), by slot: onto their requests as ``apply`` puts a step's blocks, and the
        step observed with them: ``waited``, the seconds the engine spent collecting them after the apply,
        are the drafter's and the step's (not the loop's gap); ``timing`` how all its drafter seconds split."""
        for tok in result.tokens:
            p, req = proposals.get(tok.slot), self.requests.get(tok.request_id)
            if p is not None and req is not None and not req.status.finished:
                req.proposal, req.proposal_at, req.proposal_survival = p.tokens, req.computed, p.survival
        if self._unobserved is not None:
            drafter = Drafter(result.draft_s + waited, timing.prompt_s, timing.block_s, result.proposals,
                              sum(1 for t in result.tokens if t.slot in proposals))
            self._observe_step(plan, result, self._unobserved + waited, drafter)
        self._unobserved = None
        self.step_costs.settled(waited)

    def _observe_step(self, plan, result, seconds: float, drafter: Drafter | None = None) -> None:
        """A step's figures for the cost rule and the guard: the drafter's own seconds and blocks
        (``StepCosts.observe_blocks``); for a decode-only step its time without the drafter's
        (``StepCosts.observe``), and with it, with the tokens it committed and whether it verified drafts
        (``DraftGuard``). ``drafter``: its figures where ``result`` lacks them (``settle_drafts``)."""
        d = drafter or Drafter(result.draft_s, result.draft_prompt_s, result.block_s, result.proposals,
                               sum(1 for t in result.tokens if t.proposal))
        drafts = sum(len(row.draft) for row in plan.decodes)
        self.step_costs.observe_blocks(d.seconds - d.prompt_s, d.proposals, drafts, d.block_s)
        if not plan.decodes or plan.passes:
            return
        self.step_costs.observe(len(plan.decodes), drafts, seconds - d.seconds,
                                sum(1 for row in plan.decodes if row.draft))
        self.draft_guard.observe(len(plan.decodes), drafts > 0,
                                 len(plan.decodes) + sum(len(t.accepted) for t in result.tokens), seconds, d.seconds,
                                 followed=any(row.follow or row.propose for row in plan.decodes), blocks=d.blocks)

    def _note_unfollowed(self, decodes, passes) -> None:
        """Positions a checkpoint drafter does not capture this step go out of its rings
        (``Request.unfollowed_at``, which ``DraftPolicy.catches_up`` reads): every decoder's when the merged
        forward runs plain (no decoder follows, proposes or drafts and no whole pass follows:
        ``Executor._captures``), and a prompt chunk's when its pass runs plain (no member follows: the
        drafter's window then lacks the prompt's end, and a request whose answer ends before the window
        fills again was followed and probed for nothing)."""
        if self.drafting is None or self.drafting.source != "model":
            return
        whole = [p for p in passes if p.layer_start == 0 and p.layer_stop == self.limits.num_layers]
        merged = drafter_captures(decodes, whole)
        if not merged:
            for d in decodes:
                self.requests[d.request_id].unfollowed_at = d.position
        for p in passes:
            if p.layer_start or (merged if p.layer_stop == self.limits.num_layers else any(m.follow for m in p.members)):
                continue
            for m in p.members:
                req = self.requests[m.request_id]
                req.unfollowed_at = max(req.unfollowed_at, m.start + len(m.ids) - 1)

    def _prefill_demand(self, lane: int | None) -> int:
        """Prompt tokens ``lane`` could prefill this step: the passes in flight, and each prefilling request's
        next chunk up to its first image whose rows are not ready (that part cannot run yet, and waiting on
        an encoder should not hold every decoder's drafts back)."""
        demand = sum(p.rows for p in self.passes.in_flight(lane))
        for req in self._lane(lane):
            if req.status is not RequestStatus.PREFILLING or req.pass_id is not None:
                continue
            end = req.total_len
            for im, sp in zip(self._images(req), req.live_spans):
                if sp.end > req.computed and not im.ready:
                    end = sp.start
                    break
            demand += min(max(0, end - req.computed), self.limits.max_prefill_tokens)
        return demand
