"""The prompt in an answer: completions' ``echo`` (text and logprobs) and vLLM's ``prompt_logprobs``.

The engine scores the prompt in its prefill steps and hands the entries over once, on a choice's first
output (``RequestOutput.prompt_logprobs``: ``None`` for the first token, then ``(logprob, rank, top)``).
This module only turns them into the two shapes clients read:

* completions with ``echo`` (OpenAI's legacy form, what lm-eval's loglikelihood parses): the prompt's
  text before the generated text, and with ``logprobs: N`` one entry per prompt token before the
  generated ones. The first token has no logprob and no alternatives (``null``), as OpenAI and vLLM
  answer; the others carry the token's raw logprob and its top N.
* vLLM's ``prompt_logprobs: N`` (both routes): a list with ``None`` for the first token, then per
  position a dict ``token id -> {logprob, rank, decoded_token}`` holding the top N and the prompt
  token itself (rank 1 = the most likely token).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Entry = tuple[float, int, tuple[tuple[int, float], ...]] | None


def echo_text(tokenizer: Any, prompt: Sequence[int], skip_special: bool) -> str:
    """The prompt as text, decoded like the output (``skip_special_tokens``)."""
    return tokenizer.decode(list(prompt), skip_special_tokens=skip_special)


def echo_entries(tokenizer: Any, prompt: Sequence[int], scores: Sequence[Entry], top: int) -> list[dict]:
    """A completion's logprob entries for the prompt tokens (``frames._completion_logprobs`` renders them)."""
    out = []
    for t, e in zip(prompt, scores):
        text = tokenizer.token_text(t)
        entry: dict[str, Any] = {"token": text, "logprob": None, "bytes": list(text.encode("utf-8", "replace")),
                                 "top_logprobs": None}
        if e is not None:
            entry["logprob"] = e[0]
            entry["top_logprobs"] = [{"token": tokenizer.token_text(i), "logprob": v} for i, v in e[2][:top]]
        out.append(entry)
    return out


def vllm_prompt_logprobs(tokenizer: Any, prompt: Sequence[int], scores: Sequence[Entry],
                         top: int) -> list[dict[str, dict] | None]:
    """vLLM's ``prompt_logprobs`` list (token ids as JSON object keys)."""
    out: list[dict[str, dict] | None] = []
    for t, e in zip(prompt, scores):
        if e is None:
            out.append(None)
            continue
        lp, rank, alts = e
        pos = {str(i): {"logprob": v, "rank": r, "decoded_token": tokenizer.token_text(i)}
               for r, (i, v) in enumerate(alts[:top], start=1)}
        pos[str(t)] = {"logprob": lp, "rank": rank, "decoded_token": tokenizer.token_text(t)}
        out.append(pos)
    return out
