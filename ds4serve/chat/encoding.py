"""The DS4 chat encoding: OpenAI-style messages -> the prompt DeepSeek's reference encoder writes.

DeepSeek ships no Jinja template with DS4; the prompt is defined by ``encoding/encoding_dsv4.py``
in the checkpoint repository (its ``encoding/tests`` vectors are checked byte for byte in
``tests/test_chat_encoding.py``). This module is our own implementation of that contract::

    BOS [effort prefix] {system}[\\n\\n## Tools...][\\n\\n## Response Format...]
    <｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>     (chat mode)
    <｜User｜>{user}<｜Assistant｜><think>{reasoning}</think>{answer}[\\n\\n<｜DSML｜tool_calls>...]EOS

* ``tool`` messages have no role of their own: they become ``<tool_result>`` blocks of a user turn
  (consecutive tool and user messages merge into one turn, parts joined by a blank line), sorted
  by the order of the preceding assistant's ``tool_calls``.
* ``developer`` is a user turn that can carry tools; ``latest_reminder`` gets its own token.
* Thinking mode ends every turn that asks for an answer with ``<think>``, chat mode with
  ``</think>``. Earlier reasoning is dropped (``drop_thinking``), except after the last user turn,
  and never when tools are present; dropping also removes developer messages before the last user.
* ``reasoning_effort`` prefixes the first message in thinking mode (see ``dsml.EFFORT_PROMPTS``).
* Request-level ``tools`` / ``response_format`` go on the first message. The reference renders them
  only on a system or developer message, so when the conversation starts otherwise an empty system
  message is prepended to carry them (the prompt then starts ``BOS\\n\\n## Tools``).
* Image parts become ``<｜deepseek_image｜>``, one per image, joined with a blank line like text
  parts (the Vision-Exp encoder); the parts are returned in placeholder order.

Differences from the reference, all where it fails or silently garbles: unknown content-part
types, a non-object ``arguments`` and a literal image placeholder in text are a ``ChatFormatError``;
``None`` contents render as empty; dict ``arguments`` are accepted; images are collected after
dropping (the Vision-Exp copy also counts images of dropped developer messages).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from . import dsml
from .dsml import ASSISTANT, BOS, EOS, IMAGE, LATEST_REMINDER, THINK, THINK_END, USER, MarkupError
from .template import ChatFormatError

ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
IMAGE_TYPES = ("image_url", "image", "input_image")
EFFORTS = ("low", "high", "max")


@dataclass(frozen=True)
class Piece:
    """One run of the prompt. ``kind``: "special" (a special-token string), "markup" (template text),
    "user" (text a client sent: never matched against special tokens) or "image" (a placeholder)."""
    kind: str
    text: str
    image: dict[str, Any] | None = None


@dataclass
class EncodedChat:
    """The rendered prompt as pieces; ``text`` is what the reference encoder returns."""
    pieces: list[Piece] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces)

    @property
    def images(self) -> list[dict[str, Any]]:
        return [p.image for p in self.pieces if p.kind == "image"]


@dataclass(frozen=True)
class ChatOptions:
    """What changes the prompt besides the messages (``chat_template_kwargs`` in the API)."""
    thinking: bool = False
    reasoning_effort: str | None = None
    drop_thinking: bool = True
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    add_bos: bool = True
    effort_edition: str = dsml.DEFAULT_EFFORT_EDITION


def encode_chat(messages: list[dict[str, Any]], options: ChatOptions | None = None) -> EncodedChat:
    """Render ``messages`` as DS4 prompt pieces (raises ``ChatFormatError`` naming the field)."""
    opts = options or ChatOptions()
    _check_options(opts)
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must contain at least one message", "messages")
    turns = [_normalize(m, i) for i, m in enumerate(messages)]
    turns = _attach_request_fields(turns, opts)
    turns = _sort_tool_results(_merge_turns(turns))
    drop = opts.drop_thinking and not any(t.get("tools") for t in turns)
    if opts.thinking and drop:
        turns = _drop_earlier(turns)
    out = EncodedChat([Piece("special", BOS)] if opts.add_bos else [])
    last_user = _last_user_index(turns)
    for i in range(len(turns)):
        try:
            out.pieces.extend(_render_turn(i, turns, opts, drop, last_user))
        except MarkupError as exc:  # tools carried on a message (the reference's own input form)
            where = "tools" if turns[i].get("tools") is opts.tools else f"messages[{turns[i]['src']}].tools"
            raise ChatFormatError(f"{where}: {exc}", where) from None
    return out


def _check_options(opts: ChatOptions) -> None:
    table = dsml.EFFORT_PROMPTS.get(opts.effort_edition)
    if table is None:
        raise ChatFormatError(f"unknown effort edition {opts.effort_edition!r}", "effort_edition")
    if opts.reasoning_effort not in table:
        allowed = [k for k in table if k is not None]
        raise ChatFormatError(f"reasoning_effort must be one of {allowed}, got {opts.reasoning_effort!r}",
                              "reasoning_effort")
    if opts.tools is not None and not isinstance(opts.tools, list):
        raise ChatFormatError("tools must be a list", "tools")
    if opts.response_format is not None and not isinstance(opts.response_format, dict):
        raise ChatFormatError("response_format must be an object", "response_format")


# ---------------------------------------------------------------- normalizing the messages

def _normalize(m: Any, i: int) -> dict[str, Any]:
    """One message as an internal turn: ``blocks`` of ("text", s) / ("image", part), reasoning unified."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        role = m.get("role") if isinstance(m, dict) else None
        raise ChatFormatError(f"messages[{i}].role must be one of {list(ROLES)}, got {role!r}", f"messages[{i}].role")
    t: dict[str, Any] = {"role": m["role"], "src": i, "blocks": _blocks(m.get("content"), f"messages[{i}].content")}
    reasoning = m.get("reasoning_content", m.get("reasoning"))
    if reasoning is not None:
        if not isinstance(reasoning, str):
            where = f"messages[{i}].reasoning_content"
            raise ChatFormatError(f"{where} must be a string", where)
        _check_placeholder(reasoning, f"messages[{i}].reasoning_content")
        t["reasoning"] = reasoning
    for key in ("tools", "response_format", "tool_calls", "tool_call_id", "task", "wo_eos"):
        if m.get(key) is not None:
            t[key] = m[key]
    if m.get("prefix") is True and m["role"] == "assistant":
        t["wo_eos"] = True  # DeepSeek prefix completion: the text goes on, no end of sentence
    if "task" in t and t["task"] not in dsml.TASK_TOKENS:
        raise ChatFormatError(f"messages[{i}].task must be one of {list(dsml.TASK_TOKENS)}", f"messages[{i}].task")
    return t


def _blocks(content: Any, where: str) -> list[tuple[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        _check_placeholder(content, where)
        return [("text", content)]
    if not isinstance(content, list):
        raise ChatFormatError(f"{where} must be a string or a list of content parts", where)
    out: list[tuple[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text", ""), str):
            _check_placeholder(part.get("text", ""), f"{where}[{j}].text")
            out.append(("text", part.get("text", "")))
        elif kind in IMAGE_TYPES:
            out.append(("image", part))
        else:
            raise ChatFormatError(f"{where}[{j}].type {kind!r} is not supported (use text or image_url)",
                                  f"{where}[{j}].type")
    return out


def _check_placeholder(text: str, where: str) -> None:
    if IMAGE in text:
        raise ChatFormatError(f"{where} contains the reserved image placeholder {IMAGE!r}; send images as "
                              "image_url content parts instead", where)


def _attach_request_fields(turns: list[dict[str, Any]], opts: ChatOptions) -> list[dict[str, Any]]:
    """Put request-level tools / response_format on the first message (an empty system one if needed)."""
    extra = {}
    if opts.tools:
        extra["tools"] = opts.tools
    if opts.response_format and opts.response_format.get("type") != "text":
        extra["response_format"] = opts.response_format
    if not extra:
        return turns
    if any(k in t for t in turns for k in extra):
        raise ChatFormatError("tools / response_format are given both per request and on a message", "messages")
    if turns[0]["role"] not in ("system", "developer"):
        turns = [{"role": "system", "src": 0, "blocks": []}] + turns
    turns[0] = {**turns[0], **extra}
    return turns


def _merge_turns(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool results and consecutive user messages become one user turn (the reference's merge)."""
    merged: list[dict[str, Any]] = []
    for t in turns:
        prev = merged[-1] if merged else None
        if t["role"] == "tool":
            block = ("tool_result", {"id": t.get("tool_call_id", ""), "blocks": t["blocks"]})
            if prev is not None and prev["role"] == "user":
                prev["blocks"].append(block)
            else:
                merged.append({"role": "user", "src": t["src"], "blocks": [block]})
        elif t["role"] == "user" and prev is not None and prev["role"] == "user" and "task" not in prev:
            prev["blocks"].extend(t["blocks"] or [("text", "")])
        else:
            t = copy.copy(t)
            t["blocks"] = list(t["blocks"]) if t["role"] != "user" else (t["blocks"] or [("text", "")])
            merged.append(t)
    return merged


def _sort_tool_results(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Reorder each turn's tool results by the last assistant's call order (stable; unknown ids first)."""
    order: dict[str, int] = {}
    for t in turns:
        if t["role"] == "assistant" and t.get("tool_calls"):
            order = {c["id"]: k for k, c in enumerate(t["tool_calls"]) if isinstance(c, dict) and c.get("id")}
        elif t["role"] == "user" and order:
            slots = [k for k, b in enumerate(t["blocks"]) if b[0] == "tool_result"]
            if len(slots) > 1:
                ranked = sorted((t["blocks"][k] for k in slots), key=lambda b: order.get(b[1]["id"], 0))
                for k, b in zip(slots, ranked):
                    t["blocks"][k] = b
    return turns


def _last_user_index(turns: list[dict[str, Any]]) -> int:
    return max((i for i, t in enumerate(turns) if t["role"] in ("user", "developer")), default=-1)


def _drop_earlier(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Before the last user turn: assistants lose their reasoning, developer messages go."""
    last = _last_user_index(turns)
    out = []
    for i, t in enumerate(turns):
        if i >= last or t["role"] in ("user", "system", "latest_reminder"):
            out.append(t)
        elif t["role"] == "assistant":
            out.append({k: v for k, v in t.items() if k != "reasoning"})
    return out


# ---------------------------------------------------------------- rendering

def _joined(blocks: list[tuple[str, Any]]) -> list[Piece]:
    """Text and image blocks joined by a blank line, as the reference joins content parts."""
    out: list[Piece] = []
    for k, (kind, value) in enumerate(blocks):
        if k:
            out.append(Piece("markup", "\n\n"))
        if kind == "text":
            out.append(Piece("user", value))
        elif kind == "image":
            out.append(Piece("image", IMAGE, value))
        else:  # a tool result
            out.append(Piece("markup", "<tool_result>"))
            out.extend(_joined(value["blocks"]))
            out.append(Piece("markup", "</tool_result>"))
    return [p for p in out if p.text]


def _extras(t: dict[str, Any]) -> list[Piece]:
    out = []
    if t.get("tools"):
        head, schemas, tail = dsml.render_tools_parts(t["tools"])
        out += [Piece("markup", "\n\n" + head), Piece("user", schemas), Piece("markup", tail)]
    if t.get("response_format"):
        head, schema = dsml.render_response_format(t["response_format"])
        out += [Piece("markup", "\n\n" + head), Piece("user", schema)]
    return out


def _render_turn(i: int, turns: list[dict[str, Any]], opts: ChatOptions, drop: bool, last_user: int) -> list[Piece]:
    t, role = turns[i], turns[i]["role"]
    out: list[Piece] = []
    if i == 0 and opts.thinking:
        prefix = dsml.EFFORT_PROMPTS[opts.effort_edition][opts.reasoning_effort]
        if prefix:
            out.append(Piece("markup", prefix))
    if role == "system":
        out += _joined(t["blocks"]) + _extras(t)
    elif role == "developer":
        body = _joined(t["blocks"])
        if not body:
            raise ChatFormatError(f"messages[{t['src']}]: a developer message needs content", f"messages[{t['src']}]")
        out += [Piece("special", USER)] + body + _extras(t)
    elif role == "user":
        out += [Piece("special", USER)] + _joined(t["blocks"])
    elif role == "latest_reminder":
        out += [Piece("special", LATEST_REMINDER)] + _joined(t["blocks"])
    else:
        out += _render_assistant(i, turns, opts, drop, last_user)
    return out + _transition(i, turns, opts, drop, last_user)


def _render_assistant(i: int, turns: list[dict[str, Any]], opts: ChatOptions, drop: bool,
                      last_user: int) -> list[Piece]:
    t = turns[i]
    out: list[Piece] = []
    after_task = i > 0 and "task" in turns[i - 1]
    if opts.thinking and not after_task and (not drop or i > last_user):
        if t.get("reasoning"):
            out.append(Piece("user", t["reasoning"]))
        out.append(Piece("special", THINK_END))
    out += _joined(t["blocks"])
    if t.get("tool_calls"):
        if not isinstance(t["tool_calls"], list):
            raise ChatFormatError(f"messages[{t['src']}].tool_calls must be a list", f"messages[{t['src']}].tool_calls")
        try:
            out.append(Piece("user", dsml.render_tool_calls(t["tool_calls"], f"messages[{t['src']}].tool_calls")))
        except MarkupError as exc:
            raise ChatFormatError(str(exc), f"messages[{t['src']}].tool_calls") from None
    if not t.get("wo_eos"):
        out.append(Piece("special", EOS))
    return out


def _transition(i: int, turns: list[dict[str, Any]], opts: ChatOptions, drop: bool, last_user: int) -> list[Piece]:
    """What follows a turn when the next one is the model's (or there is none): the generation prompt."""
    if i + 1 < len(turns) and turns[i + 1]["role"] not in ("assistant", "latest_reminder"):
        return []
    t = turns[i]
    if "task" in t:
        token = Piece("special", dsml.TASK_TOKENS[t["task"]])
        if t["task"] != "action":
            return [token]
        return [Piece("special", ASSISTANT), Piece("special", THINK if opts.thinking else THINK_END), token]
    if t["role"] not in ("user", "developer"):
        return []
    think = opts.thinking and (not drop or i >= last_user)
    return [Piece("special", ASSISTANT), Piece("special", THINK if think else THINK_END)]
