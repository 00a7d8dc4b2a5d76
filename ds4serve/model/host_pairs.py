"""The bf16 LM head on bf16 activations (``csrc/host_pairs.c``), seen from Python: whether a model's head
takes it (``choose_head_activations``) and the start-up probe that holds this machine's kernel bit-equal
to the product's definition.

Split from ``host_forward.py`` like ``host_q8.py``: this module only needs the bound library's entry
points (``ds4_p16_*``, ``ds4_linear``).
"""

from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

from .host_abi import _Weight
from .stored import StoredWeight

log = logging.getLogger(__name__)

HEAD_ACTIVATIONS = ("auto", "bf16", "fp32")
FMT_PAIRS = 3  # host.h Weight.fmt: bf16 [N, K] on bf16-rounded inputs


def bf16_head(model: nn.Module) -> torch.Tensor | None:
    """The head's bf16 ``[vocab, hidden]`` data when it is kept at the checkpoint's width, else None."""
    w = getattr(model, "lm_head", None)
    w = getattr(w, "weight", None)
    if isinstance(w, StoredWeight) and w.fmt == "bf16":
        return w.data
    return None


def choose_head_activations(model: nn.Module, mode: str, lib: ctypes.CDLL) -> str:
    """``bf16`` or ``fp32``: what the native forward's LM head multiplies a bf16-stored head by. ``bf16``
    (host_pairs.c) rounds the head's input rows to bf16, as llama.cpp does, and adds bf16 pairs: one
    vdpbf16ps does the work of two fp32 FMAs; ``fp32`` (host_stored.c) computes exactly what the
    dequantised head computes. ``auto`` takes bf16 where this CPU has the instruction; elsewhere the
    bf16 product is emulated bit for bit, 1.4-6x slower than fp32 (csrc/host_pairs.c), so only an
    explicit ``bf16`` takes it there. A head that is not stored as bf16 says fp32 (nothing to choose)."""
    if mode not in HEAD_ACTIVATIONS:
        raise ValueError(f"head_activations must be one of {', '.join(HEAD_ACTIVATIONS)}, got {mode!r}")
    if bf16_head(model) is None or mode == "fp32":
        return "fp32"
    if lib.ds4_p16_native():
        return "bf16"
    if mode == "bf16":
        log.warning("head_activations='bf16' on a CPU without AVX-512 BF16: the head runs the instruction's "
                    "exact emulation (%s), 1.4-6x slower than --head-activations fp32", lib.ds4_p16_kernel().decode())
        return "bf16"
    log.info("the bf16 LM head multiplies fp32 activations (this CPU has no AVX-512 BF16; --head-activations "
             "bf16 runs its emulation, the same bits, slower)")
    return "fp32"


def bind(lib: ctypes.CDLL) -> None:
    """The entry points' C types (host_forward's ``_bind`` calls this)."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.ds4_p16_kernel.restype = ctypes.c_char_p
    lib.ds4_p16_native.restype = ctypes.c_int
    lib.ds4_p16_reference.argtypes = [ptr, i64, i64, ptr, i64, ptr]
    lib.ds4_p16_reference.restype = ctypes.c_int


def product(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """``x [M, K]`` (fp32) times the bf16 ``w [N, K]`` through the kernel (``ds4_linear``, fmt 3)."""
    x = x.float().contiguous()
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N)
    desc = _Weight(None, K, 0, FMT_PAIRS, w.data_ptr(), None, 0, 0, 0, 0)
    if lib.ds4_linear(x.data_ptr(), M, K, ctypes.byref(desc), N, y.data_ptr(), N, threads):
        raise MemoryError("the bf16-pair product could not round its rows")
    return y


def reference(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same product by ``ds4_p16_reference``: the definition in scalar C, one output at a time."""
    x = x.float().contiguous()
    M, K = x.shape
    y = torch.empty(M, w.shape[0])
    if lib.ds4_p16_reference(x.data_ptr(), M, K, w.data_ptr(), w.shape[0], y.data_ptr()):
        raise MemoryError("the bf16-pair reference could not round its rows")
    return y


def probe_rows(K: int) -> torch.Tensor:
    """Inputs that reach every branch of the definition: random rows at the scales a normed hidden state
    has, one with ties to even, subnormals, zeros of both signs and values that round up an exponent."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, K, generator=g)
    x[1] *= 1e-3
    edge = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -0.0, 0.0, 1e-39, -1e-39, float.fromhex("0x1.ffffp0"), -float.fromhex("0x1.ff8p-1")])
    x[3, : min(K, edge.numel() * 8)] = edge.repeat(8)[: min(K, edge.numel() * 8)]
    return x


def first_difference(got: torch.Tensor, want: torch.Tensor) -> tuple[int, int] | None:
    """Where two ``[M, N]`` fp32 results first differ bit for bit (NaN matching NaN), or None: what the
    start-up probes of the pair products report."""
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    if bool(same.all()):
        return None
    m, n = (int(i) for i in (~same).nonzero()[0])  # sync-ok: start-up probe
    return m, n


def p16_disagrees(lib: ctypes.CDLL, head: torch.Tensor, rows: int = 256) -> str | None:
    """The kernel on the first ``rows`` rows of the loaded head, against ``ds4_p16_reference``, bit for
    bit: None when every output agrees, else where the first differs. The kernel takes the instruction
    where the CPU has it; its definition is Intel's, and a CPU that computes it otherwise must not serve
    different numbers than the emulation does."""
    w = head[:rows].contiguous()
    x = probe_rows(w.shape[1])
    got, want = product(lib, x, w, threads=torch.get_num_threads()), reference(lib, x, w)
    first = first_difference(got, want)
    if first is None:
        return None
    m, n = first
    return (f"the bf16-pair LM head product ({lib.ds4_p16_kernel().decode()}) differs from its definition at row "
            f"{m}, output {n}: {float(got[m, n])!r} against {float(want[m, n])!r}")
