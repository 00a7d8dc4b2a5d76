"""Small native kernels for the host, built once with the system C compiler and loaded with ctypes.

Why: CPU decode is dispatch-bound. mHC's Sinkhorn projection is ~80 tiny torch ops per sub-block
(two per iteration, 20 iterations, two sub-blocks per layer): on the Flash-shaped checkpoint that
is a third of the ~2,200 torch calls of a one-stream decode step. The same arithmetic as one C
loop costs one call. The kernel is written to compute *exactly* what the torch form computes (the
normaliser is ``eps + the in-order sum``, which is what ``baddbmm(eps, ones, m)`` adds; no
reassociation, no contraction), and a test checks the two are bit-equal.

Also MXFP4 dequantisation for packed experts (``packed.py``), one C loop instead of a table gather
over an int32 copy of the codes. The C source is csrc/kernels.c; it is compiled on first use into ``cache_root()/native/<hash>/`` (about
0.1 s: no torch headers), so a restart, or another process, loads the built library. Where no C
compiler exists or the build fails, the torch form is used, and that is logged once.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from ..environment import cache_root, native_build
from ..native_build import OnceLibrary, build_library, sanitized

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "kernels.c"
# IEEE arithmetic exactly as written: no fast-math, no fused multiply-add contraction
_FLAGS = ["-O2", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]
_LIBS = ["-lm"]

enabled = True  # tests switch this off to compare against the torch form


def _build(root: Path) -> Path:
    """Compile the source into ``root/<hash>/kernels.so`` unless it is already there."""
    return build_library(root, "kernels", _SOURCE.read_text(), sanitized(_FLAGS, native_build().sanitize), _LIBS)


def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(_build(cache_root() / "native")))
    lib.ds4_sinkhorn_f32.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_float]
    lib.ds4_sinkhorn_f32.restype = None
    lib.ds4_rope_f32.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_long] * 4 + [ctypes.c_int]
    lib.ds4_rope_f32.restype = None
    lib.ds4_mxfp4_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
    lib.ds4_mxfp4_f32.restype = None
    lib.ds4_mxfp4_q8_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2
    lib.ds4_mxfp4_q8_f32.restype = None
    lib.ds4_fp8_f32.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                                ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_void_p]
    lib.ds4_fp8_f32.restype = None
    return lib


_library = OnceLibrary(_load, log, "native host kernels unavailable (%s); using the torch forms (same results, "
                                   "slower CPU decode)")


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or ``None`` (torch forms are used) when they cannot be built here."""
    return _library.get()


def _applies(t: torch.Tensor) -> bool:
    return enabled and t.device.type == "cpu" and t.dtype == torch.float32 and not t.requires_grad \
        and not torch.compiler.is_compiling()


def sinkhorn_native(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor | None:
    """Sinkhorn of ``comb [n, hc, hc]`` by the C kernel (a new tensor), or ``None`` when the kernel
    does not apply: not a host fp32 tensor, gradients wanted, tracing, or no kernels here."""
    if not _applies(comb):
        return None
    lib = library()
    if lib is None:
        return None
    out = comb.clone(memory_format=torch.contiguous_format)
    n, hc, _ = out.shape
    lib.ds4_sinkhorn_f32(out.data_ptr(), n, hc, iters, ctypes.c_float(eps))
    return out


def rope_native(x: torch.Tensor, rot: torch.Tensor, inverse: bool) -> torch.Tensor | None:
    """``apply_rope`` by the C kernel (a new tensor), or ``None`` where it does not apply (see
    ``sinkhorn_native``; also a rotation table that does not match ``x`` row for row)."""
    if not _applies(x) or rot.dtype != torch.complex64 or rot.device.type != "cpu" or rot.dim() != 2 \
            or rot.shape[0] != x.shape[0] or x.dim() < 2 or 2 * rot.shape[1] > x.shape[-1]:
        return None
    lib = library()
    if lib is None:
        return None
    out = x.clone(memory_format=torch.contiguous_format)
    table = torch.view_as_real(rot.resolve_conj()).contiguous()
    n, dim, half = out.shape[0], out.shape[-1], rot.shape[1]
    lib.ds4_rope_f32(out.data_ptr(), table.data_ptr(), n, out.numel() // max(1, n * dim), dim, half, int(inverse))
    return out


def mxfp4_native(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """``dequant_mxfp4`` for uint8 ``codes [..., out, in / 2]`` and uint8 exponent ``scales [..., out,
    in / block]`` by the C kernel (fp32; into ``out`` when given, a contiguous tensor of the result's
    shape), or ``None`` where it does not apply."""
    if not enabled or codes.device.type != "cpu" or codes.dtype != torch.uint8 or scales.dtype != torch.uint8 \
            or torch.compiler.is_compiling() or scales.shape[:-1] != codes.shape[:-1] or scales.shape[-1] < 1 \
            or (2 * codes.shape[-1]) % scales.shape[-1] or (2 * codes.shape[-1] // scales.shape[-1]) % 2:
        return None
    lib = library()
    if lib is None:
        return None
    c, s = codes.contiguous(), scales.contiguous()
    half = c.shape[-1]
    shape = (*c.shape[:-1], 2 * half)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32)
    elif tuple(out.shape) != shape or out.dtype != torch.float32 or not out.is_contiguous():
        return None
    rows = c.numel() // max(1, half)
    lib.ds4_mxfp4_f32(c.data_ptr(), s.data_ptr(), out.data_ptr(), rows, half, 2 * half // s.shape[-1])
    return out


def mxfp4_interleaved_native(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> bool:
    """``mxfp4_native`` for one expert's part in the int8 product's interleaved layout (``packed.
    interleave_q8``): ``codes [rows, cols / 2]``, ``scales [rows, cols / 32]`` into ``out [rows, cols]``
    (contiguous fp32); False where the C kernels are not here."""
    lib = library() if enabled else None
    if lib is None or torch.compiler.is_compiling():
        return False
    rows, cols = out.shape
    lib.ds4_mxfp4_q8_f32(codes.contiguous().data_ptr(), scales.contiguous().data_ptr(), out.data_ptr(), rows, cols)
    return True


def _split_rows(rows: int, parts: int, align: int) -> list[tuple[int, int]]:
    """``rows`` cut into at most ``parts`` ranges that start on multiples of ``align``."""
    step = -(-rows // max(1, parts))
    step = -(-step // align) * align
    return [(a, min(rows, a + step)) for a in range(0, rows, max(1, step))]


def fp8_native(codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor | None:
    """``dequant_fp8`` of uint8 e4m3 ``codes [out, in]`` (contiguous, or the transposed view of an
    ``[in, out]`` with rows padded (``host_support.kn_store``): the native forward stores FP8 weights that
    way) with fp32 ``scales`` per ``block``, by
    the C kernel on torch's threads (ctypes releases the GIL), as a tensor of the same layout; ``None``
    where it does not apply. ~20x the torch form, which at real widths made the start-up self-check 10 s."""
    if not enabled or codes.device.type != "cpu" or codes.dtype != torch.uint8 or codes.dim() != 2 \
            or scales.dtype != torch.float32 or torch.compiler.is_compiling():
        return None
    transposed = not codes.is_contiguous()
    phys = codes.t() if transposed else codes
    if phys.stride(1) != 1 or phys.stride(0) < phys.shape[1]:
        return None
    lib = library()
    if lib is None:
        return None
    s = scales.contiguous()
    br, bc = (block[1], block[0]) if transposed else block
    rows, cols = phys.shape
    out = torch.empty(rows, cols, dtype=torch.float32)
    parts = _split_rows(rows, torch.get_num_threads(), br)

    def run(span: tuple[int, int]) -> None:
        a, b = span
        sub = (s[:, a // br: -(-b // br)] if transposed else s[a // br: -(-b // br)]).contiguous()  # held
        lib.ds4_fp8_f32(phys[a].data_ptr(), b - a, cols, phys.stride(0), sub.data_ptr(), br, bc, int(transposed),
                        out[a].data_ptr())

    if len(parts) == 1:
        run(parts[0])
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(parts)) as pool:
            list(pool.map(run, parts))
    return out.t() if transposed else out
