"""The prefix cache's lower tiers from the settings: budgets resolved, the model fingerprinted.

Defaults, and why:

* host tier **on** where the state pool lives on an accelerator, ``min(1 GiB, 1/16 of the free host
  memory)``: a spilled snapshot costs only what it holds, host memory is usually far larger than the
  device pool, and a conversation evicted from the pool by a burst comes back without recomputing its
  prefix; 1 GiB is the same cap the suspend budget uses, small next to any serving host.
  ``--prefix-cache-host-bytes 0`` turns it off. **Off** where the pool is itself host memory (a CPU
  device): there a host tier is a second cache in the same memory, which grew the Flash-shaped side by
  side's peak RSS by ~300 MiB (916 MiB against 602 without, llama-server 482); ``--prefix-cache-budget``
  gives the pool's own cache more, ``--prefix-cache-host-bytes`` sets a tier anyway.
* disk tier **off** unless ``--prefix-cache-dir`` is given (it writes users' state to a disk, which
  must be an explicit choice); its budget defaults to ``min(16 GiB, half the free space)`` there.

Built after the warm-up (the fingerprint names the forward that really runs: under ``host_kernels=auto``
the self-check may have chosen the torch path) and only for one process: a tensor-parallel group
replays rank 0's cache calls on every rank, and lower tiers on rank 0 alone would break that.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from ..cache.fingerprint import fingerprint
from ..cache.tiers import TierConfig, TierStore
from ..config import ConfigError
from ..settings import EngineSettings, parse_bytes
from .parts import EngineParts
from .sizing import available_memory

log = logging.getLogger(__name__)

_HOST_CAP = 2**30
_DISK_CAP = 16 * 2**30


def tier_config(s: EngineSettings, fp: str, device: torch.device | None = None) -> TierConfig:
    """Budgets from the settings (defaults above: ``device`` is where the state pool lives, default an
    accelerator's) and the fingerprint ``fp``."""
    host = parse_bytes(s.prefix_cache_host_bytes, "prefix_cache_host_bytes")
    if host is None:
        on_host = device is not None and device.type == "cpu"
        host = 0 if on_host else min(_HOST_CAP, available_memory(torch.device("cpu")) // 16)
    root = Path(s.prefix_cache_dir).expanduser() if s.prefix_cache_dir else None
    disk = parse_bytes(s.prefix_cache_disk_bytes, "prefix_cache_disk_bytes") or 0
    if root is not None:
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"prefix_cache_dir {str(root)!r} cannot be used as a directory: {exc}") from None
        if s.prefix_cache_disk_bytes is None:
            disk = min(_DISK_CAP, shutil.disk_usage(root).free // 2)
    return TierConfig(host_bytes=host, disk_dir=root, disk_bytes=disk, fingerprint=fp)


def attach_tiers(parts: EngineParts, model: torch.nn.Module | None) -> None:
    """Give the prefix cache its lower tiers (nothing when caching is off, or tiered caching cannot run)."""
    s, prefix = parts.settings, parts.cache.prefix
    if prefix is None:
        return
    if parts.parallel is not None:
        if s.prefix_cache_dir:
            log.warning("prefix cache: lower tiers (--prefix-cache-dir, host tier) are single-process only; "
                        "off in this tensor-parallel group")
        return
    host_forward = getattr(parts.executor, "host", None) is not None
    extra = {"device": parts.device.type, "forward": "native-host" if host_forward else "torch"}
    tensors = list(model.state_dict().items()) if model is not None and s.prefix_cache_dir else []
    fp = fingerprint(parts.cache.layout, tensors, extra) if s.prefix_cache_dir else ""  # only files need one
    config = tier_config(s, fp, parts.device)
    prefix.use_tiers(TierStore(config))
    log.info("prefix cache: host tier %s; disk tier %s; model fingerprint %s",
             f"{config.host_bytes / 2**20:.1f} MiB" if config.host_bytes else "off" + (
                 " (the state pool is host memory here; --prefix-cache-host-bytes sets one)"
                 if s.prefix_cache_host_bytes is None else ""),
             f"{config.disk_dir} ({config.disk_bytes / 2**20:.1f} MiB)" if config.disk_dir and config.disk_bytes
             else "off", fp[:16])
