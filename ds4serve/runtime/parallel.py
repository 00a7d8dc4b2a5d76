"""Starting a tensor-parallel group on one node: one ds4serve process per device.

``serve --tensor-parallel-size N`` (and ``load_core(..., parallel=...)``) make the calling process
rank 0 and start ranks 1..N-1 with torch multiprocessing (spawn). Every rank joins two process
groups over TCP on localhost (``compute``: NCCL on CUDA, gloo on CPU, with the collective timeout;
``control``: gloo), loads only its own slices of the weights (``model.sharding``; workers skip the
vision tower), and waits for rank 0's sizing. Rank 0 then builds its ``EngineCore`` with
``ParallelEngine`` and a mirrored cache (``engine.parallel``); the workers build the same cache and
engine and serve steps until rank 0 says stop.

A worker that exits while the server runs is noticed by a watchdog thread on rank 0: it logs which rank
died and with what exit code, marks the group lost (the next step fails fatally instead of waiting),
and calls ``on_lost`` (the server stops). For several nodes use ``torchrun``-style rendezvous: not built
(one node only), see the README.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..cache import StateLayout
from ..cache.manager import CacheManager
from ..config import ConfigError, ModelConfig
from ..engine.executor import Engine
from ..engine.parallel import CallRecorder, Collectives, Mirrored, ParallelEngine, serve_steps
from ..model import load_model, parse_dtype
from ..model.sharding import ShardPlan

log = logging.getLogger(__name__)

CONTROL_TIMEOUT = timedelta(days=30)  # idle workers wait for rank 0's next message this long
JOIN_TIMEOUT = timedelta(minutes=10)  # every rank started and joined the group (loading comes after)
# rank 0's sizing reaches a worker only once that worker has loaded its shard, which takes as long as its
# disk and cores make it (minutes for a real checkpoint, seconds on a loaded test machine), not a step
LOAD_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class ParallelSettings:
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    timeout_s: float = 300.0  # a collective that takes longer means a rank died or hangs
    port: int | None = None  # rendezvous port on localhost (None: a free one)
    # "module:function" each worker calls with (rank, engine) once built: fault injection for tests
    worker_hook: str | None = None


@dataclass
class ParallelGroup:
    """Rank 0's handle on its group: the collectives, the worker processes, this rank's shard."""

    settings: ParallelSettings
    coll: Collectives
    plan: ShardPlan
    workers: list = field(default_factory=list)
    on_lost: Callable[[str], None] | None = None
    stopping: bool = False

    def attach(self, cfg: ModelConfig, model, cache: CacheManager, sizing: dict) -> tuple[Mirrored, ParallelEngine]:
        """Send the workers rank 0's sizing (they build the same cache), and wrap this rank's engine."""
        self.coll.send(("init", [], sizing), timeout=LOAD_TIMEOUT)
        log.info("tensor parallel: decode graphs are off (a captured graph would replay collectives it "
                 "cannot agree on with the other ranks)")
        recorder = CallRecorder()
        engine = Engine(cfg, model, cache, decode_graphs="off")
        return Mirrored(cache, "cache", recorder), ParallelEngine(engine, self.coll, recorder, cfg.num_layers)

    def watch(self) -> None:
        threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()

    def _watch(self) -> None:
        from multiprocessing.connection import wait

        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.workers, start=1)}
        ready = wait(list(sentinels))
        if self.stopping:
            return
        rank, proc = sentinels[ready[0]]
        proc.join(timeout=1)  # reap it: the exit code is known only then
        if self.stopping:
            return
        why = f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}; stopping"
        log.critical(why)
        if self.coll is not None:
            self.coll.lost = RuntimeError(why)
        if self.on_lost is not None:
            self.on_lost(why)

    def close(self, engine: ParallelEngine | None) -> None:
        self.stopping = True
        if engine is not None:
            engine.close()
        for p in self.workers:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: str | torch.device, rank: int) -> torch.device:
    d = torch.device(device)
    return torch.device("cuda", rank) if d.type == "cuda" else d


def join_group(rank: int, world: int, port: int, device: torch.device, timeout_s: float, width: int,
               dtype: torch.dtype) -> Collectives:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # the rendezvous waits for every rank to start (spawn + imports); only collectives get ``timeout_s``
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=JOIN_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return Collectives(dist.group.WORLD, control, width, dtype, device, timedelta(seconds=timeout_s))


def _split_threads(world: int, device: torch.device) -> None:
    """CPU ranks share the cores (N ranks each using every core would oversubscribe them N-fold)."""
    if device.type == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads() // world))


def check_parallel(cfg: ModelConfig, settings: ParallelSettings, device: torch.device) -> ShardPlan:
    n = settings.tensor_parallel_size
    if n < 1:
        raise ConfigError("--tensor-parallel-size must be at least 1")
    if device.type == "cuda" and n > torch.cuda.device_count():
        raise ConfigError(f"--tensor-parallel-size {n} needs {n} CUDA devices; {torch.cuda.device_count()} visible")
    plan = ShardPlan(0, n, settings.expert_parallel)
    problems = plan.problems(cfg)
    if problems:
        raise ConfigError("cannot split this model: " + "; ".join(problems))
    return plan


def start_group(model_dir: Path, settings: ParallelSettings, device: str, dtype: str,
                packed_experts: bool) -> tuple[ParallelGroup, ModelConfig, torch.nn.Module]:
    """Spawn the workers, join the group, load rank 0's shard (with the vision tower)."""
    cfg = ModelConfig.from_file(model_dir)
    dev = torch.device(device)
    plan = check_parallel(cfg, settings, dev)
    world, port = plan.world, settings.port or _free_port()
    ctx = mp.get_context("spawn")
    workers = []
    for rank in range(1, world):
        p = ctx.Process(target=worker_main, name=f"ds4serve-tp{rank}", daemon=True,
                        args=(rank, world, port, str(model_dir), device, dtype, packed_experts,
                              settings.expert_parallel, settings.timeout_s, logging.getLogger().level,
                              settings.worker_hook))
        p.start()
        workers.append(p)
    log.info("tensor parallel: %d ranks (expert parallel %s), %s, rendezvous on 127.0.0.1:%d", world,
             "on" if settings.expert_parallel else "off", "NCCL" if dev.type == "cuda" else "gloo", port)
    dt = parse_dtype(dtype)
    _split_threads(world, dev)
    group = ParallelGroup(settings, None, plan, workers)  # type: ignore[arg-type]
    group.watch()  # a worker that dies while the group forms is logged at once
    try:
        group.coll = join_group(0, world, port, rank_device(dev, 0), settings.timeout_s, cfg.hidden_size, dt)
        _, model = load_model(model_dir, device=rank_device(dev, 0), dtype=dt, progress=True,
                              packed_experts=packed_experts, shard=plan, reduce=group.coll.reduce)
    except BaseException:
        group.close(None)
        raise
    return group, cfg, model


def worker_main(rank: int, world: int, port: int, model_dir: str, device: str, dtype: str, packed: bool,
                expert_parallel: bool, timeout_s: float, log_level: int, hook: str | None = None) -> None:
    """Rank ``rank``: load its shard, build rank 0's cache and an engine, serve steps until stopped."""
    logging.basicConfig(level=log_level or logging.INFO,
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    dev = rank_device(device, rank)
    dt = parse_dtype(dtype)
    _split_threads(world, dev)
    cfg = ModelConfig.from_file(model_dir)
    coll = join_group(rank, world, port, dev, timeout_s, cfg.hidden_size, dt)
    try:
        _, model = load_model(model_dir, device=dev, dtype=dt, progress=True, packed_experts=packed,
                              shard=ShardPlan(rank, world, expert_parallel), reduce=coll.reduce, vision=False)
        kind, _, sizing = coll.receive()
        if kind != "init":
            return
        layout = StateLayout.build(cfg, dt, sizing["page_tokens"])
        cache = CacheManager(layout, sizing["max_seqs"], sizing["n_pages"], dev, sizing["host_budget"],
                             sizing["staging_rows"], prefix_budget_bytes=sizing["prefix_budget"])
        engine = Engine(cfg, model, cache, decode_graphs="off", sample=False)
        if hook:
            module, name = hook.split(":")
            getattr(importlib.import_module(module), name)(rank, engine)
        log.info("rank %d of %d ready", rank, world)
        serve_steps(engine, cache, coll, cfg.num_layers)
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)
    dist.destroy_process_group()
