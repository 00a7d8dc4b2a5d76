"""The OpenAI Responses API request body (``POST /v1/responses``) and the fields it refuses.

The body is declared loosely where the adapter (``responses_items``) gives better errors than pydantic
would: ``input`` items, ``tools``, ``tool_choice`` and ``text`` are plain JSON here and are checked
item by item there, with the Responses path of the bad field (``input[2].content[0].image_url``) as
``param``. What is declared strictly (numbers, flags, enums) fails through FastAPI's validation
handler, also a 400 naming the field. Lone surrogates anywhere are a 400 (``ValidUnicode``).

This server keeps nothing: ``store`` is accepted either way and nothing is stored, so every field
that needs a stored response or conversation (``previous_response_id``, ``conversation``, an
``item_reference`` input, ``background``) is a 400 that says so, as is every other field whose
meaning it cannot honour (``REFUSED``). Unknown fields that change nothing about the answer are
logged once and ignored, as on the chat route.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from .protocol import MAX_TEXT_CHARS, APIError, ValidUnicode

log = logging.getLogger(__name__)

MAX_INPUT_ITEMS = 2048
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
Summary = Literal["auto", "concise", "detailed"]
#: chat-route sampling extensions (vLLM / ds4serve) passed through unchanged when sent (``extra_body``)
EXTENSIONS = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
              "max_reasoning_tokens", "cache_salt", "stop", "min_tokens", "ignore_eos")
#: ``include`` values this server can honour; the reasoning is always returned as plain text, so
#: ``reasoning.encrypted_content`` asks for nothing more (the item is sent back as it came)
INCLUDES = ("reasoning.encrypted_content", "message.input_image.image_url")

_STATELESS = "; this server is stateless (nothing is stored): send the whole conversation in 'input'"
#: undeclared fields that would change the answer, with the test that they are harmless and why not
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "previous_response_id": (lambda v: v is None, "previous_response_id is not supported" + _STATELESS),
    "conversation": (lambda v: v is None, "conversation is not supported" + _STATELESS),
    "background": (lambda v: not v, "background responses are not supported (they need a stored response)"),
    "prompt": (lambda v: v is None, "stored prompt templates ('prompt') are not supported; send 'instructions' "
               "and 'input'"),
    "max_tool_calls": (lambda v: v is None, "max_tool_calls is not supported; bound the calls with tool_choice "
                       "or parallel_tool_calls"),
    "top_logprobs": (lambda v: not v, "top_logprobs is not supported on /v1/responses; use /v1/chat/completions "
                     "with logprobs"),
    "context_management": (lambda v: not v, "context_management (server-side compaction) is not supported"),
}
_logged: set[str] = set()


class ReasoningConfig(BaseModel):
    """``reasoning``: ``effort`` maps onto DS4 thinking (``responses_items.chat_body``); ``summary``
    asks for the reasoning as summary text too (DS4 writes no separate summary)."""

    model_config = ConfigDict(extra="ignore")
    effort: Effort | None = None
    summary: Summary | None = None
    generate_summary: Summary | None = None  # the deprecated name of ``summary``

    @property
    def wants_summary(self) -> bool:
        return (self.summary or self.generate_summary) is not None


class ResponsesStreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_obfuscation: bool = True  # OpenAI's padding field; this server never pads, so either is honoured


class ResponsesRequest(ValidUnicode):
    """The body of ``POST /v1/responses``; unknown fields are sorted by ``check_response_fields``."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1, max_length=256)
    input: str | list[Any]  # lengths checked in check_response_fields (a union's own errors name no field)
    instructions: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    tools: list[Any] | None = Field(default=None, max_length=512)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = Field(default=None, max_length=256)
    truncation: Literal["auto", "disabled"] | None = None
    store: bool | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    include: list[str] | None = Field(default=None, max_length=16)

    @field_validator("input", mode="before")
    @classmethod
    def _input_kind(cls, v: Any) -> Any:
        """One clear message, where pydantic would report each alternative of the union."""
        if not isinstance(v, (str, list)):
            raise PydanticCustomError("input_type", "input must be a string or a list of input items")
        return v


def check_response_fields(body: ResponsesRequest) -> None:
    """400 for a field this server cannot honour (module docstring); log the ignored ones once."""
    if isinstance(body.input, str) and len(body.input) > MAX_TEXT_CHARS:
        raise APIError(400, f"input is longer than {MAX_TEXT_CHARS} characters", param="input")
    if isinstance(body.input, list) and not 0 < len(body.input) <= MAX_INPUT_ITEMS:
        raise APIError(400, f"input must hold 1 to {MAX_INPUT_ITEMS} items, got {len(body.input)}", param="input")
    if body.truncation == "auto":
        raise APIError(400, "truncation 'auto' is not supported: this server never drops input items; send "
                       "'disabled' (a conversation over the context limit is a 400)", param="truncation",
                       code="unsupported_parameter")
    for i, name in enumerate(body.include or ()):
        if name not in INCLUDES:
            raise APIError(400, f"include {name!r} is not supported (supported: {list(INCLUDES)})",
                           param=f"include[{i}]", code="unsupported_parameter")
    for key, value in (body.metadata or {}).items():
        if len(key) > 64 or len(value) > 512:
            raise APIError(400, "metadata keys are at most 64 characters and values at most 512",
                           param=f"metadata.{key[:64]}")
    for name, value in (body.model_extra or {}).items():
        rule = REFUSED.get(name)
        if rule is not None and not rule[0](value):
            raise APIError(400, rule[1], param=name, code="unsupported_parameter")
        if rule is None and name not in EXTENSIONS and name not in _logged:
            _logged.add(name)
            log.info("ignoring unsupported request field %r in responses (logged once)", name)


def extensions_of(body: ResponsesRequest) -> dict[str, Any]:
    """The chat-route extensions the request carries (``EXTENSIONS``), for the chat body."""
    return {k: v for k, v in (body.model_extra or {}).items() if k in EXTENSIONS}
