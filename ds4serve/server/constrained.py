"""Constrained output for chat requests: the grammar a request asks for, one matcher per choice.

``response_format`` (json_object / json_schema), ``tool_choice`` (required / a named function /
auto / none) and a reasoning budget become one grammar per request (``chat.grammar``), compiled once
per distinct spec (cached by the server's ``GrammarCompiler``) and copied into one matcher per
choice; the engine's sampler masks each choice's logits with its matcher (``engine.constraints``).

In thinking mode the grammar applies after ``</think>``; so that a structured answer always
arrives, a request with a grammar gets a reasoning budget (``max_reasoning_tokens``, default half
of ``max_tokens``) past which only ``</think>`` may come. A budget without a grammar is honoured
too (a free matcher that only tracks the reasoning).
"""

from __future__ import annotations

from typing import Any

from ..chat.grammar import GrammarError, grammar_spec
from .chat_request import ChatSetup
from .protocol import APIError
from .state import ServerState

DEFAULT_REASONING_SHARE = 0.5  # of max_tokens, when a grammar needs the answer to arrive


def reasoning_budget(setup: ChatSetup, requested: int | None, max_tokens: int, constrained: bool) -> int | None:
    """The request's reasoning budget: the one it sent, else a share of ``max_tokens`` when thinking
    output must be followed by a constrained answer, else none."""
    if requested is not None:
        if not setup.parse_thinking:
            raise APIError(400, "max_reasoning_tokens needs thinking mode (the answer has no reasoning to bound)",
                           param="max_reasoning_tokens")
        return min(requested, max_tokens)
    if constrained and setup.parse_thinking:
        return max(0, int(max_tokens * DEFAULT_REASONING_SHARE))
    return None


def spec_of(setup: ChatSetup, body: Any):
    """The request's grammar spec (None: free output); a bad schema or choice is a 400 naming it."""
    try:
        return grammar_spec(response_format=setup.options.response_format, tools=body.tools,
                            tool_choice=body.tool_choice, parallel_tool_calls=body.parallel_tool_calls is not False)
    except GrammarError as exc:
        raise APIError(400, str(exc), param=exc.field) from exc


def matchers(state: ServerState, setup: ChatSetup, spec, n: int, budget: int | None) -> list[Any]:
    """One matcher per choice (worker thread: compiling may take milliseconds); ``[None] * n`` for
    free output without a budget."""
    if spec is None and budget is None:
        return [None] * n
    compiler = state.grammar_compiler()
    try:
        return [compiler.matcher(spec, thinking=setup.parse_thinking) for _ in range(n)]
    except GrammarError as exc:
        raise APIError(400, str(exc), param=exc.field) from exc
