"""Rotary embeddings of DeepSeek-V4 (spec ds4-text §3, "RoPE details").

Partial (only the last ``rope_dim`` channels of a head rotate), interleaved (pairs ``(2i, 2i+1)``
share one frequency: GPT-J style, not NeoX split-half), with a per-layer base: plain θ on sliding
layers, ``compress_rope_theta`` + YaRN on CSA/HCA layers. cos/sin are kept in fp32 and the rotation
is computed in fp32, then cast back, as the reference does.
"""

from __future__ import annotations

import math

import torch

from ..config import RopeParams
from .native import rope_native


def inverse_frequencies(params: RopeParams, rope_dim: int) -> torch.Tensor:
    """Inverse frequencies ``[rope_dim // 2]`` (fp32, on the host), YaRN-ramped when ``params`` says so.
    Always made on the host: under a meta-device context (a model built to be loaded), a meta ``arange``
    runs through torch's reference ops, which import torch._dynamo (~1 s, ~100 MB resident)."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32, device="cpu") / rope_dim
    pos_freqs = params.theta**exponents
    inv_extra = 1.0 / pos_freqs
    if params.rope_type == "default":
        return inv_extra
    inv_inter = 1.0 / (params.factor * pos_freqs)
    low, high = _yarn_correction_range(params, rope_dim)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1.0 - ramp
    return inv_inter * (1.0 - extrapolation_weight) + inv_extra * extrapolation_weight


def _yarn_correction_range(params: RopeParams, dim: int) -> tuple[float, float]:
    def correction_dim(n_rotations: float) -> float:
        orig = params.original_max_position_embeddings
        return (dim * math.log(orig / (n_rotations * 2 * math.pi))) / (2 * math.log(params.theta))

    low, high = correction_dim(params.beta_fast), correction_dim(params.beta_slow)
    if params.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def rotations(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0) -> torch.Tensor:
    """Per-position rotations ``[*positions.shape, rope_dim // 2]`` as complex64 ``cos + i sin``
    (scaled by ``attention_factor``): one complex multiply then rotates a pair, which is the same
    arithmetic as the real form (``x0 c - x1 s``, ``x1 c + x0 s``) in a third of the op dispatches."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return torch.complex(cos, sin)


def apply_rope(x: torch.Tensor, rot: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing ``2 * rot.shape[-1]`` channels of ``x`` (interleaved pairs).

    ``x`` is ``[N, ..., dim]`` and ``rot`` is complex ``[N, rope_dim // 2]``; middle axes (heads)
    broadcast. ``inverse`` rotates by ``-pos`` (used on the attention output, because V == K
    carries the key's rotation).
    """
    fast = rope_native(x, rot, inverse)  # the same arithmetic in one call, where built (native.py)
    if fast is not None:
        return fast
    half = rot.shape[-1]
    rope_dim = 2 * half
    r = rot.reshape((rot.shape[0],) + (1,) * (x.dim() - 2) + (half,))
    if inverse:
        r = r.conj()
    pairs = x[..., -rope_dim:].float().reshape(*x.shape[:-1], half, 2)
    if pairs.storage_offset() % 2 or any(st % 2 for st in pairs.stride()[:-1]):  # view_as_complex: aligned pairs
        pairs = pairs.clone(memory_format=torch.contiguous_format)  # a fresh, aligned copy
    out = torch.view_as_real(torch.view_as_complex(pairs) * r).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-rope_dim], out), dim=-1)
