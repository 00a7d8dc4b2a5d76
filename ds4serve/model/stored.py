"""Projection weights kept at the checkpoint's width: FP8 e4m3 with block scales, or bf16.

DS4-Flash ships its attention and shared-expert projections in FP8 (one byte a weight, one scale per
128 x 128 block) and its LM head in bf16. Dequantised to fp32 at load they take 4x / 2x the bytes, and
at real widths a decode step is bound by the bytes it reads, so on the host the native forward reads
them as stored (``csrc/host_stored.c`` decodes each weight in registers to exactly the value
``dense()`` gives). ``StoredWeight`` takes the place of a ``Linear``'s parameter (as ``PackedExperts``
takes an expert stack's); the torch path, the reference, multiplies by ``dense()`` a block of rows at
a time, so it computes on the dequantise-at-load values without holding a full fp32 copy.
"""

from __future__ import annotations

import torch

from .native import fp8_native
from .quant import dequant_fp8

FORMATS = ("fp8", "bf16")
# rows of a stored weight dequantised at once on the torch path (the LM head: 129,280 rows)
_ROWS_PER_BLOCK = 8192
_WHOLE_ELEMENTS = 1 << 26  # a weight up to this size is dequantised whole (256 MB of fp32)


class StoredWeight:
    """One projection ``[out, in]`` as the checkpoint stores it.

    ``data``: FP8 codes as uint8 ``[out, in]`` (possibly a transposed view: the native forward stores
    them ``[in, out]``), or bf16 ``[out, in]``. ``scales``: FP8 only, fp32 ``[ceil(out / b0),
    ceil(in / b1)]`` (UE8M0 checkpoint scales are exact powers of two in fp32)."""

    def __init__(self, fmt: str, data: torch.Tensor, scales: torch.Tensor | None = None,
                 block: tuple[int, int] = (128, 128), name: str = "?"):
        if fmt not in FORMATS:
            raise ValueError(f"stored weight format must be one of {FORMATS}, got {fmt!r}")
        if fmt == "fp8" and (data.dtype != torch.uint8 or scales is None or scales.dtype != torch.float32):
            raise ValueError(f"{name}: FP8 weights are uint8 codes with fp32 block scales")
        if fmt == "bf16" and data.dtype != torch.bfloat16:
            raise ValueError(f"{name}: a bf16 stored weight holds bfloat16, got {data.dtype}")
        self.fmt, self.data, self.scales, self.block, self.name = fmt, data, scales, tuple(block), name

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Resident bytes (codes and scales)."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales) if t is not None)

    def dense(self, rows: slice | None = None) -> torch.Tensor:
        """The fp32 values of rows ``rows`` (all by default): what dequantise-at-load would hold."""
        if self.fmt == "bf16":
            part = self.data if rows is None else self.data[rows]
            return part.float()
        if rows is None:
            fast = fp8_native(self.data, self.scales, self.block)
            if fast is not None:
                return fast
            return dequant_fp8(self.data.view(torch.float8_e4m3fn), self.scales, self.block, self.name)
        b0 = self.block[0]
        start, stop = rows.start or 0, rows.stop if rows.stop is not None else self.shape[0]
        if start % b0:
            raise ValueError(f"{self.name}: FP8 rows must start on a block of {b0}")
        codes = self.data[start:stop].view(torch.float8_e4m3fn)
        scales = self.scales[start // b0: -(-stop // b0)]
        return dequant_fp8(codes, scales, self.block, self.name)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ dense().T`` in blocks of output rows (never a whole fp32 copy of a large weight)."""
        out_dim = self.shape[0]
        if out_dim <= _ROWS_PER_BLOCK or self.data.numel() <= _WHOLE_ELEMENTS:
            return torch.nn.functional.linear(x, self.dense().to(x.dtype))
        out = torch.empty(*x.shape[:-1], out_dim, dtype=x.dtype, device=x.device)
        step = _ROWS_PER_BLOCK - _ROWS_PER_BLOCK % self.block[0] if self.fmt == "fp8" else _ROWS_PER_BLOCK
        for start in range(0, out_dim, step):
            rows = slice(start, min(out_dim, start + step))
            out[..., rows] = torch.nn.functional.linear(x, self.dense(rows).to(x.dtype))
        return out

    def __repr__(self) -> str:
        return f"StoredWeight({self.fmt}, shape={list(self.shape)}, {self.nbytes / 2**20:.1f} MiB)"


def dense_weight(w: torch.Tensor | StoredWeight) -> torch.Tensor:
    """A weight's values as a tensor (a stored one dequantised whole: only for small projections)."""
    return w.dense() if isinstance(w, StoredWeight) else w
