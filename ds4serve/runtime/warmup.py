"""Warm-up: drive every engine path once at start-up, on scratch slots, before any user arrives.

A path that fails here fails loudly at start-up instead of on a user's request, and the first real
request does not pay for lazy initialisation (kernels, graphs, the encoder's first image).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from ..cache import SeqChunk
from ..engine.plan import DecodeRow, PassMember, PassSlice, StepPlan, validate_step_result
from ..engine.sampling import SamplerState, SamplingParams
from ..multimodal.layout import image_block
from ..multimodal.records import ImageInput, ImageSpan, sentinel_ids

if TYPE_CHECKING:
    from .core import EngineCore

log = logging.getLogger(__name__)


def warm_up(core: EngineCore) -> None:
    """A layer-sliced pass through staging, a merged decode + chunk forward, greedy / random /
    logprob sampling, suspend and restore; then, with an encoder, one image through a pass."""
    t0 = time.perf_counter()
    check_host(core)
    t1 = time.perf_counter()
    core.startup["self-check"] = t1 - t0
    _warm_text(core)
    if core.encoder is not None:
        _warm_image(core)
    leak = core.leaks()
    if leak:
        raise RuntimeError(f"warm-up leaked: {leak}")
    core.startup["warm-up"] = time.perf_counter() - t1
    log.info("warm-up: sliced pass, merged step, sampling, suspend/restore%s ok in %.2f s",
             ", encoder + image pass" if core.encoder is not None else "", time.perf_counter() - t1)


def _run(core: EngineCore, plan: StepPlan, what: str) -> None:
    res = core.engine.step(plan)
    problem = validate_step_result(plan, res, core.cfg.num_layers)
    if problem:
        raise RuntimeError(f"warm-up {what} failed: {res.error or problem}")


def _warm_text(core: EngineCore) -> None:
    cache, L = core.cache, core.cfg.num_layers
    n = min(8, core.resolved.staging_rows)
    slot = cache.alloc_slot()
    ids = tuple(int(i) % core.cfg.vocab_size for i in range(3, 3 + n))
    greedy = SamplerState(SamplingParams(temperature=0.0, logprobs=2), ids, [])
    rand = SamplerState(SamplingParams(temperature=0.8, top_p=0.9, top_k=5, seed=0), ids, [])
    try:
        if not cache.reserve({slot: n + 2}):
            raise RuntimeError("warm-up: the page pool cannot hold one short sequence")
        mid = max(1, L // 2)
        member = PassMember("warmup", slot, 0, ids, sample=True, sampler=greedy)
        _run(core, StepPlan(-1, (), (PassSlice(-1, 0, mid, (member,)),)), "sliced pass")
        if mid < L:
            _run(core, StepPlan(-2, (), (PassSlice(-1, mid, L, (member,)),)), "sliced pass")
        snap = cache.suspend(slot, n)
        if snap is not None:
            slot = cache.restore(snap)
            if slot is None or not cache.reserve({slot: n + 2}):
                raise RuntimeError("warm-up: restore after suspend failed")
        _run(core, StepPlan(-3, (DecodeRow("warmup", slot, n, 1, rand),)), "decode")
    finally:
        cache.drop(slot)


def _warm_image(core: EngineCore) -> None:
    """Encode a blank 1x1-grid image on the worker and prefill its block through a pass."""
    v, cache, encoder = core.cfg.vision, core.cache, core.encoder
    blk = image_block(1, 1, 1)
    image = ImageInput(torch.zeros(9, 3, v.patch_size, v.patch_size), 3, 3, blk, "warmup")
    encoder.submit("warmup", [image])
    state = encoder.ready("warmup")[0] if encoder.wait("warmup", 120) else None
    if state is None or state.rows.rows is None:
        raise RuntimeError(f"warm-up: the vision encoder failed: {state.error if state else 'timed out'}")
    ids = (int(core.eos_ids[0]) if core.eos_ids else 0,) + tuple(sentinel_ids(blk, core.cfg.vocab_size))
    slot = cache.alloc_slot()
    try:
        if not cache.reserve({slot: len(ids)}):
            raise RuntimeError("warm-up: the page pool cannot hold one image block")
        member = PassMember("warmup-image", slot, 0, ids, sample=True,
                            sampler=SamplerState(SamplingParams(temperature=0.0), ids, []),
                            spans=(ImageSpan.of(blk),), images=(state.rows,))
        _run(core, StepPlan(-4, (), (PassSlice(-4, 0, core.cfg.num_layers, (member,)),)), "image pass")
    finally:
        cache.drop(slot)
        encoder.cancel("warmup")


HOST_TOLERANCE = 1e-3  # of the hidden states' scale: fp32 paths that differ only in summation order agree to ~1e-6


def check_host(core: EngineCore) -> None:
    """The native host forward against the torch path, on a scratch slot: a prefill chunk from position 0
    (it reads no ring row, so running it twice is the same forward) and a decode row after it (idempotent:
    it rewrites its own rows), then the LM head. A difference turns the native forward off, loudly
    (with ``host_kernels="on"`` start-up fails): it can make a step faster, never wrong."""
    engine, cache = core.engine, core.cache
    host = getattr(engine, "host", None)
    if host is None:
        return
    room = cache.free_pages * cache.layout.page_tokens - 2  # the pool may be tiny (tests force eviction)
    # past one sliding window (the decode row then reads a wrapped ring, late queries lose early keys) and
    # one window of the largest compress ratio (every compressor emits); at DS4-Flash's widths each token
    # of the torch reference costs ~30 ms, so no longer than that
    want = max(core.cfg.sliding_window + 9, max(core.cfg.compress_ratios, default=0) + 1)
    n = max(2, min(want, core.settings.max_prefill_tokens, core.resolved.max_model_len - 2, room))
    slot = cache.alloc_slot()
    try:
        if slot is None or not cache.reserve({slot: n + 1}):
            raise RuntimeError("warm-up: no room for the native forward's self-check")
        ids = tuple(3 + i % max(1, core.cfg.vocab_size - 3) for i in range(n))
        problem = engine.host_disagrees([SeqChunk(slot, 0, ids, cache.block_table(slot))], "a prefill chunk",
                                        HOST_TOLERANCE) or \
            engine.host_disagrees([SeqChunk(slot, n, (ids[-1],), cache.block_table(slot))], "a decode row",
                                  HOST_TOLERANCE, head=False)  # the head's product does not depend on the view
    finally:
        if slot is not None:
            cache.drop(slot)
    if problem is None:
        log.info("native host forward agrees with the torch path (prefill chunk of %d tokens, decode row, LM head)", n)
        return
    if core.settings.host_kernels == "on":
        raise RuntimeError(f"host_kernels='on', but the native forward disagrees with the torch path: {problem}")
    engine.disable_host(problem)

