"""Which decoders carry a draft this step, and how long (speculative decoding, issue 28).

Drafts come from prompt lookup here (``source="ngram"``: ``engine.ngram.propose``'s rule, kept
as a per-request ``SuffixIndex``) or from the
checkpoint's drafter (``source="model"``): the block the engine drafted for this very row after the last
step (``Request.proposal``), cut where the drafter's survival estimate falls below ``confidence``.

A decode step of ``n`` decoders carrying ``D`` draft rows costs ``a + b n + c D`` (``step_costs``: fitted
from the steps' own wall time while serving, the start-up calibration of the forward as its prior). A
request drafts only while its acceptance rate pays for its rows beside the step's ``n`` decoders
(``worth``: ``rate > c n / (a + b n)``), so drafting turns itself down as the batch
fills and a loaded server is not slower for it; and all drafts together take at most ``share`` of the
rows a step may carry beside its decoders (``SchedulerLimits.prefill_tokens(n)``, the rest stays with
prefill progress), and only rows that the prompts waiting to prefill leave (``scheduler.speculation``).
Requests whose drafts were accepted most often go first. A request's ``rate`` is the chance that one of
its draft tokens is accepted once the tokens before it were (decayed counts of its accepted tokens and of
its drafts that stopped at a rejection; 1 at first, as a new request has no history), so row ``i`` of its
draft is accepted with chance ``rate ** (i + 1)``, and an n-gram draft holds the rows whose chance beats
the step's bar (``rows_that_pay``, at least one). A checkpoint drafter's block says more: its survival
estimate at each row (the confidence product), scaled by what such estimates were worth for the request
so far, is the row's probability of acceptance, and the step verifies the rows that raise its expected
tokens per second, best first across requests (``_by_survival``). A request whose rate does not pay
drafts a single token every ``PROBE_EVERY`` steps (all such requests on the same steps), so a rate that
fell during one stretch of text can recover in the next (a checkpoint drafter's probe block, its forward
spent either way, is verified by its survival estimates like any other block).

Every decoder may draft: penalties, ``min_tokens`` bans, grammars and reasoning budgets are rebuilt per
draft row from the history (``engine.drafted``, ``engine.constraints``), and a draft is cut before the first
token the request's grammar or reasoning budget refuses (``allowed_prefix``: such a token and every row
after it would be rejected); under a grammar the tokens it forces are drafted whatever the rate
(``_forced``). Drafts are verified exactly; everybody else decodes normally beside them. A draft never
holds an image sentinel id (proposals copied from a prompt's image block end before it): image blocks
come only from prompts.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..engine.constraints import allowed_prefix, forced_tokens
from ..engine.ngram import SuffixIndex
from .admission import SchedulerLimits
from .request import Request

RATE_DECAY = 0.85  # weight of the past in a request's acceptance rate (one verify step = one sample)
PROBE_EVERY = 16  # a request whose rate does not pay drafts one token this often, so the rate can recover
SURVIVAL_DECAY = 0.8  # weight of the past in a request's record of its drafter's survival estimates
# a rate must beat the cost rule's break-even by this factor: the rule's figures are estimates (a fit over
# noisy step times, an average of bursty acceptance), and a draft expected to pay a few percent did not pay
# at all at 16 streams of n-gram drafts (0.88x, with the rule's bar at 0.4 and the rate at 0.47)
MARGIN = 1.1
# a checkpoint drafter keeps following a request's rows (the capture split, the ring commits) only while the
# bar is below this: following costs every step, and a drafter that would need a rate above it to pay (the
# bundled model's DSpark at 4 streams) cost 6% in captures and probes that never verified a row
FOLLOW_LIMIT = 0.75


@dataclass(frozen=True)
class DraftPolicy:
    """The drafter and its limits: ``k`` tokens at most a step; n-gram suffixes ``min_n .. max_n`` looked
    up in the last ``window`` tokens; ``max_rows`` the longest draft the cache can undo (``max_draft``)."""

    k: int
    min_n: int
    max_n: int
    window: int
    max_rows: int
    vocab_size: int  # ids from here on are image sentinels (DS4V): never drafted, a draft ends before one
    share: float = 0.5  # of the step's calibrated spare rows
    source: str = "ngram"  # "ngram": prompt lookup here; "model": the checkpoint drafter's blocks (engine side)
    confidence: float = 0.0  # a model block is cut before its survival estimate falls below this
    # a grammar's forced tokens may stand in for a model block (``forced_tokens``); not under rejection
    # sampling, which verifies a model draft against the q its block was drawn from
    forced: bool = True
    # a checkpoint drafter's window (its rings' rows): a request whose rings lack a position drafts again only
    # ``follow_window`` positions later (``catches_up``); 0: not known, following is the bar's alone
    follow_window: int = 0

    def plan(self, decoders: Sequence[Request], limits: SchedulerLimits, costs: Sequence[float] | None = None,
             draft_cost: float = 0.0, step: int = 0, prefill: Callable[[], int] | None = None,
             per_draft: float = 0.0) -> dict[str, tuple[int, ...]]:
        """Drafts for this step: ``{request_id: tokens}`` within ``share`` of the step's spare rows and
        within the rows that the ``prefill()`` prompt tokens waiting for this step leave
        (``scheduler.speculation``; asked only once a draft could be planned), for requests whose
        acceptance rate pays for their rows (``worth`` of ``costs``: the whole step's observed costs,
        ``step_costs.StepCosts``; the calibrated forward's by default) and, for a checkpoint drafter, for
        its ``draft_cost`` seconds a verified draft row. ``step``: the scheduler's step count; requests
        below the bar probe together when it is a multiple of ``PROBE_EVERY`` (so a checkpoint drafter
        runs once for all of them, not once a step for one). ``per_draft``: what a step spends per decoder
        carrying a draft beyond its rows (``StepCosts.per_draft``), charged to a draft as a whole."""
        spare = limits.prefill_tokens(len(decoders))
        budget = int(spare * self.share)
        costs = limits.step_costs if costs is None else costs
        out: dict[str, tuple[int, ...]] = {}
        surviving: list[Request] = []  # model blocks whose length the survival estimate decides (below)
        bar = self._bar(len(decoders), costs, draft_cost, per_draft)  # the same for every request of the step
        if budget <= 0:
            return out
        if bar >= self._limit() or not any(self._may_draft(r, bar, step) for r in decoders):
            # no acceptance rate can pay beside this many decoders (not even a probe), or nobody could carry
            # a draft this step: what the loop below would find, without asking what the waiting prompts
            # need or ranking anybody
            for req in decoders:
                req.draft_skipped += 1
            return out
        if prefill is not None:
            budget = min(budget, spare - prefill())
        for req in sorted(decoders, key=lambda r: (-r.draft_rate, r.arrival)):
            if budget <= 0:
                break
            forced = self._forced(req, budget, limits.max_model_len)
            probe = not req.draft_rate > bar
            if probe and not forced:  # its rate does not pay: one token every PROBE_EVERY steps
                req.draft_skipped += 1
                if step % PROBE_EVERY:
                    continue
            n = min(1 if probe else self._length(req, limits.max_model_len, bar=bar), budget)
            if self.source == "model" and req.proposal_survival and not forced:  # a probe's block too
                surviving.append(req)
                continue
            if not probe and not forced and not any(
                    self._whole_pays(req.draft_rate, rows, len(decoders), costs, draft_cost, per_draft)
                    for rows in range(1, n + 1)):
                req.draft_skipped += 1  # no draft it could find would pay: the lookup is not worth its time
                continue
            draft = self._candidate(req, n) if n > 0 else ()
            if draft and not probe and not self._whole_pays(req.draft_rate, len(draft), len(decoders), costs,
                                                             draft_cost, per_draft):
                req.draft_skipped += 1
                draft = ()
            draft = forced if len(forced) >= len(draft) else draft
            if draft:
                out[req.request_id] = draft
                budget -= len(draft)
        if surviving and budget > 0:
            out.update(self._by_survival(surviving, len(decoders), costs, limits.max_model_len, budget, per_draft))
        return out

    def _may_draft(self, req: Request, bar: float, step: int) -> bool:
        """A first look at whether ``req`` could carry a draft this step (``plan`` decides): a grammar's
        forced tokens; else, for a checkpoint drafter, only with a block drafted for this very row
        (``_proposal``: a request its drafter does not follow has none, whatever its rate), and a rate
        that pays or a probe due."""
        if self.forced and req.sampler.constraint is not None:
            return True
        if self.source == "model" and (req.proposal_at != req.computed or not req.proposal):
            return False
        return req.draft_rate > bar or not step % PROBE_EVERY

    def _by_survival(self, reqs: Sequence[Request], n: int, costs: Sequence[float], max_model_len: int,
                     budget: int, per_draft: float = 0.0) -> dict[str, tuple[int, ...]]:
        """The rows of checkpoint-drafter blocks that raise the step's expected tokens per second (§5.3's
        verify budget). Row ``i`` of a block is accepted with probability ``s_i``, the drafter's survival
        estimate at ``i`` (the product of its confidences) scaled by the request's record of what such
        estimates were worth (``survival_scale``). A step of ``n`` decoders and ``D`` draft rows costs
        ``a + b n + c D`` (the blocks are drafted already: their drafter seconds are spent whatever is
        verified, so a row costs its verification alone; whether to draft a block at all is ``wants_block``'s
        question) and yields ``n + sum s`` tokens; adding a row of estimate ``s`` raises that ratio iff
        ``s > c (n + sum s) / (a + b n + c D)``. A block's first rows also cost ``per_draft`` (what a step
        spends per decoder carrying a draft: ``StepCosts.per_draft``), so a block opens with the prefix whose
        estimates pay best for it (``_opening``) and grows a row at a time after that.
        Chunks are taken best first across requests (each block's estimates fall along it, so a block is
        always cut to a prefix) while they pass, within ``budget`` rows. Against the rate rule's
        ``rows_that_pay``, a confident block is verified whole and a doubtful one is cut where it turns
        doubtful, whatever the request's past. A block of which no row pays (the budget aside) counts
        against the request's rate as a draft rejected at its first row (``refused``): its drafter forward
        was spent for nothing, and a request whose blocks are never verified must stop asking for them (at 4
        streams of the bundled model every decoder drafted a block a step and none was verified: 0.83-0.88x)."""
        a, b, row_cost = costs if len(costs) == 3 else (1.0, 0.0, 0.0)
        blocks: list[tuple[float, ...]] = []
        heads: list[tuple[float, int, int, int]] = []  # (-(gain / seconds), request, first row, rows)
        for i, req in enumerate(reqs):
            block = self._allowed(req, self._proposal(req, self._length(req, max_model_len, self.k)))
            scale = req.survival_scale
            blocks.append(tuple(min(1.0, s * scale) for s in req.proposal_survival[:len(block)]))
            if blocks[-1]:
                rows = _opening(blocks[-1], row_cost, per_draft)
                heapq.heappush(heads, (-_ratio(sum(blocks[-1][:rows]), per_draft + row_cost * rows), i, 0, rows))
        tokens, seconds = float(n), a + b * n
        taken = [0] * len(reqs)
        unpaid = False  # the loop stopped at rows that do not pay (not at the budget)
        while heads and budget > 0:
            _, i, pos, rows = heapq.heappop(heads)
            rows = min(rows, budget)
            gain = sum(blocks[i][pos:pos + rows])
            cost = row_cost * rows + (per_draft if pos == 0 else 0.0)
            if gain * seconds <= cost * tokens:
                unpaid = True
                break  # nothing left raises tokens per second: every other chunk pays less still
            taken[i], tokens, seconds, budget = pos + rows, tokens + gain, seconds + cost, budget - rows
            if taken[i] < len(blocks[i]):
                heapq.heappush(heads, (-_ratio(blocks[i][taken[i]], row_cost), i, taken[i], 1))
        for req, block, t in zip(reqs, blocks, taken):
            if block and not t and (unpaid or not heads):
                refused(req)  # a block not one row of which pays: into the rate, as a draft stopped at once
        return {req.request_id: req.proposal[:t] for req, t in zip(reqs, taken) if t}

    def bar(self, req: Request, n: int, costs: Sequence[float], draft_cost: float, max_model_len: int,
            per_draft: float = 0.0) -> float:
        """The acceptance rate ``req``'s draft must beat beside ``n`` decoders: ``worth``, with a checkpoint
        drafter's seconds per draft row verified (``StepCosts.draft_cost``). 1 or more: no rate
        can pay, so the request neither drafts nor probes (a probe could only confirm a loss). The
        same for every request of a step (``_bar``). ``per_draft`` (``StepCosts.per_draft``) is charged to
        the rows as a share of a whole draft's ``k``."""
        return self._bar(n, costs, draft_cost, per_draft)

    def _bar(self, n: int, costs: Sequence[float], draft_cost: float, per_draft: float = 0.0) -> float:
        return MARGIN * worth(n, tuple(costs), (draft_cost if self.source == "model" else 0.0) + per_draft / self.k)

    def _whole_pays(self, rate: float, rows: int, n: int, costs: Sequence[float], draft_cost: float,
                    per_draft: float) -> bool:
        """Whether a draft of ``rows`` rows at acceptance ``rate`` pays as a whole beside ``n`` decoders:
        its expected tokens (``rate + rate^2 + ...``, each worth a plain step's time per token) against its
        verification (``per_draft`` once, a row cost each, the drafter's ``draft_cost`` a row). The rate
        bar charges ``per_draft`` as if every draft were ``k`` rows long; a short one pays less of it back."""
        if len(costs) != 3 or rows <= 0:
            return True
        a, b, c = costs
        gain = sum(rate ** i for i in range(1, rows + 1)) * (a + b * n) / n
        extra = draft_cost if self.source == "model" else 0.0
        return gain > MARGIN * (per_draft + (c + extra) * rows)

    def _limit(self) -> float:
        """The bar at which drafting stops, probes included: 1 for n-gram drafts (no rate can pay past
        it); ``FOLLOW_LIMIT`` for a checkpoint drafter, whose following costs every step."""
        return FOLLOW_LIMIT if self.source == "model" else 1.0

    def turns(self, reqs: Sequence[Request], n: int, costs: Sequence[float], draft_cost: float,
              step: int, plain_next: bool = False, per_draft: float = 0.0) -> list[tuple[bool, bool]]:
        """``turn`` of each of ``reqs`` beside ``n`` decoders, the bar worked out once for the step (a
        decode step asks this of every decoder: per request, the bar's arithmetic was a tenth of a 4-stream
        step of the bundled model). ``plain_next``: the next step runs without drafts (``StepCosts.baseline``),
        so no block is drafted for it."""
        bar = self._bar(n, costs, draft_cost, per_draft) if self.source == "model" else 1.0
        if bar >= self._limit():
            return [(False, False)] * len(reqs)
        probe_next = (step + 1) % PROBE_EVERY == 0
        return [(not plain_next and (probe_next or req.draft_rate > bar), True) if self.catches_up(req)
                else (False, False) for req in reqs]

    def catches_up(self, req: Request) -> bool:
        """Whether ``req``'s drafter rings can be whole again before it ends: none lacks a position, or the
        latest they lack (``unfollowed_at``, a step that ran without capturing) is ``follow_window``
        positions and a block before the request's last. Following a request that cannot draft again costs
        its captures and commits for nothing (at 4 streams of the bundled model the bar crossed the follow
        limit back and forth, and the requests followed, never whole, at ~10% of the step)."""
        if not self.follow_window or req.unfollowed_at < 0:
            return True
        return req.unfollowed_at + self.follow_window + self.k < len(req.prompt_ids) + req.params.max_tokens

    def pays(self, req: Request, n: int, costs: Sequence[float], draft_cost: float, max_model_len: int,
             per_draft: float = 0.0) -> bool:
        """Whether ``req``'s acceptance rate pays for its draft beside ``n`` decoders (``bar``)."""
        return req.draft_rate > self.bar(req, n, costs, draft_cost, max_model_len, per_draft)

    def follows(self, req: Request, n: int, costs: Sequence[float], draft_cost: float, max_model_len: int,
                per_draft: float = 0.0) -> bool:
        """Whether a checkpoint drafter keeps ``req``'s committed rows this step (``DecodeRow.follow``): while
        drafting could plausibly pay (``bar`` below ``FOLLOW_LIMIT``), as the request drafts or probes from
        them. Once it cannot (a full batch, a slow drafter), the step runs without the capture split, as a plain step;
        the drafter's rings then miss those positions and the request drafts again only once they are
        whole (``ModelDrafts.propose``'s ``ready``), never from a ring with holes."""
        if self.source != "model" or not self.catches_up(req):
            return False
        return self.bar(req, n, costs, draft_cost, max_model_len, per_draft) < FOLLOW_LIMIT

    def turn(self, req: Request, n: int, costs: Sequence[float], draft_cost: float, max_model_len: int,
             step: int, per_draft: float = 0.0) -> tuple[bool, bool]:
        """``(propose, follow)`` of ``req``'s decode row beside ``n`` decoders: whether a checkpoint
        drafter drafts its next block after this step (``wants_block``), and keeps its rows (``follows``);
        neither for n-gram drafts, which are looked up here when a step is planned."""
        if self.source != "model":
            return False, False
        return (self.wants_block(req, n, costs, draft_cost, max_model_len, step, per_draft),
                self.follows(req, n, costs, draft_cost, max_model_len, per_draft))

    def wants_block(self, req: Request, n: int, costs: Sequence[float], draft_cost: float, max_model_len: int,
                    step: int = 0, per_draft: float = 0.0) -> bool:
        """Whether a checkpoint drafter should draft ``req``'s next block after step ``step``: when its
        rate pays, or when the next step probes (a block costs a drafter forward, verified or not); never
        when no rate could pay (``follows``)."""
        if not self.follows(req, n, costs, draft_cost, max_model_len, per_draft):
            return False
        return self.pays(req, n, costs, draft_cost, max_model_len, per_draft) or (step + 1) % PROBE_EVERY == 0

    def _forced(self, req: Request, budget: int, max_model_len: int) -> tuple[int, ...]:
        """The tokens ``req``'s grammar forces next (a schema's keys and punctuation; ``forced_tokens``), as
        many as its draft may hold (``_length`` of ``k``, within ``budget``): a draft whatever the request's
        rate, as a row the grammar leaves one choice is accepted whenever the model writes the grammar's own
        tokenization, so it pays wherever any row does (the step's bar below the limit, checked before).
        Nothing without a grammar, or where ``forced`` is off."""
        if not self.forced or req.sampler.constraint is None:
            return ()
        n = min(self._length(req, max_model_len, self.k), budget)
        return forced_tokens(req.sampler, n) if n > 0 else ()

    def _candidate(self, req: Request, n: int) -> tuple[int, ...]:
        """Up to ``n`` tokens from the drafter (the model's block, or prompt lookup), cut before an image
        sentinel id and before the first token the request's grammar refuses (``_allowed``)."""
        draft = self._proposal(req, n) if self.source == "model" else self._lookup(req, n)
        draft = draft[:next((i for i, t in enumerate(draft) if not 0 <= t < self.vocab_size), len(draft))]
        return self._allowed(req, draft)

    @staticmethod
    def _allowed(req: Request, draft: tuple[int, ...]) -> tuple[int, ...]:
        """``draft`` up to the first token ``req``'s grammar refuses. A draft refused from its first token
        counts against the request's rate as a draft rejected at its first row (``refused``): it was
        drafted (a checkpoint drafter's forward spent on it), so a drafter that writes what the grammar
        never allows drafts less, as one the target rejects does."""
        ok = draft[:allowed_prefix(req.sampler, draft)]
        if draft and not ok:
            refused(req)
        return ok

    def _proposal(self, req: Request, n: int) -> tuple[int, ...]:
        """The first ``n`` tokens of the block the model drafter drafted for this very row (none when the
        request moved on since: a preemption, a failed step), cut where the drafter's own survival
        estimate falls below ``confidence`` (DeepSpec's truncation, ``ds4-speculative.md`` §5.3)."""
        if req.proposal_at != req.computed:
            return ()
        sure = next((i for i, s in enumerate(req.proposal_survival) if s < self.confidence),
                    len(req.proposal_survival) if req.proposal_survival else len(req.proposal))
        return req.proposal[:min(n, sure)]

    def _lookup(self, req: Request, n: int) -> tuple[int, ...]:
        """Up to ``n`` tokens by prompt lookup (``engine.ngram.propose``'s rule over prompt + output) from
        the request's own index, which takes in only the tokens added since its last draft."""
        if req.ngram is None:
            req.ngram = SuffixIndex(self.min_n, self.max_n, self.window)
        return req.ngram.propose(req.prompt_ids, req.output_ids, k=n)

    def _length(self, req: Request, max_model_len: int, want: int | None = None, bar: float = 0.0) -> int:
        """The longest draft worth verifying for ``req``: ``want``, by default ``rows_that_pay`` of its rate
        beside the step's ``bar``, within what it may still generate (the verified token after the draft
        counts too) and what the cache can undo."""
        want = rows_that_pay(req.draft_rate, bar, self.k) if want is None else want
        room = min(req.params.max_tokens - len(req.output_ids), max_model_len - req.total_len) - 1
        return max(0, min(want, room, self.max_rows))


def _ratio(gain: float, seconds: float) -> float:
    return gain / seconds if seconds > 0.0 else math.inf


def _opening(estimates: Sequence[float], row_cost: float, per_draft: float) -> int:
    """The rows a block opens with: the prefix of ``estimates`` with the most expected tokens per second
    of its verification (``per_draft`` once, ``row_cost`` a row); 1 without a cost per draft, where the
    first row (the likeliest) pays best."""
    best, best_rows, gain = -1.0, 1, 0.0
    for rows, s in enumerate(estimates, 1):
        gain += s
        r = _ratio(gain, per_draft + row_cost * rows)
        if r > best:
            best, best_rows = r, rows
    return best_rows


@functools.lru_cache(maxsize=256)  # asked for every row of every step, with a handful of distinct arguments
def worth(n: int, costs: Sequence[float], extra: float = 0.0) -> float:
    """The acceptance rate a draft must beat beside ``n`` decoders: a step of ``n`` rows costs ``a + b n``
    and yields ``n`` tokens; ``D`` draft rows add ``(c + extra) D`` and yield ``r D`` more, which pays
    when ``r > (c + extra) n / (a + b n)`` (``extra``: seconds per drafted token beyond its row, a
    checkpoint drafter's forward). Near 0 for one stream with a cheap drafter, where the step's fixed
    cost dominates; it rises with ``n`` as rows dominate, and turns drafting off once no rate can pay.
    Without measured costs (warm-up off): 0, the token budget alone decides."""
    if len(costs) != 3:
        return 0.0
    a, b, c = costs
    return (c + extra) * n / (a + b * n)


def rows_that_pay(rate: float, bar: float, k: int) -> int:
    """How many draft rows pay at a per-token acceptance ``rate`` beside a step whose ``bar`` a row's
    chance of acceptance must beat (``worth``): row ``i`` (from 0) is accepted only with every row before
    it, with chance ``rate ** (i + 1)``, so the rows that pay are the first ``L`` with ``rate ** L > bar``
    (at least 1: the caller drafts only when the first row pays, or probes), at most ``k``. The
    draft's average acceptance (the old rule drafted ``ceil(k * average)`` rows) hides that the later rows
    pay least: at 16 streams of the bundled model the positions were accepted 0.67 / 0.47 / 0.21 / 0.13
    beside a bar of 0.41, and every row past the second lost time."""
    if bar <= 0.0 or rate >= 1.0:
        return k
    if rate <= bar:
        return 1
    return max(1, min(k, math.ceil(math.log(bar) / math.log(rate)) - 1))


def estimated(req: Request, draft: tuple[int, ...], accepted: int) -> float | None:
    """The drafter's survival estimates of the ``draft`` rows ``req`` just verified, summed: its block
    was drafted for the row at ``proposal_at``, which ``computed`` has since passed by 1 + ``accepted``.
    None for an n-gram draft (no estimates) or a draft that is not that block's prefix (a grammar's forced
    tokens verified in its place)."""
    drafted = len(draft)
    survival = req.proposal_survival if req.proposal_at == req.computed - 1 - accepted else ()
    if not drafted or len(survival) < drafted or tuple(req.proposal[:drafted]) != tuple(draft):
        return None
    return sum(survival[:drafted])


def record(req: Request, drafted: int, accepted: int, expected: float | None = None) -> None:
    """Fold one verify step into ``req``'s acceptance rate and counts; ``expected``: the drafter's own
    survival estimates of those rows, summed (a checkpoint drafter's block), folded into
    ``req.survival_scale``'s record."""
    req.drafted_tokens += drafted
    req.accepted_tokens += accepted
    req.draft_hits = RATE_DECAY * req.draft_hits + accepted
    req.draft_stops = RATE_DECAY * req.draft_stops + (accepted < drafted)
    req.draft_rate = req.draft_hits / (req.draft_hits + req.draft_stops)
    if expected is not None:
        req.survival_hits = SURVIVAL_DECAY * req.survival_hits + accepted
        req.survival_expected = SURVIVAL_DECAY * req.survival_expected + expected


def refused(req: Request) -> None:
    """A draft the request's grammar refused from its first token (never verified): into the rate as a draft
    stopped at its first row, outside the verify figures (nothing was verified)."""
    req.draft_hits = RATE_DECAY * req.draft_hits
    req.draft_stops = RATE_DECAY * req.draft_stops + 1
    req.draft_rate = req.draft_hits / (req.draft_hits + req.draft_stops)


def count_draft(req: Request, draft: tuple[int, ...], accepted: int, spec: Counter) -> None:
    """Acceptance figures of one verify step: the request's own rate (its next draft lengths, ``record``)
    and the server's totals in ``spec`` (verify steps, drafted and accepted tokens, per draft position)."""
    record(req, len(draft), accepted, estimated(req, draft, accepted))
    spec["verify_steps"] += 1
    spec["drafted_tokens"] += len(draft)
    spec["accepted_tokens"] += accepted
    spec.update([f"accepted_at_{i}" for i in range(accepted)] + [f"drafted_at_{i}" for i in range(len(draft))])
