"""Manifold-constrained hyper-connections (mHC, spec ds4-text §7).

The residual stream is ``hc_mult`` parallel copies ``[T, hc, D]``. Each sub-block computes, per
token, ``pre`` (collapse weights), ``post`` (expand weights) and a doubly-stochastic ``comb``
(Sinkhorn-projected) from the flattened streams. All of it runs in fp32, vectorised over tokens:
one set of ops per layer regardless of batch size, which matters because CPU decode is
dispatch-bound.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .norms import rms_norm_unweighted


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    rms_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(collapsed [T, D], post [T, hc] fp32, comb [T, hc, hc] fp32)``."""
    n_tok, hc, _ = streams.shape
    flat = rms_norm_unweighted(streams.reshape(n_tok, -1).float(), rms_eps)
    mixes = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    s = scale.float()
    pre = torch.sigmoid(pre_w * s[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * s[1] + post_b)
    comb = torch.softmax(comb_w.view(n_tok, hc, hc) * s[2] + comb_b.view(hc, hc), dim=-1) + hc_eps
    comb = sinkhorn(comb, sinkhorn_iters, hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return collapsed, post, comb


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Alternate column / row normalisation: one column pass, then ``iters - 1`` (row, column) pairs."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_post(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``X'[j] = post[j] * y + sum_i comb[i, j] * X[i]`` (comb applied transposed)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            hc_eps: float, rms_eps: float) -> torch.Tensor:
    """Final collapse of the streams: sigmoid-weighted sum, no post/comb."""
    flat = rms_norm_unweighted(streams.flatten(1).float(), rms_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
