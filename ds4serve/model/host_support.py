"""What the native forward's kernels can read as loaded (``host_forward.unsupported`` asks, weight by
weight): FP8 projections' block scales and shapes (``csrc/host_stored.c``) and packed expert stacks'
layout (``csrc/host_packed.c``). Split from ``host_forward.py`` to keep it to its descriptors."""

from __future__ import annotations

import torch

from .packed import PackedExperts
from .stored import StoredWeight


def stored_unsupported(w, name: str) -> str | None:
    """Why the native forward cannot read this stored weight as it is (None: it can, or it is not one):
    FP8 block scales below 2^8 (the kernels multiply by scale x 2^120, which must stay finite) and blocks
    whose outputs are whole vectors and whose inputs come in fours (host_stored.c)."""
    if not isinstance(w, StoredWeight) or w.fmt != "fp8":
        return None
    if w.device.type != "cpu" or not bool((w.scales < 256.0).all()):
        return f"{name}: FP8 block scales of 2^8 or more"
    if w.block[0] % 16 or w.block[1] % 4:
        return f"{name}: FP8 blocks of {list(w.block)} (the native forward needs outputs in 16s, inputs in 4s)"
    return None


def packed_unsupported(stack, max_parts: int) -> str | None:
    """Why the native forward cannot read this packed expert stack as it is (None: it can, or the stack
    is not packed): it reads MXFP4 with byte scales, one per 32 inputs, on the host (host_packed.c)."""
    if not isinstance(stack, PackedExperts):
        return None
    k = 2 * stack.parts[0].codes.shape[-1]
    if stack.fmt != "mxfp4":
        return f"packed {stack.fmt} experts (the native forward reads MXFP4)"
    if len(stack.parts) > max_parts or k % 32 or any(
            p.codes.dtype != torch.uint8 or p.scales.dtype != torch.uint8 or p.scales.shape[-1] * 32 != k
            or not (p.codes.is_contiguous() and p.scales.is_contiguous()) for p in stack.parts):
        return "packed experts in a layout the native forward does not read (MXFP4, a byte scale per 32 inputs)"
    return None
