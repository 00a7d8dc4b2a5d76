"""A Responses request -> the chat route's request (``ChatCompletionRequest``), and errors back.

The Responses API is served as an adapter: the body becomes a chat completion request that goes
through the chat route's own validation, rendering, constraints and engine path (``jobs.build_chat``),
so tools, images, ``json_schema`` and thinking behave exactly as there. The field mapping:

* ``instructions`` + ``input`` -> ``messages`` (``responses_items``).
* flat function ``tools`` (``{"type": "function", "name", "parameters", "strict"}``) -> chat tools;
  ``tool_choice`` ``{"type": "function", "name"}`` -> the chat named form; hosted tools are a 400.
* ``text.format`` ``json_schema`` / ``json_object`` / ``text`` -> ``response_format``.
* ``reasoning.effort`` -> ``reasoning_effort`` (``none`` turns DS4 thinking off, any other effort on;
  without it the server's ``--default-thinking`` decides).
* ``max_output_tokens`` -> ``max_completion_tokens``; ``temperature``, ``top_p``, ``user`` as they are;
  ``parallel_tool_calls: false`` is handed on to the chat path, whose tool grammar then allows one call.

A 400 the chat path raises names chat fields (``messages[2].content[0]``); ``responses_error``
rewrites them to the Responses field they came from (``input[3].content[0]``).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from .protocol import MAX_MESSAGES, APIError, ChatCompletionRequest
from .responses_items import ChatInput, bad, chat_input
from .responses_protocol import ResponsesRequest, check_response_fields, extensions_of

VERBOSITY = (None, "medium")
_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal", "constrained"}
#: chat-path parameter names -> the Responses field they came from (longest first)
_RENAMES = (("response_format.json_schema.schema", "text.format.schema"),
            ("response_format.json_schema", "text.format"), ("response_format", "text.format"), ("max_completion_tokens", "max_output_tokens"),
            ("max_tokens", "max_output_tokens"), ("reasoning_effort", "reasoning.effort"),
            ("tool_choice.function.name", "tool_choice.name"))


def chat_request(body: ResponsesRequest) -> tuple[ChatCompletionRequest, ChatInput]:
    """The chat request that answers ``body``, and the message sources for ``responses_error``."""
    check_response_fields(body)
    inp = chat_input(body.instructions, body.input)
    if len(inp.messages) > MAX_MESSAGES:
        raise bad(f"input makes {len(inp.messages)} messages (a turn each, function calls of one turn together); "
                  f"at most {MAX_MESSAGES} are served", "input")
    data: dict[str, Any] = {"model": body.model, "messages": inp.messages, "tools": chat_tools(body.tools),
                            "tool_choice": chat_tool_choice(body.tool_choice),
                            "response_format": chat_format(body.text), "temperature": body.temperature,
                            "top_p": body.top_p, "user": body.user, "max_completion_tokens": body.max_output_tokens}
    if body.reasoning is not None and body.reasoning.effort is not None:
        data["reasoning_effort"] = body.reasoning.effort
    if body.parallel_tool_calls is False:
        data["parallel_tool_calls"] = False
    data.update(extensions_of(body))
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in data.items() if v is not None}), inp
    except ValidationError as exc:
        err = exc.errors()[0]
        param = _path(err.get("loc", ()))
        raise responses_error(APIError(400, f"{param}: {err.get('msg', 'invalid value')}", param=param or None),
                              inp) from None


def _path(loc: tuple[Any, ...]) -> str:
    """A pydantic location as an OpenAI param path (``messages[2].content``), union tags left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" not in part and part.split("-")[0] not in _TAGS:
            out += f".{part}" if out else part
    return out


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Flat Responses function tools -> chat tools (the chat form ``{"function": {...}}`` is taken too)."""
    out = []
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad(f"{where}.type {kind!r} is not supported: this server offers function tools only (the client "
                      'runs them): {"type": "function", "name": ..., "parameters": {...}}', f"{where}.type",
                      "unsupported_parameter")
        fn = tool["function"] if isinstance(tool.get("function"), dict) and "name" not in tool else tool
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"{where}.name must be a non-empty string", f"{where}.name")
        for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
            if fn.get(key) is not None and not isinstance(fn[key], kind):
                raise bad(f"{where}.{key} must be a {kind.__name__ if kind is not dict else 'JSON Schema object'}",
                          f"{where}.{key}")
        spec = {k: fn[k] for k in ("name", "description", "parameters", "strict") if fn.get(k) is not None}
        out.append({"type": "function", "function": spec})
    return out or None


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """``auto`` / ``none`` / ``required`` as they are; ``{"type": "function", "name"}`` -> the chat form."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function":
        if not isinstance(choice.get("name"), str) or not choice["name"]:
            raise bad("tool_choice.name must name one of the function tools", "tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}
    if kind is not None:
        raise bad(f"tool_choice type {kind!r} is not supported (function tools only; allowed_tools and hosted tools "
                  "are not available)", "tool_choice.type", "unsupported_parameter")
    raise bad('tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}', "tool_choice")


def chat_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` -> the chat ``response_format`` (None: free text)."""
    if not text:
        return None
    if text.get("verbosity") not in VERBOSITY:
        raise bad(f"text.verbosity {text['verbosity']!r} is not supported (the model has no verbosity control; send "
                  "'medium' or leave it out)", "text.verbosity", "unsupported_parameter")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise bad(f"text.format.type must be one of ['text', 'json_object', 'json_schema'], got {kind!r}",
                  "text.format.type")
    if not isinstance(fmt.get("name"), str) or not fmt["name"]:
        raise bad("text.format.name must be a non-empty string", "text.format.name")
    if not isinstance(fmt.get("schema"), dict):
        raise bad("text.format.schema must be a JSON Schema object", "text.format.schema")
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
    return {"type": "json_schema", "json_schema": spec}


def _rename(text: str, sources: list[str]) -> str:
    """Chat-path field names in ``text`` -> the Responses fields they came from."""
    text = re.sub(r"messages\[(\d+)\]", lambda m: sources[int(m[1])] if int(m[1]) < len(sources) else m[0], text)
    text = re.sub(r"tools\[(\d+)\]\.function", r"tools[\1]", text)
    text = re.sub(r"(?<![\w.])messages(?![\w\[])", "input", text)
    for old, new in _RENAMES:
        text = re.sub(rf"(?<![\w.]){re.escape(old)}(?![\w])", new, text)
    return text


def responses_error(err: APIError, inp: ChatInput) -> APIError:
    """``err`` with its ``param`` and message naming Responses fields (module docstring)."""
    param = _rename(err.param, inp.sources) if err.param else err.param
    out = APIError(err.status, _rename(err.message, inp.sources), err.type, param, err.code, err.headers)
    return out
