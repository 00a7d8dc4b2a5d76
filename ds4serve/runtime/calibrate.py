"""A step budget calibrated to time: how many prefill tokens a step may carry beside ``n`` decoders.

Why: the token budget (``step_tokens``) treats a decode row and a prefill token as equal, but on a
dispatch-bound CPU a 16-row decode step costs ~40 ms while each prefill token adds well under 1 ms,
so a step that carries 240 prefill tokens beside 16 decoders took ~4x their normal step: every
stream stalled (p99 inter-token latency 2-4x llama.cpp's). Users feel the stall, so the budget is
set by time: a step that carries prefill may take at most ``max_stall`` times the pure-decode step
of the same decoders.

The costs are measured once at start-up, on scratch slots, after the warm-up: a pure-decode step
of one row and of several rows, and a prefill of one chunk, fitted as
``step(n, P) = a + b * n + c * P``. The budget for ``n`` decoders is then
``P(n) = (max_stall - 1) * (a + b * n) / c`` tokens, clamped to ``[min_prefill_tokens,
step_tokens - n]``, and fixed as a table for the life of the process, so chunk boundaries are
deterministic within a run (exactness never depends on timing: any chunking computes the same).
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from ..engine.plan import DecodeRow, PassMember, PassSlice, StepPlan, validate_step_result
from ..engine.sampling import SamplerState, SamplingParams
from .parts import EngineParts

log = logging.getLogger(__name__)

_REPEATS = 3
_ENOUGH_S = 0.5  # timed runs stop early once they add up to this (a 128-token prefill at real widths: ~1 s)
_PREFILL_PROBE = 128  # tokens of the prefill probe (fewer where staging or the pool is smaller)


def _timed(parts: EngineParts, plan: StepPlan, what: str) -> float:
    """Median wall time of ``plan`` over a few runs (the first run, cold, is discarded; fewer runs where
    each is long: the start-up of a real-width model is part of its time to healthy)."""
    times: list[float] = []
    for i in range(_REPEATS + 1):
        if sum(times) >= _ENOUGH_S:
            break
        t = time.perf_counter()
        res = parts.executor.step(plan)
        if parts.device.type == "cuda":
            torch.cuda.synchronize(parts.device)
        if i:
            times.append(time.perf_counter() - t)
        problem = validate_step_result(plan, res, parts.cfg.num_layers)
        if problem:
            raise RuntimeError(f"step-budget calibration: {what} failed: {res.error or problem}")
    return statistics.median(times)


def probe_position(parts: EngineParts) -> int:
    """Where the decode probe decodes: past a full sliding window and several compressed rows, as a
    live stream does (a decoder at position 8 attends to 8 keys and costs a third less here than one
    at 300, which would make the budget too generous), within the context and the page pool."""
    want = 4 * parts.cfg.sliding_window
    room = parts.cache.free_pages // max(1, min(parts.resolved.max_seqs, 16)) * parts.cache.layout.page_tokens
    return max(8, min(want, parts.resolved.max_model_len - 2, room - 2))


def _decode_time(parts: EngineParts, n: int, position: int) -> float:
    cache, slots = parts.cache, []
    try:
        for _ in range(n):
            slot = cache.alloc_slot()
            if slot is None or not cache.reserve({slot: position + 2}):
                raise RuntimeError("step-budget calibration: no room for its decode probe")
            slots.append(slot)
        greedy = SamplerState(SamplingParams(temperature=0.0), (3,), [])
        rows = tuple(DecodeRow(f"calibrate-{i}", s, position, 3, greedy) for i, s in enumerate(slots))
        return _timed(parts, StepPlan(-10, rows), f"decode of {n} rows")
    finally:
        for s in slots:
            cache.drop(s)


def _prefill_time(parts: EngineParts, n: int) -> float:
    cache, L = parts.cache, parts.cfg.num_layers
    slot = cache.alloc_slot()
    try:
        if slot is None or not cache.reserve({slot: n + 1}):
            raise RuntimeError("step-budget calibration: no room for its prefill probe")
        ids = tuple(3 + i % max(1, parts.cfg.vocab_size - 3) for i in range(n))
        member = PassMember("calibrate", slot, 0, ids, sample=True,
                            sampler=SamplerState(SamplingParams(temperature=0.0), ids, []))
        return _timed(parts, StepPlan(-11, (), (PassSlice(-11, 0, L, (member,)),)), f"prefill of {n} tokens")
    finally:
        cache.drop(slot)


def budget_table(a: float, b: float, c: float, max_stall: float, n_max: int, min_tokens: int,
                 step_tokens: int) -> tuple[int, ...]:
    """``P(n)`` for ``n = 0..n_max`` from the fitted costs (see the module docstring). ``P(0)`` is
    unused (a step without decoders prefills whole) and kept as ``step_tokens``."""
    out = [step_tokens]
    for n in range(1, n_max + 1):
        allowed = int((max_stall - 1.0) * (a + b * n) / c) if c > 0 else step_tokens
        out.append(max(min_tokens, min(step_tokens - n, allowed)))
    return tuple(out)


def calibrate(parts: EngineParts, max_stall: float) -> tuple[tuple[int, ...], tuple[float, float, float]]:
    """Measure the step costs on scratch slots of the assembled parts (before any core exists) and
    return the prefill-token table (``SchedulerLimits.prefill_tokens_at``; empty when ``max_stall`` is 0,
    the token budget alone) and the fitted costs ``(a, b, c)`` in seconds (``SchedulerLimits.step_costs``:
    speculative drafting weighs a draft row's cost ``c`` against what its acceptance saves)."""
    t0 = time.perf_counter()
    n_big = max(1, min(parts.resolved.max_seqs, 16, parts.cache.free_slots,
                       parts.cache.free_pages // max(1, parts.cache.layout.pages_for(probe_position(parts) + 2))))
    probe = max(2, min(_PREFILL_PROBE, parts.resolved.staging_rows, parts.settings.max_prefill_tokens))
    pos = probe_position(parts)
    t1 = _decode_time(parts, 1, pos)
    tn = _decode_time(parts, n_big, pos) if n_big > 1 else t1
    tp = _prefill_time(parts, probe)
    b = max(0.0, (tn - t1) / (n_big - 1)) if n_big > 1 else 0.0
    a = max(1e-6, t1 - b)
    c = max(1e-9, (tp - t1) / (probe - 1))
    lim = parts.settings
    if not max_stall:
        log.info("step costs measured in %.2f s: decode %.1f ms (1 row) / %.1f ms (%d rows), prefill %.3f ms per "
                 "token", time.perf_counter() - t0, 1000 * t1, 1000 * tn, n_big, 1000 * c)
        return (), (a, b, c)
    table = budget_table(a, b, c, max_stall, parts.resolved.max_seqs, lim.min_prefill_tokens, lim.step_tokens)
    show = sorted({1, min(4, len(table) - 1), len(table) - 1})
    log.info("step budget calibrated in %.2f s: decode at position %d %.1f ms (1 row) / %.1f ms (%d rows), "
             "prefill %.3f ms per token -> prefill tokens per step beside %s decoders: %s (a step with prefill "
             "<= %.1fx its decoders' step; step_tokens %d caps it)", time.perf_counter() - t0, pos, 1000 * t1,
             1000 * tn, n_big, 1000 * c,
             "/".join(map(str, show)), "/".join(str(table[n]) for n in show), max_stall, lim.step_tokens)
    return table, (a, b, c)
