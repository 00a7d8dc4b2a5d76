"""The step contract between policy (scheduler) and mechanism (engine).

The boundary: each iteration the scheduler hands the engine one frozen ``StepPlan`` and gets back
one frozen ``StepResult``. The plan lists every live decoder exactly once (one token fed, one token
sampled) and slices of prefill *passes* (a pass is a prefill in flight; a slice advances it over a
range of layers). The engine executes the plan and reports one sampled token per decoder, one per
pass member whose prompt ended when its pass completed, and the layer cursor of every pass. A member
that asks for prompt logprobs (``PassMember.prompt_logprobs``) also gets, when its pass completes, the
raw logprob of each of its ``targets`` (``PromptLogprobs``): the LM head runs over all its rows.

Rules:
* One thread owns model state: the engine loop calls ``Executor.step`` and nothing else touches the
  state tensors concurrently.
* Nothing about HTTP, tokenizers or request bookkeeping crosses this boundary; the engine knows
  slots, positions, token ids and sampler state, nothing else.
* ``validate_step_result(plan, result)`` runs on every step; a non-empty answer is a fatal step
  error, never ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass(frozen=True)
class DecodeRow:
    """A live decoder: feed ``token`` at absolute ``position`` in ``slot``, sample one token."""

    request_id: str
    slot: int
    position: int
    token: int
    sampler: Any = field(default=None, compare=False)  # the request's SamplerState (engine advances its RNG)
    # speculative decoding: tokens a drafter proposes after ``token`` (fed at ``position + 1 ...``); the
    # engine verifies them in this step and reports the accepted prefix (``SampledToken.accepted``)
    draft: tuple[int, ...] = ()
    # a checkpoint drafter drafts this sequence's next block after the step (the scheduler's call: a block
    # costs a drafter forward whether or not it is verified)
    propose: bool = True
    # a checkpoint drafter keeps this sequence's committed rows (the forward's captures) this step; a step
    # where no decoder follows and no pass runs skips the capture split: a plain step (``capture.py``)
    follow: bool = True

    @property
    def rows(self) -> int:
        """Rows this decoder feeds: its token and its draft."""
        return 1 + len(self.draft)


@dataclass(frozen=True)
class PassMember:
    """One sequence's rows in a pass: ``ids`` at absolute positions ``start...``."""

    request_id: str
    slot: int
    start: int
    ids: tuple[int, ...]
    sample: bool  # the pass ends this sequence's pending input: sample its next token at the end
    sampler: Any = field(default=None, compare=False)
    spans: tuple = ()  # every image block of the sequence (ImageSpan), for masks and split checks
    # blocks inside this chunk: multimodal.records.ImageRows (IMAGE slot positions, rows in stream order)
    image_rows: tuple = field(default=(), compare=False)
    # prefix-cache snapshots strictly inside the chunk: (position, snapshot arena entry), filled by the
    # forward (cache.view.SeqChunk.captures)
    captures: tuple[tuple[int, int], ...] = ()
    # prompt logprobs: None, or how many top alternatives to report per scored row. ``targets[i]`` is the
    # prompt token at ``start + i + 1`` (only rows whose next token lies in the prompt are scored), so the
    # head runs over the first ``len(targets)`` rows of the chunk, not only its last
    prompt_logprobs: int | None = None
    targets: tuple[int, ...] = ()
    # a checkpoint drafter reads these rows (its context) and drafts after the last one (``DecodeRow.follow``):
    # off where drafting could not pay at the step's width, so a full batch's prompts cost no drafter work
    follow: bool = True


@dataclass(frozen=True)
class PassSlice:
    """Advance pass ``pass_id`` through layers ``[layer_start, layer_stop)``.

    The members are fixed for the pass's life; the first slice (``layer_start == 0``) creates the
    pass and its staging, the slice ending at the last layer completes it.
    """

    pass_id: int
    layer_start: int
    layer_stop: int
    members: tuple[PassMember, ...]

    @property
    def rows(self) -> int:
        return sum(len(m.ids) for m in self.members)


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    decodes: tuple[DecodeRow, ...]
    passes: tuple[PassSlice, ...] = ()
    # passes in flight whose members all left (aborted, failed): the engine forgets them and their
    # staging before this step runs. A plan with only retirements still goes to the engine.
    retired: tuple[int, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.passes and not self.retired

    @property
    def request_ids(self) -> set[str]:
        """Every request with rows in this plan (the members a failed step makes suspect)."""
        return {d.request_id for d in self.decodes} | {m.request_id for p in self.passes for m in p.members}

    def row_layers(self, num_layers: int) -> int:
        """Cost of the plan in the step budget's unit."""
        passes = sum(p.rows * (p.layer_stop - p.layer_start) for p in self.passes)
        return sum(d.rows for d in self.decodes) * num_layers + passes


class RowStatus(str, Enum):
    """Outcome of one sampled row."""

    OK = "ok"  # ``token`` is valid
    FAILED = "failed"  # this request alone failed (e.g. non-finite logits); ``error`` says why


@dataclass(frozen=True)
class SampledToken:
    request_id: str
    slot: int
    token: int
    status: RowStatus = RowStatus.OK
    logprob: float | None = None  # log-probability of ``token`` under the raw model distribution
    top_logprobs: tuple[tuple[int, float], ...] | None = None  # (token, logprob), best first
    error: str | None = None
    # speculative decoding: the drafted tokens the target accepted, committed before ``token`` (which is
    # then the target's own sample at the first rejected or the bonus row), with their logprobs
    accepted: tuple[int, ...] = ()
    accepted_logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]] | None, ...] = ()
    # a model drafter's next block for this sequence (fed after ``token``); the engine keeps its ``q``
    proposal: tuple[int, ...] = ()
    proposal_survival: tuple[float, ...] = ()  # P(its first i + 1 tokens all survive), by the drafter's confidence

    def with_run(self, accepted: tuple[int, ...], accepted_logprobs: tuple) -> "SampledToken":
        """This token after an accepted draft run (``dataclasses.replace`` without its field walk: a step
        makes one per decoder, ~6 us each that way)."""
        return SampledToken(self.request_id, self.slot, self.token, self.status, self.logprob, self.top_logprobs,
                            self.error, accepted, accepted_logprobs, self.proposal, self.proposal_survival)

    def with_proposal(self, proposal: tuple[int, ...], survival: tuple[float, ...]) -> "SampledToken":
        """This token carrying a model drafter's next block (as ``with_run``)."""
        return SampledToken(self.request_id, self.slot, self.token, self.status, self.logprob, self.top_logprobs,
                            self.error, self.accepted, self.accepted_logprobs, proposal, survival)


@dataclass(frozen=True)
class PromptLogprobs:
    """A member's scored rows, reported when its pass completes: entry ``i`` scores the prompt token at
    ``start + i + 1`` as ``(logprob, rank, ((token, logprob), ...) best first)``, from the raw logits
    (log_softmax, as ``SampledToken.logprob``); rank 1 is the most likely token. ``error``: its logits
    were not finite (then ``entries`` is empty and the request fails alone)."""

    request_id: str
    slot: int
    start: int
    entries: tuple[tuple[float, int, tuple[tuple[int, float], ...]], ...]
    error: str | None = None


@dataclass(frozen=True)
class PassProgress:
    pass_id: int
    layer_cursor: int  # layers done so far
    done: bool  # the pass completed (its staging is freed)


class StepStatus(str, Enum):
    OK = "ok"  # the plan executed
    FAILED = "failed"  # the forward raised; every request in the plan failed with ``error``


@dataclass(frozen=True)
class StepResult:
    step_id: int
    tokens: tuple[SampledToken, ...]
    passes: tuple[PassProgress, ...]
    status: StepStatus = StepStatus.OK
    error: str | None = None
    elapsed_s: float = 0.0
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()  # one per member that asked, when its pass completed
    draft_s: float = 0.0  # of ``elapsed_s``: the checkpoint drafter drafting next blocks (``proposals`` of them)
    proposals: int = 0
    draft_prompt_s: float = 0.0  # of ``draft_s``: the drafter committing prompt rows (a prefill cost)
    block_s: float = 0.0  # of ``draft_s``: the blocks' own forward
    # the drafter's next blocks are still being drafted on the host pool's worker (``Executor.settle_drafts``):
    # the tokens carry none yet, and ``draft_s`` is only what starting them took
    drafting: bool = False


def drafter_captures(decodes: Sequence[DecodeRow], whole: Sequence[PassSlice]) -> bool:
    """Whether a step's merged forward splits for a checkpoint drafter's captures (given it has one): when
    a prompt chunk the drafter follows runs in a whole pass (``PassMember.follow``) or a decoder follows,
    drafts or proposes (``DecodeRow.follow``). Otherwise the forward is a plain one and the decoders'
    positions are missing from the drafter's rings (the executor runs it so; the scheduler notes the gap)."""
    return any(m.follow for p in whole for m in p.members) or any(d.follow or d.propose or d.draft for d in decodes)


def validate_plan(plan: StepPlan, num_layers: int) -> str:
    """Scheduler-side structure before compute: every slot at most once, slices well-formed. A
    violation is a scheduler bug (fatal). Empty string if fine."""
    seen: dict[int, str] = {}
    for row in plan.decodes:
        if row.slot in seen:
            return f"slot {row.slot} planned twice ({seen[row.slot]} and {row.request_id})"
        seen[row.slot] = row.request_id
    ids = set()
    for p in plan.passes:
        if p.pass_id in ids:
            return f"pass {p.pass_id} planned twice"
        ids.add(p.pass_id)
        if not 0 <= p.layer_start < p.layer_stop <= num_layers:
            return f"pass {p.pass_id}: bad layer range [{p.layer_start}, {p.layer_stop})"
        if not p.members:
            return f"pass {p.pass_id} has no members"
        for m in p.members:
            if m.slot in seen:
                return f"slot {m.slot} planned twice ({seen[m.slot]} and {m.request_id})"
            seen[m.slot] = m.request_id
            if not m.ids:
                return f"pass {p.pass_id}: member {m.request_id} has no rows"
    if set(plan.retired) & ids:
        return f"passes {sorted(set(plan.retired) & ids)} are both retired and planned"
    return ""


def member_problems(plan: StepPlan, staging_rows: int, image_slot_id: int | None) -> dict[str, str]:
    """Problems confined to one member, found before compute: ``{request_id: what is wrong}``.

    A chunk larger than the staging the engine holds, or IMAGE slots (``image_slot_id``: the IMAGE
    sentinel id; ``None`` for text-only models) not filled by exactly one retained row each. Such a
    member is refused before compute and its request fails alone; the rest of the plan is re-planned.
    """
    out = {}
    for p in plan.passes:
        for m in p.members:
            problem = _member_problem(m, staging_rows, image_slot_id)
            if problem:
                out[m.request_id] = f"pass {p.pass_id}: {problem}"
    return out


def _member_problem(m: PassMember, staging_rows: int, image_slot_id: int | None) -> str:
    if len(m.ids) > staging_rows:
        return f"{len(m.ids)} rows exceed the staging size {staging_rows}"
    if image_slot_id is None:
        return ""
    slots = {m.start + i for i, t in enumerate(m.ids) if t == image_slot_id}
    filled: list[int] = []
    for positions, rows in m.image_rows:
        if rows is None or len(positions) != rows.shape[0]:
            return f"an image has {len(positions)} slots but {None if rows is None else rows.shape[0]} rows"
        filled.extend(int(q) for q in positions)
    if len(filled) != len(set(filled)) or set(filled) != slots:
        return (f"{len(slots)} IMAGE slots in [{m.start}, {m.start + len(m.ids)}) but rows for {len(filled)} "
                f"positions ({len(set(filled) ^ slots)} mismatched): image rows missing or misplaced")
    return ""


def validate_step_result(plan: StepPlan, result: StepResult, num_layers: int) -> str:
    """Check a result against its plan; returns a description of the first violation, or ''."""
    if result.step_id != plan.step_id:
        return f"result for step {result.step_id} answers plan {plan.step_id}"
    if result.status is StepStatus.FAILED:
        return "" if result.tokens == () and result.prompt_logprobs == () else "a failed step must not report tokens"
    expected: dict[int, str] = {row.slot: row.request_id for row in plan.decodes}
    drafts = {row.slot: row.draft for row in plan.decodes}
    for p in plan.passes:
        if p.layer_stop == num_layers:
            expected.update({m.slot: m.request_id for m in p.members if m.sample})
    got: dict[int, str] = {}
    for tok in result.tokens:
        if tok.slot in got:
            return f"duplicate row: slot {tok.slot} ({tok.request_id}) reported twice"
        if tok.slot not in expected:
            return f"token for unplanned slot {tok.slot} ({tok.request_id})"
        if expected[tok.slot] != tok.request_id:
            return f"slot {tok.slot}: token for {tok.request_id}, planned {expected[tok.slot]}"
        if tok.status is RowStatus.OK and tok.token < 0:
            return f"slot {tok.slot}: invalid token id {tok.token}"
        if tok.accepted and tok.accepted != drafts.get(tok.slot, ())[:len(tok.accepted)]:
            return f"slot {tok.slot}: accepted {list(tok.accepted)} is not a prefix of its draft"
        got[tok.slot] = tok.request_id
    missing = [f"{rid} (slot {s})" for s, rid in expected.items() if s not in got]
    if missing:
        return f"planned rows without a token: {', '.join(missing)}"
    planned_passes = {p.pass_id: p for p in plan.passes}
    reported = set()
    for prog in result.passes:
        p = planned_passes.get(prog.pass_id)
        if p is None:
            return f"progress for unplanned pass {prog.pass_id}"
        if prog.pass_id in reported:
            return f"pass {prog.pass_id} reported twice"
        reported.add(prog.pass_id)
        if prog.layer_cursor != p.layer_stop or prog.done != (p.layer_stop == num_layers):
            return (f"pass {prog.pass_id}: cursor {prog.layer_cursor} done={prog.done}, planned stop "
                    f"{p.layer_stop} of {num_layers}")
    if reported != set(planned_passes):
        return f"passes without progress: {sorted(set(planned_passes) - reported)}"
    return _prompt_logprobs_problem(plan, result, num_layers)


def _prompt_logprobs_problem(plan: StepPlan, result: StepResult, num_layers: int) -> str:
    """Every member asking for prompt logprobs (with rows to score) whose pass completes is answered
    once, for its rows."""
    expected = {m.slot: m for p in plan.passes if p.layer_stop == num_layers for m in p.members
                if m.prompt_logprobs is not None and m.targets}
    got: set[int] = set()
    for pl in result.prompt_logprobs:
        m = expected.get(pl.slot)
        if m is None or m.request_id != pl.request_id:
            return f"prompt logprobs for unplanned slot {pl.slot} ({pl.request_id})"
        if pl.slot in got:
            return f"prompt logprobs for slot {pl.slot} ({pl.request_id}) reported twice"
        got.add(pl.slot)
        if pl.start != m.start:
            return f"slot {pl.slot}: prompt logprobs start at {pl.start}, the chunk at {m.start}"
        if pl.error is None and len(pl.entries) != len(m.targets):
            return f"slot {pl.slot}: {len(pl.entries)} prompt logprobs for {len(m.targets)} scored rows"
        if any(len(e[2]) != m.prompt_logprobs for e in pl.entries):
            return f"slot {pl.slot}: a prompt logprob entry without exactly {m.prompt_logprobs} alternatives"
    missing = [f"{m.request_id} (slot {s})" for s, m in expected.items() if s not in got]
    return f"planned prompt logprobs missing: {', '.join(missing)}" if missing else ""
