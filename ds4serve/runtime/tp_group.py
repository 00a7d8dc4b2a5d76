"""Starting a tensor-parallel group: one ds4serve process per device, on one node or several.

``serve --tensor-parallel-size N`` (and ``load_core(..., parallel=...)``) make the calling process
rank 0 and start the other ranks of its node with torch multiprocessing (spawn); with ``--nnodes M``
every other node runs ``serve --node-rank R`` (or torchrun starts one process per rank), which runs
its ranks without HTTP (``run_node``). How the ranks meet, and how nodes notice each other leave, is
``rendezvous.py``. Every rank joins two process groups (``compute``: NCCL on CUDA, gloo on CPU, with
the collective timeout; ``control``: gloo), loads only its own slices of the weights
(``model.sharding``; ranks other than 0 skip the vision tower), and waits for rank 0's sizing. Rank 0
then builds its ``EngineCore`` with ``ParallelExecutor`` and a mirrored cache (``engine.parallel_executor``); the
others build the same cache and engine and serve steps until rank 0 says stop.

A local worker that exits while the server runs is noticed by a watchdog thread on rank 0 (its process
sentinel), another node by its link closing: either way rank 0 logs which rank or node went and why,
marks the group lost (the next step fails fatally instead of waiting) and calls ``on_lost`` (the server
stops). A node whose own worker dies tells rank 0 why and exits; a node whose rank 0 goes away exits.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import threading
import time
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
from ..engine.executor import Executor
from ..engine.parallel_executor import CallRecorder, Collectives, Mirrored, ParallelExecutor, serve_steps
from ..model import load_model, parse_dtype
from ..model.sharding import ShardPlan
from .rendezvous import (NodeLinks, ParallelSettings, RankZeroLink, Topology, agreement, open_store,
                         topology)

log = logging.getLogger(__name__)

CONTROL_TIMEOUT = timedelta(days=30)  # idle workers wait for rank 0's next message this long
# rank 0's sizing reaches a worker only once that worker has loaded its shard, which takes as long as its
# disk and cores make it (minutes for a real checkpoint, seconds on a loaded test machine), not a step
LOAD_TIMEOUT = timedelta(minutes=30)

__all__ = ["ParallelGroup", "ParallelSettings", "check_parallel", "run_node", "start_group"]


@dataclass(frozen=True)
class RankArgs:
    """What a rank needs to start (spawned workers get it pickled)."""

    topo: Topology
    model_dir: str
    device: str
    dtype: str
    packed: bool
    expert_parallel: bool
    timeout_s: float
    log_level: int
    hook: str | None = None


@dataclass
class ParallelGroup:
    """Rank 0's handle on its group: the collectives, the local worker processes, the links to the
    other nodes, this rank's shard."""

    settings: ParallelSettings
    coll: Collectives
    plan: ShardPlan
    workers: list = field(default_factory=list)
    on_lost: Callable[[str], None] | None = None
    stopping: bool = False
    links: NodeLinks | None = None
    first_worker: int = 1  # the rank of ``workers[0]``

    def attach(self, cfg: ModelConfig, model, cache: CacheManager, sizing: dict) -> tuple[Mirrored, ParallelExecutor]:
        """Send the workers rank 0's sizing (they build the same cache), and wrap this rank's engine."""
        self.coll.send(("init", [], sizing), timeout=LOAD_TIMEOUT)
        log.info("tensor parallel: decode graphs are off (a captured graph would replay collectives it "
                 "cannot agree on with the other ranks)")
        recorder = CallRecorder()
        engine = Executor(cfg, model, cache, decode_graphs="off")
        engine.agree = self.coll.agree  # drafts: every rank rolls back what rank 0's sampling rejected
        return Mirrored(cache, "cache", recorder), ParallelExecutor(engine, self.coll, recorder, cfg.num_layers)

    def watch(self) -> None:
        threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()

    def watch_links(self) -> None:
        """One thread per other node, blocked on its link until it closes."""
        for node, (conn, peer) in self.links.links.items():
            threading.Thread(target=self._watch_link, args=(node, conn, peer), name=f"tp-node{node}",
                             daemon=True).start()

    def _watch(self) -> None:
        from multiprocessing.connection import wait

        if not self.workers:
            return
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.workers, start=self.first_worker)}
        ready = wait(list(sentinels))
        if self.stopping:
            return
        rank, proc = sentinels[ready[0]]
        proc.join(timeout=1)  # reap it: the exit code is known only then
        self._lost(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}; stopping")

    def _watch_link(self, node: int, conn, peer: str) -> None:
        said = b""
        try:
            while chunk := conn.recv(4096):
                said += chunk
        except OSError:
            pass
        per = self.settings.tensor_parallel_size // self.settings.nnodes
        first, last = per * node, per * node + per - 1
        detail = said.decode(errors="replace").strip() or "its process exited or the network failed"
        self._lost(f"tensor-parallel node {node} (ranks {first}-{last}, {peer}) is gone: {detail}; stopping")

    def _lost(self, why: str) -> None:
        if self.stopping:
            return
        log.critical(why)
        if self.coll is not None:
            self.coll.lost = RuntimeError(why)
        if self.on_lost is not None:
            self.on_lost(why)

    def close(self, engine: ParallelExecutor | None) -> None:
        self.stopping = True
        if engine is not None:
            engine.close()
        if self.links is not None and engine is not None:  # a clean stop; a failed start-up is "rank 0 gone"
            self.links.bye()
        for p in self.workers:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.links is not None:
            self.links.close()


def join_group(store: dist.Store, rank: int, world: int, device: torch.device, timeout_s: float, width: int,
               dtype: torch.dtype) -> Collectives:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return Collectives(dist.group.WORLD, control, width, dtype, device, timedelta(seconds=timeout_s))


def _split_threads(local: int, device: torch.device) -> None:
    """CPU ranks of one node share its cores (N ranks each using every core would oversubscribe them)."""
    if device.type == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads() // local))


def check_parallel(cfg: ModelConfig, settings: ParallelSettings, device: torch.device) -> ShardPlan:
    topo = topology(settings)  # the group's shape first: node rank, divisibility, address
    n = settings.tensor_parallel_size
    need = topo.device_base + topo.local
    if device.type == "cuda" and need > torch.cuda.device_count():
        raise ConfigError(f"--tensor-parallel-size {n} over {topo.nnodes} node(s) needs {need} CUDA devices on "
                          f"this node; {torch.cuda.device_count()} visible")
    plan = ShardPlan(0, n, settings.expert_parallel)
    problems = plan.problems(cfg)
    if problems:
        raise ConfigError("cannot split this model: " + "; ".join(problems))
    return plan


def _spawn(args: RankArgs) -> list:
    """Start the ranks of this node after this process's own (``topo.first``)."""
    ctx = mp.get_context("spawn")
    workers = []
    for rank in range(args.topo.first + 1, args.topo.first + args.topo.local):
        p = ctx.Process(target=worker_main, name=f"ds4serve-tp{rank}", daemon=True, args=(rank, args))
        p.start()
        workers.append(p)
    return workers


def start_group(model_dir: Path, settings: ParallelSettings, device: str, dtype: str,
                packed_experts: bool) -> tuple[ParallelGroup, ModelConfig, torch.nn.Module]:
    """Spawn this node's workers, meet the other nodes, join the group, load rank 0's shard (with the
    vision tower)."""
    cfg = ModelConfig.from_file(model_dir)
    dev = torch.device(device)
    plan = check_parallel(cfg, settings, dev)
    topo = topology(settings)
    if topo.first != 0:
        raise ConfigError(f"node {topo.node_rank} runs its ranks without serving: start it with "
                          f"`ds4serve serve --node-rank {topo.node_rank}` (runtime.tp_group.run_node)")
    args = RankArgs(topo, str(model_dir), device, dtype, packed_experts, settings.expert_parallel,
                    settings.timeout_s, logging.getLogger().level, settings.worker_hook)
    workers = _spawn(args)
    log.info("tensor parallel: %d ranks on %d node(s) (expert parallel %s), %s, rendezvous on %s", topo.world,
             topo.nnodes, "on" if settings.expert_parallel else "off", "NCCL" if dev.type == "cuda" else "gloo",
             topo.address)
    dt = parse_dtype(dtype)
    _split_threads(topo.local, dev)
    group = ParallelGroup(settings, None, plan, workers)  # type: ignore[arg-type]
    group.watch()  # a worker that dies while the group forms is logged at once
    try:
        store = open_store(topo, 0)
        if topo.nnodes > 1:
            group.links = NodeLinks(topo)
            group.links.publish(store, agreement(model_dir, settings, device, dtype),
                                {"packed_experts": bool(packed_experts), "timeout_s": settings.timeout_s})
            group.links.gather()
            group.watch_links()
        group.coll = join_group(store, 0, topo.world, topo.device(dev, 0), settings.timeout_s, cfg.hidden_size, dt)
        _, model = load_model(model_dir, device=topo.device(dev, 0), dtype=dt, progress=True,
                              packed_experts=packed_experts, shard=plan, reduce=group.coll.reduce)
    except BaseException:
        group.close(None)
        raise
    return group, cfg, model


def run_rank(args: RankArgs, rank: int, store: dist.Store) -> None:
    """Rank ``rank`` (not 0): load its shard, build rank 0's cache and an engine, serve steps until stopped."""
    topo = args.topo
    dev, dt = topo.device(args.device, rank), parse_dtype(args.dtype)
    cfg = ModelConfig.from_file(args.model_dir)
    coll = join_group(store, rank, topo.world, dev, args.timeout_s, cfg.hidden_size, dt)
    _, model = load_model(args.model_dir, device=dev, dtype=dt, progress=True, packed_experts=args.packed,
                          shard=ShardPlan(rank, topo.world, args.expert_parallel), reduce=coll.reduce, vision=False)
    kind, _, sizing = coll.receive()
    if kind != "init":
        return
    layout = StateLayout.build(cfg, dt, sizing["page_tokens"])
    cache = CacheManager(layout, sizing["max_seqs"], sizing["n_pages"], dev, sizing["host_budget"],
                         sizing["staging_rows"], prefix_budget_bytes=sizing["prefix_budget"])
    engine = Executor(cfg, model, cache, decode_graphs="off", sample=False)
    engine.agree = coll.agree
    if args.hook:
        module, name = args.hook.split(":")
        getattr(importlib.import_module(module), name)(rank, engine)
    log.info("rank %d of %d ready", rank, topo.world)
    serve_steps(engine, cache, coll, cfg.num_layers)


def worker_main(rank: int, args: RankArgs) -> None:
    """A spawned rank: run it; any failure ends the process with 1 (rank 0's watchdog reports it)."""
    logging.basicConfig(level=args.log_level or logging.INFO,
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    _split_threads(args.topo.local, args.topo.device(args.device, rank))
    try:
        run_rank(args, rank, open_store(args.topo, rank))
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)
    dist.destroy_process_group()


def _stop_node(workers: list, code: int) -> None:
    for p in workers:
        if p.is_alive():
            p.kill()
    logging.shutdown()
    os._exit(code)


def _watch_rank0(link: RankZeroLink, workers: list) -> None:
    """Rank 0 said bye: this node's ranks got "stop" and end (a grace period, then they are ended);
    rank 0's side closed without it: rank 0 is gone, so this node exits at once."""
    if link.wait_for_rank0():
        time.sleep(30)
        log.error("rank 0 stopped the group but this node's ranks did not end within 30 s; exiting")
        _stop_node(workers, 0)
    log.critical("lost rank 0 at %s (node 0's process exited or the network failed); exiting", link.topo.address)
    _stop_node(workers, 1)


def _watch_workers(link: RankZeroLink, workers: list) -> None:
    """A local rank that fails (a non-zero exit) takes this node down, telling rank 0 why first."""
    from multiprocessing.connection import wait

    pending = {p.sentinel: p for p in workers}
    while pending:
        for s in wait(list(pending)):
            proc = pending.pop(s)
            proc.join(timeout=1)
            if proc.exitcode != 0:  # 0: rank 0's "stop"
                why = f"its tensor-parallel rank {proc.name.removeprefix('ds4serve-tp')} (pid {proc.pid}) exited " \
                      f"with code {proc.exitcode}"
                log.critical("%s; exiting", why)
                link.tell(why)
                _stop_node(workers, 1)


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def run_node(model_dir: Path, settings: ParallelSettings, device: str, dtype: str) -> int:
    """A node other than 0 (``serve --node-rank R``, or a torchrun rank > 0): run this node's ranks
    without HTTP until rank 0 stops the group (returns 0). Rank 0 going away, or one of this node's
    ranks failing, ends the process with 1 and a log line saying why. Mismatched flags: ConfigError."""
    cfg = ModelConfig.from_file(model_dir)
    dev = torch.device(device)
    check_parallel(cfg, settings, dev)
    topo = topology(settings)
    if topo.first == 0:
        raise ConfigError("node 0 serves: run_node is for --node-rank 1 and above")
    store = open_store(topo, topo.first)
    link = RankZeroLink(topo, store, agreement(model_dir, settings, device, dtype))
    args = RankArgs(topo, str(model_dir), device, dtype, bool(link.adopted["packed_experts"]),
                    settings.expert_parallel, float(link.adopted["timeout_s"]), logging.getLogger().level)
    log.info("node %d of %d: ranks %d-%d of %d, rendezvous on %s; serving steps for rank 0 (no HTTP here)",
             topo.node_rank, topo.nnodes, topo.first, topo.first + topo.local - 1, topo.world, topo.address)
    workers = _spawn(args)
    _split_threads(topo.local, dev)
    threading.Thread(target=_watch_rank0, args=(link, workers), name="tp-rank0", daemon=True).start()
    threading.Thread(target=_watch_workers, args=(link, workers), name="tp-workers", daemon=True).start()
    signal.signal(signal.SIGTERM, _interrupted)  # torchrun stops its ranks with SIGTERM (or SIGINT)
    try:
        run_rank(args, topo.first, store)
    except KeyboardInterrupt:
        log.warning("node %d: interrupted; exiting", topo.node_rank)
        link.tell(f"node {topo.node_rank} was interrupted (SIGINT or SIGTERM)")
        _stop_node(workers, 130)
    except Exception as exc:
        log.exception("tensor-parallel rank %d failed", topo.first)
        link.tell(f"its tensor-parallel rank {topo.first} failed: {exc}")
        _stop_node(workers, 1)
    for p in workers:
        p.join(timeout=30)
    dist.destroy_process_group()
    log.info("node %d: rank 0 stopped the group; exiting", topo.node_rank)
    # out as every other exit of a node (os._exit): a normal interpreter exit once raced C++ destructors
    # against the rank-0 watcher thread inside a store call ("terminate called without an active
    # exception", SIGABRT, in CI under load)
    _stop_node(workers, 0)
    return 0  # not reached
