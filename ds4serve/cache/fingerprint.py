"""The model fingerprint disk snapshots are written under: a different model never reads them.

A snapshot is only valid for the weights that computed it, in the dtype they ran in, with the state
laid out the same way and computed by the same forward. The fingerprint hashes all of that:

* the checkpoint's ``config.json`` (every architecture number) and the state layout (dtype, page size,
  per-layer windows, ratios and widths): anything that changes what a snapshot holds or where;
* the weights' identity: every tensor's name, dtype and shape, and its values: all of them for tensors
  up to 64 Ki elements, else 4,096 evenly spaced ones including the first and the last (two different
  checkpoints, or a fine-tune of one, differ throughout the tensors they change; hashing every byte of a
  hundreds-of-GB model at each start-up would cost minutes);
* ``extra``: the runtime choices that change the numbers (the device type, the forward in use).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping

import torch

from .layout import StateLayout

FORMAT = "ds4serve-prefix-fingerprint-v1"
_FULL = 1 << 16
_SAMPLES = 4096


def _tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().reshape(-1)
    if flat.numel() > _FULL:
        at = torch.arange(_SAMPLES, dtype=torch.long, device=flat.device) * (flat.numel() - 1) // (_SAMPLES - 1)
        flat = flat[at]  # evenly spaced, the first and the last included (integer arithmetic: exact)
    flat = flat.contiguous()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8).cpu().numpy().tobytes()


def fingerprint(layout: StateLayout, tensors: Iterable[tuple[str, torch.Tensor]],
                extra: Mapping[str, str] | None = None) -> str:
    """Hex sha256 of the model, its state layout and ``extra`` (see the module docstring)."""
    h = hashlib.sha256(FORMAT.encode())
    h.update(json.dumps(layout.cfg.raw, sort_keys=True, default=str).encode())
    h.update(repr((str(layout.dtype), layout.page_tokens, layout.layers)).encode())
    h.update(json.dumps(dict(extra or {}), sort_keys=True).encode())
    for name, t in sorted(tensors, key=lambda nt: nt[0]):
        h.update(f"\x00{name} {t.dtype} {tuple(t.shape)}\x00".encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()
