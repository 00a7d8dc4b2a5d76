"""Prompt logprobs and prompt-only requests, the scheduler's side.

A request with ``prompt_logprobs`` marks each of its prefill chunks (``PassMember.prompt_logprobs`` and
``targets``: the prompt token after each row of the chunk that has one), so the engine scores those rows
in the same batched step that computes them (``engine.prompt_scoring``). The entries come back per chunk
in ``StepResult.prompt_logprobs`` and are folded onto the request by position, so a chunk recomputed after
a failed step or a drop simply overwrites its own entries. They go out once, on the request's first
output, with ``None`` for the first prompt token (nothing predicts it, as OpenAI and vLLM answer).

Such a request never starts from a prefix-cache hit (``reuse.attach`` refuses it): a hit would skip the
very positions it asks about. ``max_tokens == 0`` (echo / scoring only) needs no sampled token: its
chunks never sample, and it finishes (``length``) once every position that predicts a prompt token,
``[0, len(prompt) - 1)``, is computed.
"""

from __future__ import annotations

from typing import Any

from ..engine.plan import PromptLogprobs
from .request import Request


def scoring(req: Request, lo: int, hi: int) -> dict[str, Any]:
    """``PassMember`` fields for the chunk ``[lo, hi)`` of ``req``: what to score, or nothing."""
    n_prompt = len(req.prompt_ids)
    if not req.wants_prompt_logprobs or lo >= n_prompt - 1:
        return {}
    return {"prompt_logprobs": req.params.prompt_logprobs,
            "targets": tuple(req.prompt_ids[lo + 1:min(hi + 1, n_prompt)])}


def samples(req: Request, n: int) -> bool:
    """A chunk of ``n`` tokens samples the request's next token: it ends the pending input, and the
    request generates at all."""
    return n == req.pending and req.params.max_tokens > 0


def prompt_only_done(req: Request) -> bool:
    """A ``max_tokens == 0`` request has computed everything it reports (see the module docstring)."""
    return req.params.max_tokens == 0 and req.computed >= len(req.prompt_ids) - 1


def fold(req: Request, pl: PromptLogprobs) -> str | None:
    """Put one chunk's entries onto ``req``; returns an error when the request must fail instead."""
    if pl.error is not None:
        return pl.error
    if pl.start > len(req.prompt_lp):  # a chunk past a gap: the prefill skipped rows it had to score
        return f"internal error: prompt logprobs from position {pl.start}, but only {len(req.prompt_lp)} known"
    req.prompt_lp[pl.start:pl.start + len(pl.entries)] = pl.entries
    return None


def take(req: Request) -> tuple | None:
    """The prompt logprobs to deliver with this output: on the first output of a request that asked."""
    if not req.wants_prompt_logprobs:
        return None
    req.prompt_lp_sent = True
    return (None, *req.prompt_lp[:len(req.prompt_ids) - 1])
