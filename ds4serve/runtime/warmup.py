"""Warm-up: drive every engine path once at start-up, on scratch slots, before any user arrives.

A path that fails here fails loudly at start-up instead of on a user's request, and the first real
request does not pay for lazy initialisation (kernels, graphs, the encoder's first image).
"""

from __future__ import annotations

import logging
import time

import torch

from ..cache import SeqChunk
from ..engine.plan import DecodeRow, PassMember, PassSlice, StepPlan, validate_step_result
from ..engine.sampling import SamplerState, SamplingParams
from ..multimodal.layout import image_block
from ..multimodal.records import ImageInput, ImageSpan, sentinel_ids
from .parts import EngineParts

log = logging.getLogger(__name__)


def warm_up(parts: EngineParts) -> dict[str, float]:
    """A layer-sliced pass through staging, a merged decode + chunk forward, greedy / random /
    logprob sampling, suspend and restore; then, with an encoder, one image through a pass. Runs on
    the assembled parts before any core exists; returns the seconds of its phases (``self-check``,
    ``warm-up``) for the start-up log."""
    t0 = time.perf_counter()
    check_host(parts)
    t1 = time.perf_counter()
    _warm_text(parts)
    if parts.encoder is not None:
        _warm_image(parts)
    leak = "; ".join(parts.leaks())
    if leak:
        raise RuntimeError(f"warm-up leaked: {leak}")
    t2 = time.perf_counter()
    log.info("warm-up: sliced pass, merged step, sampling, suspend/restore%s ok in %.2f s",
             ", encoder + image pass" if parts.encoder is not None else "", t2 - t1)
    return {"self-check": t1 - t0, "warm-up": t2 - t1}


def _run(parts: EngineParts, plan: StepPlan, what: str) -> None:
    res = parts.executor.step(plan)
    problem = validate_step_result(plan, res, parts.cfg.num_layers)
    if problem:
        raise RuntimeError(f"warm-up {what} failed: {res.error or problem}")


def _warm_text(parts: EngineParts) -> None:
    cache, L = parts.cache, parts.cfg.num_layers
    n = min(8, parts.resolved.staging_rows)
    slot = cache.alloc_slot()
    ids = tuple(int(i) % parts.cfg.vocab_size for i in range(3, 3 + n))
    greedy = SamplerState(SamplingParams(temperature=0.0, logprobs=2), ids, [])
    rand = SamplerState(SamplingParams(temperature=0.8, top_p=0.9, top_k=5, seed=0), ids, [])
    try:
        if not cache.reserve({slot: n + 2}):
            raise RuntimeError("warm-up: the page pool cannot hold one short sequence")
        mid = max(1, L // 2)
        member = PassMember("warmup", slot, 0, ids, sample=True, sampler=greedy)
        _run(parts, StepPlan(-1, (), (PassSlice(-1, 0, mid, (member,)),)), "sliced pass")
        if mid < L:
            _run(parts, StepPlan(-2, (), (PassSlice(-1, mid, L, (member,)),)), "sliced pass")
        snap = cache.suspend(slot, n)
        if snap is not None:
            slot = cache.restore(snap)
            if slot is None or not cache.reserve({slot: n + 2}):
                raise RuntimeError("warm-up: restore after suspend failed")
        _run(parts, StepPlan(-3, (DecodeRow("warmup", slot, n, 1, rand),)), "decode")
    finally:
        cache.drop(slot)


def _warm_image(parts: EngineParts) -> None:
    """Encode a blank 1x1-grid image on the worker and prefill its block through a pass."""
    v, cache, encoder = parts.cfg.vision, parts.cache, parts.encoder
    blk = image_block(1, 1, 1)
    image = ImageInput(torch.zeros(9, 3, v.patch_size, v.patch_size), 3, 3, blk, "warmup")
    encoder.submit("warmup", [image])
    state = encoder.ready("warmup")[0] if encoder.wait("warmup", 120) else None
    if state is None or state.rows.rows is None:
        raise RuntimeError(f"warm-up: the vision encoder failed: {state.error if state else 'timed out'}")
    ids = (int(parts.eos_ids[0]) if parts.eos_ids else 0,) + tuple(sentinel_ids(blk, parts.cfg.vocab_size))
    slot = cache.alloc_slot()
    try:
        if not cache.reserve({slot: len(ids)}):
            raise RuntimeError("warm-up: the page pool cannot hold one image block")
        member = PassMember("warmup-image", slot, 0, ids, sample=True,
                            sampler=SamplerState(SamplingParams(temperature=0.0), ids, []),
                            spans=(ImageSpan.of(blk),), image_rows=(state.rows,))
        _run(parts, StepPlan(-4, (), (PassSlice(-4, 0, parts.cfg.num_layers, (member,)),)), "image pass")
    finally:
        cache.drop(slot)
        encoder.cancel("warmup")


HOST_TOLERANCE = 1e-3  # of the hidden states' scale: fp32 paths that differ only in summation order agree to ~1e-6
# With packed experts on int8 activations (host_q8.c) each expert input is rounded to 8 bits, and a rounding
# that flips with a 1e-7 difference upstream moves a value by 1/127 of its block: the two forwards then
# differ by what quantisation costs the model (6% of the hidden states' scale, 14% of the logits' on the
# random test checkpoints). So the forward is checked loosely (a wrong attention or layout is off by
# the whole scale), and the int8 product itself exactly (HostForward.q8_disagrees: same integers, 1e-4).
HOST_TOLERANCE_INT8 = 0.25
# A bf16 LM head on bf16-rounded rows (host_pairs.c) moves each input by up to 2^-9 of itself: the logits
# then differ from the fp32 head's by ~1e-3 of their scale (random signs over 4096 inputs). So the logits
# are checked loosely, and the product itself bit for bit against its definition (HostForward.p16_disagrees).
HOST_TOLERANCE_BF16_HEAD = 0.02
# FP8 projections on bf16-rounded rows (host_f8pairs.c) move every projection's inputs by up to 2^-9 of
# themselves (each product ~2e-3 of its scale off the exact one), layer after layer: on the random wide
# checkpoint (peers/make_wide_ckpt.py) the prefill's hidden states then differ by 15% of their scale (the
# int8 experts alone: 17%). Checked as loosely as the int8 experts, and the product itself bit for bit
# against its definition (HostForward.f8p_disagrees).
HOST_TOLERANCE_BF16_FP8 = 0.25


def check_host(parts: EngineParts) -> None:
    """The native host forward against the torch path, on a scratch slot: a prefill chunk from position 0
    (it reads no ring row, so running it twice is the same forward) and a decode row after it (idempotent:
    it rewrites its own rows), then the LM head. A difference turns the native forward off, loudly
    (with ``host_kernels="on"`` start-up fails): it can make a step faster, never wrong."""
    engine, cache = parts.executor, parts.cache
    host = getattr(engine, "host", None)
    if host is None:
        return
    room = cache.free_pages * cache.layout.page_tokens - 2  # the pool may be tiny (tests force eviction)
    # past one sliding window (the decode row then reads a wrapped ring, late queries lose early keys) and
    # one window of the largest compress ratio (every compressor emits); at DS4-Flash's widths each token
    # of the torch reference costs ~30 ms, so no longer than that
    want = max(parts.cfg.sliding_window + 9, max(parts.cfg.compress_ratios, default=0) + 1)
    n = max(2, min(want, parts.settings.max_prefill_tokens, parts.resolved.max_model_len - 2, room))
    slot = cache.alloc_slot()
    try:
        if slot is None or not cache.reserve({slot: n + 1}):
            raise RuntimeError("warm-up: no room for the native forward's self-check")
        ids = tuple(3 + i % max(1, parts.cfg.vocab_size - 3) for i in range(n))
        int8 = host.moe_activations == "int8"
        tol = HOST_TOLERANCE_INT8 if int8 else HOST_TOLERANCE
        if host.fp8_pairs:  # every projection's inputs move by up to 2^-9: the whole forward, loosely
            tol = max(tol, HOST_TOLERANCE_BF16_FP8)
        head_tol = max(tol, HOST_TOLERANCE_BF16_HEAD) if host.head_activations == "bf16" else tol
        problem = (host.q8_disagrees() if int8 else None) or host.p16_disagrees() or host.f8p_disagrees() or \
            engine.host_disagrees([SeqChunk(slot, 0, ids, cache.block_table(slot))], "a prefill chunk",
                                  tol, head_tolerance=head_tol) or \
            engine.host_disagrees([SeqChunk(slot, n, (ids[-1],), cache.block_table(slot))], "a decode row",
                                  tol, head=False)  # the head's product does not depend on the view
    finally:
        if slot is not None:
            cache.drop(slot)
    if problem is None:
        log.info("native host forward agrees with the torch path (prefill chunk of %d tokens, decode row, LM head)", n)
        return
    if parts.settings.host_kernels == "on":
        raise RuntimeError(f"host_kernels='on', but the native forward disagrees with the torch path: {problem}")
    engine.disable_host(problem)

