"""Compressor pooling and the lightning indexer (spec ds4-text §5-§6).

A compressor turns every ``m`` raw tokens (window ``w`` = positions ``[w*m, w*m+m)``, aligned to
*absolute* positions) into one compressed row. Per raw token the engine keeps the projected
``[C | Z]`` (``Z`` already including the position bias ``ape[pos % m]``) in fp32, in a small
position-addressed ring; a closing window gathers its slots from that ring and from the tokens of
the current forward. CSA (``overlap``) pools 8 slots: the ``Ca/Za`` halves of window ``w-1`` and
the ``Cb/Zb`` halves of window ``w``. The softmax is per channel, in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .norms import rms_norm
from .rope import apply_rope


def token_states(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor, ape: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
    """Per-token compressor state ``[T, 2 * width]`` fp32: ``C`` then ``Z + ape[pos % m]``."""
    ratio = ape.shape[0]
    kv = F.linear(x, wkv).float()
    gate = F.linear(x, wgate).float() + ape.float().index_select(0, positions % ratio)
    return torch.cat((kv, gate), dim=-1)


def pool_windows(slots: torch.Tensor, valid: torch.Tensor, overlap: bool, ratio: int,
                 norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Pool gathered window slots into normalised rows ``[E, d]`` (fp32, before RoPE).

    ``slots [E, span, 2 * width]`` holds ``[C | Z]`` per slot (``span = 2m`` with overlap, else
    ``m``); ``valid [E, span]`` is False for slots before position 0 (weight 0).
    """
    width = slots.shape[-1] // 2
    kv, gate = slots[..., :width], slots[..., width:]
    if overlap:
        d = width // 2
        # first m slots: window w-1, "a" halves; last m slots: window w, "b" halves
        kv = torch.cat((kv[:, :ratio, :d], kv[:, ratio:, d:]), dim=1)
        gate = torch.cat((gate[:, :ratio, :d], gate[:, ratio:, d:]), dim=1)
    # slots before position 0 point at arbitrary ring rows: zero weight *and* zero value
    kv = kv.masked_fill(~valid.unsqueeze(-1), 0.0)
    gate = gate.masked_fill(~valid.unsqueeze(-1), float("-inf"))
    pooled = (kv * torch.softmax(gate, dim=1)).sum(dim=1)
    return rms_norm(pooled, norm_weight, eps)


def finish_rows(pooled: torch.Tensor, rot: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """RoPE at each window's start position, then cast to the pool dtype."""
    return apply_rope(pooled, rot).to(dtype)


def indexer_scores(q_idx: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor,
                   valid: torch.Tensor) -> torch.Tensor:
    """``sum_h w_h * relu(q_h . k_r) / sqrt(d)`` for every visible row; invalid rows -> -inf.

    ``q_idx [T, H, d]``, ``keys [T, R, d]``, ``head_weights [T, H]`` (already scaled by
    ``1/sqrt(H)``), ``valid [T, R]``. Summation order follows the reference (elementwise product,
    then a sum over heads), so near-ties resolve like it.
    """
    d = q_idx.shape[-1]
    dots = torch.bmm(q_idx.float(), keys.float().transpose(1, 2))  # [T, H, R]
    dots = F.relu(dots) * (d**-0.5)
    s = (dots * head_weights.float().unsqueeze(-1)).sum(dim=1)
    return s.masked_fill(~valid, float("-inf"))


def block_indexer_scores(q_idx: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor,
                         valid: torch.Tensor) -> torch.Tensor:
    """``indexer_scores`` for queries that share one key block ``keys [R, d]`` (``valid [t, R]``)."""
    n_tok, n_heads, d = q_idx.shape
    dots = (q_idx.float().reshape(n_tok * n_heads, d) @ keys.float().t()).view(n_tok, n_heads, -1)
    dots = F.relu(dots) * (d**-0.5)
    s = (dots * head_weights.float().unsqueeze(-1)).sum(dim=1)
    return s.masked_fill(~valid, float("-inf"))


def select_top_rows(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` columns per query with a deterministic tie-break (lower row index first).

    Returns ``(columns [T, k], valid [T, k])``; a column is invalid when its score is -inf (the
    query has fewer than ``k`` visible rows).
    """
    k = min(k, scores.shape[-1])
    values, cols = torch.sort(scores, dim=-1, descending=True, stable=True)
    values, cols = values[:, :k], cols[:, :k]
    return cols, values > float("-inf")
