"""Whether a request can ever fit this engine: one pure function, used everywhere it is asked.

The HTTP layer (before a stream opens), the async front (any thread), the scheduler (on ``add``) and
``LLM.generate`` all ask the same question; answering it in one place keeps their limits and their
messages from drifting apart. The limits the scheduler admits by, and its two refusals, live
here too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; retry later (HTTP 503)."""


class RequestTooLarge(ValueError):
    """The request can never fit this engine (HTTP 400); the message says by how much."""


@dataclass(frozen=True)
class SchedulerLimits:
    """What the scheduler admits and plans by, resolved once at start-up (the loop's ``limits``)."""

    num_layers: int
    max_model_len: int
    step_tokens: int
    max_prefill_tokens: int
    min_prefill_tokens: int
    prefill_mode: str
    max_queue: int
    image_rows_budget: int = 0  # bytes of retained image rows (0: images refused)
    # prefill tokens a step may carry beside n decoders, index n (runtime/calibrate.py); empty: the
    # token budget, step_tokens - n
    prefill_tokens_at: tuple[int, ...] = ()
    prefix_interval: int = 256  # prefix-cache snapshot every this many input tokens (when caching is on)
    # fitted step costs (a, b, c) in seconds: step(n decode rows, P prefill rows) = a + b n + c P
    # (runtime/calibrate.py); empty when not measured (warm-up off)
    step_costs: tuple[float, ...] = ()

    def prefill_tokens(self, n_decoders: int) -> int:
        """Prefill tokens a step may carry beside ``n_decoders`` (before the progress floor)."""
        if 0 < n_decoders < len(self.prefill_tokens_at):
            return self.prefill_tokens_at[n_decoders]
        return self.step_tokens - n_decoders


def fit_problem(prompt_tokens: int, max_tokens: int, max_model_len: int, pages_for: Callable[[int], int],
                n_pages: int) -> str | None:
    """``None`` if a request of ``prompt_tokens`` + ``max_tokens`` can be served; else what to change.

    ``pages_for(n)`` is the number of cache pages ``n`` tokens need; ``n_pages`` the whole pool.
    """
    total = prompt_tokens + max_tokens
    if total > max_model_len:
        return (f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds the context "
                f"limit of {max_model_len} tokens; shorten the prompt or lower max_tokens")
    pages = pages_for(total)
    if pages > n_pages:
        return (f"the request needs {pages} cache pages but the whole pool has {n_pages}; lower max_tokens "
                f"or shorten the prompt (or start the server with a larger --kv-budget)")
    return None
