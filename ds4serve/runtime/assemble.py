"""Assembly: build every part of a core, warm the parts up, calibrate them, then construct the core.

The one place that knows every part. In order: resolve the settings against the model and the device
(``sizing``), allocate all fixed memory and build the cache, the engine and the encoder worker into
``parts.EngineParts`` (logging what went where), drive every path once (``warmup.warm_up``), measure
the step budget (``calibrate.calibrate``), and only then construct ``core.EngineCore`` from the
finished parts and limits: nothing is patched into a core after its constructor returns.

``assemble_core`` takes a loaded model (``LLM``, tests); ``load_core`` loads a checkpoint first (the
server's way in), refusing one that cannot fit before any weight is read.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from ..cache import StateLayout
from ..cache.manager import CacheManager
from ..config import ConfigError, ModelConfig
from ..engine.decode_graphs import MODES as DECODE_GRAPH_MODES
from ..engine.encoder import EncoderWorker
from ..engine.executor import Executor
from ..model import DS4ForCausalLM, load_model, parse_dtype
from ..model.loader import fp8_block_size
from ..model.weights import stored_bytes
from ..scheduler.scheduler import SchedulerLimits
from ..settings import EngineSettings
from .calibrate import calibrate
from .capacity import check_fits, choose_packed_experts, choose_stored_weights
from .core import EngineCore
from .tp_group import ParallelGroup, ParallelSettings, start_group
from .parts import EngineParts
from .sizing import Resolved, resolve
from .speculation import draft_policy
from .tier_setup import attach_tiers
from .warmup import warm_up

log = logging.getLogger(__name__)

ExecutorFactory = Callable[[ModelConfig, "DS4ForCausalLM | None", CacheManager], Executor]


def check_decode_graphs(mode: str) -> None:
    """``EngineSettings.decode_graphs`` against the engine's own list (settings.py sits below the engine, so the
    one list, ``engine.decode_graphs.MODES``, is checked here, before anything is allocated)."""
    if mode not in DECODE_GRAPH_MODES:
        raise ConfigError(f"decode_graphs must be one of {', '.join(DECODE_GRAPH_MODES)}, got {mode!r}")


def assemble_core(cfg: ModelConfig, model: DS4ForCausalLM | None, settings: EngineSettings | None = None,
                  device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                  eos_ids: Sequence[int] | None = None, engine_factory: ExecutorFactory | None = None,
                  parallel: ParallelGroup | None = None, startup: Mapping[str, float] | None = None,
                  checkpoint: Path | None = None) -> EngineCore:
    """Build the parts, warm them up and calibrate the step budget on them (with ``settings.warmup``;
    a fake engine is never calibrated), then construct the core from the finished parts.
    ``engine_factory(cfg, model, cache)`` replaces the real ``Executor`` (contract tests use fakes).
    ``parallel``: this is rank 0 of a tensor-parallel group (``parallel.py``); ``model`` is its shard.
    ``startup``: seconds of the phases before this one (``load_core``'s load), first in the core's."""
    t0 = time.perf_counter()
    s = settings or EngineSettings()
    phases = dict(startup or {})
    parts = build_parts(cfg, model, s, torch.device(device), dtype, eos_ids, engine_factory, parallel)
    limits = scheduler_limits(cfg, s, parts.resolved)
    drafting = draft_policy(cfg, s.speculative, parts.cache, tensor_parallel=parallel is not None,
                            checkpoint=checkpoint, model=model, executor=parts.executor)
    phases["engine"] = time.perf_counter() - t0
    try:
        if s.warmup:
            phases.update(warm_up(parts))
            if (s.max_stall or drafting is not None) and engine_factory is None:  # drafts weigh the costs too
                t1 = time.perf_counter()
                table, costs = calibrate(parts, s.max_stall)
                limits = dataclasses.replace(limits, prefill_tokens_at=table, step_costs=costs)
                phases["calibration"] = time.perf_counter() - t1
    except BaseException:
        if parts.encoder is not None:  # the worker thread; a group is the caller's to close
            parts.encoder.shutdown()
        raise
    attach_tiers(parts, model)  # after the warm-up: the fingerprint names the forward it settled on
    return EngineCore(parts, limits, phases, drafting)


def build_parts(cfg: ModelConfig, model: DS4ForCausalLM | None, settings: EngineSettings, device: torch.device,
                dtype: torch.dtype, eos_ids: Sequence[int] | None = None, engine_factory: ExecutorFactory | None = None,
                parallel: ParallelGroup | None = None) -> EngineParts:
    """Resolve the sizes and allocate every fixed buffer: the cache, the engine, the encoder worker."""
    s = settings
    check_decode_graphs(s.decode_graphs)
    layout = StateLayout.build(cfg, dtype, s.page_tokens)
    r = resolve(cfg, s, layout, device)
    cache = CacheManager(layout, r.max_seqs, r.n_pages, device, r.host_budget, r.staging_rows,
                         prefix_budget_bytes=r.prefix_budget)
    if parallel is not None:  # the workers build the same cache; every cache call is mirrored to them
        cache, engine = parallel.attach(cfg, model, cache, {
            "page_tokens": s.page_tokens, "max_seqs": r.max_seqs, "n_pages": r.n_pages,
            "host_budget": r.host_budget, "staging_rows": r.staging_rows, "prefix_budget": r.prefix_budget})
    else:
        engine = _engine(cfg, model, cache, s, device, engine_factory)
    vision = getattr(model, "vision_encoder", None) if model is not None else None
    encoder = EncoderWorker(vision, device, dtype, cfg.hidden_size) if vision is not None else None
    parts = EngineParts(cfg, s, device, r, cache, engine, encoder,
                        tuple(cfg.eos_token_ids if eos_ids is None else eos_ids), parallel)
    _log_sizes(parts, layout)
    return parts


def scheduler_limits(cfg: ModelConfig, s: EngineSettings, r: Resolved) -> SchedulerLimits:
    """The limits requests are admitted and planned by, before calibration adds its table."""
    return SchedulerLimits(
        num_layers=cfg.num_layers, max_model_len=r.max_model_len, step_tokens=s.step_tokens,
        max_prefill_tokens=s.max_prefill_tokens, min_prefill_tokens=s.min_prefill_tokens,
        prefill_mode=s.prefill_mode, max_queue=s.max_queue, prefix_interval=s.prefix_interval,
        image_rows_budget=r.image_rows_budget if cfg.vision.enabled else 0)


def _engine(cfg: ModelConfig, model: DS4ForCausalLM | None, cache: CacheManager, s: EngineSettings,
            device: torch.device, factory: ExecutorFactory | None) -> Executor:
    if factory is not None:
        return factory(cfg, model, cache)
    if s.decode_graphs == "cuda" and device.type != "cuda":
        raise ConfigError("decode_graphs='cuda' needs a CUDA device")
    return Executor(cfg, model, cache, decode_graphs=s.decode_graphs, host_kernels=s.host_kernels,
                    moe_activations=s.moe_activations, head_activations=s.head_activations,
                    fp8_activations=s.fp8_activations)


def _log_sizes(parts: EngineParts, layout: StateLayout) -> None:
    r, s = parts.resolved, parts.settings
    log.info("engine: %s; %d slots, %d pages (%d tokens of compressed state), max_model_len %d, step budget "
             "%d tokens x %d layers, prefill chunk <= %d, mode %s, decode graphs %s",
             layout.describe(), r.max_seqs, r.n_pages, r.n_pages * layout.page_tokens, r.max_model_len,
             s.step_tokens, parts.cfg.num_layers, s.max_prefill_tokens, s.prefill_mode,
             getattr(getattr(parts.executor, "decode", None), "mode", "n/a"))
    full = min(r.max_seqs, r.n_pages // max(1, layout.pages_for(r.max_model_len)))
    log.info("capacity: %d sequences of the full max_model_len (%d tokens) fit at once (%d slots, %d pages); "
             "pass staging holds chunks of up to %d rows", full, r.max_model_len, r.max_seqs, r.n_pages,
             r.staging_rows)


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
        core = assemble_core(cfg, model, s, device, dt, eos_ids=eos, parallel=group, startup={"load": loaded},
                             checkpoint=Path(model_dir))
    except BaseException:
        if group is not None:
            group.close(None)
        raise
    log.info("%s", core.describe_startup())
    # what start-up built lives as long as the process: out of the collector's reach, so the full
    # collections that the steps' allocations trigger do not walk it again (~2% of a decode step)
    gc.collect()
    gc.freeze()
    return core


__all__ = ["ExecutorFactory", "assemble_core", "build_parts", "check_decode_graphs", "load_core", "scheduler_limits"]
