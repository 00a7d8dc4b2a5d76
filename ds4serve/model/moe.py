"""Mixture of experts (spec ds4-text §8, ds4-vision §5.1).

Routing: sqrt-softplus scores from an fp32 gate; the correction bias (or ``bias_vl`` for image
tokens) steers *selection* only; weights come from the unbiased scores, renormalised and scaled.
Hash layers select experts by ``tid2eid[token_id]`` for text tokens; image-block tokens bypass the
hash table and route with ``bias_vl`` (branch-free ``where``, so it survives capture/compile).

Experts run as grouped GEMMs over (token, expert) pairs sorted by expert: one kernel per
projection for the whole flattened batch, no Python loop over sequences and no host sync.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from . import triton_experts
from .packed import PackedExperts


def score(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


def route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    *,
    top_k: int,
    scoring_func: str,
    scaling: float,
    normalize: bool,
    bias: torch.Tensor | None,
    tid2eid: torch.Tensor | None,
    ids: torch.Tensor,
    is_image: torch.Tensor | None = None,
    bias_vl: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(weights [T, k] fp32, expert ids [T, k])``."""
    scores = score(F.linear(x.float(), gate_weight.float()), scoring_func)
    sel = scores if bias is None else scores + bias.float()
    if is_image is not None and bias_vl is not None:
        sel_img = scores + bias_vl.float()
        sel = torch.where(is_image.unsqueeze(-1), sel_img, sel)
    idx = _topk_indices(sel, top_k)
    if tid2eid is not None:
        safe_ids = ids if is_image is None else torch.where(is_image, torch.zeros_like(ids), ids)
        hashed = tid2eid[safe_ids.clamp(0, tid2eid.shape[0] - 1)].long()
        idx = hashed if is_image is None else torch.where(is_image.unsqueeze(-1), idx, hashed)
    weights = scores.gather(1, idx)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, idx


def _topk_indices(sel: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(sel, k, dim=-1, sorted=False).indices


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """SiLU(min(gate, limit)) * clamp(up, -limit, limit): the gate clamp is upper-only."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


# The experts run densely (every expert on every token, two GEMMs) instead of grouped only where that
# wins: small batches of small experts, whose routes could touch every expert (at least as many
# (token, expert) pairs as experts), with all the expert weights small enough to stream cheaply.
# Measured on 2 cores: Appendix A's 3 MiB of experts, dense ~ grouped at 4-8 tokens and 15% faster
# at 16; the Flash-shaped checkpoint's 12.6 MiB, grouped faster at every batch size (1.2 vs 5.8 ms
# at one token, 1.7 vs 3.4 at four, 2.9 vs 4.6 at sixteen): dense reads weights no token needs.
DENSE_FLOP_LIMIT = 32e6
DENSE_WEIGHT_BYTES = 4 << 20


def run_experts(
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    gate_up,
    down,
    limit: float,
) -> torch.Tensor:
    """Routed experts for ``x [T, D]``: ``gate_up [E, 2I, D]``, ``down [E, D, I]`` (HF layout), tensors
    or ``PackedExperts`` (then only the routed experts are dequantised, for this call only)."""
    n_exp, two_i, d = gate_up.shape
    # training (CPU grouped_mm has no backward) and small batches take the dense path; the choice is
    # made on the full stack's shapes, so packed and dequantised-at-load experts take the same path
    weight_bytes = (math.prod(gate_up.shape) + math.prod(down.shape)) * gate_up.dtype.itemsize
    dense = (torch.is_grad_enabled() and getattr(gate_up, "requires_grad", False)) or (
            x.shape[0] * idx.shape[1] >= n_exp and weight_bytes <= DENSE_WEIGHT_BYTES
            and x.shape[0] * n_exp * 3 * (two_i // 2) * d * 2 <= DENSE_FLOP_LIMIT)
    if isinstance(gate_up, PackedExperts):
        return _packed_experts(x, idx, weights, gate_up, down, limit, dense)
    if dense:
        return _dense_experts(x, idx, weights, gate_up, down, limit)
    return _grouped_experts(x, idx, weights, gate_up, down, limit)


def run_local_experts(x, idx, weights, gate_up, down, limit: float, expert_range: tuple[int, int]) -> torch.Tensor:
    """Expert parallel: this process's part of the routed sum, from the experts ``[lo, hi)`` it holds
    (``gate_up``/``down`` hold those only). Pairs routed elsewhere are dropped before any GEMM, so a rank
    computes only its own experts' pairs; the ranks' parts add up to ``run_experts``'s sum."""
    lo, hi = expert_range
    flat = idx.reshape(-1)
    keep = (flat >= lo) & (flat < hi)
    tokens = torch.arange(x.shape[0], device=x.device).repeat_interleave(idx.shape[1])[keep]
    experts, w = flat[keep] - lo, weights.reshape(-1)[keep]
    if isinstance(gate_up, PackedExperts) and triton_experts.available(x.device):
        return _fused_packed_pairs(x, tokens, experts, w, gate_up, down, limit)
    if isinstance(gate_up, PackedExperts):
        return _packed_pairs(x, tokens, experts, w, gate_up, down, limit)
    return _grouped_pairs(x, tokens, experts, w, gate_up, down, limit)


def _packed_bytes(gate_up: PackedExperts, down: PackedExperts) -> int:
    """Bytes of one expert dequantised (gate/up and down)."""
    return (math.prod(gate_up.shape[1:]) + math.prod(down.shape[1:])) * gate_up.dtype.itemsize


def _packed_pairs(x, tokens, experts, weights, gate_up: PackedExperts, down: PackedExperts, limit,
                  used: torch.Tensor | None = None) -> torch.Tensor:
    """(token, expert, weight) pairs over packed experts: only the experts some pair uses (``used``,
    sorted) are dequantised, ``PACKED_TILE_BYTES`` at a time, their partial sums added per token."""
    if used is None:
        used = torch.unique(experts)  # sync-ok: sorted expert ids (host path)
    group = max(1, PACKED_TILE_BYTES // _packed_bytes(gate_up, down))
    out = torch.zeros_like(x)
    bufs = [torch.empty(min(group, used.numel()), *s.shape[1:], dtype=s.dtype, device=x.device) if x.device.type == "cpu"
            else None for s in (gate_up, down)]  # one buffer for every group (host: the native loop fills it)
    for start in range(0, used.numel(), group):  # a loop over expert groups, not sequences
        ids = used[start:start + group]
        remap = torch.full((gate_up.n_experts,), -1, dtype=experts.dtype, device=experts.device)
        remap[ids] = torch.arange(ids.numel(), dtype=experts.dtype, device=experts.device)
        sub = remap[experts]
        keep = sub >= 0
        gu, dn = (st.take(ids, b[:ids.numel()] if b is not None else None) for st, b in zip((gate_up, down), bufs))
        out.add_(_grouped_pairs(x, tokens[keep], sub[keep], weights[keep], gu, dn, limit))
    return out


def _dense_experts(x, idx, weights, gate_up, down, limit) -> torch.Tensor:
    """Every expert on every token; the routing weights (zero for unselected experts) scale the
    activations before the down projection, so the weighted sum over experts is one reduction."""
    n_tok = x.shape[0]
    n_exp, two_i, _ = gate_up.shape
    h = F.linear(x, gate_up.reshape(n_exp * two_i, -1)).view(n_tok, n_exp, two_i)
    g, u = h.chunk(2, dim=-1)
    dense_w = torch.zeros(n_tok, n_exp, dtype=h.dtype, device=x.device).scatter_(1, idx, weights.to(h.dtype))
    act = swiglu(g, u, limit) * dense_w.unsqueeze(-1)  # [T, E, I]
    return torch.bmm(act.transpose(0, 1), down.transpose(1, 2)).sum(dim=0)


def _grouped_experts(x, idx, weights, gate_up, down, limit) -> torch.Tensor:
    return _grouped_pairs(x, None, idx.reshape(-1), weights.reshape(-1), gate_up, down, limit, idx.shape[1])


def _grouped_pairs(x, tokens, experts, weights, gate_up, down, limit, top_k: int = 1, linear=None) -> torch.Tensor:
    """(token, expert, weight) pairs, sorted by expert (stable), through two grouped GEMMs (``linear``,
    default ``grouped_linear``; packed stacks on CUDA: ``triton_experts.packed_grouped_linear``). ``tokens``
    None: the pairs are every token's ``top_k`` routes in order, so a pair's token is its index // top_k."""
    linear = linear or grouped_linear
    n_exp = gate_up.shape[0]
    order = torch.argsort(experts, stable=True)
    token_of = order // top_k if tokens is None else tokens.index_select(0, order)
    x_sorted = x.index_select(0, token_of)
    # a scatter-add, not bincount: CUDA's bincount reads the max on the host, which a captured graph forbids
    counts = torch.zeros(n_exp, dtype=experts.dtype, device=experts.device).scatter_add_(
        0, experts, torch.ones_like(experts))
    h = linear(x_sorted, gate_up, counts)
    g, u = h.chunk(2, dim=-1)
    y = linear(swiglu(g, u, limit), down, counts)
    y = y * weights.index_select(0, order).to(y.dtype).unsqueeze(-1)
    out = torch.zeros_like(x)
    return out.index_add_(0, token_of, y)


# packed experts are dequantised this many bytes at a time at most (a Flash expert is 100 MB in fp32)
PACKED_TILE_BYTES = 256 << 20


def _packed_experts(x, idx, weights, gate_up: PackedExperts, down: PackedExperts, limit, dense: bool):
    """Only the routed experts dequantised, in groups of at most ``PACKED_TILE_BYTES``. One group (every
    model whose step's experts fit) computes exactly what the dequantised stack would: the same path
    on the same values. Several groups add their partial sums per token (fp32 rounding may differ)."""
    if triton_experts.available(x.device):
        return _fused_packed_pairs(x, None, idx.reshape(-1), weights.reshape(-1), gate_up, down, limit, idx.shape[1])
    used = torch.unique(idx)  # sync-ok: sorted expert ids; host path (CUDA takes the Triton one above)
    if 0 < used.numel() <= max(1, PACKED_TILE_BYTES // _packed_bytes(gate_up, down)):  # one group: exact
        remap = torch.full((gate_up.n_experts,), -1, dtype=idx.dtype, device=idx.device)
        remap[used] = torch.arange(used.numel(), dtype=idx.dtype, device=idx.device)
        return (_dense_experts if dense else _grouped_experts)(x, remap[idx], weights, gate_up.take(used),
                                                               down.take(used), limit)
    tokens = torch.arange(x.shape[0], device=x.device).repeat_interleave(idx.shape[1])
    return _packed_pairs(x, tokens, idx.reshape(-1), weights.reshape(-1), gate_up, down, limit, used)


def _fused_packed_pairs(x, tokens, experts, weights, gate_up: PackedExperts, down: PackedExperts, limit,
                        top_k: int = 1) -> torch.Tensor:
    """``_grouped_pairs`` through the Triton GEMMs that decode packed tiles in registers: no expert is
    ever dequantised to memory."""
    return _grouped_pairs(x, tokens, experts, weights, gate_up, down, limit, top_k,
                          linear=triton_experts.packed_grouped_linear)


def grouped_linear(x_sorted: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``y[rows of group e] = x[rows] @ weight[e].T`` for rows sorted by group."""
    if _grouped_mm_ok(x_sorted.device.type, x_sorted.dtype):
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return F.grouped_mm(x_sorted, weight.transpose(1, 2), offs=offs)
    # Fallback for torch builds without grouped_mm: a loop over experts (not sequences). It needs
    # the counts on the host, i.e. one sync per call.
    out = x_sorted.new_empty((x_sorted.shape[0], weight.shape[1]))
    start = 0
    for e, n in enumerate(counts.tolist()):  # sync-ok: only for torch builds without grouped_mm
        if n:
            out[start:start + n] = F.linear(x_sorted[start:start + n], weight[e])
            start += n
    return out


@functools.lru_cache(maxsize=None)
def _grouped_mm_ok(device_type: str, dtype: torch.dtype) -> bool:
    """Probe once per (device, dtype) whether ``F.grouped_mm`` works and is exact here."""
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(6, 16, generator=gen).to(device_type, dtype)
        w = torch.randn(3, 8, 16, generator=gen).to(device_type, dtype)
        counts = torch.tensor([2, 0, 4], device=device_type)
        got = F.grouped_mm(x, w.transpose(1, 2), offs=torch.cumsum(counts, 0).to(torch.int32))
        ref = torch.cat([F.linear(x[:2], w[0]), F.linear(x[2:], w[2])])
        return bool(torch.allclose(got.float(), ref.float(), atol=1e-2, rtol=1e-2))
    except (RuntimeError, TypeError, NotImplementedError):
        return False
