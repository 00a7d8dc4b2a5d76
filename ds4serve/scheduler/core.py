"""EngineCore: scheduler + engine + cache, stepped by one thread.

``step()`` is one iteration: schedule a plan, check it, execute it, check the result against the
plan, fold it back. Used synchronously by ``LLM.generate`` and from the engine-loop thread by
``AsyncEngine``: the same code either way. Start-up resolves every setting against the model and
the device, allocates all fixed memory, logs what went where, and runs a warm-up through every path.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import deque
from dataclasses import dataclass

import torch

from ..cache import StateLayout
from ..cache.manager import CacheManager
from ..config import ConfigError, EngineSettings, ModelConfig, parse_budget
from ..engine.encoder import EncoderWorker
from ..engine.executor import Engine
from ..engine.plan import (DecodeRow, PassMember, PassSlice, StepPlan, member_problems, validate_plan,
                           validate_step_result)
from ..engine.sampling import SamplerState, SamplingParams
from ..model import DS4ForCausalLM
from ..multimodal.chunking import max_chunk_len
from ..multimodal.layout import TokenType
from .request import Request, RequestOutput
from .scheduler import Scheduler, SchedulerLimits

log = logging.getLogger(__name__)


class FatalStepError(RuntimeError):
    """The engine broke the step contract; the core refuses further work (state may be corrupt)."""


@dataclass(frozen=True)
class StepRecord:
    """What one step did and how long it took (for metrics and benchmarks)."""

    step_id: int
    decode_rows: int
    prefill_rows: int  # rows of pass slices (each counted once per slice)
    layers_run: int  # row-layers executed
    elapsed_s: float


@dataclass(frozen=True)
class Resolved:
    max_seqs: int
    max_model_len: int
    n_pages: int
    host_budget: int
    staging_rows: int
    image_rows_budget: int


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def resolve(cfg: ModelConfig, s: EngineSettings, layout: StateLayout, device: torch.device) -> Resolved:
    """Concrete sizes from settings; defaults derive from the model and the device's free memory."""
    max_len = min(s.max_model_len or 8192, cfg.max_position_embeddings)
    per_seq_pages = layout.pages_for(max_len)
    budget = parse_budget(s.kv_budget)
    if budget is None:
        affordable = int(0.3 * available_memory(device)) // layout.bytes_per_page()
        n_pages = max(per_seq_pages, min(per_seq_pages * s.max_seqs, affordable))
    elif budget[0] == "tokens":
        n_pages = layout.pages_for(budget[1])
    else:
        n_pages = budget[1] // layout.bytes_per_page()
    if n_pages < 1:
        raise ConfigError(f"kv_budget {s.kv_budget!r} is smaller than one page ({layout.bytes_per_page()} B)")
    host = parse_budget(s.host_budget)
    if host is None:
        host_bytes = min(2**30, available_memory(torch.device("cpu")) // 10)
    elif host[0] == "bytes":
        host_bytes = host[1]
    else:
        host_bytes = int(host[1] * layout.bytes_per_token()) + layout.bytes_per_slot()
    rows = parse_budget(s.image_rows_budget)
    # staging holds the longest chunk the planner may legally make (its tail and block overshoots)
    staging = max_chunk_len(s.max_prefill_tokens, s.min_prefill_tokens,
                            cfg.vision.max_n_token if cfg.vision.enabled else 0)
    return Resolved(max_seqs=s.max_seqs, max_model_len=max_len, n_pages=n_pages, host_budget=host_bytes,
                    staging_rows=staging, image_rows_budget=rows[1] if rows else 256 * 2**20)


class EngineCore:
    def __init__(self, cfg: ModelConfig, model: DS4ForCausalLM | None, settings: EngineSettings | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, eos_ids=None,
                 engine_factory=None):
        """``engine_factory(cfg, model, cache)`` replaces the real ``Engine`` (contract tests use fakes)."""
        self.cfg = cfg
        self.settings = settings or EngineSettings()
        self.device = torch.device(device)
        layout = StateLayout.build(cfg, dtype, self.settings.page_tokens)
        self.resolved = r = resolve(cfg, self.settings, layout, self.device)
        self.cache = CacheManager(layout, r.max_seqs, r.n_pages, self.device, r.host_budget, r.staging_rows)
        if engine_factory is None:
            if self.settings.decode_graphs == "cuda" and self.device.type != "cuda":
                raise ConfigError("decode_graphs='cuda' needs a CUDA device")
            self.engine = Engine(cfg, model, self.cache, decode_graphs=self.settings.decode_graphs)
        else:
            self.engine = engine_factory(cfg, model, self.cache)
        self.limits = SchedulerLimits(
            num_layers=cfg.num_layers, max_model_len=r.max_model_len, step_tokens=self.settings.step_tokens,
            max_prefill_tokens=self.settings.max_prefill_tokens, min_prefill_tokens=self.settings.min_prefill_tokens,
            prefill_mode=self.settings.prefill_mode, max_queue=self.settings.max_queue,
            image_rows_budget=r.image_rows_budget if cfg.vision.enabled else 0)
        encoder = getattr(model, "vision_encoder", None) if model is not None else None
        self.encoder = EncoderWorker(encoder, self.device, dtype, cfg.hidden_size) if encoder is not None else None
        self.scheduler = Scheduler(self.limits, self.cache, self.encoder)
        self.eos_ids = tuple(cfg.eos_token_ids if eos_ids is None else eos_ids)
        self.image_slot_id = cfg.vocab_size + int(TokenType.IMAGE) if cfg.vision.enabled else None
        self.broken: str | None = None
        self._ids = itertools.count(1)
        self.history: deque[StepRecord] = deque(maxlen=4096)
        log.info("engine: %s; %d slots, %d pages (%d tokens of compressed state), max_model_len %d, step budget "
                 "%d tokens x %d layers, prefill chunk <= %d, mode %s, decode graphs %s",
                 layout.describe(), r.max_seqs, r.n_pages, r.n_pages * layout.page_tokens, r.max_model_len,
                 self.settings.step_tokens, cfg.num_layers, self.settings.max_prefill_tokens,
                 self.settings.prefill_mode, getattr(getattr(self.engine, "decode", None), "mode", "n/a"))
        full = min(r.max_seqs, r.n_pages // max(1, layout.pages_for(r.max_model_len)))
        log.info("capacity: %d sequences of the full max_model_len (%d tokens) fit at once (%d slots, %d pages); "
                 "pass staging holds chunks of up to %d rows", full, r.max_model_len, r.max_seqs, r.n_pages,
                 r.staging_rows)
        if self.settings.warmup:
            self.warmup()

    # ---- requests ------------------------------------------------------------------------------
    def make_request(self, prompt_ids, params: SamplingParams, request_id: str | None = None,
                     images=None) -> Request:
        return Request(request_id=request_id or f"req-{next(self._ids)}", prompt_ids=list(prompt_ids),
                       params=params, eos_ids=self.eos_ids, images=images)

    def add(self, req: Request) -> None:
        if self.broken:
            raise FatalStepError(self.broken)
        self.scheduler.add(req)

    def abort(self, request_id: str, reason: str | None = None) -> bool:
        """Cancel a request now: its slot, pages and snapshot are free on return; a pass left without
        members is retired by the next plan (``has_work`` stays true until then)."""
        return self.scheduler.abort(request_id, reason)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ---- one iteration -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.broken:
            raise FatalStepError(self.broken)
        plan = self.scheduler.schedule()
        if plan is None:
            return self.scheduler.take_outputs()
        problem = validate_plan(plan, self.cfg.num_layers)
        if problem:
            self._break(f"scheduler produced an invalid plan: {problem}")
        refused = member_problems(plan, self.cache.staging_rows, self.image_slot_id)
        if refused:  # confined to those members: they fail alone, the rest is planned again
            return self.scheduler.refuse(plan, refused)
        result = self.engine.step(plan)
        problem = validate_step_result(plan, result, self.cfg.num_layers)
        if problem:
            self._break(f"step {plan.step_id}: result does not match its plan: {problem}")
        self.history.append(StepRecord(plan.step_id, len(plan.decodes), sum(p.rows for p in plan.passes),
                                       plan.row_layers(self.cfg.num_layers), result.elapsed_s))
        return self.scheduler.apply(plan, result)

    def _break(self, why: str) -> None:
        log.critical("fatal step error: %s", why)
        self.broken = why
        for rid in list(self.scheduler.requests):
            self.scheduler.abort(rid, reason=f"engine stopped after a fatal step error: {why}")
        raise FatalStepError(why)

    def run_until_idle(self, max_steps: int = 10**9) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        for _ in range(max_steps):
            if not self.has_work:
                break
            outs.extend(self.step())
        outs.extend(self.scheduler.take_outputs())
        return outs

    def close(self) -> None:
        """Stop the encoder worker (the engine loop owns everything else)."""
        if self.encoder is not None:
            self.encoder.shutdown()

    def leaks(self) -> str:
        """'' if every slot, page, snapshot byte and pass is accounted for by live requests."""
        problems = [self.cache.leaks(self.scheduler.live_slots())]
        live_passes = {r.pass_id for r in self.scheduler.running if r.pass_id is not None}
        stray = self.engine.active_passes - live_passes - self.scheduler.retiring
        if stray:
            problems.append(f"engine passes without requests: {sorted(stray)}")
        if self.encoder is not None:
            live = {r.request_id for r in self.scheduler.requests.values() if r.encoded is not None}
            stray = self.encoder.live_requests() - live
            if stray:
                problems.append(f"encoder work for retired requests: {sorted(stray)}")
            held = sum(r.image_bytes for r in self.scheduler.requests.values() if r.encoded is not None)
            if held != self.scheduler.image_bytes_used:
                problems.append(f"image rows accounted {self.scheduler.image_bytes_used} B, held {held} B")
        live_snaps = sum(r.snapshot.nbytes for r in self.scheduler.parked if r.snapshot is not None)
        if self.cache.host_used != live_snaps:
            problems.append(f"host budget in use {self.cache.host_used} B, snapshots hold {live_snaps} B")
        return "; ".join(p for p in problems if p)

    # ---- warm-up -------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Drive every engine path once on a scratch slot: a layer-sliced pass through staging, a merged
        decode + chunk forward, greedy / random / logprob sampling, suspend and restore."""
        t0 = time.perf_counter()
        L = self.cfg.num_layers
        n = min(8, self.resolved.staging_rows)
        slot = self.cache.alloc_slot()
        ids = tuple(int(i) % self.cfg.vocab_size for i in range(3, 3 + n))
        greedy = SamplerState(SamplingParams(temperature=0.0, logprobs=2), ids, [])
        rand = SamplerState(SamplingParams(temperature=0.8, top_p=0.9, top_k=5, seed=0), ids, [])
        try:
            if not self.cache.reserve({slot: n + 2}):
                raise RuntimeError("warm-up: the page pool cannot hold one short sequence")
            mid = max(1, L // 2)
            member = PassMember("warmup", slot, 0, ids, sample=True, sampler=greedy)
            plans = [StepPlan(-1, (), (PassSlice(-1, 0, mid, (member,)),))]
            if mid < L:
                plans.append(StepPlan(-2, (), (PassSlice(-1, mid, L, (member,)),)))
            for plan in plans:
                res = self.engine.step(plan)
                if validate_step_result(plan, res, L):
                    raise RuntimeError(f"warm-up failed: {res.error or validate_step_result(plan, res, L)}")
            snap = self.cache.suspend(slot, n)
            if snap is not None:
                slot = self.cache.restore(snap)
                if slot is None or not self.cache.reserve({slot: n + 2}):
                    raise RuntimeError("warm-up: restore after suspend failed")
            plan = StepPlan(-3, (DecodeRow("warmup", slot, n, 1, rand),))
            res = self.engine.step(plan)
            if validate_step_result(plan, res, L):
                raise RuntimeError(f"warm-up failed: {res.error or validate_step_result(plan, res, L)}")
        finally:
            self.cache.drop(slot)
        if self.encoder is not None:
            self._warmup_image()
        leak = self.leaks()
        if leak:
            raise RuntimeError(f"warm-up leaked: {leak}")
        log.info("warm-up: sliced pass, merged step, sampling, suspend/restore%s ok in %.2f s",
                 ", encoder + image pass" if self.encoder is not None else "", time.perf_counter() - t0)

    def _warmup_image(self) -> None:
        """Encode a blank 1x1-grid image on the worker and prefill its block through a pass."""
        from ..cache.view import ImageSpan  # noqa: PLC0415
        from ..multimodal.layout import image_block  # noqa: PLC0415
        from ..multimodal.records import ImageInput, sentinel_ids  # noqa: PLC0415

        v = self.cfg.vision
        blk = image_block(1, 1, 1)
        image = ImageInput(torch.zeros(9, 3, v.patch_size, v.patch_size), 3, 3, blk, "warmup")
        handle = self.encoder.submit("warmup", [image])[0]
        if not handle.ready.wait(120) or handle.rows is None:
            raise RuntimeError(f"warm-up: the vision encoder failed: {handle.error}")
        ids = (int(self.eos_ids[0]) if self.eos_ids else 0,) + tuple(sentinel_ids(blk, self.cfg.vocab_size))
        slot = self.cache.alloc_slot()
        try:
            if not self.cache.reserve({slot: len(ids)}):
                raise RuntimeError("warm-up: the page pool cannot hold one image block")
            span = ImageSpan(blk.start, blk.end, blk.visible_start, blk.visible_end)
            member = PassMember("warmup-image", slot, 0, ids, sample=True,
                                sampler=SamplerState(SamplingParams(temperature=0.0), ids, []),
                                spans=(span,), images=((handle.positions, handle.rows),))
            plan = StepPlan(-4, (), (PassSlice(-4, 0, self.cfg.num_layers, (member,)),))
            res = self.engine.step(plan)
            if validate_step_result(plan, res, self.cfg.num_layers):
                raise RuntimeError(f"warm-up image pass failed: {res.error}")
        finally:
            self.cache.drop(slot)
            self.encoder.cancel("warmup")
