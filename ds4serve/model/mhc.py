"""Manifold-constrained hyper-connections (mHC, spec ds4-text §7).

The residual stream is ``hc_mult`` parallel copies ``[T, hc, D]``. Each sub-block computes, per
token, ``pre`` (collapse weights), ``post`` (expand weights) and a doubly-stochastic ``comb``
(Sinkhorn-projected) from the flattened streams. All of it runs in fp32, vectorised over tokens:
one set of ops per layer regardless of batch size, which matters because CPU decode is
dispatch-bound.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .native import sinkhorn_native
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
    # one fused ``base + mixes * scale`` for all three heads (scale expanded per column)
    z = torch.addcmul(base.float(), F.linear(flat, fn.float()), scale.float().index_select(0, _scale_index(hc, scale.device)))
    pre_z, post_z, comb_z = z.split([hc, hc, hc * hc], dim=-1)
    pre = torch.sigmoid(pre_z) + hc_eps
    post = 2 * torch.sigmoid(post_z)
    comb = sinkhorn(torch.softmax(comb_z.reshape(n_tok, hc, hc), dim=-1) + hc_eps, sinkhorn_iters, hc_eps)
    return _collapse(pre, streams), post, comb


def _collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """``sum_i pre[i] * X[i]`` in fp32 (one batched matvec), cast back to the streams' dtype."""
    return torch.bmm(pre.unsqueeze(1), streams.float()).squeeze(1).to(streams.dtype)


@functools.lru_cache(maxsize=None)
def _scale_index(hc: int, device: torch.device) -> torch.Tensor:
    """Which of the three scales each mix column uses: ``hc`` pre, ``hc`` post, ``hc*hc`` comb. Made
    outside inference mode: the cached index must also serve training (``tiny train``) in a process
    that served first (an inference tensor cannot be saved for backward)."""
    with torch.inference_mode(False):
        return torch.tensor([0] * hc + [1] * hc + [2] * hc * hc, device=device)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Alternate column / row normalisation: one column pass, then ``iters - 1`` (row, column) pairs.

    Each normaliser ``sum + eps`` is one ``baddbmm`` against a ones vector (the sum of ``hc``
    products with 1.0, in order, which is how the reference's ``sum`` adds them too), so an
    iteration is four dispatches instead of six: the loop is ~80 tiny ops per sub-block, and CPU
    decode is dispatch-bound. On the host it runs as one C call (``native.py``), bit-equal to this.
    """
    fast = sinkhorn_native(comb, iters, eps)  # the same arithmetic in one call, where built
    if fast is not None:
        return fast
    n, hc, _ = comb.shape
    ones_row = comb.new_ones(1, 1, hc).expand(n, 1, hc)
    ones_col = comb.new_ones(1, hc, 1).expand(n, hc, 1)
    e = comb.new_full((1, 1, 1), eps)
    comb = comb / torch.baddbmm(e, ones_row, comb)
    for _ in range(iters - 1):
        comb = comb / torch.baddbmm(e, comb, ones_col)
        comb = comb / torch.baddbmm(e, ones_row, comb)
    return comb


def hc_post(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``X'[j] = post[j] * y + sum_i comb[i, j] * X[i]`` (comb applied transposed)."""
    dtype = streams.dtype
    expanded = post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2)
    return torch.baddbmm(expanded, comb.to(dtype).transpose(-1, -2), streams)


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            hc_eps: float, rms_eps: float) -> torch.Tensor:
    """Final collapse of the streams: sigmoid-weighted sum, no post/comb."""
    flat = rms_norm_unweighted(streams.flatten(1).float(), rms_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + hc_eps
    return _collapse(pre, streams)
