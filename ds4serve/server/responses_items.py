"""Responses ``instructions`` + ``input`` items -> the chat route's messages.

The Responses API spells a conversation as a flat list of items; the chat path (and so the DS4
encoder) wants messages. The mapping, one item at a time:

* a ``message`` item (``type`` may be left out) -> a message of its role (user, system, developer,
  assistant). Content is a string or parts: ``input_text`` / ``output_text`` (and an assistant's
  ``refusal``) are text, ``input_image`` is an ``image_url`` part (a ``data:`` URL, or an http(s) URL
  that the server's fetch policy allows). An assistant's text parts, and consecutive assistant
  message items, are joined into one turn's string: the model wrote them as one answer.
* ``function_call`` items -> ``tool_calls`` of one assistant message (joined to the assistant text just
  before them: DS4 writes the answer text, then the calls, in one turn).
* ``function_call_output`` -> a ``tool`` message for that ``call_id``, which an earlier
  ``function_call`` must have made (as OpenAI requires); every call needs its output.
* ``reasoning`` -> the ``reasoning_content`` of the assistant turn that follows it (its
  ``reasoning_text`` content, else its summary text), which the encoder keeps or drops exactly as it
  does for the chat route's history; encrypted content alone carries nothing and is ignored.
* ``instructions`` -> a system message first.

Anything else (``item_reference``: nothing is stored; hosted-tool items; files, audio, images by
``file_id``) is a 400 whose ``param`` is the item's path. ``ChatInput.sources`` keeps, for each chat
message, the item it came from, so an error the chat path raises names the Responses field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .protocol import APIError

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
DETAILS = ("auto", "low", "high", "original")


def bad(message: str, param: str, code: str = "invalid_parameter") -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class ChatInput:
    """The chat messages and, per message, the Responses path it came from (``input[3]``)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    calls: dict[str, str] = field(default_factory=dict)  # call_id -> the function_call item's path
    answered: set[str] = field(default_factory=set)  # call_ids with a function_call_output
    reasoning: str | None = None  # a reasoning item's text, waiting for its assistant turn
    open_assistant: bool = False  # the last message is an assistant turn more calls may join

    def add(self, message: dict[str, Any], source: str) -> None:
        self.messages.append(message)
        self.sources.append(source)
        self.open_assistant = message["role"] == "assistant"

    def assistant(self, source: str) -> dict[str, Any]:
        """The open assistant turn, or a new one carrying the pending reasoning."""
        if not self.open_assistant:
            msg: dict[str, Any] = {"role": "assistant", "content": None}
            if self.reasoning:
                msg["reasoning_content"] = self.reasoning
            self.add(msg, source)
        self.reasoning = None
        return self.messages[-1]


def chat_input(instructions: str | None, items: str | list[Any]) -> ChatInput:
    """The chat messages of a Responses request (raises the 400s of the module docstring)."""
    out = ChatInput()
    if instructions:
        out.add({"role": "system", "content": instructions}, "instructions")
    if isinstance(items, str):
        out.add({"role": "user", "content": items}, "input")
        return out
    for i, item in enumerate(items):
        _item(out, item, f"input[{i}]")
    missing = [(cid, path) for cid, path in out.calls.items() if cid not in out.answered]
    if missing:
        cid, path = missing[0]
        raise bad(f"{path}: no function_call_output item answers the function_call with call_id {cid!r}; send "
                  "the tool's output for every call", path)
    last = out.messages[-1] if out.messages else None
    if last is None or last["role"] not in ("user", "developer", "tool"):
        where = out.sources[-1] if out.messages else "input"
        raise bad("input must end with a user or developer message or a function_call_output item (the model "
                  "answers after it)", where)
    return out


def _item(out: ChatInput, item: Any, path: str) -> None:
    if not isinstance(item, dict):
        raise bad(f"{path} must be an object (a message or an item with a 'type')", path)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        _message(out, item, path)
    elif kind == "function_call":
        _function_call(out, item, path)
    elif kind == "function_call_output":
        _function_output(out, item, path)
    elif kind == "reasoning":
        out.open_assistant = False  # reasoning starts the next assistant turn
        out.reasoning = _reasoning_text(item, path) or None
    elif kind == "item_reference":
        raise bad(f"{path}: item_reference is not supported; this server is stateless (nothing is stored): send "
                  "the item itself", f"{path}.type", "unsupported_parameter")
    else:
        raise bad(f"{path}.type {kind!r} is not supported (supported: message, function_call, function_call_output, "
                  "reasoning)", f"{path}.type", "unsupported_parameter")


def _message(out: ChatInput, item: dict[str, Any], path: str) -> None:
    role = item.get("role")
    if role not in ROLES:
        raise bad(f"{path}.role must be one of {list(ROLES)}, got {role!r}", f"{path}.role")
    content = item.get("content")
    if role != "assistant":
        out.reasoning = None  # reasoning belongs to the assistant turn right after it
        out.add({"role": role, "content": _user_content(content, f"{path}.content", images=role == "user")}, path)
        return
    text = _assistant_text(content, f"{path}.content")
    msg = out.assistant(path)
    if msg.get("tool_calls"):  # text after calls starts a new turn (DS4 writes calls last)
        out.open_assistant = False
        msg = out.assistant(path)
    msg["content"] = (msg["content"] or "") + text


def _function_call(out: ChatInput, item: dict[str, Any], path: str) -> None:
    cid, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
    for key, value in (("call_id", cid), ("name", name), ("arguments", args)):
        if not isinstance(value, str) or (key != "arguments" and not value):
            raise bad(f"{path}.{key} must be a{' non-empty' if key != 'arguments' else ''} string", f"{path}.{key}")
    if cid in out.calls:
        raise bad(f"{path}.call_id {cid!r} is used by an earlier function_call ({out.calls[cid]})", f"{path}.call_id")
    if not _object_or_text(args):
        raise bad(f"{path}.arguments must encode a JSON object (it is JSON of another kind)", f"{path}.arguments")
    out.calls[cid] = path
    msg = out.assistant(path)
    msg.setdefault("tool_calls", []).append({"id": cid, "type": "function",
                                             "function": {"name": name, "arguments": args}})


def _object_or_text(arguments: str) -> bool:
    """Arguments the chat path renders: a JSON object, or text that is not JSON at all (the DS4
    reference takes that as one ``arguments`` string); other JSON (a list, a number) is refused."""
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return True


def _function_output(out: ChatInput, item: dict[str, Any], path: str) -> None:
    cid = item.get("call_id")
    if not isinstance(cid, str) or cid not in out.calls:
        raise bad(f"{path}.call_id {cid!r} answers no earlier function_call item in input", f"{path}.call_id")
    if cid in out.answered:
        raise bad(f"{path}: the function_call {cid!r} already has an output", f"{path}.call_id")
    out.answered.add(cid)
    out.reasoning = None
    content = item.get("output")
    out.add({"role": "tool", "tool_call_id": cid, "content": _user_content(content, f"{path}.output", images=True)},
            path)


def _reasoning_text(item: dict[str, Any], path: str) -> str:
    """The reasoning's own text (``content``), else its summary; either may be absent."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                  for p in parts):
            raise bad(f"{path}.{key} must be a list of {{\"type\": \"{kind}\", \"text\": ...}} parts", f"{path}.{key}")
        if parts:
            return ("" if key == "content" else "\n\n").join(p["text"] for p in parts)
    return ""


def _assistant_text(content: Any, path: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{path} must be a string or a list of output_text parts", path)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind not in (*TEXT_PARTS, "refusal"):
            raise bad(f"{path}[{j}].type {kind!r} is not supported in an assistant message (send output_text)",
                      f"{path}[{j}].type")
        if not isinstance(part.get(key), str):
            raise bad(f"{path}[{j}].{key} must be a string", f"{path}[{j}].{key}")
        texts.append(part[key])
    return "".join(texts)


def _user_content(content: Any, path: str, images: bool) -> str | list[dict[str, Any]]:
    """A string, or chat content parts (text, and images where ``images``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise bad(f"{path} must be a string or a non-empty list of content parts", path)
    return [_part(part, f"{path}[{j}]", images) for j, part in enumerate(content)]


def _part(part: Any, path: str, images: bool) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS:
        if not isinstance(part.get("text"), str):
            raise bad(f"{path}.text must be a string", f"{path}.text")
        return {"type": "text", "text": part["text"]}
    if kind == "input_image" and images:
        return _image(part, path)
    if kind == "input_image":
        raise bad(f"{path}: images go in user messages and function_call_output items only", f"{path}.type")
    if kind in ("input_file", "input_audio"):
        raise bad(f"{path}.type {kind!r} is not supported (this server reads text and images)", f"{path}.type",
                  "unsupported_parameter")
    raise bad(f"{path}.type {kind!r} is not supported (send input_text or input_image)", f"{path}.type")


def _image(part: dict[str, Any], path: str) -> dict[str, Any]:
    url, detail = part.get("image_url"), part.get("detail") or "auto"
    if part.get("file_id") is not None and url is None:
        raise bad(f"{path}.file_id: images by file id need the Files API, which this server does not have; send "
                  "image_url (a data: URL)", f"{path}.file_id", "unsupported_parameter")
    if not isinstance(url, str) or not url:
        raise bad(f"{path}.image_url must be a URL string (a data: URL, or http(s) where the server allows it)",
                  f"{path}.image_url")
    if detail not in DETAILS:
        raise bad(f"{path}.detail must be one of {list(DETAILS)}, got {detail!r}", f"{path}.detail")
    return {"type": "image_url", "image_url": {"url": url, "detail": detail}}
