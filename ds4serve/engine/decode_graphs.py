"""Pure-decode forwards on fixed shapes, optionally captured once and replayed as CUDA graphs.

A decode step of a small batch is mostly launch and dispatch overhead: thousands of tiny kernels per
step. On CUDA, capturing the step's forward (embedding + every layer) as a graph and replaying it
removes that overhead; this is how a decode step gets its time down to the GPU's arithmetic.

Modes (``EngineSettings.decode_graphs``):

* ``off``: decode rows run in the merged forward like everything else (the CPU default);
* ``static``: pure-decode steps run eagerly on the padded fixed-shape view (``cache/static_view``).
  No speed gain by itself; it exists so the padding is exercised and tested on any device;
* ``cuda``: as ``static``, and each distinct view shape is captured once into a CUDA graph, then
  replayed. Every graph checks itself on first use: the step runs eagerly (that result is the one
  returned), then the graph is captured and replayed on the same inputs (a decode forward is
  idempotent: it rewrites the same state rows with the same values) and must reproduce the eager
  hidden states (up to the order of atomic adds). Any capture error or mismatch turns graphs off for the process, with the
  reason logged, and the engine carries on eagerly: graphs can make a step faster, never wrong.

The state tensors are allocated once at start-up and never reallocated, so graphs may keep their
addresses; index views are copied into each graph's static input buffers before a replay.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..cache.static_view import (batch_buckets, bucket_for, clone_view, copy_view_into, static_decode_view,
                                 view_key)
from ..model.batch import BatchView

log = logging.getLogger(__name__)

MODES = ("auto", "off", "static", "cuda")


def resolve_mode(mode: str, device: torch.device) -> str:
    if mode not in MODES:
        raise ValueError(f"decode_graphs must be one of {MODES}, got {mode!r}")
    if mode == "auto":
        return "cuda" if device.type == "cuda" else "off"
    if mode == "cuda" and device.type != "cuda":
        raise ValueError("decode_graphs='cuda' needs a CUDA device")
    return mode


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    inputs: BatchView
    output: torch.Tensor
    replays: int = 0


class DecodeRunner:
    """Runs pure-decode forwards for the engine: pads the view, then eager or graph replay.

    ``forward(view) -> streams`` is ``embed`` + all layers; the runner returns hidden streams for the
    first ``n`` rows only (the real ones).
    """

    def __init__(self, mode: str, forward: Callable[[BatchView], torch.Tensor], max_rows: int, window: int,
                 scratch_rows: dict[int, int], max_graphs: int = 128):
        self.mode = mode
        self._forward = forward
        self.buckets = batch_buckets(max_rows)
        self.window = window
        self.scratch_rows = scratch_rows
        self.max_graphs = max_graphs
        self.graphs: dict[tuple, _Graph] = {}
        self.disabled: str | None = None
        self._pool = None
        self.stats = {"static_steps": 0, "captures": 0, "replays": 0}

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def run(self, view: BatchView, n_seqs: int) -> torch.Tensor | None:
        """Streams ``[n, hc, D]`` of a pure-decode view of ``n_seqs`` sequences, or ``None`` when the
        caller should run it the ordinary way (more rows than the largest bucket, or graphs turned off
        after a failure)."""
        n = view.num_tokens
        bucket = bucket_for(n, self.buckets)
        if bucket is None or (self.mode == "cuda" and self.disabled is not None):
            return None
        fixed = static_decode_view(view, bucket, self.window, self.scratch_rows, n_seqs)
        self.stats["static_steps"] += 1
        if self.mode == "cuda":
            return self._graph_forward(fixed)[:n]
        return self._forward(fixed)[:n]

    # ---- CUDA graphs ---------------------------------------------------------------------------
    def _graph_forward(self, fixed: BatchView) -> torch.Tensor:
        key = view_key(fixed)
        entry = self.graphs.get(key)
        if entry is not None:
            copy_view_into(entry.inputs, fixed)
            entry.graph.replay()
            entry.replays += 1
            self.stats["replays"] += 1
            return entry.output
        eager = self._forward(fixed)
        if len(self.graphs) >= self.max_graphs:
            return eager
        try:
            entry = self._capture(fixed)
            entry.graph.replay()  # same inputs, same state rows rewritten: must reproduce the eager step
            _check_same(entry.output, eager)
        except Exception as exc:  # noqa: BLE001 - any failure means: stay eager, loudly
            self.disabled = f"{type(exc).__name__}: {exc}"
            self.graphs.clear()
            log.error("CUDA graphs for decode turned off (%s); decode continues eagerly", self.disabled)
            return eager
        self.graphs[key] = entry
        self.stats["captures"] += 1
        log.info("captured a decode graph for %s (%d graphs)", key[0], len(self.graphs))
        return eager

    def _capture(self, fixed: BatchView) -> _Graph:
        inputs = clone_view(fixed)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as capture requires
            self._forward(inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the encoder worker may use the device from its own thread meanwhile
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            output = self._forward(inputs)
        return _Graph(graph=graph, inputs=inputs, output=output)


def _check_same(replayed: torch.Tensor, eager: torch.Tensor) -> None:
    """Equal up to the float noise of kernels that add in a nondeterministic order (atomics in
    expert scatter-adds): within 1e-3 of the eager result's scale, and finite."""
    if not torch.isfinite(replayed).all():
        raise RuntimeError("graph replay produced non-finite hidden states")
    scale = max(1.0, eager.float().abs().max().item())  # sync-ok: once per graph, at its self-check
    diff = (replayed.float() - eager.float()).abs().max().item()  # sync-ok: once per graph
    if diff > 1e-3 * scale:
        raise RuntimeError(f"graph replay differs from the eager step by {diff:.3g} (scale {scale:.3g})")
