"""Anthropic Messages API request bodies (``POST /v1/messages``, ``/v1/messages/count_tokens``).

pydantic checks the top-level fields (types, ranges, ``max_tokens`` required as Anthropic requires
it, lone surrogates anywhere via ``ValidUnicode``); content blocks, tools, ``tool_choice``,
``thinking`` and ``output_config`` are checked by ``anthropic_convert`` while it translates them,
where a refusal can say exactly which block is wrong and why (a pydantic union of a dozen block
types reports a dozen errors, none of them the one the client made).

Undeclared top-level fields follow the server's rule (``protocol.check_extra_fields``): one that
would change the answer (server-side features such as ``mcp_servers``) is a 400 naming it, others
(``service_tier``, ``cache_control``...) are logged once and ignored.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .protocol import MAX_MESSAGES, MAX_STOP_LEN, MAX_STOPS, APIError, ValidUnicode

log = logging.getLogger(__name__)

MAX_BLOCKS = 4096  # content blocks of one message


class AnthropicMessage(BaseModel):
    """One turn: ``content`` is a string (one text block) or a list of content blocks."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]] = Field(max_length=MAX_BLOCKS)


class CountTokensRequest(ValidUnicode):
    """What decides the prompt: the fields ``count_tokens`` takes and ``create`` shares."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1, max_length=256)
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=512)
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``: the prompt fields plus sampling, stopping and streaming."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOPS)
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=100_000)
    metadata: dict[str, Any] | None = None
    stream: bool = False

    @field_validator("stop_sequences")
    @classmethod
    def _stop_lengths(cls, v: list[str] | None) -> list[str] | None:
        if any(len(s) > MAX_STOP_LEN for s in v or ()):
            raise ValueError(f"stop sequences must be at most {MAX_STOP_LEN} characters")
        return v


# Undeclared fields that would change the answer if ignored: Anthropic's server-side features.
_REFUSED = ("container", "mcp_servers", "context_management", "tool_runner", "betas")
# Declared by Anthropic, and without effect here: logged once, then ignored.
_IGNORED = ("service_tier", "inference_geo", "speed", "cache_control", "diagnostics", "user_profile_id",
            "workspace_id", "max_tokens", "stream", "metadata")
_logged: set[str] = set()


def check_extra_fields(body: BaseModel) -> None:
    """400 for a field this server cannot honour; log the other undeclared ones once."""
    for name in body.model_extra or {}:
        if name in _REFUSED:
            raise APIError(400, f"'{name}' is not supported by this server; remove it from the request", param=name,
                           code="unsupported_parameter")
        if name not in _logged:
            _logged.add(name)
            how = "has no effect here" if name in _IGNORED else "is not an Anthropic Messages field"
            log.info("ignoring request field %r on the Messages API (%s; logged once)", name, how)
