"""Routed experts kept in the checkpoint's own format (MXFP4 or block-scaled FP8) until a step uses them.

DS4-Flash's routed experts are 277B of its 284B parameters; stored as MXFP4 (4.25 bits each) they take
~137 GiB, dequantised to bf16 at load ~516 GiB. ``PackedExperts`` holds one layer's stack
(``gate_up [E, 2I, D]`` or ``down [E, D, I]``) as codes + scales and dequantises only the experts a
step routes to, with the loader's own arithmetic (``quant.dequant_mxfp4`` / ``dequant_fp8``, then
the model dtype), so a step computes on exactly the values the dequantise-at-load path would hold.
Nothing dequantised outlives the call that made it.

A stack may be several parts concatenated along the rows (gate and up are separate checkpoint tensors,
and an FP8 block can straddle their boundary, so each keeps its own scales).

This is the host (torch) form. On a CPU the native forward reads MXFP4 stacks in place instead
(``csrc/host_packed.c``, blocks decoded in registers); on CUDA the MoE takes ``triton_experts``' GEMMs,
which decode tiles in registers and never write a dequantised expert (checked under Triton's
interpreter; not yet run on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quant import dequant_fp8, dequant_mxfp4

FORMATS = ("mxfp4", "fp8")


@dataclass
class PackedPart:
    codes: torch.Tensor  # [E, rows, cols / 2] uint8 (MXFP4) or [E, rows, cols] float8 (FP8)
    scales: torch.Tensor  # [E, rows, cols / 32] (MXFP4) or [E, ceil(rows / b0), ceil(cols / b1)] (FP8)
    interleaved: bool = False  # MXFP4 in the native int8 product's layout (interleave_q8), same shapes


Q8_GROUP = 16  # output rows of one interleaved group (csrc/host_q8.c Q8_G, checked against ds4_abi)


def interleave_q8(codes: torch.Tensor, scales: torch.Tensor) -> None:
    """MXFP4 ``codes [E, R, K / 2]`` and ``scales [E, R, K / 32]`` rewritten in place into host_q8.c's layout
    (one expert at a time, so the extra memory is one expert's nibbles): per group of 16 rows and block of
    32 inputs, 4 vectors of 64 bytes whose byte 4j + r holds row j's input 8t + r (low nibble) and
    8t + 4 + r (high nibble); scales as [group][block][16 rows]."""
    E, R, half = codes.shape
    K, G = 2 * half, R // Q8_GROUP
    for e in range(E):
        nib = torch.stack((codes[e] & 15, codes[e] >> 4), dim=-1).reshape(G, Q8_GROUP, K // 32, 4, 2, 4)
        packed = nib[..., 0, :] | (nib[..., 1, :] << 4)  # [G, j, b, t, r]
        codes[e].copy_(packed.permute(0, 2, 3, 1, 4).reshape(R, half))
        scales[e].copy_(scales[e].reshape(G, Q8_GROUP, K // 32).permute(0, 2, 1).reshape(R, K // 32))


def quantize_rows_q8(x: torch.Tensor) -> torch.Tensor:
    """Rows ``x [M, K]`` as host_q8.c multiplies them, in float64: per block of 32, round-half-even(x *
    (127 / amax)) times amax / 127 (the kernel's integers and scale; a product of the two is exact in
    float64). For checks of the kernel: the same inputs give it the same integers."""
    M, K = x.shape
    b = x.float().reshape(M, K // 32, 32)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(b * inv)
    return (q.double() * (amax / 127.0).double()).reshape(M, K)


def deinterleave_q8(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``interleave_q8``, into new tensors (the torch path's view of interleaved experts)."""
    E, R, half = codes.shape
    K, G = 2 * half, R // Q8_GROUP
    v = codes.reshape(E, G, K // 32, 4, Q8_GROUP, 4).permute(0, 1, 4, 2, 3, 5)  # [E, G, j, b, t, r]
    nib = torch.stack((v & 15, v >> 4), dim=-2).reshape(E, R, K)  # inputs in order
    plain = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return plain, scales.reshape(E, G, K // 32, Q8_GROUP).permute(0, 1, 3, 2).reshape(E, R, K // 32)


class PackedExperts:
    def __init__(self, fmt: str, parts: list[PackedPart], shape: tuple[int, int, int], dtype: torch.dtype,
                 fp8_block: tuple[int, int] = (128, 128), name: str = "?"):
        if fmt not in FORMATS:
            raise ValueError(f"packed expert format must be one of {FORMATS}, got {fmt!r}")
        self.fmt, self.parts, self.shape, self.dtype = fmt, parts, tuple(shape), dtype
        self.fp8_block, self.name = fp8_block, name
        self.device = parts[0].codes.device

    @property
    def n_experts(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        """Resident bytes (codes and scales)."""
        return sum(t.numel() * t.element_size() for p in self.parts for t in (p.codes, p.scales))

    def take(self, experts: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The dequantised weights of ``experts`` (sorted unique expert ids) -> ``[len, rows, cols]``,
        written into ``out`` where the native loop applies and ``out`` fits (a buffer reused across
        groups: first touches of fresh memory cost more than the decoding on a VM)."""
        fast = self._take_native(experts, out)
        if fast is not None:
            return fast
        pieces = []
        every = experts.numel() == self.n_experts  # callers pass sorted unique ids: then it is all of them
        for p in self.parts:
            codes, scales = (p.codes, p.scales) if every else (p.codes.index_select(0, experts),
                                                                p.scales.index_select(0, experts))
            if p.interleaved:
                codes, scales = deinterleave_q8(codes, scales)
            if self.fmt == "mxfp4":
                pieces.append(dequant_mxfp4(codes, scales, self.name))
            else:
                pieces.append(dequant_fp8(codes, scales, self.fp8_block, self.name))
        full = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-2)
        return full.to(self.dtype)

    def _take_native(self, experts: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor | None:
        """MXFP4 with byte scales on the host: each (expert, part) decoded by the C kernel straight into
        its rows of one fp32 result (no gather of codes, no concatenation); ``None`` elsewhere."""
        from .native import mxfp4_interleaved_native, mxfp4_native

        if self.fmt != "mxfp4" or self.dtype != torch.float32 or self.device.type != "cpu" \
                or any(p.scales.dtype != torch.uint8 for p in self.parts):
            return None
        ids = experts.tolist()  # sync-ok: host-only path, a handful of expert ids
        shape = (len(ids), *self.shape[1:])
        fits = into is not None and into.dtype == torch.float32 and into.is_contiguous() and tuple(into.shape) == shape
        out = into if fits else torch.empty(shape, dtype=torch.float32)

        def expert(k: int) -> bool:
            row = 0
            for p in self.parts:
                n = p.codes.shape[1]
                if p.interleaved:
                    if not mxfp4_interleaved_native(p.codes[ids[k]], p.scales[ids[k]], out[k, row:row + n]):
                        return False
                elif mxfp4_native(p.codes[ids[k]], p.scales[ids[k]], out[k, row:row + n]) is None:
                    return False
                row += n
            return True

        threads = min(len(ids), torch.get_num_threads())
        if threads <= 1:
            return out if all(expert(k) for k in range(len(ids))) else None
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(threads) as pool:  # the C loop releases the GIL: experts in parallel
            return out if all(pool.map(expert, range(len(ids)))) else None

    def q8_unsupported(self) -> str | None:
        """Why the native int8 product cannot read this stack (None: it can)."""
        if self.fmt != "mxfp4" or self.device.type != "cpu":
            return f"{self.fmt} experts on {self.device.type}"
        for p in self.parts:
            if p.scales.dtype != torch.uint8 or p.codes.shape[1] % Q8_GROUP or p.codes.shape[2] % 16:
                return f"{self.name}: rows not in groups of {Q8_GROUP} or inputs not in blocks of 32"
        return None

    def interleave(self, on: bool, how=None) -> None:
        """Every part into (``on``) or out of the native int8 product's layout, in place; ``how(codes,
        scales)`` does the interleaving (default ``interleave_q8``; the host forward passes its C loop)."""
        for p in self.parts:
            if p.interleaved == on:
                continue
            if on:
                (how or interleave_q8)(p.codes, p.scales)
            else:
                codes, scales = deinterleave_q8(p.codes, p.scales)
                p.codes.copy_(codes)
                p.scales.copy_(scales)
            p.interleaved = on

    def __repr__(self) -> str:
        return f"PackedExperts({self.fmt}, shape={list(self.shape)}, {self.nbytes / 2**20:.1f} MiB resident)"


def stack_parts(per_expert: list[list[tuple[torch.Tensor, torch.Tensor]]], device: torch.device) -> list[PackedPart]:
    """``per_expert[e][k] = (codes, scales)`` of part ``k`` of expert ``e`` -> one stacked part per ``k``."""
    n_parts = len(per_expert[0])
    out = []
    for k in range(n_parts):
        codes = torch.stack([_as_codes(e[k][0]) for e in per_expert]).to(device)
        scales = torch.stack([_as_scale_bytes(e[k][1]) for e in per_expert]).to(device)
        out.append(PackedPart(codes, scales))
    return out


def _as_scale_bytes(t: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales as their exponent bytes (what ``dequant_mxfp4`` reads them as); others unchanged."""
    return t.view(torch.uint8) if t.dtype == getattr(torch, "float8_e8m0fnu", None) else t


def _as_codes(t: torch.Tensor) -> torch.Tensor:
    """FP4 codes as uint8 bytes whatever dtype the checkpoint used (int8, uint8, float4_e2m1fn_x2)."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t
    return t.contiguous().view(torch.uint8)
