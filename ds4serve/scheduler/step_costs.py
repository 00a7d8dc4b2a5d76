"""What a decode step really costs, learnt from the steps themselves (speculative decoding's cost rule).

The start-up calibration (``runtime/calibrate.py``) times the forward alone: ``a + b n + c P``. A step
also plans, samples every row in Python, verifies drafts and folds the results back, and on a small
model those per-row costs are most of it (the bundled model: a plain step of 16 decoders took 2.2 ms
where the forward's fit said 0.97 ms, and a draft row cost several prefill rows). A cost rule fed the
forward's figures keeps drafting where it no longer pays. So the scheduler times each decode-only step
from planning to the end of ``apply`` and this model fits ``seconds = a + b n + c D`` (``n`` decoders,
``D`` draft rows) over the last ``WINDOW`` such steps, by weighted least squares. The calibrated costs
enter as pseudo-steps (``PRIOR_WEIGHT`` each at the corners of the range seen), so a fit over steps
that all look alike stays near the prior instead of swinging. Steps with prompt work are left out: their
rows would be charged to the decoders. Once the window holds enough plain steps, ``a + b n`` comes from
them alone and ``c`` from what the drafting steps cost beyond that (``_fit_apart``: drafting steps carry
per-request verification cost the joint fit spread over ``b``). A checkpoint drafter's own forward is
charged per draft row it got verified (``draft_cost``), not per token of the block it drafted.

A drafting step also costs something per request that carries a draft, whatever its length (the verify
rows' own forward path, settling the draft, the drafter's bookkeeping): on the bundled model ~0.3 ms a
drafting step at one stream against ~0.05-0.1 ms a verified row. Fitted as a row cost alone, it made a row
look dearer the shorter the blocks got (0.09 ms at 3.5 rows a block, 0.4 at 1.5): blocks were cut shorter,
rows looked dearer still, and drafting switched itself off at 0.7-0.93x of plain decoding. So ``_fit_apart``
fits the drafting steps' excess as ``c D + e k`` (``k`` decoders carrying a draft) and ``per_draft`` is
``e``: ``drafting.DraftPolicy`` charges it to a draft as a whole.

What keeps the fit honest where a server drafts on every step: the prior's corners fade as real steps
of their kind come (``_prior_weight``); a step in ``BASELINE_EVERY`` runs plain while the window lacks
plain steps of its width (``baseline``), so the plain cost at that width is timed, not extrapolated from
a calibration that was a quarter off; stalled steps are left out (``_without_spikes``); and the serving
loop's own work between steps counts in ``a`` (``observe_gap``), as every step pays it.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Sequence

import numpy as np

WINDOW = 256  # decode-only steps the fit remembers
REFIT_EVERY = 32  # steps between fits (a fit walks the window: ~0.1-0.3 ms, ~10-20 us a step at 16)
BLOCK_DECAY = 0.9  # weight of the past in the running cost of drafting one block
PRIOR_WEIGHT = 4.0  # each corner pseudo-step of the calibrated costs counts as this many observed steps
APART_MIN_PLAIN = 24  # plain steps the window must hold before a and b come from them alone (``_fit_apart``)
DRAFT_DECAY = 0.98  # per step, of the running sums of drafter seconds and of the draft rows verified
PRIOR_BLOCK_ROWS = 4  # draft rows the prior block of ``draft_cost`` was verified in
SPIKE = 2.5  # a step that took this many times its fitted cost was stalled (another job, a pause): left out
GAP_DECAY = 0.95  # weight of the past in the running time between one step's apply and the next plan
GAP_MAX = 0.01  # a longer gap is the loop waiting for work, not its per-step work: not counted
BASELINE_EVERY = 16  # a step in this many runs without drafts while the window lacks plain steps of its width
BASELINE_MIN = 8  # plain steps of a width the window should hold for the fit to know that width's cost


_N, _D, _T, _K = range(4)  # the columns of a window row: decoders, draft rows, seconds, decoders carrying a draft


class StepCosts:
    """The ``(a, b, c)`` that ``drafting.worth`` reads: fitted from observed steps once there are
    ``REFIT_EVERY`` of them, the calibrated prior until then. The window is a numpy ring of
    ``(n, D, seconds, k)`` rows, so observing a step is a row write and a fit a few dozen array operations
    (a fit in Python loops walked the window twice: ~0.2 ms, 7 us a step; with the running sums an
    observation kept, ~11 us a step in all, a percent of a 16-stream step of the bundled model)."""

    def __init__(self, prior: Sequence[float] = ()):
        self.prior = tuple(prior)
        self.block_cost = 0.0  # seconds a checkpoint drafter takes to draft one block (a running average)
        self._ring = np.zeros((WINDOW, 4))  # (n, D, seconds, k) of the last WINDOW decode-only steps
        self._kinds: deque[tuple[int, bool]] = deque()  # (n, drafted) of the same steps, oldest first
        self._at = 0  # the ring row the next step is written to
        self._plain: Counter[int] = Counter()  # plain steps in the window, by width
        self._drafted: Counter[int] = Counter()  # drafting steps in the window, by width
        self._since_fit = 0
        self._fitted: tuple[float, ...] = self.prior
        self._per_draft = 0.0  # ``e``: seconds a drafting step spends per decoder carrying a draft (``_fit_apart``)
        self._draft_s = self._draft_rows = 0.0  # decayed sums: drafter seconds, draft rows verified
        self.gap = 0.0  # seconds the serving loop spends between steps (running average, observe_gap)
        self._applied_at: float | None = None

    def observe(self, decoders: int, draft_rows: int, seconds: float, drafting: int | None = None) -> None:
        """One decode-only step: ``decoders`` rows of their own, ``draft_rows`` more (carried by ``drafting``
        of the decoders; one by default when there are any), ``seconds`` from planning to the end of applying it."""
        if decoders <= 0 or not seconds > 0 or seconds == float("inf"):
            return
        k = (1 if draft_rows else 0) if drafting is None else drafting
        self._ring[self._at] = (decoders, draft_rows, seconds, k)
        self._at = (self._at + 1) % WINDOW
        self._kinds.append((decoders, draft_rows > 0))
        (self._drafted if draft_rows else self._plain)[decoders] += 1
        if len(self._kinds) > WINDOW:
            n, drafted = self._kinds.popleft()
            (self._drafted if drafted else self._plain)[n] -= 1
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY:
            self._since_fit = 0
            self._fitted, self._per_draft = self._without_spikes(*self._fit())

    def window(self) -> np.ndarray:
        """The remembered steps, ``[m, 4]`` rows of ``(n, D, seconds, k)`` (in no particular order)."""
        return self._ring[:len(self._kinds)]

    @property
    def per_draft(self) -> float:
        """``e``: what a drafting step costs per decoder carrying a draft beyond its rows (0 until fitted)."""
        return self._per_draft

    def baseline(self, decoders: int, step: int) -> bool:
        """Whether step ``step`` of ``decoders`` decoders should run without drafts, to time a plain step of
        that width: one in ``BASELINE_EVERY`` steps while the window holds fewer than ``BASELINE_MIN`` of
        them. A server that drafts on every step never sees its plain steps, and the start-up calibration
        it falls back to was off by a quarter at 16 streams of the bundled model (2.5 ms against 2.2): a
        token looked worth more than it was, a draft row cost less, and n-gram drafts ran at 0.86x."""
        return step % BASELINE_EVERY == BASELINE_EVERY // 2 and self._plain[decoders] < BASELINE_MIN

    def observe_blocks(self, seconds: float, blocks: int, verified: int = 0, block_seconds: float | None = None
                       ) -> None:
        """A step's checkpoint-drafter time for ``blocks`` blocks (left out of the step's own ``seconds``),
        and the ``verified`` draft rows the step carried (blocks drafted earlier). ``block_seconds``: of
        ``seconds``, the blocks' own forward (``block_cost``; all of ``seconds`` when not given): the rows
        committed beside it vary with what the step accepted and are no part of a block's cost."""
        own = seconds if block_seconds is None else block_seconds
        if blocks > 0 and own >= 0:
            if self.block_cost > 0.0:  # a stalled drafter forward (``SPIKE``) counts as a slow one, no more
                clamped = min(own, SPIKE * self.block_cost * blocks)
                seconds, own = seconds - (own - clamped), clamped
            per = own / blocks
            self.block_cost = per if self.block_cost == 0.0 else BLOCK_DECAY * self.block_cost + (1 - BLOCK_DECAY) * per
        self._draft_s = DRAFT_DECAY * self._draft_s + max(0.0, seconds)
        self._draft_rows = DRAFT_DECAY * self._draft_rows + verified

    @property
    def draft_cost(self) -> float:
        """Drafter seconds per draft row verified: what drafting one more verified token costs beyond its
        row. A block is drafted whole (5 tokens) but the budget and the confidence cut may verify one or
        two of them, so the block's cost spread over its length undercounts it (on the bundled model
        ~3.6x at 4 streams, where drafting then ran at 0.81x). The sums start from one block verified in
        ``PRIOR_BLOCK_ROWS`` rows, so a drafter is tried before it has a record, and one that stopped
        drafting (its sums decay) is tried again."""
        return (self._draft_s + self.block_cost) / (self._draft_rows + PRIOR_BLOCK_ROWS)

    def _without_spikes(self, fitted: tuple[float, ...], per_draft: float = 0.0) -> tuple[tuple[float, ...], float]:
        """``fitted`` again without the steps that took over ``SPIKE`` times what it says they cost. Least
        squares weighs a stalled step (the cores shared with another job, a collector pause) by its square:
        a few of them among the drafting steps, which run longer and so are stalled more often, charged the
        bundled model's draft row twice its cost, and drafting went off at one stream where it paid 1.2x.
        A stall says nothing about what a row costs; a cost that really rose (a slower machine) is not
        a spike for long, as every refit moves the bar with it."""
        if len(fitted) != 3:
            return fitted, per_draft
        a, b, c = fitted
        w = self.window()
        kept = w[w[:, _T] <= SPIKE * (a + b * w[:, _N] + c * w[:, _D] + per_draft * w[:, _K])]
        if len(kept) == len(w) or 2 * len(kept) < len(w):
            return fitted, per_draft  # none, or so many that they are the machine's pace now, not stalls
        return self._fit(kept)

    def planned(self) -> float:
        """A step is being planned: now, after folding in the gap since the last step was applied."""
        now = time.perf_counter()
        if self._applied_at is not None:
            self.observe_gap(now - self._applied_at)
            self._applied_at = None
        return now

    def applied(self) -> None:
        """The step planned last is applied (its outputs go to the loop now)."""
        self._applied_at = time.perf_counter()

    def settled(self, seconds: float) -> None:
        """``seconds`` after the last apply were the step's own (waiting for its drafter's blocks, which
        ran beside the apply): not the loop's gap."""
        if self._applied_at is not None:
            self._applied_at += seconds

    def observe_gap(self, seconds: float) -> None:
        """The time from one step's apply to the next step's plan: the serving loop's own work a step
        (publishing figures, handing out tokens), which every step pays and the steps' timing misses.
        Gaps over ``GAP_MAX`` are the loop idle, waiting for requests: not counted."""
        if 0.0 <= seconds <= GAP_MAX:
            self.gap = seconds if self.gap == 0.0 else GAP_DECAY * self.gap + (1 - GAP_DECAY) * seconds

    def costs(self) -> tuple[float, ...]:
        """``(a, b, c)``: the fit, with the loop's gap in ``a`` (a step's whole cost, what a token is worth;
        left out, one stream of the bundled model valued a token a fifth too low and stopped drafting where
        drafting paid 1.3x)."""
        if len(self._fitted) == 3 and self.gap:
            return (self._fitted[0] + self.gap, *self._fitted[1:])
        return self._fitted

    def fit(self, steps: Sequence[tuple[int, int, float, int]] | None = None) -> tuple[float, ...]:
        """``(a, b, c)`` of ``_fit`` (``per_draft`` aside) over ``steps`` (``(n, D, seconds, k)`` each), the
        window's by default."""
        return self._fit(None if steps is None else np.asarray(steps, dtype=np.float64).reshape(-1, 4))[0]

    def _fit(self, w: np.ndarray | None = None) -> tuple[tuple[float, ...], float]:
        """``(a, b)`` from the plain steps and ``c`` from what the drafting steps cost beyond them
        (``_fit_apart``) once plain steps of two widths are remembered; else weighted least squares of
        ``seconds`` on ``(1, n, D)`` over the steps and the prior's corner pseudo-steps. Each cost clamped
        at 0 (a negative one is noise). Without a prior, the steps alone, once both ``n`` and ``D`` have
        varied (else the system has no unique answer). ``w``: rows of ``(n, D, seconds, k)``, the window's
        by default."""
        w = self.window() if w is None else w
        apart = self._fit_apart(w)
        if apart is not None:
            return apart[:3], apart[3]
        drafted = w[:, _D] > 0
        if len(self.prior) == 3 and not drafted.any():
            return self._undrafted(w), 0.0
        n, d, t = w[:, _N], w[:, _D], w[:, _T]
        weights = np.ones(len(w))
        if len(self.prior) == 3:
            a, b, c = self.prior
            top_n = max(float(n.max()) if len(w) else 1.0, 2.0)
            top_d = (float(d.max()) if len(w) else 1.0) or 1.0
            corners = [(cn, cd) for cn in (1.0, top_n) for cd in (0.0, top_d)]
            n = np.concatenate([n, [cn for cn, _ in corners]])
            d = np.concatenate([d, [cd for _, cd in corners]])
            t = np.concatenate([t, [a + b * cn + c * cd for cn, cd in corners]])
            weights = np.concatenate([weights, [self._prior_weight(int(cn), int(cd)) for cn, cd in corners]])
        elif len(np.unique(n)) < 2 or len(np.unique(d)) < 2:
            return self.prior, 0.0
        x = np.stack([np.ones_like(n), n, d], axis=1)
        m, v = x.T @ (weights[:, None] * x), x.T @ (weights * t)
        fitted = _solve3(m.tolist(), v.tolist())
        return tuple(max(0.0, float(f)) for f in fitted), 0.0

    def _undrafted(self, w: np.ndarray) -> tuple[float, float, float]:
        """``(a, b, c)`` of a window without drafting steps: ``a + b n`` from its plain steps (``_plain_line``;
        too few of them: the calibrated line scaled to their median), and ``c``, which no step measured, the
        calibrated row cost scaled alike (a machine slower than at start-up is slower at every row). The
        joint fit gave ``c`` whatever the prior's drafting corners said beyond the line the plain steps
        drew: at 4 streams of the bundled model, calibrated a tenth above its plain steps, 0.05 -> 0.2 ms a
        row from plain steps alone, and drafting was priced out by a cost no draft had shown."""
        pa, pb, pc = self.prior
        line = pa + pb * w[:, _N]
        ok = line > 0
        scale = float(np.sort(w[ok, _T] / line[ok])[int(ok.sum()) // 2]) if ok.any() else 1.0
        fitted = self._plain_line(w[:, _N], w[:, _T], float(w[:, _N].max()) if len(w) else 1.0)
        a, b = fitted if fitted is not None else (scale * pa, scale * pb)
        return max(0.0, a), max(0.0, b), scale * pc

    def _fit_apart(self, w: np.ndarray) -> tuple[float, float, float, float] | None:
        """``(a, b, c, e)``. The joint fit charges a draft row too little when drafting steps cost more than
        their rows and ``D`` grows with ``n`` (the two are then nearly the same column): on the bundled
        model, 0.12 ms a draft row where the steps said 0.30. So: ``a + b n`` by least squares over the
        plain steps (and the prior's plain corners), then the drafting steps' excess over it by least
        squares through the origin on ``(D, k)`` (``_excess_fit``). None until ``APART_MIN_PLAIN`` plain
        steps of two widths or more are remembered."""
        drafted = w[:, _D] > 0
        if not drafted.any():
            return None
        plain = w[~drafted]
        line = self._plain_line(plain[:, _N], plain[:, _T], float(w[:, _N].max()))
        if line is None:
            return None
        a, b = line
        dr = w[drafted]
        d, k, x = dr[:, _D], dr[:, _K], dr[:, _T] - a - b * dr[:, _N]
        weights = np.ones(len(dr))
        if len(self.prior) == 3:  # the prior's corner: its row cost, no cost per draft
            top_d = float(d.max())
            d, k = np.append(d, top_d), np.append(k, 1.0)
            x, weights = np.append(x, self.prior[2] * top_d), np.append(weights, self._prior_weight(None, int(top_d)))
        c, e = _excess_fit(d, k, x, weights)
        return max(0.0, a), max(0.0, b), c, e

    def _prior_weight(self, n: int | None, d: int) -> float:
        """The weight of the calibrated prior's corner at width ``n`` (None: every width) with ``d`` draft
        rows: ``PRIOR_WEIGHT``, fading to 0 as the window fills with ``BASELINE_MIN`` real steps of that
        kind (plain or drafting). The calibration times the forward at start-up: at 16 streams of the
        bundled model it said 2.5 ms where the steps took 2.2, and a fixed-weight corner kept the fit
        there however many plain steps were timed."""
        counts = self._plain if d == 0 else self._drafted
        seen = sum(counts.values()) if n is None else counts[n]
        return PRIOR_WEIGHT * max(0.0, 1.0 - seen / BASELINE_MIN)

    def _plain_line(self, n: np.ndarray, t: np.ndarray, top_n: float) -> tuple[float, float] | None:
        """``(a, b)`` of the plain steps' ``a + b n`` (widths ``n``, seconds ``t``): least squares once
        ``APART_MIN_PLAIN`` of them span two widths or more (the prior's plain corners pulling a little).
        Plain steps of one width say nothing of ``b``: then the calibrated line scaled to their median, from
        ``APART_MIN_PLAIN // 3`` of them. One stream that drafts most steps has a few plain steps at n = 1
        only, and the joint fit charged the drafting steps' own overhead to ``a`` (1.05 ms where a plain
        step took 0.75): at the next width, 4 streams, a token looked worth a third more than it was, and
        drafting ran at 0.9x until the window learnt the width. None without enough plain steps (or a
        prior for one width)."""
        if not len(n):
            return None
        lo, hi = float(n.min()), float(n.max())
        if lo == hi and len(self.prior) == 3 and len(n) >= APART_MIN_PLAIN // 3:
            pa, pb, _ = self.prior
            times = np.sort(t)
            scale = float(times[len(times) // 2]) / (pa + pb * lo) if pa + pb * lo > 0 else 1.0
            return scale * pa, scale * pb
        if len(n) < APART_MIN_PLAIN or lo == hi:
            return None
        weights = np.ones(len(n))
        if len(self.prior) == 3:
            pa, pb, _ = self.prior
            n = np.append(n, [1.0, top_n])
            t = np.append(t, [pa + pb, pa + pb * top_n])
            weights = np.append(weights, [self._prior_weight(1, 0), self._prior_weight(int(top_n), 0)])
        total = float(weights.sum())
        mn, mt = float(weights @ n) / total, float(weights @ t) / total
        var = float(weights @ (n - mn) ** 2)
        b = float(weights @ ((n - mn) * (t - mt))) / var if var > 0 else 0.0
        return mt - b * mn, b


COLLINEAR = 0.01  # drafting steps whose D / k varies less than this (relative) cannot tell c from e


def _excess_fit(d: np.ndarray, k: np.ndarray, x: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    """``(c, e)`` of ``x = c D + e k`` by weighted least squares through the origin over the steps' ``D``,
    ``k``, excess ``x`` and weight ``w``, each clamped at 0 (the other refitted alone then). Where ``D / k``
    barely varies (every draft the same length) the two cannot be told apart: ``c`` alone, as a cost per
    row, is then exact for those steps."""
    sdd, sdk, skk = float(w @ (d * d)), float(w @ (d * k)), float(w @ (k * k))
    sdx, skx = float(w @ (d * x)), float(w @ (k * x))
    if sdd <= 0.0:
        return 0.0, 0.0
    det = sdd * skk - sdk * sdk
    if det <= COLLINEAR * sdd * skk:
        return max(0.0, sdx / sdd), 0.0
    c, e = (skk * sdx - sdk * skx) / det, (sdd * skx - sdk * sdx) / det
    if e < 0.0:
        return max(0.0, sdx / sdd), 0.0
    if c < 0.0:
        return 0.0, max(0.0, skx / skk)
    return c, e


def _det3(m: Sequence[Sequence[float]]) -> float:
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))


def _solve3(m: list[list[float]], v: list[float]) -> tuple[float, float, float]:
    """``m x = v`` for a symmetric positive 3x3 ``m`` by Cramer's rule (a library call costs more than
    the arithmetic here); a singular system (steps that never varied) gives zeros, as no answer."""
    det = _det3(m)
    if abs(det) < 1e-300:
        return 0.0, 0.0, 0.0
    out = []
    for col in range(3):
        mc = [[v[r] if c == col else m[r][c] for c in range(3)] for r in range(3)]
        out.append(_det3(mc) / det)
    return out[0], out[1], out[2]
