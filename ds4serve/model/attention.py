"""Attention over gathered rows with per-head sinks (spec ds4-text §3-§4).

Every query attends to its own list of key rows (sliding-window rows, then compressed rows),
gathered by the engine's index metadata into ``[T, K, head_dim]`` with a validity mask. DS4 uses
one shared K=V head (MQA), so the same gathered tensor is key and value. The learned sink adds one
logit per head whose "value" is zero. This one shape covers prefill, chunked prefill, decode and
image-span visibility: only the index lists differ.
"""

from __future__ import annotations

import torch


def sink_attention(
    q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q [T, H, d]``, ``kv [T, K, d]``, ``valid [T, K]`` bool, ``sinks [H]`` -> ``[T, H, d]``.

    Softmax statistics are fp32 whatever the model dtype.
    """
    n_tok, n_heads, _ = q.shape
    logits = torch.bmm(q, kv.transpose(1, 2)).float() * scale  # [T, H, K]
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sink = sinks.float().view(1, n_heads, 1).expand(n_tok, n_heads, 1)
    combined = torch.cat((logits, sink), dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.bmm(probs.to(kv.dtype), kv)


def gather_rows(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``source [N, d]`` gathered by ``index [T, K]`` -> ``[T, K, d]`` (one index_select)."""
    return source.index_select(0, index.reshape(-1)).view(*index.shape, source.shape[-1])
