"""An Anthropic Messages request -> the server's own chat completion request.

The Messages API is an adapter: the request is translated into a ``ChatCompletionRequest`` and then
takes the chat route's path unchanged (validation, DS4 rendering, images, tools and their grammar,
the reasoning budget, admission, serving). What is Anthropic's alone is checked here, with the
Anthropic field path in the message (``messages[2].content[1].tool_use_id``):

* ``system`` (a string or text blocks) -> a system message.
* user blocks: ``text``; ``image`` with a ``base64`` source (jpeg, png, gif, webp) -> a ``data:`` URL,
  or a ``url`` source, fetched only under the server's image-host policy (else the image pipeline's
  400); ``tool_result`` -> a ``tool`` message (text and image content; ``is_error`` puts "Error:"
  first), whose ``tool_use_id`` must name a ``tool_use`` of the latest assistant message.
* assistant blocks: ``text``; ``thinking`` -> the turn's reasoning (its ``signature`` is required, as
  Anthropic requires it, and not checked: DS4 needs no proof of origin); ``tool_use`` -> a tool call.
  A trailing assistant message is continued (DeepSeek prefix completion = Anthropic prefill).
* ``tools`` (client tools: ``name``, ``input_schema``) -> function tools; ``tool_choice`` ``auto`` /
  ``any`` (-> ``required``) / ``tool`` (-> the named function) / ``none``.
* ``thinking`` ``enabled`` -> DS4 thinking mode with ``budget_tokens`` as the reasoning budget,
  ``adaptive`` -> thinking mode, ``disabled`` -> chat mode; ``output_config.effort`` -> the reasoning
  effort (as OpenAI's ``reasoning_effort``), ``output_config.format`` -> a ``json_schema`` answer.

Every other block type (documents, server tools' blocks, ``redacted_thinking``...) is a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from .anthropic_protocol import CountTokensRequest, MessagesRequest, check_extra_fields
from .protocol import APIError, ChatCompletionRequest

MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
EFFORTS = ("low", "medium", "high", "xhigh", "max")
Block = dict[str, Any]


def bad(message: str, param: str | None = None) -> APIError:
    """A 400 for the client (Anthropic-shaped on these routes, ``anthropic_errors``)."""
    return APIError(400, f"{param}: {message}" if param else message, param=param, code="invalid_request")


def _field(block: Block, key: str, kind: type, where: str, required: bool = True) -> Any:
    """``block[key]`` checked to be a ``kind`` (missing: None, or a 400 when ``required``)."""
    value = block.get(key)
    if value is None and not required:
        return None
    if value is None or not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        name = {str: "a string", dict: "an object", int: "an integer", list: "a list", bool: "true or false"}[kind]
        raise bad(f"'{key}' must be {name}" if key in block else f"'{key}' is required", where)
    return value


def _blocks(content: str | list[Block], where: str) -> list[tuple[str, Block, str]]:
    """(type, block, path) of each block; a string is one text block."""
    if isinstance(content, str):
        return [("text", {"type": "text", "text": content}, where)]
    if not content:
        raise bad("a message needs at least one content block", where)
    out = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(block, dict):
            raise bad("a content block must be an object with a 'type'", at)
        out.append((_field(block, "type", str, at), block, at))
    return out


def _text(block: Block, where: str) -> Block:
    return {"type": "text", "text": _field(block, "text", str, where)}


def _image(block: Block, where: str) -> Block:
    """An image block as the chat route's ``image_url`` part (the image pipeline decodes it)."""
    source = _field(block, "source", dict, where)
    kind = _field(source, "type", str, f"{where}.source")
    if kind == "base64":
        media = _field(source, "media_type", str, f"{where}.source")
        if media not in MEDIA_TYPES:
            raise bad(f"media_type must be one of {list(MEDIA_TYPES)}, got {media!r}", f"{where}.source.media_type")
        data = _field(source, "data", str, f"{where}.source")
        if not data:
            raise bad("'data' is empty", f"{where}.source.data")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if kind == "url":
        return {"type": "image_url", "image_url": {"url": _field(source, "url", str, f"{where}.source")}}
    raise bad(f"image source type {kind!r} is not supported; send a 'base64' source (or a 'url' source where "
              "the server allows image hosts)", f"{where}.source.type")


def _tool_result(block: Block, where: str, open_ids: dict[str, bool]) -> Block:
    """A ``tool_result`` block as a ``tool`` message; its id must answer a call of the latest assistant turn."""
    call_id = _field(block, "tool_use_id", str, where)
    if call_id not in open_ids:
        known = sorted(open_ids) or "none"
        raise bad(f"tool_use_id {call_id!r} names no tool_use block of the previous assistant message (its ids: "
                  f"{known})", f"{where}.tool_use_id")
    if open_ids[call_id]:
        raise bad(f"tool_use {call_id!r} already has a tool_result", f"{where}.tool_use_id")
    open_ids[call_id] = True
    content = block.get("content", "")
    if content is None or isinstance(content, str):
        parts = [{"type": "text", "text": content or ""}]
    elif isinstance(content, list):
        parts = []
        for kind, inner, at in _blocks(content, f"{where}.content") if content else []:
            if kind not in ("text", "image"):
                raise bad(f"a tool_result may hold text and image blocks, not {kind!r}", f"{at}.type")
            parts.append(_text(inner, at) if kind == "text" else _image(inner, at))
    else:
        raise bad("'content' must be a string or a list of text and image blocks", f"{where}.content")
    if _field(block, "is_error", bool, where, required=False):
        parts.insert(0, {"type": "text", "text": "Error:"})
    return {"role": "tool", "tool_call_id": call_id, "content": parts}


def _user(content: str | list[Block], where: str, open_ids: dict[str, bool]) -> list[Block]:
    """A user turn: runs of text and image blocks are user messages, each tool_result a tool message."""
    out: list[Block] = []
    parts: list[Block] = []
    for kind, block, at in _blocks(content, where):
        if kind == "text":
            parts.append(_text(block, at))
        elif kind == "image":
            parts.append(_image(block, at))
        elif kind == "tool_result":
            if parts:
                out.append({"role": "user", "content": parts})
                parts = []
            out.append(_tool_result(block, at, open_ids))
        elif kind in ("tool_use", "thinking", "redacted_thinking"):
            raise bad(f"a {kind} block belongs in an assistant message", f"{at}.type")
        else:
            raise bad(f"content block type {kind!r} is not supported (user messages: text, image, tool_result)",
                      f"{at}.type")
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def _tool_use(block: Block, where: str, ids: dict[str, bool]) -> Block:
    call_id = _field(block, "id", str, where)
    if not call_id or call_id in ids:
        raise bad(f"tool_use ids must be unique and non-empty, got {call_id!r}", f"{where}.id")
    ids[call_id] = False
    args = _field(block, "input", dict, where)
    return {"id": call_id, "type": "function",
            "function": {"name": _field(block, "name", str, where), "arguments": json.dumps(args, ensure_ascii=False)}}


def _assistant(content: str | list[Block], where: str) -> tuple[Block, dict[str, bool]]:
    """An assistant turn: text -> content, thinking -> reasoning, tool_use -> tool calls (with their ids)."""
    parts: list[Block] = []
    reasoning: list[str] = []
    calls: list[Block] = []
    ids: dict[str, bool] = {}
    for kind, block, at in _blocks(content, where):
        if kind == "text":
            parts.append(_text(block, at))
        elif kind == "thinking":
            _field(block, "signature", str, at)
            reasoning.append(_field(block, "thinking", str, at))
        elif kind == "tool_use":
            calls.append(_tool_use(block, at, ids))
        elif kind == "redacted_thinking":
            raise bad("redacted_thinking blocks are not supported (this server never writes them)", f"{at}.type")
        else:
            raise bad(f"content block type {kind!r} is not supported (assistant messages: text, thinking, "
                      "tool_use)", f"{at}.type")
    msg: Block = {"role": "assistant", "content": parts or None}
    if reasoning:
        msg["reasoning_content"] = "\n\n".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg, ids


def _conversation(body: CountTokensRequest) -> list[Block]:
    """``system`` and ``messages`` as chat messages; a trailing assistant message becomes a prefix."""
    out = _system(body.system)
    open_ids: dict[str, bool] = {}
    for i, m in enumerate(body.messages):
        if m.role == "user":
            out += _user(m.content, f"messages[{i}].content", open_ids)
        else:
            msg, open_ids = _assistant(m.content, f"messages[{i}].content")
            out.append(msg)
    last = out[-1]
    if last["role"] == "assistant":
        if last.get("tool_calls"):
            raise bad("the last message has tool_use blocks; answer them with tool_result blocks in a user message",
                      f"messages[{len(body.messages) - 1}]")
        last["prefix"] = True
    return out


def _system(system: str | list[Block] | None) -> list[Block]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    parts = []
    for kind, block, at in _blocks(system, "system") if system else []:
        if kind != "text":
            raise bad(f"system blocks must be text blocks, not {kind!r}", f"{at}.type")
        parts.append(_text(block, at))
    return [{"role": "system", "content": parts}] if parts else []


def _tools(tools: list[Block] | None) -> list[Block] | None:
    """Client tools as function tools; Anthropic's server tools (typed, e.g. web search) are refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        kind = tool.get("type") or "custom"
        if kind != "custom":
            raise bad(f"tool type {kind!r} is not supported; declare client tools with 'name', 'description' and "
                      "'input_schema'", f"{at}.type")
        name = _field(tool, "name", str, at)
        if not 1 <= len(name) <= 128:
            raise bad("a tool name is 1-128 characters", f"{at}.name")
        fn: Block = {"name": name, "parameters": _field(tool, "input_schema", dict, at)}
        description = _field(tool, "description", str, at, required=False)
        if description is not None:
            fn["description"] = description
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Block | None, tools: list[Block] | None, out: Block) -> None:
    """``tool_choice`` as the chat route's; ``disable_parallel_tool_use`` as ``parallel_tool_calls: false``
    (a named tool is one call anyway)."""
    if choice is None:
        return
    kind = _field(choice, "type", str, "tool_choice")
    names = [t["function"]["name"] for t in tools or ()]
    if kind in ("any", "tool") and not names:
        raise bad(f'tool_choice {{"type": "{kind}"}} needs tools', "tool_choice.type")
    if kind == "tool":
        name = _field(choice, "name", str, "tool_choice")
        if name not in names:
            raise bad(f"names the tool {name!r}, which is not among the tools {names}", "tool_choice.name")
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
        return
    if kind not in ("auto", "any", "none"):
        raise bad(f"tool_choice type must be one of 'auto', 'any', 'tool', 'none', got {kind!r}", "tool_choice.type")
    out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if kind != "none" and _field(choice, "disable_parallel_tool_use", bool, "tool_choice", required=False):
        out["parallel_tool_calls"] = False


def _thinking(body: CountTokensRequest, out: Block) -> None:
    """``thinking`` -> DS4 thinking mode and the reasoning budget; ``output_config`` -> effort and format."""
    cfg = body.output_config or {}
    effort = _field(cfg, "effort", str, "output_config", required=False)
    if effort is not None:
        if effort not in EFFORTS:
            raise bad(f"effort must be one of {list(EFFORTS)}, got {effort!r}", "output_config.effort")
        out["reasoning_effort"] = effort
    fmt = _field(cfg, "format", dict, "output_config", required=False)
    if fmt is not None:
        if fmt.get("type") != "json_schema":
            raise bad("format must be {\"type\": \"json_schema\", \"schema\": {...}}", "output_config.format.type")
        schema = _field(fmt, "schema", dict, "output_config.format")
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema,
                                                                         "strict": True}}
    if body.thinking is None:
        return
    kind = _field(body.thinking, "type", str, "thinking")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise bad(f"type must be 'enabled', 'adaptive' or 'disabled', got {kind!r}", "thinking.type")
    if body.thinking.get("display") == "omitted":
        raise bad("display 'omitted' is not supported: thinking is returned as written", "thinking.display")
    if kind == "disabled":
        if effort is not None:
            raise bad("an effort needs thinking, and thinking is disabled (DS4 writes the effort prompt only "
                      "in thinking mode)", "output_config.effort")
        out["thinking"] = {"type": "disabled"}
        return
    out["thinking"] = {"type": "enabled"}
    if body.messages[-1].role == "assistant":
        raise bad("thinking cannot be combined with a trailing assistant message (prefill)", "thinking")
    if kind == "enabled":
        budget = _field(body.thinking, "budget_tokens", int, "thinking")
        if budget < 1:
            raise bad("budget_tokens must be at least 1", "thinking.budget_tokens")
        if isinstance(body, MessagesRequest) and budget >= body.max_tokens:
            raise bad(f"budget_tokens ({budget}) must be less than max_tokens ({body.max_tokens})",
                      "thinking.budget_tokens")
        out["max_reasoning_tokens"] = budget


def _sampling(body: MessagesRequest, out: Block) -> None:
    out.update(max_tokens=body.max_tokens, stream=body.stream, temperature=body.temperature, top_p=body.top_p,
               top_k=body.top_k, stop=body.stop_sequences)
    user = _field(body.metadata or {}, "user_id", str, "metadata", required=False)
    if user is not None:
        if len(user) > 256:
            raise bad("user_id is at most 256 characters", "metadata.user_id")
        out["user"] = user


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completion request ``body`` means (a ``MessagesRequest`` also carries sampling)."""
    check_extra_fields(body)
    tools = _tools(body.tools)
    out: Block = {"model": body.model, "messages": _conversation(body), "tools": tools}
    _tool_choice(body.tool_choice, tools, out)
    _thinking(body, out)
    if isinstance(body, MessagesRequest):
        _sampling(body, out)
    try:
        return ChatCompletionRequest.model_validate(out)
    except ValidationError as exc:  # a value the chat route bounds tighter than the checks above
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        raise bad(err.get("msg", "invalid value"), where or None) from exc
