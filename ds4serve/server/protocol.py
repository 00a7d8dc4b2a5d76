"""OpenAI-compatible request and response bodies (pydantic), with the limits the server enforces.

Unknown fields are allowed through pydantic and then sorted by ``check_extra_fields``: fields that
would change the meaning of the answer (``structured_outputs``, ``guided_json``...) are a 400 naming
the field; the rest are logged once and ignored. The DS4 chat controls (``ChatControls``: thinking,
effort, tools, tool_choice, response_format) are declared fields, honoured or refused by
``chat_request``.

Text must be valid Unicode. JSON can spell a lone UTF-16 surrogate (``"\\ud800"``) that no UTF-8
text contains; the tokenizer and the response encoder cannot take it, so a request holding one
anywhere (any string, any key, any depth) is refused with a 400 naming the field, rather than
repaired: a silent replacement would change the prompt the client sent.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

log = logging.getLogger(__name__)

MAX_N = 8
MAX_STOPS = 16
MAX_STOP_LEN = 256
MAX_MESSAGES = 512
MAX_TEXT_CHARS = 1_000_000
MAX_CACHE_SALT = 256


class APIError(Exception):
    """An error answered with an OpenAI-shaped body: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage (so far) on every chunk
    include_obfuscation: bool = True  # OpenAI's padding field; this server never pads, so either is honoured


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="ignore")
    url: str = Field(max_length=64 * 2**20)
    detail: Literal["auto", "low", "high", "original"] = "auto"


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "image_url"]
    text: str | None = Field(default=None, max_length=MAX_TEXT_CHARS, validate_default=True)
    image_url: ImageURL | None = Field(default=None, validate_default=True)

    @field_validator("text")
    @classmethod
    def _text_present(cls, v, info: ValidationInfo):
        """A text part without text would render as nothing: the client meant to send something."""
        if v is None and info.data.get("type") == "text":
            raise PydanticCustomError("missing_text", "a text part needs a 'text' string")
        return v

    @field_validator("image_url")
    @classmethod
    def _url_present(cls, v, info: ValidationInfo):
        """Refused here rather than by the image worker: no thread is spent on a request that is malformed."""
        if v is None and info.data.get("type") == "image_url":
            raise PydanticCustomError("missing_image_url", "an image_url part needs an 'image_url' object with a 'url'")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "latest_reminder"]
    content: str | list[ContentPart] | None = Field(default=None, validate_default=True)
    name: str | None = Field(default=None, max_length=256)
    reasoning_content: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)  # DeepSeek, SGLang
    reasoning: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)  # vLLM's name for the same
    tool_call_id: str | None = Field(default=None, max_length=256)
    tool_calls: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    prefix: bool = False  # DeepSeek prefix completion: the last assistant message is continued

    @field_validator("content")
    @classmethod
    def _content(cls, v, info: ValidationInfo):
        """Only an assistant turn may omit its content (OpenAI allows ``null`` there, e.g. beside
        tool calls); any other role without content would silently become an empty turn."""
        if v is None and info.data.get("role") not in (None, "assistant"):
            raise PydanticCustomError("missing_content", "a {role} message needs 'content' (a string or a list of "
                                      "content parts)", {"role": info.data["role"]})
        if isinstance(v, str) and len(v) > MAX_TEXT_CHARS:
            raise ValueError(f"content longer than {MAX_TEXT_CHARS} characters")
        return v


class ValidUnicode(BaseModel):
    """A request body whose every string must be valid Unicode (see the module docstring)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """Refuse lone surrogates before any field is parsed (see the module docstring)."""
        where = find_lone_surrogate(data)
        if where is not None:
            param, what, pos = where
            raise PydanticCustomError(
                "invalid_unicode", "{what} contains a lone UTF-16 surrogate escape at character {pos}, which is not "
                "valid Unicode; send real characters (astral ones as a surrogate pair or as raw UTF-8)",
                {"param": param, "what": what, "pos": pos})
        return data


class SamplingFields(ValidUnicode):
    """Fields shared by chat and completions (standard ones and the common extensions)."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1, max_length=256)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=100_000)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=-(2**53), le=2**53)  # exactly representable in JSON numbers
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0, le=10)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = Field(default=None, max_length=64)
    skip_special_tokens: bool = True
    # vLLM's prefix-cache salt: requests reuse cached prompt state only within one salt (and one API key)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT)
    # OpenAI: token id (a decimal string) -> bias in [-100, 100]; checked against the vocabulary by jobs
    logit_bias: dict[str, float] | None = None
    # vLLM's: every prompt token's logprob (but the first's) plus the top N, as the answer's ``prompt_logprobs``
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        if any(len(s) > MAX_STOP_LEN for s in stops):
            raise ValueError(f"stop strings must be at most {MAX_STOP_LEN} characters")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatControls(BaseModel):
    """What changes a DS4 chat prompt besides the messages (``chat_options`` maps them onto the
    encoder); shared by chat completions, ``/tokenize`` and ``/apply-template``."""

    chat_template_kwargs: dict[str, Any] | None = None  # thinking, reasoning_effort, drop_thinking
    thinking: dict[str, Any] | None = None  # DeepSeek API: {"type": "enabled" | "disabled"}
    reasoning_effort: str | None = Field(default=None, max_length=32)  # OpenAI's top-level effort
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=512)
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call (the tool grammar closes after it)


class ChatCompletionRequest(SamplingFields, ChatControls):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # reasoning budget in thinking mode: past it only </think> may come (vLLM / DeepSeek style)
    max_reasoning_tokens: int | None = Field(default=None, ge=0)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(...)
    max_tokens: int | None = Field(default=16, ge=0)  # 0 only with echo (jobs.build_completion says so)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False  # the prompt (and with logprobs, its tokens' logprobs) before the output
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: BOS before a text prompt (false: none); specials in it match either way


def _surrogate_at(s: str) -> int | None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def find_lone_surrogate(data: Any) -> tuple[str, str, int] | None:
    """``(param, what, character index)`` of the first string (value or key) holding a lone surrogate.

    Iterative, so a deeply nested body cannot overflow the stack; ``param`` uses the OpenAI path
    style (``messages[0].content[1].text``)."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        children: list[tuple[str, Any]] = []
        if isinstance(value, str):
            pos = _surrogate_at(value)
            if pos is not None:
                return path or "body", path or "the body", pos
        elif isinstance(value, dict):
            for key, item in value.items():
                key_s = str(key)
                pos = _surrogate_at(key_s)
                if pos is not None:
                    return path or "body", f"a field name in {path or 'the body'}", pos
                children.append((f"{path}.{key_s}" if path else key_s, item))
        elif isinstance(value, list):
            children = [(f"{path}[{i}]", item) for i, item in enumerate(value)]
        stack.extend(reversed(children))  # document order: the first bad string is the one named
    return None


# Fields that would change the answer if silently ignored: refuse them unless harmless. A chat
# request declares the chat controls (``ChatControls``), so the chat-only names below are reached
# only by a completions request, where they would do nothing.
_MEANING = {
    "tools": lambda v: not v,
    "functions": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none"),
    "function_call": lambda v: v in (None, "none"),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "thinking": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "chat_template_kwargs": lambda v: not v,
    "structured_outputs": lambda v: not v,  # vLLM's form of constrained decoding: send response_format
    "guided_grammar": lambda v: v is None,
    "guided_decoding_backend": lambda v: v is None,
    "thinking_token_budget": lambda v: v is None,
    "thinking_budget": lambda v: v is None,
    "include_reasoning": lambda v: v in (None, True),
    "echo": lambda v: not v,  # vLLM chat: echo the last message
    "add_generation_prompt": lambda v: v in (None, True),
    "continue_final_message": lambda v: not v,  # use DeepSeek's "prefix": true on the last message
    "chat_template": lambda v: v is None,
    "documents": lambda v: not v,
    "audio": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]),
    "prediction": lambda v: v is None,
    "guided_json": lambda v: v is None,
    "guided_regex": lambda v: v is None,
    "guided_choice": lambda v: v is None,
    "logits_processors": lambda v: not v,
}
_HINTS = {"continue_final_message": "; send \"prefix\": true on the last assistant message instead",
          "structured_outputs": "; send response_format (json_object / json_schema) or tool_choice",
          "thinking_budget": "; send max_reasoning_tokens",
          "thinking_token_budget": "; send max_reasoning_tokens",
          "thinking": " on this endpoint (thinking is a chat control)",
          "reasoning_effort": " on this endpoint (reasoning effort is a chat control)"}
_logged_ignored: set[str] = set()


def check_extra_fields(req: BaseModel, where: str = "") -> None:
    """400 for an undeclared field that would change the answer; log the others once."""
    extra = req.model_extra or {}
    for name, value in extra.items():
        ok = _MEANING.get(name)
        if ok is not None and not ok(value):
            raise APIError(400, f"'{name}' is not supported by this server{_HINTS.get(name, '')}; remove it from "
                           "the request", param=name, code="unsupported_parameter")
        if ok is None and name not in _logged_ignored:
            _logged_ignored.add(name)
            log.info("ignoring unsupported request field %r%s (logged once)", name, f" in {where}" if where else "")
