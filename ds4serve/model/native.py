"""Small native kernels for the host, built once with the system C compiler and loaded with ctypes.

Why: CPU decode is dispatch-bound. mHC's Sinkhorn projection is ~80 tiny torch ops per sub-block
(two per iteration, 20 iterations, two sub-blocks per layer): on the Flash-shaped checkpoint that
is a third of the ~2,200 torch calls of a one-stream decode step. The same arithmetic as one C
loop costs one call. The kernel is written to compute *exactly* what the torch form computes (the
normaliser is ``eps + the in-order sum``, which is what ``baddbmm(eps, ones, m)`` adds; no
reassociation, no contraction), and a test checks the two are bit-equal.

Also MXFP4 dequantisation for packed experts (``packed.py``), one C loop instead of a table gather
over an int32 copy of the codes. The C source lives here; it is compiled on first use into ``cache_root()/native/<hash>/`` (about
0.1 s: no torch headers), so a restart, or another process, loads the built library. Where no C
compiler exists or the build fails, the torch form is used, and that is logged once.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from ..config import cache_root, native_build
from ..native_build import OnceLibrary, build_library, sanitized

log = logging.getLogger(__name__)

_SOURCE = r"""
/* Sinkhorn on n row-major hc x hc fp32 matrices, in place: one column pass, then iters - 1
   (row, column) pairs. Each normaliser is eps + the in-order sum of hc entries. */
void ds4_sinkhorn_f32(float *m, long n, long hc, long iters, float eps) {
    for (long b = 0; b < n; b++) {
        float *x = m + b * hc * hc;
        for (long it = 0; it < iters; it++) {
            if (it > 0) {
                for (long i = 0; i < hc; i++) {
                    float s = 0.0f;
                    for (long j = 0; j < hc; j++) s += x[i * hc + j];
                    float d = eps + s;
                    for (long j = 0; j < hc; j++) x[i * hc + j] = x[i * hc + j] / d;
                }
            }
            for (long j = 0; j < hc; j++) {
                float s = 0.0f;
                for (long i = 0; i < hc; i++) s += x[i * hc + j];
                float d = eps + s;
                for (long i = 0; i < hc; i++) x[i * hc + j] = x[i * hc + j] / d;
            }
        }
    }
}

/* Rotary embedding in place on the last 2 * half channels of x [n, h, dim] (contiguous), with
   rot [n, half, 2] = (cos, sin): the pair (a, b) becomes (a c - b s, a s + b c), which is the
   arithmetic of torch's complex multiply (s negated for the inverse rotation). */
void ds4_rope_f32(float *x, const float *rot, long n, long h, long dim, long half, int inverse) {
    for (long i = 0; i < n; i++) {
        const float *r = rot + i * half * 2;
        for (long k = 0; k < h; k++) {
            float *p = x + (i * h + k) * dim + (dim - 2 * half);
            for (long j = 0; j < half; j++) {
                float a = p[2 * j], b = p[2 * j + 1], c = r[2 * j], d = inverse ? -r[2 * j + 1] : r[2 * j + 1];
                p[2 * j] = a * c - b * d;
                p[2 * j + 1] = a * d + b * c;
            }
        }
    }
}

/* MXFP4 dequantisation: codes [rows, half] (two E2M1 codes per byte, the low nibble first) times
   2^(scale byte - 127) per block of inputs, into out [rows, 2 * half]; each output is one table value
   times its block's power of two (one fp32 product, as the torch form computes it). */
void ds4_mxfp4_f32(const unsigned char *codes, const unsigned char *scales, float *out, long rows, long half,
                   long block) {
    static const float lut[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    float pairs[512]; /* byte -> (low nibble's value, high nibble's value) */
    for (int b = 0; b < 256; b++) { pairs[2 * b] = lut[b & 15]; pairs[2 * b + 1] = lut[b >> 4]; }
    long n_blocks = 2 * half / block, per = block / 2;
    for (long r = 0; r < rows; r++) {
        const unsigned char *c = codes + r * half;
        float *o = out + r * 2 * half;
        for (long b = 0; b < n_blocks; b++) {
            float s = ldexpf(1.0f, (int)scales[r * n_blocks + b] - 127);
            for (long j = b * per; j < (b + 1) * per; j++) {
                const float *p = pairs + 2 * c[j];
                o[2 * j] = p[0] * s;
                o[2 * j + 1] = p[1] * s;
            }
        }
    }
}
"""
# IEEE arithmetic exactly as written: no fast-math, no fused multiply-add contraction
_FLAGS = ["-O2", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]
_LIBS = ["-lm"]

enabled = True  # tests switch this off to compare against the torch form


def _build(root: Path) -> Path:
    """Compile the source into ``root/<hash>/kernels.so`` unless it is already there."""
    return build_library(root, "kernels", _SOURCE, sanitized(_FLAGS, native_build().sanitize), _LIBS)


def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(_build(cache_root() / "native")))
    lib.ds4_sinkhorn_f32.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_float]
    lib.ds4_sinkhorn_f32.restype = None
    lib.ds4_rope_f32.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_long] * 4 + [ctypes.c_int]
    lib.ds4_rope_f32.restype = None
    lib.ds4_mxfp4_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
    lib.ds4_mxfp4_f32.restype = None
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
