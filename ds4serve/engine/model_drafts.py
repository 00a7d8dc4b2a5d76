"""A checkpoint drafter (DSpark, MTP) driven by the engine's steps (speculative decoding, issue 28).

Per step, after sampling (``ds4-speculative.md`` §4):

1. **commit**: every sequence of the forward hands the drafter the captured hidden rows (``capture.py``)
   of the positions it *committed*: a prompt chunk all its rows, a decoder its token and the accepted
   part of its draft, never a rejected row (§4 step 6: a rejected tail would make the next draft read a
   false candidate as context). A drafter state is a function of committed positions only, so nothing
   is ever rolled back.
2. **propose**: every sequence that got a token drafts its next block from it (the anchor), for the
   step after. The block waits here (``pending``) beside the distributions ``q`` it was drawn from; the
   scheduler sees only the tokens (``SampledToken.proposal``) and decides how many to verify; the
   executor then takes the verified prefix with its ``q`` (``take``), so a draft is verified against
   the distribution it was really drawn from, never a point mass.

How a sampled draft is accepted (``acceptance``; greedy requests draft the argmax and accept it while
it is the target's argmax, in both):

* ``"coupled"`` (the default): the draft token for output index ``k`` races over the drafter's ``q``
  with the very exponential noise plain decoding draws index ``k`` with (``sampling._race``, seeded by
  (request seed, ``k``)), and is accepted while it equals the target's own draw there. Each token really
  is a draw from ``q``; the committed token at every index is plain decoding's draw, so the sampled stream
  is plain decoding's, token for token, whatever was drafted, whatever the batch, after any undo; the
  drafts only decide how many of those tokens one step commits. It accepts ``P(race_q = race_p)``, a
  little below rejection sampling's ``1 - TV(p, q)``.
* ``"rejection"``: Leviathan/Chen rejection sampling against ``q`` (``spec_verify.verify_rows``), drafts
  drawn in the draft domain (``DRAFT_DOMAIN``): accepts ``1 - TV`` on average and is exact in
  distribution, but which tokens a seeded request gets then depends on what was drafted.

A slot's drafter state belongs to one request: a new request in the slot, or the same request starting
over at position 0 (a recompute), gets a fresh state. After a prefix-cache hit a state lacks the rows
below the hit; the drafter's ``ready`` says so and the request does not draft until its window is whole
(counted in ``not_ready``, never a silently worse draft).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..cache import SeqChunk
from .capture import CapturePlan
from .sampling import SamplerState, _race, token_seed
from .spec_verify import DRAFT_DOMAIN, Draft, domain_seed, draft_probs, request_seed

ACCEPTANCE = ("coupled", "rejection")
# pick(logits [R, V] of block position i, i) -> (tokens [R], q [R, V]): how a drafter draws its tokens;
# ``pick.greedy`` is True when every row is greedy (the tokens are the argmax, q one-hot there);
# ``pick.needs_q`` False when nothing reads ``Block.q`` (coupled acceptance), so a drafter may leave it None
Pick = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Block:
    """A drafter's blocks for ``R`` requests: ``tokens [R, B]``, ``q [R, B, V]`` (what each token was
    drawn from) and ``survival [R, B]`` (the confidence product, 1 where the drafter has none)."""

    tokens: torch.Tensor
    q: torch.Tensor | None  # None only where the pick said it is not needed (``pick.needs_q``)
    survival: torch.Tensor


class DraftModel(Protocol):
    """What the engine asks of a checkpoint drafter (``engine/checkpoint_drafters.py`` adapts DSpark and
    MTP to it)."""

    plan: CapturePlan  # what it reads from the target's forward
    block: int  # tokens one proposal holds
    keep_rows: int  # the latest committed rows a block can depend on (older ones may be skipped)

    def new_state(self) -> Any: ...

    def release(self, state: Any) -> None: ...

    def commit(self, states: Sequence[Any], positions: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor,
               owners: torch.Tensor) -> None: ...

    def ready(self, states: Sequence[Any], last: torch.Tensor) -> list[bool]: ...

    def draft(self, states: Sequence[Any], anchors: torch.Tensor, anchor_positions: torch.Tensor,
              pick: Pick) -> Block: ...


@dataclass(frozen=True)
class Fed:
    """One sequence's rows in this step's forward: ``ids`` fed at ``start ..``, from row ``row`` of the
    step's captures."""

    request_id: str
    slot: int
    start: int
    ids: tuple[int, ...]
    row: int


class StepFeed:
    """The sequences of one step's forwards and their captured rows, for the model drafter (the executor
    fills it as its forwards run; ``ModelDrafts.commit`` takes its entries and rows)."""

    def __init__(self) -> None:
        self.entries: list[Fed] = []
        self._parts: list[torch.Tensor] = []
        self._rows = 0

    def add(self, chunks: list[tuple[SeqChunk, str]], captured: torch.Tensor) -> None:
        at = self._rows
        for chunk, request_id in chunks:
            ids = chunk.ids.tolist() if isinstance(chunk.ids, torch.Tensor) else chunk.ids
            self.entries.append(Fed(request_id, chunk.slot, chunk.start, tuple(ids), at))
            at += len(chunk.ids)
        if at - self._rows != captured.shape[0]:
            raise ValueError(f"{captured.shape[0]} captured rows for {at - self._rows} fed rows")
        self._parts.append(captured)
        self._rows = at

    def rows(self) -> torch.Tensor:
        return self._parts[0] if len(self._parts) == 1 else torch.cat(self._parts)


@dataclass(frozen=True)
class Ask:
    """A sequence that got ``anchor`` this step, fed next at ``position``: it drafts its next block,
    whose first token would be output index ``index``."""

    request_id: str
    slot: int
    anchor: int
    position: int
    sampler: SamplerState
    index: int


@dataclass(frozen=True)
class ProposeTiming:
    """Where one ``propose`` spent its time, for the scheduler's cost of drafting (``StepCosts``):
    ``prompt_s`` committing prompt rows (a share of the commit by rows: the drafter reading a prompt, paid
    once a request like its prefill, not per verified draft row; charged to the blocks, the first block
    after a 240-token prompt of the bundled model cost ~3x a steady one and switched its drafting off for
    good), ``block_s`` the blocks' own forward."""

    prompt_s: float = 0.0
    block_s: float = 0.0


@dataclass(frozen=True)
class Proposal:
    position: int  # the anchor's: the next decode row's position
    tokens: tuple[int, ...]
    q: torch.Tensor | None  # [B, V] under rejection sampling; coupled acceptance needs none
    survival: tuple[float, ...]


LATE_DECAY = 0.9  # weight of the past in ``ModelDrafts``' share of late workers
LATE_LIMIT = 0.5  # above this share the worker is not used for ``LATE_PAUSE`` proposals
LATE_PAUSE = 256


@dataclass
class _Later:
    """A proposal running on the host pool's worker: its asks, the native job (which holds the backlog rows
    it commits until it is done), their count and prompt share, and the seconds it took to start."""

    asks: list[Ask]
    job: Any
    rows: int
    prompt_rows: int
    start_s: float


@dataclass
class _Backlog:
    """A slot's committed rows not handed to the drafter yet: ``(start, ids, hidden rows, whether a prompt
    chunk's)`` oldest first, and how many rows they hold (kept, not summed: a request that follows without
    drafting adds a row a step to a backlog of ~``keep_rows`` entries)."""

    entries: deque = field(default_factory=deque)
    rows: int = 0


class ModelDrafts:
    """The drafter's per-slot states and the blocks waiting to be verified."""

    def __init__(self, model: DraftModel, acceptance: str = "coupled"):
        if acceptance not in ACCEPTANCE:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE}, not {acceptance!r}")
        self.model = model
        self.rejection = acceptance == "rejection"
        self._states: dict[int, tuple[str, Any]] = {}
        # rows not yet committed: (start, ids, hidden rows, whether a prompt chunk's)
        self._backlog: dict[int, _Backlog] = {}
        self.pending: dict[int, Proposal] = {}
        self.timing = ProposeTiming()  # the last ``propose``'s
        self.not_ready = 0  # proposals skipped: the drafter's window was not whole (after a prefix hit)
        self._later: _Later | None = None  # a proposal running on the host pool's worker (``propose_later``)
        self.later = 0  # proposals started on the worker (for tests and logs)
        self.overlapped = 0  # of them, the ones the worker drafted (not the engine at its wait)
        self._late = 0.0  # decayed share of them the engine waited for longer than they ran (a late worker)
        self._paused = 0  # proposals left to draft in place after a run of late ones (``LATE_PAUSE``)

    @property
    def plan(self) -> CapturePlan:
        return self.model.plan

    def _state(self, request_id: str, slot: int, start: int) -> Any:
        held = self._states.get(slot)
        if held is None or held[0] != request_id or start == 0:
            if held is not None:
                self.model.release(held[1])
            held = (request_id, self.model.new_state())
            self._states[slot] = held
            self.pending.pop(slot, None)
            self._backlog.pop(slot, None)
        return held[1]

    def commit(self, fed: Sequence[Fed], captured: torch.Tensor, kept: Mapping[int, int]) -> None:
        """``kept[slot]``: how many of its leading rows a sequence committed (a prompt chunk: all of
        them, missing from ``kept``; a decoder: 1 + accepted; 0: none, e.g. its sampling failed).

        The rows wait in the slot's backlog (copies of the captured rows, the last ``model.keep_rows``
        only: no drafter reads further back) and reach the drafter when the slot next drafts a block
        (``_flush``): a request whose rate does not pay for drafting costs a row copy a step, not a
        drafter forward."""
        self.settle()
        for f in fed:
            n = kept.get(f.slot, len(f.ids))
            if n <= 0:
                continue
            self._state(f.request_id, f.slot, f.start)
            log_ = self._backlog.setdefault(f.slot, _Backlog())
            log_.entries.append((f.start, f.ids[:n], captured[f.row:f.row + n].clone(), f.slot not in kept))
            log_.rows += n
            while log_.rows - len(log_.entries[0][1]) >= self.model.keep_rows:  # whole chunks no drafter reads
                log_.rows -= len(log_.entries.popleft()[1])

    def _flush(self, slots: Sequence[int]) -> tuple[int, int]:
        """Hand the backlogs of ``slots`` to the drafter in one batched commit; returns ``(rows, prompt
        rows)`` committed. A drafter with ``commit_entries`` (the native DSpark one) takes the backlog
        entries as they are: no tensor is built for them."""
        entries, prompt_rows = self._backlogs(slots)
        if not entries:
            return 0, 0
        fast = getattr(self.model, "commit_entries", None)
        if fast is not None:
            fast(entries)
            return sum(len(e[2]) for e in entries), prompt_rows
        positions: list[int] = []
        tokens: list[int] = []
        owners: list[int] = []
        states: list[Any] = []
        for state, start, ids, _ in entries:
            if not states or states[-1] is not state:
                states.append(state)
            owners += [len(states) - 1] * len(ids)
            positions += range(start, start + len(ids))
            tokens += ids
        parts = [e[3] for e in entries]
        dev = parts[0].device
        self.model.commit(states, torch.tensor(positions, device=dev), torch.tensor(tokens, device=dev),
                          torch.cat(parts) if len(parts) > 1 else parts[0], torch.tensor(owners, device=dev))
        return len(positions), prompt_rows

    def _backlogs(self, slots: Sequence[int]) -> tuple[list[tuple[Any, int, tuple[int, ...], torch.Tensor]], int]:
        """The backlog entries of ``slots`` as ``(state, start, ids, hidden rows)``, taken out of the backlogs,
        and how many of their rows are a prompt's."""
        entries: list[tuple[Any, int, tuple[int, ...], torch.Tensor]] = []
        prompt_rows = 0
        for slot in slots:
            log_ = self._backlog.pop(slot, None)
            for start, ids, hidden, prompt in log_.entries if log_ is not None else ():
                prompt_rows += len(ids) if prompt else 0
                entries.append((self._states[slot][1], start, ids, hidden))
        return entries, prompt_rows

    def _live(self, asks: Sequence[Ask]) -> list[Ask]:
        return [a for a in asks if a.slot in self._states and self._states[a.slot][0] == a.request_id]

    def propose_later(self, asks: Sequence[Ask], threads: int) -> bool:
        """``propose``, its drafter work (the backlogs' commit and the greedy blocks) handed to the host pool's
        worker (``start_greedy`` of the native DSpark drafter): the engine applies its step meanwhile, and
        ``settle`` collects the blocks before anything reads them (every method here settles first).
        False, with nothing done, where that does not apply (another drafter, a sampled or rejection-sampled
        row, nothing to draft): then ``propose`` runs as before."""
        start = getattr(self.model, "start_greedy", None)
        if start is None or self.rejection or threads < 2 or not all(a.sampler.params.greedy for a in asks):
            return False
        self.settle()
        if self._paused:
            self._paused -= 1
            return False
        t0 = time.perf_counter()
        asks = self._live(asks)
        if not asks:
            return False
        entries, prompt_rows = self._backlogs([a.slot for a in asks])
        job = start(entries, [self._states[a.slot][1] for a in asks], [a.anchor for a in asks],
                    [a.position for a in asks], threads)
        self._later = _Later(asks, job, sum(len(e[2]) for e in entries), prompt_rows, time.perf_counter() - t0)
        self.later += 1
        return True

    def settle(self) -> dict[int, Proposal]:
        """The blocks of the proposal ``propose_later`` started (waited for; kept in ``pending``), by slot
        (none without one). ``timing`` splits the seconds the engine spent on it itself (starting it, waiting
        for it and reading it: what the worker did while the engine went on is not a cost of the step) as
        the job's own commit and blocks split."""
        later = self._later
        if later is None:
            return {}
        self._later = None
        t0 = time.perf_counter()
        ok, tokens, survival = later.job.wait()
        commit, blocks = later.job.seconds
        self._note_wait(time.perf_counter() - t0, commit + blocks, bool(later.job.on_worker))
        out = {a.slot: Proposal(a.position, tuple(t), None, tuple(v))
               for a, t, v, good in zip(later.asks, tokens, survival, ok) if good}
        self.not_ready += ok.count(False)
        self.pending.update(out)
        spent = later.start_s + time.perf_counter() - t0
        share = commit / (commit + blocks) if commit + blocks > 0 else 0.0
        prompt = spent * share * later.prompt_rows / later.rows if later.rows else 0.0
        self.timing = ProposeTiming(prompt, spent * (1 - share))
        return out

    def _note_wait(self, waited: float, ran: float, on_worker: bool) -> None:
        """A proposal's wait against its job's own seconds: a worker that keeps starting late (its core taken
        by another job, so the engine waits longer than the job runs) drafts nothing in parallel and delays
        every step it is waited for; after a run of such waits the blocks are drafted in place again for
        ``LATE_PAUSE`` proposals, then the worker is tried again."""
        self.overlapped += on_worker
        self._late = LATE_DECAY * self._late + (1 - LATE_DECAY) * float(waited > ran)
        if self._late > LATE_LIMIT:
            log.info("the drafter's worker started late in most recent steps (waited %.0f us for a %.0f us job): "
                     "blocks are drafted in place for the next %d proposals", waited * 1e6, ran * 1e6, LATE_PAUSE)
            self._late, self._paused = 0.0, LATE_PAUSE

    def propose(self, asks: Sequence[Ask]) -> dict[int, Proposal]:
        """Draft the next block of every ready ``ask``; kept in ``pending`` and returned by slot. Where
        the time went is left in ``timing``."""
        self.settle()
        self.timing = ProposeTiming()
        asks = self._live(asks)
        if not asks:
            return {}
        t0 = time.perf_counter()
        rows, prompt_rows = self._flush([a.slot for a in asks])
        commit_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        greedy = getattr(self.model, "propose_greedy", None)
        if greedy is not None and not self.rejection and all(a.sampler.params.greedy for a in asks):
            ok, tokens, survival = greedy([self._states[a.slot][1] for a in asks], [a.anchor for a in asks],
                                          [a.position for a in asks])
            blocks = [(a, tuple(t), None, tuple(v)) for a, t, v, good in zip(asks, tokens, survival, ok) if good]
        else:
            ok, blocks = self._blocks(asks)
        self.timing = ProposeTiming(commit_s * prompt_rows / rows if rows else 0.0, time.perf_counter() - t0)
        self.not_ready += ok.count(False)
        out = {a.slot: Proposal(a.position, toks, q, surv) for a, toks, q, surv in blocks}
        self.pending.update(out)
        return out

    def _blocks(self, asks: Sequence[Ask]) -> tuple[list[bool], list[tuple[Ask, tuple[int, ...], Any, tuple]]]:
        """Readiness of every ask, and the blocks of the ready ones through the drafter's ``ready`` and
        ``draft``: ``(ask, tokens, q, survival)``, ``q`` only under rejection sampling."""
        states = [self._states[a.slot][1] for a in asks]
        ok = self.model.ready(states, torch.tensor([a.position - 1 for a in asks]))
        asks = [a for a, good in zip(asks, ok) if good]
        if not asks:
            return ok, []
        block = self.model.draft([self._states[a.slot][1] for a in asks], torch.tensor([a.anchor for a in asks]),
                                 torch.tensor([a.position for a in asks]), self._pick(asks))
        tokens, survival = block.tokens.tolist(), block.survival.tolist()
        return ok, [(a, tuple(tokens[i]), block.q[i] if self.rejection else None, tuple(survival[i]))
                    for i, a in enumerate(asks)]

    def take(self, slot: int, position: int, draft: tuple[int, ...]) -> Draft:
        """The verified prefix ``draft`` of the block pending for ``slot`` at ``position``, with its ``q``.
        Anything else is a scheduler bug (a draft whose ``q`` is unknown cannot be verified exactly)."""
        self.settle()
        p = self.pending.pop(slot, None)
        if p is None or p.position != position or tuple(p.tokens[:len(draft)]) != tuple(draft):
            raise ValueError(f"slot {slot}: draft {draft} at position {position} is not the prefix of the block "
                             f"proposed there ({None if p is None else (p.position, p.tokens)})")
        return Draft(tuple(draft), p.q[:len(draft)])

    def drop(self, slot: int) -> None:
        self.settle()
        held = self._states.pop(slot, None)
        if held is not None:
            self.model.release(held[1])
        self.pending.pop(slot, None)
        self._backlog.pop(slot, None)


    def _pick(self, asks: Sequence[Ask]) -> Pick:
        """How the block's tokens are drawn (see the module docstring): ``q`` is the request's
        temperature / top-k / top-p / min-p over the drafter's logits (one-hot at the argmax when
        greedy); a sampled row races over ``q`` with the noise of its output index, plain decoding's
        (coupled) or the draft domain's (rejection)."""
        params = [a.sampler.params for a in asks]
        sampled = [r for r, p in enumerate(params) if not p.greedy]
        seeds = {r: request_seed(asks[r].sampler) for r in sampled}

        def pick(logits: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            q = draft_probs(logits.float(), params)
            tokens = torch.argmax(q, dim=-1)
            gen = torch.Generator(device=q.device)  # plain decoding's generator lives on the logits' device
            for r in sampled:
                index = asks[r].index + i
                gen.manual_seed(domain_seed(seeds[r], index, DRAFT_DOMAIN) if self.rejection
                                else token_seed(seeds[r], index))
                tokens[r] = _race(q[r], gen)
            return tokens, q

        pick.greedy = not sampled  # every row greedy: a drafter may take its argmax without calling pick
        pick.needs_q = self.rejection  # coupled acceptance never reads a block's q: a drafter may skip it
        return pick
