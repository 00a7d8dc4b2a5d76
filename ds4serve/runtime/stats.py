"""EngineStats: what the engine holds and has done, as one frozen snapshot the core publishes.

The core (``core.EngineCore``) builds a new ``EngineStats`` when it is constructed and after every
``step``, ``add``, ``abort`` and prefix-cache reset, on the thread that owns it, and swaps it into
``EngineCore.stats``. Any thread reads the latest through ``EngineLoop.stats``: a reference read of a
record that never changes, so a reader never sees scheduler or cache state half-way through a step.
The server's metrics (``server/metrics.py``) are rendered from it and from nothing else below.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

DECODE_WIDTH_WINDOW = 64  # decode steps averaged by ``EngineStats.decode_width``


@dataclass(frozen=True)
class StepRecord:
    """What one step did and how long it took (for metrics and benchmarks)."""

    step_id: int
    decode_rows: int
    prefill_rows: int  # rows of pass slices (each counted once per slice)
    layers_run: int  # row-layers executed
    elapsed_s: float


@dataclass(frozen=True)
class EngineStats:
    """One moment of the engine, as plain numbers (every mapping is read-only).

    ``requests``: live requests by status (``waiting``, ``prefilling``, ``decoding``, ``suspended``,
    ``parked``) and ``passes`` (prefill passes in flight), as ``Scheduler.counts`` gives them;
    ``counters``: the scheduler's running counters (``added``, ``preempt_suspend`` / ``_drop`` /
    ``_fail``, ``rejected``, ``completed``, ``aborted``, ...); ``prefix``: the prefix cache's figures
    (``enabled``, ``hits``, ``misses``, ``hit_tokens``, ``queried_tokens``, ``stored``, ``evictions``,
    ``snapshots``, ``cached_pages``, ``cached_bytes``, ``budget_bytes``; all 0 when caching is off; with
    lower tiers also ``host_*`` / ``disk_*``: ``hits``, ``bytes``, ``snapshots``, ``evictions``, ``budget_bytes``,
    and ``disk_skipped_files``, ``disk_dropped_writes``, ``disk_writes``);
    ``speculation``: speculative decoding's counts (``Scheduler.spec``: verify steps, drafted and accepted
    tokens, and per draft position ``drafted_at_i`` / ``accepted_at_i``); empty while nothing was drafted.
    """

    requests: Mapping[str, int]
    counters: Mapping[str, int]
    slots_in_use: int
    slots_total: int
    pages_in_use: int
    pages_total: int
    host_used: int  # bytes of host memory held by suspended requests
    prefix: Mapping[str, int]
    steps: int = 0  # calls of ``EngineCore.step`` (one a loop iteration with work)
    decode_steps: int = 0  # steps that decoded at least one row
    decode_rows: int = 0  # rows decoded (one token each), summed over steps
    prefill_rows: int = 0  # rows of pass slices, summed over steps
    decode_width: float = 0.0  # mean decoding rows per decode step over the last DECODE_WIDTH_WINDOW
    speculation: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    at: float = field(default_factory=time.time)  # wall-clock time of the snapshot

    @property
    def running(self) -> int:
        """Requests holding a slot (prefilling or decoding)."""
        return self.requests.get("prefilling", 0) + self.requests.get("decoding", 0)


class StepTally:
    """Running totals of the steps a core has run (its own thread's; published in ``EngineStats``)."""

    def __init__(self) -> None:
        self.steps = self.decode_steps = self.decode_rows = self.prefill_rows = 0
        self.recent: deque[int] = deque(maxlen=DECODE_WIDTH_WINDOW)

    def count(self, record: StepRecord | None) -> None:
        """One call of ``step``; ``record``: what it ran (None: nothing was planned)."""
        self.steps += 1
        if record is None:
            return
        self.prefill_rows += record.prefill_rows
        if record.decode_rows:
            self.decode_steps += 1
            self.decode_rows += record.decode_rows
            self.recent.append(record.decode_rows)

    @property
    def width(self) -> float:
        return sum(self.recent) / len(self.recent) if self.recent else 0.0


def frozen(mapping: Mapping) -> Mapping:
    """A read-only copy of ``mapping``."""
    return MappingProxyType(dict(mapping))


__all__ = ["DECODE_WIDTH_WINDOW", "EngineStats", "StepRecord", "StepTally", "frozen"]
