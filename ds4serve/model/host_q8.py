"""The int8 expert product of the native forward (``csrc/host_q8.c``), seen from Python: whether a model's
packed experts take it (``choose_moe_activations``), the in-place interleaving its layout needs at load,
and the start-up probe that checks it on the loaded checkpoint against its definition.

Split from ``host_forward.py``, which binds the library and builds the descriptors; this module only
needs the bound library's entry points (``ds4_q8_interleave``, ``ds4_q8_product``).
"""

from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

from .packed import Q8_GROUP, PackedExperts, deinterleave_q8, quantize_rows_q8
from .quant import dequant_mxfp4

log = logging.getLogger(__name__)

MOE_ACTIVATIONS = ("auto", "int8", "fp32")


def choose_moe_activations(model: nn.Module, mode: str, limits: dict[str, int]) -> str:
    """``int8`` or ``fp32``: how the native forward multiplies packed MXFP4 experts. ``int8`` (host_q8.c)
    quantises each row's inputs per block of 32, as llama.cpp does for every product, and runs 2-7x
    faster at 1-8 rows an expert; ``fp32`` (host_packed.c) computes exactly what dequantise-at-load
    computes. ``auto`` takes int8 where every packed stack can be read that way. A model without packed
    experts says fp32 (nothing to choose)."""
    if mode not in MOE_ACTIVATIONS:
        raise ValueError(f"moe_activations must be one of {', '.join(MOE_ACTIVATIONS)}, got {mode!r}")
    stacks = [s for ly in model.model.layers for s in (ly.mlp.experts.gate_up_proj, ly.mlp.experts.down_proj)
              if isinstance(s, PackedExperts)]
    if not stacks or mode == "fp32":
        return "fp32"
    if limits.get("Q8_GROUP") != Q8_GROUP:
        raise RuntimeError(f"host_q8.c groups {limits.get('Q8_GROUP')} outputs, packed.py {Q8_GROUP}: changed apart")
    why = next((w for w in (s.q8_unsupported() for s in stacks) if w), None)
    if why is None:
        return "int8"
    if mode == "int8":
        raise ValueError(f"moe_activations='int8', but the packed experts cannot be read that way: {why}")
    log.info("packed experts multiply on fp32 activations (%s)", why)
    return "fp32"


def bind(lib: ctypes.CDLL) -> None:
    """The entry points' C types (host_forward's ``_bind`` calls this)."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.ds4_q8_kernel.restype = ctypes.c_char_p
    lib.ds4_q8_product.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.ds4_q8_product.restype = ctypes.c_int
    lib.ds4_q8_interleave.argtypes = [ptr, ptr, i64, i64, i64]
    lib.ds4_q8_interleave.restype = ctypes.c_int


def interleave_part(lib: ctypes.CDLL, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """``packed.interleave_q8`` in C (the same permutation, ~20x faster at load; test_host_q8 holds them
    equal)."""
    E, R, half = codes.shape
    if lib.ds4_q8_interleave(codes.data_ptr(), scales.data_ptr(), E, R, 2 * half):
        raise MemoryError("no memory to interleave one expert for the int8 product")


def q8_disagrees(lib: ctypes.CDLL, stacks: list[PackedExperts], tolerance: float = 1e-4) -> str | None:
    """``_disagrees`` on each stack (the host forward passes its first layer's gate/up and down): None when
    all agree, else what differs."""
    return next((why for why in (_disagrees(lib, s, tolerance) for s in stacks) if why), None)


def _disagrees(lib: ctypes.CDLL, stack: PackedExperts, tolerance: float) -> str | None:
    """The int8 product on the stack's first part's expert 0, as loaded, against the same product in torch
    (``quantize_rows_q8`` rows times the dequantised weights, float64): None when every output is within
    ``tolerance`` of sum |x w|. Both quantise the same inputs to the same integers, so only the order of
    the float sums differs (a wrong layout or scale is off by the whole sum)."""
    p = stack.parts[0]
    N, K = p.codes.shape[1], 2 * p.codes.shape[2]
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(0))
    y = torch.empty(3, N)
    codes, scales = p.codes[0].contiguous(), p.scales[0].contiguous()
    if lib.ds4_q8_product(x.data_ptr(), 3, K, codes.data_ptr(), scales.data_ptr(), N, y.data_ptr(),
                          torch.get_num_threads()):
        raise MemoryError("the int8 expert product could not allocate its rows")
    plain_c, plain_s = deinterleave_q8(codes[None], scales[None])
    w = dequant_mxfp4(plain_c, plain_s, stack.name)[0].double()
    xq = quantize_rows_q8(x)
    ref, mag = xq @ w.T, xq.abs() @ w.abs().T
    over = float(((y.double() - ref).abs() - tolerance * mag).max())  # sync-ok: start-up self-check
    if not over <= 0.0:
        return f"the int8 expert product of {stack.name} is off its definition by {over:.3g} beyond {tolerance:g} x sum |x w|"
    return None
