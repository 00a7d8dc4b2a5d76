"""Number formats of DS4 checkpoints: FP8 e4m3 with block scales, MXFP4 (E2M1 codes, UE8M0 scales).

Below both the checkpoint reader (``weights.py``), which dequantises at load, and the packed expert
stacks (``packed.py``), which dequantise the experts a step routes to: both compute exactly these
values, so a packed step and a dequantise-at-load step see the same weights bit for bit. The native
forward's in-register decoding (``csrc/host_packed.c``) makes the same products.
"""

from __future__ import annotations

import torch

from .native import mxfp4_native


class FormatError(ValueError):
    """A tensor and its scales do not fit the format (shapes, dtypes); the message names the tensor."""


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def dequant_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
                name: str = "?") -> torch.Tensor:
    """FP8 e4m3 ``weight [..., out, in]`` times per-block ``scale [..., ceil(out/b0), ceil(in/b1)]``."""
    w = weight.float()
    s = scale.float()
    out_dim, in_dim = w.shape[-2:]
    b0, b1 = block
    if s.shape[-2:] != (-(-out_dim // b0), -(-in_dim // b1)):
        raise FormatError(
            f"{name}: scale shape {list(s.shape)} does not fit weight {list(w.shape)} with block {list(block)} "
            "(set quantization_config.weight_block_size)")
    s = s.repeat_interleave(b0, dim=-2)[..., :out_dim, :].repeat_interleave(b1, dim=-1)[..., :in_dim]
    return w * s


# E2M1 code -> value (sign bit, then two exponent bits and one mantissa bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def is_packed_fp4(t: torch.Tensor) -> bool:
    return t.dtype in (torch.int8, torch.uint8) or t.dtype == getattr(torch, "float4_e2m1fn_x2", None)


def _fp4_byte_table() -> torch.Tensor:
    """byte -> (value of the low nibble, value of the high nibble): one gather decodes two inputs."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = torch.arange(256)
    return torch.stack((lut[b & 0xF], lut[b >> 4]), dim=-1)


FP4_PAIRS = _fp4_byte_table()


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor, name: str = "?") -> torch.Tensor:
    """MXFP4 ``packed [..., out, in / 2]`` (two E2M1 codes per byte, the low nibble is the even
    input) times one scale per block of inputs ``scale [..., out, in / block]`` -> fp32
    ``[..., out, in]``. Scales are UE8M0 (``float8_e8m0fnu``, or raw bytes meaning
    ``2 ** (byte - 127)``) or plain floats. Each value is one table entry times its block's scale
    (one fp32 product, so any evaluation order gives the same bits)."""
    codes = packed.contiguous().view(torch.uint8)
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        scale = scale.view(torch.uint8)  # the same exponent byte (0xFF, NaN in E8M0, is never a real scale)
    fast = mxfp4_native(codes, scale)
    if fast is not None:
        return fast
    table = FP4_PAIRS.to(codes.device)
    s = (scale.float() - 127.0).exp2() if scale.dtype == torch.uint8 else scale.float()
    in_dim = 2 * codes.shape[-1]
    if s.shape[:-1] != codes.shape[:-1] or s.shape[-1] < 1 or in_dim % s.shape[-1]:
        raise FormatError(f"{name}: FP4 scale shape {list(s.shape)} does not fit packed weight "
                          f"{list(packed.shape)} ({in_dim} inputs)")
    values = table.index_select(0, codes.reshape(-1).int()).view(*s.shape, in_dim // s.shape[-1])
    return values.mul_(s.unsqueeze(-1)).view(*codes.shape[:-1], in_dim)  # values is a fresh gather
