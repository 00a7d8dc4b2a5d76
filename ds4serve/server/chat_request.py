"""A chat request's DS4 controls -> the encoder's ``ChatOptions`` and how to read the output back.

Every control that changes the prompt or the output is honoured here or refused with a 400 that
names the field; nothing is dropped quietly. The mapping (also in the README):

* thinking: ``chat_template_kwargs.thinking`` (bool; ``enable_thinking`` is taken as the same),
  DeepSeek's ``thinking: {"type": "enabled" | "disabled"}``, else a top-level ``reasoning_effort``
  other than ``"none"`` turns it on, else the server's ``--default-thinking``. Sources that
  disagree are a 400.
* effort: ``chat_template_kwargs.reasoning_effort`` is the encoder's own ``low | high | max``;
  OpenAI's top-level ``reasoning_effort`` maps ``minimal, low -> low``, ``medium, high -> high``,
  ``xhigh, max -> max`` and ``none`` -> thinking off. An effort with thinking off is a 400 (the
  encoder only writes it in thinking mode).
* ``tools`` are rendered; ``tool_choice`` ``auto`` / ``none`` are taken (with ``none``, a call the
  model writes anyway is dropped, never shown as text); ``required`` and a named function need
  constrained decoding and are a 400 until it exists.
* ``response_format`` ``text`` is the default; ``json_object`` / ``json_schema`` are rendered into
  the prompt (``/apply-template``, ``/tokenize``) but a chat completion with them is a 400, because
  the output is not constrained yet.
* A last assistant message with ``"prefix": true`` is continued (DeepSeek's prefix completion); the
  answer is read as content, after its prefix. Any other trailing assistant message is a 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..chat import ChatOptions
from ..chat.dsml import DEFAULT_EFFORT_EDITION
from .protocol import APIError, ChatControls
from .schema_check import schema_problem

#: OpenAI's top-level ``reasoning_effort`` -> the encoder's effort (``None``: thinking off).
OPENAI_EFFORT = {"none": None, "minimal": "low", "low": "low", "medium": "high", "high": "high",
                 "xhigh": "max", "max": "max"}
ENCODER_EFFORTS = ("low", "high", "max")
KWARGS = ("thinking", "enable_thinking", "reasoning_effort", "drop_thinking")
FORMATS = ("text", "json_object", "json_schema")


@dataclass(frozen=True)
class ChatSetup:
    """How to render one chat request and how to read its output."""

    messages: list[dict[str, Any]]
    options: ChatOptions
    prefix: bool = False  # the last assistant message is continued (its text is in the prompt)
    tool_choice: str = "auto"  # "auto" | "none" | "required" | "function"
    tool_name: str | None = None  # the function a named tool_choice asks for

    @property
    def parse_thinking(self) -> bool:
        """The output starts in reasoning: thinking mode, unless a prefix already closed it."""
        return self.options.thinking and not self.prefix

    @property
    def keep_tool_calls(self) -> bool:
        return self.tool_choice != "none"


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_parameter")


def _flag(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise _bad(f"{param} must be true or false, got {value!r}", param)
    return value


def _thinking_votes(body: ChatControls, kwargs: dict[str, Any]) -> list[tuple[str, bool]]:
    """Every explicit thinking choice in the request, with the field that made it."""
    votes = [(f"chat_template_kwargs.{k}", _flag(kwargs[k], f"chat_template_kwargs.{k}"))
             for k in ("thinking", "enable_thinking") if k in kwargs]
    if body.thinking is not None:
        kind = body.thinking.get("type")
        if kind not in ("enabled", "disabled") or set(body.thinking) - {"type"}:
            raise _bad('thinking must be {"type": "enabled"} or {"type": "disabled"}', "thinking.type")
        votes.append(("thinking", kind == "enabled"))
    if body.reasoning_effort is not None:
        if body.reasoning_effort not in OPENAI_EFFORT:
            raise _bad(f"reasoning_effort must be one of {list(OPENAI_EFFORT)}, got {body.reasoning_effort!r}",
                       "reasoning_effort")
        on = OPENAI_EFFORT[body.reasoning_effort] is not None
        if on or not votes:  # an effort asks for thinking; "none" only decides when nothing else does
            votes.append(("reasoning_effort", on))
    return votes


def _thinking_and_effort(body: ChatControls, kwargs: dict[str, Any], default: bool) -> tuple[bool, str | None]:
    votes = _thinking_votes(body, kwargs)
    if len({v for _, v in votes}) > 1:
        names = ", ".join(f"{p}={'on' if v else 'off'}" for p, v in votes)
        raise _bad(f"the request asks for thinking both on and off ({names})", votes[-1][0])
    thinking = votes[0][1] if votes else default
    effort = kwargs.get("reasoning_effort")
    if effort is not None and effort not in ENCODER_EFFORTS:
        raise _bad(f"chat_template_kwargs.reasoning_effort must be one of {list(ENCODER_EFFORTS)}, got {effort!r}",
                   "chat_template_kwargs.reasoning_effort")
    top = OPENAI_EFFORT.get(body.reasoning_effort or "none")
    if effort is not None and top is not None and top != effort:
        raise _bad(f"reasoning_effort {body.reasoning_effort!r} (-> {top!r}) disagrees with "
                   f"chat_template_kwargs.reasoning_effort {effort!r}", "reasoning_effort")
    effort = effort or top
    if effort is not None and not thinking:
        param = "chat_template_kwargs.reasoning_effort" if "reasoning_effort" in kwargs else "reasoning_effort"
        raise _bad("a reasoning effort needs thinking mode, and this request has thinking off", param)
    return thinking, effort


def _check_tools(tools: list[dict[str, Any]] | None) -> list[str]:
    """The tool names; a malformed tool or a parameters schema that is not JSON Schema is a 400."""
    names = []
    for i, tool in enumerate(tools or ()):
        fn = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or \
                not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad('each tool must be {"type": "function", "function": {"name": ..., "parameters": {...}}}',
                       f"tools[{i}]")
        params = fn.get("parameters")
        if params is not None:
            _check_schema(params, f"tools[{i}].function.parameters")
        names.append(fn["name"])
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise _bad(f"tool names must be unique; repeated: {sorted(dup)}", "tools")
    return names


def _check_schema(schema: Any, param: str) -> None:
    problem = schema_problem(schema, param)
    if problem:
        raise _bad(f"not a valid JSON Schema: {problem}", problem.split(" ", 1)[0])


def _tool_choice(choice: str | dict[str, Any] | None, names: list[str]) -> tuple[str, str | None]:
    if choice is None or choice in ("auto", "none"):
        return choice or "auto", None
    if choice == "required":
        if not names:
            raise _bad('tool_choice "required" needs tools', "tool_choice")
        return "required", None
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or choice.get("type") != "function" or not isinstance(fn.get("name"), str):
        raise _bad('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                   '{"name": ...}}', "tool_choice")
    if fn["name"] not in names:
        raise _bad(f"tool_choice names the function {fn['name']!r}, which is not among the tools {names}",
                   "tool_choice.function.name")
    return "function", fn["name"]


def _response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind not in FORMATS:
        raise _bad(f"response_format.type must be one of {list(FORMATS)}, got {kind!r}", "response_format.type")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
            raise _bad('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}',
                       "response_format.json_schema")
        if "schema" in spec:
            _check_schema(spec["schema"], "response_format.json_schema.schema")
    return None if kind == "text" else fmt


def _check_messages(messages: list[dict[str, Any]]) -> None:
    """Images only where a client shows them to the model: user and tool messages (the model never
    wrote an image, and the tiny model's template has none elsewhere); the model's own fields only on
    assistant messages (the encoder would drop them anywhere else)."""
    for i, m in enumerate(messages):
        for key in ("tool_calls", "reasoning_content", "reasoning"):
            if m["role"] != "assistant" and m.get(key) is not None:
                raise _bad(f"messages[{i}].{key} is only for assistant messages (this one is {m['role']})",
                           f"messages[{i}].{key}")
        if m["role"] in ("user", "tool") or not isinstance(m.get("content"), list):
            continue
        for j, part in enumerate(m["content"]):
            if part.get("type") != "text":
                raise _bad(f"messages[{i}].content[{j}]: a {m['role']} message may only contain text parts",
                           f"messages[{i}].content[{j}].type")


def _prefix(messages: list[dict[str, Any]]) -> bool:
    """Whether the last message is an assistant prefix to continue; a prefix anywhere else is a 400."""
    for i, m in enumerate(messages[:-1]):
        if m.get("prefix"):
            raise _bad('"prefix": true is only for the last message (an assistant message)', f"messages[{i}].prefix")
    last = messages[-1]
    if last.get("prefix") and last["role"] != "assistant":
        raise _bad('"prefix": true is only for an assistant message', f"messages[{len(messages) - 1}].prefix")
    return bool(last.get("prefix"))


def chat_setup(body: ChatControls, messages: list[dict[str, Any]], default_thinking: bool,
               edition: str = DEFAULT_EFFORT_EDITION) -> ChatSetup:
    """The encoder options and output reading for ``body`` (raises the 400s of the module docstring);
    ``edition``: the checkpoint's effort prompts (``chat.edition``, chosen at start-up)."""
    kwargs = body.chat_template_kwargs or {}
    unknown = [k for k in kwargs if k not in KWARGS]
    if unknown:
        raise _bad(f"chat_template_kwargs.{unknown[0]} is not a DS4 chat option (known: {list(KWARGS)})",
                   f"chat_template_kwargs.{unknown[0]}")
    _check_messages(messages)
    thinking, effort = _thinking_and_effort(body, kwargs, default_thinking)
    drop = _flag(kwargs.get("drop_thinking", True), "chat_template_kwargs.drop_thinking")
    names = _check_tools(body.tools)
    choice, name = _tool_choice(body.tool_choice, names)
    opts = ChatOptions(thinking=thinking, reasoning_effort=effort, drop_thinking=drop, tools=body.tools or None,
                       response_format=_response_format(body.response_format), effort_edition=edition)
    return ChatSetup(messages, opts, _prefix(messages), choice, name)


def check_generation(setup: ChatSetup) -> None:
    """What a chat completion needs beyond rendering: an answer can follow (constrained output is
    ``constrained.py``'s)."""
    last, where = setup.messages[-1], f"messages[{len(setup.messages) - 1}]"
    if last["role"] == "assistant" and not setup.prefix:
        raise _bad('the last message must not be an assistant message unless it is a prefix to continue '
                   '("prefix": true)', where)
    if last["role"] not in ("user", "tool", "developer", "assistant"):
        raise _bad(f"the last message is a {last['role']} message; the model answers after a user, tool or "
                   "developer message", where)
