"""The last word on whether drafting pays beside ``n`` decoders: the tokens per second the steps really got.

The cost rule (``drafting``, ``step_costs``) decides from a model of a step's cost, fitted from noisy step
times, and from estimates of acceptance; near its break-even a few percent of error in either drafts where
drafting loses. On the bundled model at 4 streams its DSpark drafter's blocks cost ~0.2 ms each against
the ~0.05-0.08 ms a verified row the rule charged them (the drafter's cost per row was learnt at one stream,
where a block is verified whole), and the drafting steps there ran at 3.9 tokens a ms against the plain
steps' 4.4 (a 0.79x round). This guard does not model anything: per width it keeps the decayed tokens and
seconds of the steps that verified drafts and of the plain ones, and once both are known it turns drafting
off at a width whose drafting steps get fewer tokens a second than its plain ones. The drafter's own
seconds (its blocks, drafted in the step before the one that verifies them, and the rows it commits)
count for drafting wherever they are spent. A width whose drafter follows (captures and commits rows) for
``IDLE_STEPS`` steps after it drafted a block without a draft verified in between is turned off too: at 4
streams of the bundled model the cost rule kept DSpark following, with probe blocks that it then refused to
verify (no row paid), ~4% of every step for nothing. (Following while the drafter's window fills after a gap
drafts no block, and does not count.) A width turned off is tried again ``RETRY`` steps later (its
drafting record forgotten): the text or the load may have changed.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.97  # weight of the past in a width's record, per step of that kind
MIN_STEPS = 6.0  # decayed steps of each kind a width needs before the guard judges it
RETRY = 256  # steps at a width turned off before its drafting is tried again
PLAIN_EVERY = 16  # a width that drafts but lacks plain steps runs one plain in this many (``baseline``)
IDLE_STEPS = 64  # steps a width's drafter may follow without a draft verified before it is turned off


@dataclass
class _Record:
    tokens: float = 0.0
    seconds: float = 0.0
    steps: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = DECAY * self.tokens + tokens
        self.seconds = DECAY * self.seconds + seconds
        self.steps = DECAY * self.steps + 1.0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class DraftGuard:
    """Per width, the realised tokens per second of drafting and of plain decode steps (see the module)."""

    def __init__(self) -> None:
        self._plain: dict[int, _Record] = {}
        self._drafting: dict[int, _Record] = {}
        self._off_since: dict[int, int] = {}  # width -> steps observed there since it was turned off
        # width -> steps its drafter followed since it drafted a block, without a draft verified (None: no block
        # drafted since the last verified draft)
        self._idle: dict[int, int | None] = {}

    def observe(self, width: int, drafting: bool, tokens: int, seconds: float, drafter_s: float = 0.0,
                followed: bool = False, blocks: int = 0) -> None:
        """One decode-only step of ``width`` decoders that committed ``tokens`` in ``seconds``, ``drafter_s`` of
        them the drafter's own; ``drafting``: it verified a draft; ``followed``: its drafter captured rows in
        it; ``blocks``: the blocks it drafted."""
        if width <= 0 or not seconds > 0 or not 0.0 <= drafter_s <= seconds:
            return
        idle = self._idle.get(width)
        if drafting:
            idle = None
        elif blocks or (idle is not None and followed):
            idle = (idle or 0) + 1
        self._idle[width] = idle
        if drafting:
            self._drafting.setdefault(width, _Record()).add(tokens, seconds)
        else:
            self._plain.setdefault(width, _Record()).add(tokens, seconds - drafter_s)
            if drafter_s:  # blocks for the next step's drafts: drafting's time
                self._drafting.setdefault(width, _Record()).seconds += drafter_s
        if width in self._off_since:
            self._off_since[width] += 1
            if self._off_since[width] >= RETRY:  # try again from a clean record
                del self._off_since[width]
                self._drafting.pop(width, None)
        elif self._loses(width) or (idle or 0) >= IDLE_STEPS:
            self._off_since[width] = 0
            self._idle[width] = None

    def baseline(self, width: int, step: int) -> bool:
        """Whether step ``step`` of ``width`` decoders should run plain, for the record to compare with: a
        width that drafts on every step (one stream of a drafter that pays) has no plain steps of its own
        (``StepCosts.baseline`` stops at the few its fit needs)."""
        if step % PLAIN_EVERY:
            return False
        p = self._plain.get(width)
        return p is None or p.steps < MIN_STEPS

    def allows(self, width: int) -> bool:
        """Whether drafting may run beside ``width`` decoders."""
        return width not in self._off_since

    def _loses(self, width: int) -> bool:
        d, p = self._drafting.get(width), self._plain.get(width)
        if d is None or p is None or d.steps < MIN_STEPS or p.steps < MIN_STEPS:
            return False
        return d.rate < p.rate
