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
            if self.fmt == "mxfp4":
                pieces.append(dequant_mxfp4(codes, scales, self.name))
            else:
                pieces.append(dequant_fp8(codes, scales, self.fp8_block, self.name))
        full = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-2)
        return full.to(self.dtype)

    def _take_native(self, experts: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor | None:
        """MXFP4 with byte scales on the host: each (expert, part) decoded by the C kernel straight into
        its rows of one fp32 result (no gather of codes, no concatenation); ``None`` elsewhere."""
        from .native import mxfp4_native

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
                if mxfp4_native(p.codes[ids[k]], p.scales[ids[k]], out[k, row:row + n]) is None:
                    return False
                row += n
            return True

        threads = min(len(ids), torch.get_num_threads())
        if threads <= 1:
            return out if all(expert(k) for k in range(len(ids))) else None
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(threads) as pool:  # the C loop releases the GIL: experts in parallel
            return out if all(pool.map(expert, range(len(ids)))) else None

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
