"""EngineParts: the finished pieces a core steps, built before any core exists.

``assemble.py`` resolves the sizes and builds the cache, the engine and the encoder worker into one
``EngineParts``; the start-up work that needs a forward (``warmup``, ``calibrate``) runs on these
parts, and only then is the ``EngineCore`` constructed from them (with its scheduler and the
calibrated limits). Nothing here knows a core or a scheduler, so both start-up modules sit below the
core instead of reaching back into a half-built one.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass

import torch

from ..cache.manager import CacheManager
from ..config import ModelConfig
from ..engine.encoder import EncoderWorker
from ..engine.executor import Executor
from ..settings import EngineSettings
from .tp_group import ParallelGroup
from .sizing import Resolved


@dataclass(frozen=True)
class EngineParts:
    """What ``assemble`` built for one core. ``executor`` is a ``ParallelExecutor`` (and ``cache`` the
    mirrored cache) on rank 0 of a tensor-parallel ``parallel`` group."""

    cfg: ModelConfig
    settings: EngineSettings
    device: torch.device
    resolved: Resolved
    cache: CacheManager
    executor: Executor
    encoder: EncoderWorker | None
    eos_ids: tuple[int, ...]
    parallel: ParallelGroup | None = None

    def leaks(self, live_slots: Set[int] = frozenset(), live_passes: Set[int] = frozenset(),
              live_encodes: Set[str] = frozenset(), snapshot_bytes: int = 0) -> list[str]:
        """What the cache, the engine and the encoder hold beyond what is named live (the defaults:
        nothing is live, as after the warm-up); an empty list when everything is accounted for."""
        problems = [self.cache.leaks(set(live_slots))]
        stray = self.executor.active_passes - set(live_passes)
        if stray:
            problems.append(f"engine passes without requests: {sorted(stray)}")
        if self.encoder is not None:
            stray = self.encoder.live_requests() - set(live_encodes)
            if stray:
                problems.append(f"encoder work for retired requests: {sorted(stray)}")
        if self.cache.host_used != snapshot_bytes:
            problems.append(f"host budget in use {self.cache.host_used} B, snapshots hold {snapshot_bytes} B")
        return [p for p in problems if p]

    def close(self) -> None:
        """Persist the prefix cache's lower tiers, stop the encoder worker and, on rank 0 of a group, the
        other ranks."""
        if self.parallel is None:
            self.cache.close()
        if self.encoder is not None:
            self.encoder.shutdown()
        if self.parallel is not None:
            self.parallel.close(self.executor)


__all__ = ["EngineParts"]
