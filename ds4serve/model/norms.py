"""RMS norms as the reference computes them: statistics in fp32, fp32 weights, one cast at the end.

Both use the fused ``F.rms_norm`` on fp32 input (one dispatch instead of six; tests pin it to the
written-out ``x * rsqrt(mean(x^2) + eps) * w``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm; the weight is kept in fp32 (HF keeps every norm in fp32)."""
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(x.dtype)


def rms_norm_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (per-head q norm, mHC input norm): fp32 statistics, scale applied
    in ``x``'s dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], None, eps)
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)
