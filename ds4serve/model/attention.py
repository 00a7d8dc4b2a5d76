"""Attention with per-head sinks (spec ds4-text §3-§4), in two shapes with the same arithmetic.

* ``sink_attention``: every query attends to its own list of key rows (sliding-window rows, then
  compressed rows), gathered into ``[T, K, head_dim]`` with a validity mask: decode rows and short
  chunks.
* ``block_sink_attention``: the queries of a prefill tile share one key block ``[K, head_dim]`` and
  a mask keeps each query's own rows (plus, optionally, per-query rows such as an indexer's top-k):
  no private ``[T, K, d]`` copy per query, so long prefill chunks move far less memory.

DS4 uses one shared K=V head (MQA), so the same rows are key and value. The learned sink adds one
logit per head whose "value" is zero. Softmax statistics are fp32 whatever the model dtype.
"""

from __future__ import annotations

import torch


def sink_attention(
    q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor, scale: float,
    extra: torch.Tensor | None = None, extra_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [T, H, d]``, ``kv [T, K, d]``, ``valid [T, K]`` bool, ``sinks [H]`` -> ``[T, H, d]``.

    ``extra [T, k, d]`` (``extra_valid [T, k]``): a second group of keys per query (the compressed
    rows) in the same softmax, without copying both groups into one tensor first. Softmax statistics
    are fp32 whatever the model dtype.
    """
    n_tok, n_heads, _ = q.shape
    logits = torch.bmm(q, kv.transpose(1, 2)).float() * scale  # [T, H, K]
    parts = [logits.masked_fill(~valid.unsqueeze(1), float("-inf"))]
    if extra is not None:
        own = torch.bmm(q, extra.transpose(1, 2)).float() * scale
        parts.append(own.masked_fill(~extra_valid.unsqueeze(1), float("-inf")))
    parts.append(sinks.float().view(1, n_heads, 1).expand(n_tok, n_heads, 1))
    combined = torch.cat(parts, dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = torch.softmax(combined, dim=-1)
    width = kv.shape[1]
    out = torch.bmm(probs[..., :width].to(kv.dtype), kv)
    if extra is not None:
        out = out + torch.bmm(probs[..., width:width + extra.shape[1]].to(extra.dtype), extra)
    return out


def gather_rows(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``source [N, d]`` gathered by ``index [T, K]`` -> ``[T, K, d]`` (one index_select)."""
    return source.index_select(0, index.reshape(-1)).view(*index.shape, source.shape[-1])


def block_sink_attention(q: torch.Tensor, block: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
                         scale: float, extra: torch.Tensor | None = None,
                         extra_valid: torch.Tensor | None = None) -> torch.Tensor:
    """``q [t, H, d]`` over a shared ``block [K, d]`` (``mask [t, K]``) and optional per-query rows
    ``extra [t, k, d]`` (``extra_valid [t, k]``), one softmax with the sink -> ``[t, H, d]``."""
    n_tok, n_heads, d = q.shape
    width = block.shape[0]
    logits = (q.reshape(n_tok * n_heads, d) @ block.t()).float().view(n_tok, n_heads, width) * scale
    parts = [logits.masked_fill(~mask.unsqueeze(1), float("-inf"))]
    if extra is not None:
        own = torch.bmm(q, extra.transpose(1, 2)).float() * scale  # [t, H, k]
        parts.append(own.masked_fill(~extra_valid.unsqueeze(1), float("-inf")))
    parts.append(sinks.float().view(1, n_heads, 1).expand(n_tok, n_heads, 1))
    combined = torch.cat(parts, dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = torch.softmax(combined, dim=-1)
    out = (probs[..., :width].to(block.dtype).reshape(n_tok * n_heads, width) @ block).view(n_tok, n_heads, d)
    if extra is not None:
        out = out + torch.bmm(probs[..., width:width + extra.shape[1]].to(extra.dtype), extra)
    return out
