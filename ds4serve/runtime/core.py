"""EngineCore: assembly, and one step of scheduler + engine + cache, on one thread.

Assembly is the only place that knows every part: it resolves the settings against the model and
the device (``sizing``), allocates all fixed memory, builds the cache, the engine, the encoder
worker and the scheduler, logs what went where, and runs the warm-up (``warmup``).

``step()`` is one iteration: schedule a plan, check it, execute it, check the result against the
plan, fold it back. Used synchronously by ``LLM.generate`` and from the engine-loop thread by
``EngineLoop``: the same code either way. Only that one thread touches a core after start-up.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..cache import StateLayout
from ..cache.manager import CacheManager
from ..config import ConfigError, EngineSettings, ModelConfig
from ..engine.decode_graphs import MODES as DECODE_GRAPH_MODES
from ..engine.encoder import EncoderWorker
from ..engine.executor import Engine
from ..engine.parallel import RankFailure
from ..engine.plan import member_problems, validate_plan, validate_step_result
from ..engine.sampling import SamplingParams
from ..model import DS4ForCausalLM, load_model, parse_dtype
from ..model.loader import fp8_block_size
from ..model.weights import stored_bytes
from ..multimodal.layout import TokenType
from ..multimodal.records import ImageInput
from ..scheduler.admission import fit_problem
from ..scheduler.request import Request, RequestOutput
from ..scheduler.scheduler import Scheduler, SchedulerLimits
from .capacity import check_fits, choose_packed_experts, choose_stored_weights
from .parallel import ParallelGroup, ParallelSettings, start_group
from .sizing import Resolved, resolve
from .calibrate import calibrate
from .warmup import warm_up

log = logging.getLogger(__name__)

EngineFactory = Callable[[ModelConfig, "DS4ForCausalLM | None", CacheManager], Engine]


def check_decode_graphs(mode: str) -> None:
    """``EngineSettings.decode_graphs`` against the engine's own list (config.py is a leaf, so the
    one list, ``engine.decode_graphs.MODES``, is checked here, before anything is allocated)."""
    if mode not in DECODE_GRAPH_MODES:
        raise ConfigError(f"decode_graphs must be one of {', '.join(DECODE_GRAPH_MODES)}, got {mode!r}")


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


class EngineCore:
    def __init__(self, cfg: ModelConfig, model: DS4ForCausalLM | None, settings: EngineSettings | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 eos_ids: Sequence[int] | None = None, engine_factory: EngineFactory | None = None,
                 parallel: ParallelGroup | None = None):
        """``engine_factory(cfg, model, cache)`` replaces the real ``Engine`` (contract tests use fakes).
        ``parallel``: this is rank 0 of a tensor-parallel group (``parallel.py``); ``model`` is its shard."""
        t0 = time.perf_counter()
        self.cfg = cfg
        self.settings = s = settings or EngineSettings()
        self.device = torch.device(device)
        self.startup: dict[str, float] = {}  # seconds per start-up phase (see describe_startup)
        layout = StateLayout.build(cfg, dtype, s.page_tokens)
        self.resolved = r = resolve(cfg, s, layout, self.device)
        self.cache = CacheManager(layout, r.max_seqs, r.n_pages, self.device, r.host_budget, r.staging_rows,
                                  prefix_budget_bytes=r.prefix_budget)
        self.parallel = parallel
        if parallel is not None:  # the workers build the same cache; every cache call is mirrored to them
            self.cache, self.engine = parallel.attach(cfg, model, self.cache, {
                "page_tokens": s.page_tokens, "max_seqs": r.max_seqs, "n_pages": r.n_pages,
                "host_budget": r.host_budget, "staging_rows": r.staging_rows, "prefix_budget": r.prefix_budget})
        else:
            self.engine = self._engine(model, engine_factory)
        self.limits = SchedulerLimits(
            num_layers=cfg.num_layers, max_model_len=r.max_model_len, step_tokens=s.step_tokens,
            max_prefill_tokens=s.max_prefill_tokens, min_prefill_tokens=s.min_prefill_tokens,
            prefill_mode=s.prefill_mode, max_queue=s.max_queue, prefix_interval=s.prefix_interval,
            image_rows_budget=r.image_rows_budget if cfg.vision.enabled else 0)
        encoder = getattr(model, "vision_encoder", None) if model is not None else None
        self.encoder = EncoderWorker(encoder, self.device, dtype, cfg.hidden_size) if encoder is not None else None
        self.scheduler = Scheduler(self.limits, self.cache, self.encoder)
        self.eos_ids = tuple(cfg.eos_token_ids if eos_ids is None else eos_ids)
        self.image_slot_id = cfg.vocab_size + int(TokenType.IMAGE) if cfg.vision.enabled else None
        self.broken: str | None = None
        self._ids = itertools.count(1)
        self.history: deque[StepRecord] = deque(maxlen=4096)
        self._log_sizes(layout)
        self.startup["engine"] = time.perf_counter() - t0
        if s.warmup:
            self.warmup()
            if s.max_stall and engine_factory is None:
                t1 = time.perf_counter()
                self.limits = dataclasses.replace(self.limits, prefill_tokens_at=calibrate(self, s.max_stall))
                self.scheduler.limits = self.limits
                self.startup["calibration"] = time.perf_counter() - t1

    def _engine(self, model: DS4ForCausalLM | None, factory: EngineFactory | None) -> Engine:
        mode = self.settings.decode_graphs
        check_decode_graphs(mode)
        if factory is not None:
            return factory(self.cfg, model, self.cache)
        if mode == "cuda" and self.device.type != "cuda":
            raise ConfigError("decode_graphs='cuda' needs a CUDA device")
        return Engine(self.cfg, model, self.cache, decode_graphs=mode, host_kernels=self.settings.host_kernels)

    def _log_sizes(self, layout: StateLayout) -> None:
        r, s = self.resolved, self.settings
        log.info("engine: %s; %d slots, %d pages (%d tokens of compressed state), max_model_len %d, step budget "
                 "%d tokens x %d layers, prefill chunk <= %d, mode %s, decode graphs %s",
                 layout.describe(), r.max_seqs, r.n_pages, r.n_pages * layout.page_tokens, r.max_model_len,
                 s.step_tokens, self.cfg.num_layers, s.max_prefill_tokens, s.prefill_mode,
                 getattr(getattr(self.engine, "decode", None), "mode", "n/a"))
        full = min(r.max_seqs, r.n_pages // max(1, layout.pages_for(r.max_model_len)))
        log.info("capacity: %d sequences of the full max_model_len (%d tokens) fit at once (%d slots, %d pages); "
                 "pass staging holds chunks of up to %d rows", full, r.max_model_len, r.max_seqs, r.n_pages,
                 r.staging_rows)

    # ---- requests ------------------------------------------------------------------------------
    def make_request(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
                     images: Sequence[ImageInput] | None = None, constraint: Any = None, cache_salt: str = "",
                     cache_points: Sequence[int] = ()) -> Request:
        return Request(request_id=request_id or f"req-{next(self._ids)}", prompt_ids=list(prompt_ids),
                       params=params, eos_ids=self.eos_ids, images=images, constraint=constraint,
                       cache_salt=cache_salt, cache_points=tuple(cache_points))

    def fit_problem(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request of this size can never run here (None: it can); any thread may ask."""
        return fit_problem(prompt_tokens, max_tokens, self.limits.max_model_len, self.cache.layout.pages_for,
                           self.cache.state.n_pages)

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
        try:
            result = self.engine.step(plan)
        except RankFailure as exc:  # a tensor-parallel rank died or hangs: nothing can be agreed any more
            self._break(str(exc))
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

    def warmup(self) -> None:
        """Drive every path once at start-up (see ``warmup.warm_up``)."""
        warm_up(self)

    def describe_startup(self) -> str:
        """How long start-up took, per phase (load, engine, self-check, warm-up, calibration)."""
        parts = ", ".join(f"{name} {sec:.1f} s" for name, sec in self.startup.items())
        return f"start-up took {sum(self.startup.values()):.1f} s: {parts}"
    def close(self) -> None:
        """Stop the encoder worker (the engine loop owns everything else)."""
        if self.encoder is not None:
            self.encoder.shutdown()
        if self.parallel is not None:
            self.parallel.close(self.engine)

    def reset_prefix_cache(self) -> int:
        """Empty the prefix cache (snapshots pinned by live requests stay); returns how many went."""
        prefix = self.cache.prefix
        return prefix.reset() if prefix is not None else 0

    def prefix_stats(self) -> dict:
        """Prefix-cache counters for metrics and logs (``enabled`` False: caching is off)."""
        prefix = self.cache.prefix
        if prefix is None:
            return {"enabled": False, "hits": 0, "misses": 0, "hit_tokens": 0, "queried_tokens": 0, "stored": 0,
                    "evictions": 0, "snapshots": 0, "cached_pages": 0, "cached_bytes": 0, "budget_bytes": 0}
        return {"enabled": True, **prefix.summary()}

    def leaks(self) -> str:
        """'' if every slot, page, snapshot byte and pass is accounted for by live requests."""
        sched = self.scheduler
        problems = [self.cache.leaks(sched.live_slots())]
        live_passes = {r.pass_id for r in sched.running if r.pass_id is not None}
        stray = self.engine.active_passes - live_passes - sched.retiring
        if stray:
            problems.append(f"engine passes without requests: {sorted(stray)}")
        if self.encoder is not None:
            holders = [r for r in sched.requests.values() if r.images_submitted]
            stray = self.encoder.live_requests() - {r.request_id for r in holders}
            if stray:
                problems.append(f"encoder work for retired requests: {sorted(stray)}")
            held = sum(r.image_bytes for r in holders)
            if held != sched.image_bytes_used:
                problems.append(f"image rows accounted {sched.image_bytes_used} B, held {held} B")
        live_snaps = sum(r.snapshot.nbytes for r in sched.parked if r.snapshot is not None)
        if self.cache.host_used != live_snaps:
            problems.append(f"host budget in use {self.cache.host_used} B, snapshots hold {live_snaps} B")
        return "; ".join(p for p in problems if p)


def load_core(model_dir: Path, *, device: str = "cpu", dtype: str = "float32", settings: EngineSettings | None = None,
              vision_device: str | None = None, extra_eos: Sequence[int] = (),
              packed_experts: bool | str = False, parallel: ParallelSettings | None = None,
              packed_weights: bool | str | None = None) -> EngineCore:
    """Load a checkpoint and assemble its core (the server's way in; ``LLM`` keeps its own model).
    A model that cannot fit the device is refused before any weight is read (``capacity.check_fits``).
    ``packed_experts``: a bool, or "auto" / "on" / "off" (``capacity.choose_packed_experts``: auto packs
    only when the dequantised experts would not fit and packed ones do). ``packed_weights`` (serve's
    ``--packed-weights``; None: as ``packed_experts``) also keeps FP8 projections and a bf16 embedding /
    LM head as stored (``capacity.choose_stored_weights``), and then the experts packed too.
    ``parallel`` with ``tensor_parallel_size > 1`` starts the other ranks (``parallel.py``) first."""
    t0 = time.perf_counter()
    s = settings or EngineSettings()
    tp = parallel.tensor_parallel_size if parallel is not None else 1
    ep = parallel is not None and parallel.expert_parallel
    cfg0, dt, dev = ModelConfig.from_file(model_dir), parse_dtype(dtype), torch.device(device)
    stored, why_stored = choose_stored_weights(packed_experts if packed_weights is None else packed_weights, dt, dev,
                                               s.host_kernels, tp)
    log.info("projections, embedding and LM head %s: %s", "kept as stored" if stored else "dequantised at load",
             why_stored)
    packed_experts, why = choose_packed_experts(packed_experts if packed_weights is None else packed_weights, cfg0,
                                                dt, dev, s.max_model_len, s.max_prefill_tokens, tp, ep, stored=stored)
    log.info("routed experts %s: %s", "kept packed" if packed_experts else "dequantised at load", why)
    check_fits(cfg0, dt, dev, s.max_model_len, s.max_prefill_tokens, packed_experts, tp, ep,
               stored=stored_bytes(model_dir, fp8_block_size(cfg0)) if stored else None)
    group = None
    if tp > 1:
        group, cfg, model = start_group(model_dir, parallel, device, dtype, packed_experts)
    else:
        cfg, model = load_model(model_dir, device=device, dtype=dtype, progress=True, vision_device=vision_device,
                                packed_experts=packed_experts, stored_weights=stored)
    loaded = time.perf_counter() - t0
    eos = tuple(dict.fromkeys((*extra_eos, *cfg.eos_token_ids)))
    try:
        core = EngineCore(cfg, model, s, device, parse_dtype(dtype), eos_ids=eos, parallel=group)
        core.startup = {"load": loaded, **core.startup}
        log.info("%s", core.describe_startup())
        # what start-up built lives as long as the process: out of the collector's reach, so the full
        # collections that the steps' allocations trigger do not walk it again (~2% of a decode step)
        gc.collect()
        gc.freeze()
        return core
    except BaseException:
        if group is not None:
            group.close(None)
        raise


__all__ = ["EngineCore", "FatalStepError", "check_decode_graphs", "Resolved", "StepRecord", "load_core"]
