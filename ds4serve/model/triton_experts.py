"""Packed routed experts on CUDA: Triton GEMMs that dequantise MXFP4 / FP8 weights tile by tile.

``PackedExperts.take`` (the host form) dequantises each routed expert whole, then multiplies. On a GPU
that would mean writing and re-reading a dequantised expert per step; these kernels instead load a
``BK x BN`` tile of codes and scales, decode it in registers (E2M1 codes times their block's UE8M0
scale, or FP8 e4m3 times its 2-D block scale: the loader's own arithmetic), and feed it straight into
the tile product. Nothing dequantised ever reaches memory.

``packed_grouped_linear`` runs one launch per (routed expert, part) over the rows sorted to that
expert: a loop over experts, never over sequences. The host needs the per-expert counts for that
(one sync per call).

Triton comes with CUDA builds of torch. The kernels also run on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``), which is how the tests check them against the host path on machines with no
GPU; ``available(device)`` says whether a device can use them.
"""

from __future__ import annotations

import torch

try:  # pragma: no cover - depends on the torch build
    import triton
    import triton.language as tl
except ImportError:  # CPU wheels of torch bring no Triton
    triton = None
    tl = None


def available(device: torch.device) -> bool:
    """True where the kernels can run: a CUDA device with Triton, or the host when Triton's interpreter
    is on (``TRITON_INTERPRET=1`` turns the kernels into interpreted functions as they are defined)."""
    if triton is None:
        return False
    return device.type == "cuda" or type(_packed_mm).__name__ == "InterpretedFunction"


if triton is not None:

    @triton.jit
    def _mxfp4_tile(c_ptr, s_ptr, rn, rk, wmask, scn, sck, ssn, ssk, SCALE_BYTES: tl.constexpr, BLOCK: tl.constexpr):
        """A ``[BK, BN]`` tile of W.T: E2M1 codes (the low nibble is the even input) times UE8M0 scales."""
        byte = tl.load(c_ptr + rn[None, :] * scn + (rk // 2)[:, None] * sck, mask=wmask, other=0).to(tl.int32)
        nib = tl.where((rk % 2 == 0)[:, None], byte & 15, (byte >> 4) & 15)
        e = (nib >> 1) & 3
        m = (nib & 1).to(tl.float32)
        mag = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.exp2((e - 1).to(tl.float32)))
        s = tl.load(s_ptr + rn[None, :] * ssn + (rk // BLOCK)[:, None] * ssk, mask=wmask, other=0)
        scale = tl.exp2(s.to(tl.float32) - 127.0) if SCALE_BYTES else s.to(tl.float32)
        return tl.where((nib & 8) != 0, -mag, mag) * scale

    @triton.jit
    def _fp8_tile(c_ptr, s_ptr, rn, rk, wmask, scn, sck, ssn, ssk, B0: tl.constexpr, B1: tl.constexpr):
        """A ``[BK, BN]`` tile of W.T: FP8 codes times their ``B0 x B1`` block's scale."""
        code = tl.load(c_ptr + rn[None, :] * scn + rk[:, None] * sck, mask=wmask, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + (rn // B0)[None, :] * ssn + (rk // B1)[:, None] * ssk, mask=wmask, other=0.0)
        return code * s.to(tl.float32)

    @triton.jit
    def _packed_mm(x_ptr, c_ptr, s_ptr, y_ptr, M, N, K, sxm, sxk, scn, sck, ssn, ssk, sym, syn,
                   FP8: tl.constexpr, SCALE_BYTES: tl.constexpr, BLOCK: tl.constexpr, B0: tl.constexpr,
                   B1: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """``y = x @ W.T`` for one packed expert part, W decoded tile by tile (``IEEE``: fp32 products)."""
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            wmask = (rk[:, None] < K) & (rn[None, :] < N)
            x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=(rm[:, None] < M) & (rk[None, :] < K),
                        other=0.0)
            if FP8:
                w = _fp8_tile(c_ptr, s_ptr, rn, rk, wmask, scn, sck, ssn, ssk, B0, B1)
            else:
                w = _mxfp4_tile(c_ptr, s_ptr, rn, rk, wmask, scn, sck, ssn, ssk, SCALE_BYTES, BLOCK)
            if IEEE:
                acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :] * syn, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


TILE = (16, 32, 32)  # (BM, BN, BK): BK a multiple of the MXFP4 block's 32 halves keeps a tile's scales whole


def packed_matmul(x: torch.Tensor, packed, expert: int) -> torch.Tensor:
    """``x [M, K] @ W_e.T`` for expert ``expert`` of ``packed`` (a ``PackedExperts``), every part (gate and
    up are two) written into its own columns: ``[M, rows]`` in fp32."""
    M = x.shape[0]
    y = torch.empty(M, packed.shape[1], dtype=torch.float32, device=x.device)
    ieee = x.dtype == torch.float32
    bm, bn, bk = TILE
    col = 0
    for p in packed.parts:
        codes, scales = p.codes[expert], p.scales[expert]
        n = codes.shape[0]
        out = y[:, col:col + n]
        grid = (triton.cdiv(M, bm), triton.cdiv(n, bn))
        fp8 = packed.fmt == "fp8"
        s = scales
        if not fp8 and scales.dtype == getattr(torch, "float8_e8m0fnu", None):
            s = scales.view(torch.uint8)  # the same exponent bytes
        k = codes.shape[1] if fp8 else 2 * codes.shape[1]
        b0, b1 = packed.fp8_block
        _packed_mm[grid](x, codes if fp8 else codes.view(torch.uint8), s, out, M, n, k, x.stride(0), x.stride(1),
                         codes.stride(0), codes.stride(1), s.stride(0), s.stride(1), out.stride(0), out.stride(1),
                         FP8=fp8, SCALE_BYTES=s.dtype == torch.uint8, BLOCK=1 if fp8 else k // s.shape[1],
                         B0=b0, B1=b1, IEEE=ieee, BM=bm, BN=bn, BK=bk)
        col += n
    return y


def packed_grouped_linear(x_sorted: torch.Tensor, packed, counts: torch.Tensor) -> torch.Tensor:
    """``moe.grouped_linear`` over packed experts: rows sorted by expert, ``counts[e]`` rows for expert e."""
    out = torch.empty(x_sorted.shape[0], packed.shape[1], dtype=x_sorted.dtype, device=x_sorted.device)
    start = 0
    for e, n in enumerate(counts.tolist()):  # sync-ok: one launch per routed expert (a loop over experts)
        if n:
            out[start:start + n] = packed_matmul(x_sorted[start:start + n], packed, e).to(out.dtype)
            start += n
    return out
