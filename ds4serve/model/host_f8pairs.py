"""FP8 projections on bf16 activations (``csrc/host_f8pairs.c``), seen from Python: which FP8 weights
take the bf16-pair product (``choose_fp8_activations``, ``takes``) and the start-up probe that holds this
machine's kernel bit-equal to the product's definition.

A sibling of ``host_pairs.py`` (the bf16 LM head on bf16 rows): the same rounding of the input rows, the
same instruction, over FP8 codes decoded to bf16 in registers. Only the bound library's entry points are
needed here (``ds4_f8p_*``, ``ds4_linear``).
"""

from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

from .host_abi import _Weight
from .host_pairs import first_difference, probe_rows
from .host_support import kn_store, kn_stored
from .stored import StoredWeight

log = logging.getLogger(__name__)

FP8_ACTIVATIONS = ("auto", "bf16", "fp32")
FMT_F8_PAIRS = 4  # host.h Weight.fmt: FP8 [K, N] codes on bf16-rounded inputs
STRIP = 32  # outputs the kernel computes together (host_f8pairs.c F8P_STRIP)


def takes(w: StoredWeight) -> str | None:
    """None when the pair product takes this FP8 weight, else why not: it needs even ``in`` and input
    blocks, and ``out`` and output blocks in whole strips of 32 (every DS4 projection has them)."""
    n_out, n_in = w.shape
    b_out, b_in = w.block
    if n_in % 2 or b_in % 2:
        return f"{n_in} inputs in blocks of {b_in} (the pairs need even counts)"
    if n_out % STRIP or b_out % STRIP:
        return f"{n_out} outputs in blocks of {b_out} (the pairs need multiples of {STRIP})"
    return None


def fmt_for(w: StoredWeight, mode: str, pairs: list[StoredWeight], kept: list[str]) -> int:
    """The native descriptor's fmt for the FP8 ``w`` under ``mode`` (``choose_fp8_activations``'s answer):
    ``FMT_F8_PAIRS`` where the pair product takes it (then ``w`` joins ``pairs``), else 1, host_stored.c's
    fp32 rows (with bf16 asked for, the reason joins ``kept``: the start-up log names it)."""
    if mode != "bf16":
        return 1
    why = takes(w)
    if why is not None:
        kept.append(f"{w.name}: {why}")
        return 1
    pairs.append(w)
    return FMT_F8_PAIRS


def fp8_weights(model: nn.Module) -> list[StoredWeight]:
    """Every FP8 projection kept at the checkpoint's width, in module order."""
    return [m.weight for m in model.modules()
            if isinstance(getattr(m, "weight", None), StoredWeight) and m.weight.fmt == "fp8"]


def choose_fp8_activations(model: nn.Module, mode: str, lib: ctypes.CDLL) -> str:
    """``bf16`` or ``fp32``: what the native forward multiplies the FP8 projections by. ``bf16``
    (host_f8pairs.c) rounds their input rows to bf16 and adds bf16 pairs of the decoded codes: one
    vdpbf16ps does the work of two fp32 FMAs; ``fp32`` (host_stored.c) computes exactly what the
    dequantised weights compute. ``auto`` takes bf16 where this CPU has AVX-512 BF16 and VBMI; elsewhere
    the product is computed by a plain C loop (the same bits, many times slower), so only an explicit
    ``bf16`` takes it there. A model without FP8 weights says fp32 (nothing to choose)."""
    if mode not in FP8_ACTIVATIONS:
        raise ValueError(f"fp8_activations must be one of {', '.join(FP8_ACTIVATIONS)}, got {mode!r}")
    if not fp8_weights(model) or mode == "fp32":
        return "fp32"
    if lib.ds4_f8p_native():
        return "bf16"
    if mode == "bf16":
        log.warning("fp8_activations='bf16' on a CPU without AVX-512 BF16 and VBMI: the FP8 projections run "
                    "the product's plain C definition (%s), far slower than --fp8-activations fp32",
                    lib.ds4_f8p_kernel().decode())
        return "bf16"
    log.info("FP8 projections multiply fp32 activations (this CPU has no AVX-512 BF16 + VBMI; "
             "--fp8-activations bf16 runs the pair product's plain C definition, the same bits, slower)")
    return "fp32"


def bind(lib: ctypes.CDLL) -> None:
    """The entry points' C types (host_forward's ``_bind`` calls this)."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.ds4_f8p_kernel.restype = ctypes.c_char_p
    lib.ds4_f8p_native.restype = ctypes.c_int
    lib.ds4_f8p_reference.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, i64, i64, i64, ptr]
    lib.ds4_f8p_reference.restype = ctypes.c_int


def _kn(w: StoredWeight) -> torch.Tensor:
    """The codes stored ``[in, out]`` as the kernels read them (``kn_store``, once)."""
    if not kn_stored(w.data):
        w.data = kn_store(w.data)
    return w.data


def product(lib: ctypes.CDLL, x: torch.Tensor, w: StoredWeight, threads: int = 1) -> torch.Tensor:
    """``x [M, in]`` (fp32) times the FP8 ``w`` through the kernel (``ds4_linear``, fmt 4)."""
    if (why := takes(w)) is not None:
        raise ValueError(f"{w.name}: the bf16-pair product does not take {why}")
    x = x.float().contiguous()
    M, K = x.shape
    N = w.shape[0]
    data, scales = _kn(w), w.scales.contiguous()
    y = torch.empty(M, N)
    desc = _Weight(None, data.stride(1), 1, FMT_F8_PAIRS, data.data_ptr(), scales.data_ptr(), w.block[0],
                   w.block[1], scales.shape[1], scales.shape[0])
    rc = lib.ds4_linear(x.data_ptr(), M, K, ctypes.byref(desc), N, y.data_ptr(), N, threads)
    if rc:
        raise (MemoryError if rc == -1 else ValueError)(f"{w.name}: the bf16-pair product failed ({rc})")
    return y


def reference(lib: ctypes.CDLL, x: torch.Tensor, w: StoredWeight, n_out: int | None = None) -> torch.Tensor:
    """The same product (its first ``n_out`` outputs) by ``ds4_f8p_reference``: the definition in scalar
    C, one output at a time."""
    x = x.float().contiguous()
    M, K = x.shape
    N = w.shape[0] if n_out is None else n_out
    data, scales = _kn(w), w.scales.contiguous()
    y = torch.empty(M, N)
    rc = lib.ds4_f8p_reference(x.data_ptr(), M, K, data.data_ptr(), data.stride(1), scales.data_ptr(),
                               scales.shape[1], w.block[0], w.block[1], N, y.data_ptr())
    if rc:
        raise (MemoryError if rc == -1 else ValueError)(f"{w.name}: the bf16-pair reference failed ({rc})")
    return y


def _first_columns(w: StoredWeight, n_out: int) -> StoredWeight:
    """The first ``n_out`` outputs (whole output blocks) of ``w`` as a weight of their own (a copy)."""
    rows = -(-n_out // w.block[0]) * w.block[0]
    data = w.data[:rows].contiguous()
    return StoredWeight("fp8", data, w.scales[: rows // w.block[0]].contiguous(), w.block, w.name)


def f8p_disagrees(lib: ctypes.CDLL, w: StoredWeight, n_out: int = 256) -> str | None:
    """The kernel on the first ``n_out`` outputs of a loaded FP8 weight, against ``ds4_f8p_reference``, bit
    for bit: None when every output agrees, else where the first differs. The kernel takes the instructions
    where the CPU has them; a CPU that computes vdpbf16ps otherwise must not serve other numbers than the
    definition."""
    part = _first_columns(w, min(n_out, w.shape[0]))
    x = probe_rows(part.shape[1])
    got = product(lib, x, part, threads=torch.get_num_threads())
    want = reference(lib, x, part)
    first = first_difference(got, want)
    if first is None:
        return None
    m, n = first
    return (f"the FP8 bf16-pair product ({lib.ds4_f8p_kernel().decode()}) differs from its definition on "
            f"{w.name} at row {m}, output {n}: {float(got[m, n])!r} against {float(want[m, n])!r}")
