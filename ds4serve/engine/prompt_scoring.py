"""Prompt logprobs, the engine's side: score a member's prompt rows in the step that computes them.

A member with ``prompt_logprobs`` set keeps the hidden streams of its first ``len(targets)`` rows (the
rows whose next token lies in the prompt) when its pass completes, instead of only the last row. After
the step's forwards they go through the LM head together, in blocks of ``BLOCK_ROWS`` rows so a long
chunk never holds ``rows x vocab`` logits at once, and each row reports the raw logprob (log_softmax of
the raw logits, as ``sample_rows`` reports a sampled token's) of its target, the target's rank, and the
top N. Everything is batched: one head call, one log_softmax, one gather, one top-k per block, and one
``tolist`` per result tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .plan import PassMember, PromptLogprobs

BLOCK_ROWS = 512  # rows per head call: 512 x a 129k vocabulary is ~260 MB of fp32 logits


@dataclass(frozen=True)
class ScoredRows:
    """A member's rows to score: its hidden streams ``[len(targets), ...]`` as the forward left them."""

    member: PassMember
    streams: torch.Tensor


def keep_rows(member: PassMember, streams: torch.Tensor, offset: int, out: list[ScoredRows]) -> None:
    """Keep the rows of ``member`` (whose chunk starts at row ``offset`` of ``streams``) that it scores."""
    if member.prompt_logprobs is not None and member.targets:
        out.append(ScoredRows(member, streams[offset:offset + len(member.targets)]))


def score(head: Callable[[torch.Tensor], torch.Tensor], scored: list[ScoredRows]) -> tuple[PromptLogprobs, ...]:
    """Every kept member's ``PromptLogprobs`` (a member with no ``targets`` was not kept: nothing to report)."""
    if not scored:
        return ()
    streams = torch.cat([s.streams for s in scored]) if len(scored) > 1 else scored[0].streams
    targets = torch.tensor([t for s in scored for t in s.member.targets], device=streams.device)
    top = max(s.member.prompt_logprobs for s in scored)
    parts = [_score_block(head(streams[i:i + BLOCK_ROWS]), targets[i:i + BLOCK_ROWS], top)
             for i in range(0, streams.shape[0], BLOCK_ROWS)]
    lp, rank, finite, tv, ti = (torch.cat([p[k] for p in parts]).tolist() for k in range(5))
    out, start = [], 0
    for s in scored:
        m, stop = s.member, start + len(s.member.targets)
        if not all(finite[start:stop]):
            out.append(PromptLogprobs(m.request_id, m.slot, m.start, (),
                                      error="the model produced non-finite logits for this prompt"))
        else:
            k = m.prompt_logprobs
            out.append(PromptLogprobs(m.request_id, m.slot, m.start, tuple(
                (lp[r], rank[r], tuple(zip(ti[r][:k], tv[r][:k]))) for r in range(start, stop))))
        start = stop
    return tuple(out)


def _score_block(logits: torch.Tensor, targets: torch.Tensor, top: int):
    """One block: the target's logprob and rank, whether the row is finite, the top ``top`` (values, ids)."""
    finite = torch.isfinite(logits).all(dim=-1)
    logits = torch.where(finite.unsqueeze(-1), logits.float(), torch.zeros_like(logits, dtype=torch.float32))
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, targets.unsqueeze(-1))
    rank = (logprobs > chosen).sum(dim=-1) + 1
    tv, ti = torch.topk(logprobs, top, dim=-1)
    return chosen.squeeze(-1), rank, finite, tv, ti
