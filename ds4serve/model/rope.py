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


def inverse_frequencies(params: RopeParams, rope_dim: int) -> torch.Tensor:
    """Inverse frequencies ``[rope_dim // 2]`` (fp32), YaRN-ramped when ``params`` says so."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    pos_freqs = params.theta**exponents
    inv_extra = 1.0 / pos_freqs
    if params.rope_type == "default":
        return inv_extra
    inv_inter = 1.0 / (params.factor * pos_freqs)
    low, high = _yarn_correction_range(params, rope_dim)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
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


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0):
    """fp32 ``(cos, sin)`` of shape ``[*positions.shape, rope_dim // 2]``."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x`` (interleaved pairs).

    ``x`` is ``[N, ..., dim]`` and ``cos``/``sin`` are ``[N, rope_dim // 2]``; middle axes (heads)
    broadcast. ``inverse`` rotates by ``-pos`` (used on the attention output, because V == K
    carries the key's rotation).
    """
    half = cos.shape[-1]
    rope_dim = 2 * half
    lead = x.shape[:-1]
    view_shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.reshape(view_shape), sin.reshape(view_shape)
    if inverse:
        s = -s
    rot = x[..., -rope_dim:].float().reshape(*lead, half, 2)
    x0, x1 = rot[..., 0], rot[..., 1]
    out = torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).reshape(*lead, rope_dim).to(x.dtype)
    return torch.cat((x[..., :-rope_dim], out), dim=-1)
