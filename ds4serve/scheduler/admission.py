"""Whether a request can ever fit this engine: ``fit(spec, limits)``, one pure function asked everywhere.

The server (before a stream opens, through the async front's ``check``), the scheduler (on ``add``)
and ``LLM`` all ask the same question; answering it in one place, from one ``FitLimits`` record, keeps their
limits and their messages from drifting apart. The limits the scheduler admits by, and its two
refusals, live here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..multimodal.records import ImageInput
from .spec import RequestSpec


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


@dataclass(frozen=True)
class FitLimits:
    """Everything ``fit`` reads: plain numbers, so the answer depends on nothing else.

    The scheduler derives them from its own limits, cache and encoder (``Scheduler.fit_limits``); the
    core and the loop hand out that same record, so every door asks with the same numbers.
    """

    max_model_len: int
    page_tokens: int  # tokens per cache page (``PageLayout.pages_for`` rounds up by this)
    n_pages: int  # the whole page pool
    max_prefill_tokens: int  # the largest prefill pass: an image block must fit one
    image_rows_budget: int = 0  # bytes of retained image rows
    image_row_bytes: int = 0  # bytes of one encoded image row; 0: this model has no vision encoder


def image_bytes(images: Sequence[ImageInput], limits: FitLimits) -> int:
    """Bytes of encoded rows a request's images hold while it lives (what the image budget counts)."""
    return sum(im.n_rows for im in images) * limits.image_row_bytes


def fit(spec: RequestSpec, limits: FitLimits) -> str | None:
    """``None`` if ``spec`` can ever be served by an engine of these ``limits``; else what to change.

    The one answer to "can this request ever run here", whoever asks: ``EngineLoop.check`` (any thread;
    the server's ``submit``, answered as a 400 before a stream opens), ``Scheduler.add`` and ``LLM``.
    Pure: the same spec and limits always give the same answer and message.
    """
    return _length_problem(spec.prompt_tokens, spec.params.max_tokens, limits) or _image_problem(spec, limits)


def _length_problem(prompt_tokens: int, max_tokens: int, limits: FitLimits) -> str | None:
    limit, total = limits.max_model_len, prompt_tokens + max_tokens
    if total > limit and prompt_tokens >= limit:  # no max_tokens could help: say what to change
        return (f"the prompt ({prompt_tokens} tokens) fills the context limit of {limit} tokens, leaving no room "
                f"for max_tokens ({max_tokens}); shorten the prompt")
    if total > limit:
        return (f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds the context "
                f"limit of {limit} tokens; shorten the prompt or lower max_tokens")
    pages = -(-total // limits.page_tokens)
    if pages > limits.n_pages:
        return (f"the request needs {pages} cache pages but the whole pool has {limits.n_pages}; lower max_tokens "
                f"or shorten the prompt (or start the server with a larger --kv-budget)")
    return None


def _image_problem(spec: RequestSpec, limits: FitLimits) -> str | None:
    if not spec.images:
        return None
    if not limits.image_row_bytes:
        return "this model has no vision encoder; send text only"
    need = image_bytes(spec.images, limits)
    if need > limits.image_rows_budget:
        return (f"the request's images need {need} bytes of encoded rows, more than the image budget of "
                f"{limits.image_rows_budget} bytes; send fewer or smaller images")
    for im in spec.images:
        if im.block.length > limits.max_prefill_tokens:
            return (f"an image block of {im.block.length} tokens exceeds the largest prefill pass "
                    f"({limits.max_prefill_tokens} tokens); send a smaller image")
    return None
