"""Memory sizing: the concrete sizes every fixed buffer is allocated with, resolved once at start-up.

Defaults derive from the model and from the device's free memory, so a knob left unset is safe on
any machine; the results are logged by ``assemble`` as it allocates them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..cache import StateLayout
from ..config import ConfigError, ModelConfig
from ..multimodal.chunking import max_chunk_len
from ..settings import EngineSettings, parse_budget


@dataclass(frozen=True)
class Resolved:
    """Settings turned into sizes (the only numbers the cache and the scheduler are built with)."""

    max_seqs: int  # sequence slots
    max_model_len: int  # longest prompt + completion
    n_pages: int  # pages of the paged pool
    host_budget: int  # bytes of host memory for suspended sequences
    staging_rows: int  # rows of pass staging: the longest chunk the planner may legally make
    image_rows_budget: int  # bytes of retained image rows
    prefix_budget: int = 0  # bytes of prefix-cache snapshots + cache-only pages (0: caching off)


def available_memory(device: torch.device) -> int:
    """Free bytes on ``device`` (8 GiB when the host cannot say)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def _n_pages(s: EngineSettings, layout: StateLayout, per_seq_pages: int, device: torch.device) -> int:
    budget = parse_budget(s.kv_budget)
    if layout.bytes_per_page() == 0:  # only sliding layers: no compressed state, pages cost nothing
        return per_seq_pages * s.max_seqs
    if budget is None:
        affordable = int(0.3 * available_memory(device)) // layout.bytes_per_page()
        n_pages = max(per_seq_pages, min(per_seq_pages * s.max_seqs, affordable))
    elif budget[0] == "tokens":
        n_pages = layout.pages_for(budget[1])
    else:
        n_pages = budget[1] // layout.bytes_per_page()
    if n_pages < 1:
        raise ConfigError(f"kv_budget {s.kv_budget!r} is smaller than one page ({layout.bytes_per_page()} B)")
    return n_pages


def _host_bytes(s: EngineSettings, layout: StateLayout) -> int:
    host = parse_budget(s.host_budget)
    if host is None:
        return min(2**30, available_memory(torch.device("cpu")) // 10)
    if host[0] == "bytes":
        return host[1]
    return int(host[1] * layout.bytes_per_token()) + layout.bytes_per_slot()


def _prefix_bytes(s: EngineSettings, layout: StateLayout, n_pages: int) -> int:
    """The prefix cache's budget: the setting, else a quarter of the pool but room for at least two
    snapshots per slot (one snapshot is one slot's rings plus one page)."""
    if not s.enable_prefix_caching:
        return 0
    got = parse_budget(s.prefix_cache_budget)
    if got is not None:
        return got[1]
    snap = layout.bytes_per_slot() + layout.bytes_per_page()
    return max(n_pages * layout.bytes_per_page() // 4, 2 * s.max_seqs * snap)


def resolve(cfg: ModelConfig, s: EngineSettings, layout: StateLayout, device: torch.device) -> Resolved:
    """Concrete sizes from settings; defaults derive from the model and the device's free memory."""
    max_len = min(s.max_model_len or 8192, cfg.max_position_embeddings)
    rows = parse_budget(s.image_rows_budget)
    # staging holds the longest chunk the planner may legally make (its tail and block overshoots)
    staging = max_chunk_len(s.max_prefill_tokens, s.min_prefill_tokens,
                            cfg.vision.max_n_token if cfg.vision.enabled else 0)
    n_pages = _n_pages(s, layout, layout.pages_for(max_len), device)
    return Resolved(max_seqs=s.max_seqs, max_model_len=max_len, n_pages=n_pages,
                    host_budget=_host_bytes(s, layout), staging_rows=staging,
                    image_rows_budget=rows[1] if rows else 256 * 2**20,
                    prefix_budget=_prefix_bytes(s, layout, n_pages))
