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


LINE = 64  # bytes in a cache line


def kn_stride(n_out: int, element_size: int) -> int:
    """The row stride (in elements) of an ``[in, out]`` weight the native kernels stream: whole cache lines,
    and an odd number of them. Why: the register tiles read one line from each of 8-512 consecutive weight
    rows at a time (a pass of f8_many, a block of kn_tile), and a stride that is a multiple of 4 KiB (any
    ``out`` of 1,024 floats or 4,096 FP8 codes) puts all those lines in the same set of a 64-set L1, which
    holds 8-12 of them: every weight load then came from L2 (FP8 at 8 rows ran at ~35% of the FMA peak on a
    Zen 3; ~1.6x with the stride one line off). With an odd count of lines, 64 consecutive rows take 64
    different sets. The padding (at most two lines a row) is never read."""
    per_line = max(1, LINE // element_size)
    stride = -(-n_out // per_line) * per_line
    return stride + per_line if (stride // per_line) % 2 == 0 else stride


def kn_stored(data: torch.Tensor) -> bool:
    """Is ``data`` (``[out, in]``) already the transposed view ``kn_store`` makes?"""
    n_out = data.shape[0]
    return data.stride() == (1, kn_stride(n_out, data.element_size()))


def kn_store(data: torch.Tensor) -> torch.Tensor:
    """``data [out, in]`` copied once into an ``[in, kn_stride]`` buffer (zero padding) and returned as the
    ``[out, in]`` view of it: the same values for the torch path, the layout the native kernels stream."""
    n_out, n_in = data.shape
    buf = torch.zeros(n_in, kn_stride(n_out, data.element_size()), dtype=data.dtype, device=data.device)
    buf[:, :n_out] = data.t()
    return buf[:, :n_out].t()
