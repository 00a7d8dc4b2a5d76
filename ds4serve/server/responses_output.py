"""The ``response`` object: what a Responses request echoes back, its usage, its status.

OpenAI's ``Response`` type requires the request's settings in every response (``tools``,
``tool_choice``, ``parallel_tool_calls``, ``text``, ``reasoning``...), including the snapshots in
``response.created`` / ``response.in_progress``; ``Echo`` holds them once per request, in the
Responses shapes the client sent (flat function tools), with OpenAI's defaults filled in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .jobs import Job
from .responses_protocol import ResponsesRequest


@dataclass(frozen=True)
class Echo:
    """The request fields every ``response`` object repeats."""

    model: str
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    parallel_tool_calls: bool = True
    reasoning: dict[str, Any] = field(default_factory=dict)
    temperature: float = 1.0
    text: dict[str, Any] = field(default_factory=lambda: {"format": {"type": "text"}, "verbosity": "medium"})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = field(default_factory=list)
    top_p: float = 1.0
    user: str | None = None
    store: bool = False
    summary: bool = False  # the client asked for reasoning summaries (reasoning.summary)

    @classmethod
    def of(cls, body: ResponsesRequest, chat_tools: list[dict[str, Any]] | None) -> Echo:
        """``chat_tools``: the request's tools as the adapter passed them on (validated)."""
        reasoning = body.reasoning
        text = {"format": (body.text or {}).get("format") or {"type": "text"},
                "verbosity": (body.text or {}).get("verbosity") or "medium"}
        return cls(model=body.model, instructions=body.instructions, max_output_tokens=body.max_output_tokens,
                   metadata=dict(body.metadata or {}),
                   parallel_tool_calls=body.parallel_tool_calls is not False,
                   reasoning={"effort": reasoning.effort if reasoning else None,
                              "summary": (reasoning.summary or reasoning.generate_summary) if reasoning else None},
                   temperature=1.0 if body.temperature is None else body.temperature, text=text,
                   tool_choice=body.tool_choice or "auto",
                   tools=[{"type": "function", "strict": None, **t["function"]} for t in chat_tools or ()],
                   top_p=1.0 if body.top_p is None else body.top_p, user=body.user, store=bool(body.store),
                   summary=bool(reasoning and reasoning.wants_summary))


def response_object(echo: Echo, response_id: str, created: int, status: str, output: list[dict[str, Any]],
                    usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """One ``response`` object; an ``incomplete`` one ran out of ``max_output_tokens`` (the only way
    this server leaves a response unfinished)."""
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status,
        "completed_at": int(time.time()) if status == "completed" else None, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": echo.instructions, "max_output_tokens": echo.max_output_tokens, "model": echo.model,
        "output": output, "parallel_tool_calls": echo.parallel_tool_calls, "previous_response_id": None,
        "reasoning": echo.reasoning, "store": echo.store, "temperature": echo.temperature, "text": echo.text,
        "tool_choice": echo.tool_choice, "tools": echo.tools, "top_p": echo.top_p, "truncation": "disabled",
        "usage": usage, "user": echo.user, "metadata": echo.metadata, "background": False,
    }


def usage_of(job: Job, output_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    """Responses ``usage``: prompt tokens (those served from the prefix cache as ``cached_tokens``),
    output tokens (of which reasoning). Nothing is written to a cache a client pays for, so
    ``cache_write_tokens`` (required by newer SDK types) is 0."""
    prompt = sum(len(p) for p in job.prompts)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": job.cached_tokens(), "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt + output_tokens}
