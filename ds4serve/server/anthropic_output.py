"""The chat route's output events -> Anthropic content blocks, stream events and the final message.

``BlockWriter`` turns a choice's parsed DS4 output events (reasoning, content, tool calls; the same
events the chat route sends as deltas) into Anthropic content-block events: a block starts when the
kind of output changes (thinking -> text -> tool_use), gets its deltas (``thinking_delta``,
``text_delta``, ``input_json_delta``) and stops when the next one starts or the output ends. A
streaming answer sends those events; a non-streaming one is the writer's ``blocks``, built by the
same calls, so the two cannot disagree.

A thinking block ends with a ``signature_delta`` (the SDK's ``ThinkingBlock`` requires one): an
opaque digest of the text, which the server accepts back without checking (nothing to prove for an
open model). A tool_use block's ``input`` is its arguments parsed as JSON; a call cut off by
``max_tokens`` gets what the partial JSON holds (the SDK's own stream reader parses it the same way),
and the ``stop_reason`` says ``max_tokens``.

Usage follows Anthropic: ``input_tokens`` are the prompt tokens not read from the prefix cache and
``cache_read_input_tokens`` those that were, so their sum is the prompt (``count_tokens``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic_core import from_json

from ..chat import ContentDelta, Event, ReasoningDelta, ToolCallDelta, ToolCallEnd, ToolCallStart
from .frames import ChoiceStep

Block = dict[str, Any]


def signature(thinking: str) -> str:
    """The opaque ``signature`` of a thinking block (a digest of its text)."""
    return "ds4-" + hashlib.sha256(thinking.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def parse_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as the ``input`` object; partial JSON gives what it holds so far."""
    try:
        value = from_json(arguments, allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class BlockWriter:
    """One choice's output as Anthropic content blocks (``blocks``) and content-block stream events."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self._open: str | None = None  # the type of the block still open
        self._args = ""  # the open tool_use block's arguments so far

    def feed(self, events: tuple[Event, ...]) -> list[Block]:
        """The stream events of these output events."""
        out: list[Block] = []
        for ev in events:
            if isinstance(ev, ReasoningDelta) and ev.text:
                out += self._ensure("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                self.blocks[-1]["thinking"] += ev.text
                out.append(self._delta({"type": "thinking_delta", "thinking": ev.text}))
            elif isinstance(ev, ContentDelta) and ev.text:
                out += self._ensure("text", {"type": "text", "text": ""})
                self.blocks[-1]["text"] += ev.text
                out.append(self._delta({"type": "text_delta", "text": ev.text}))
            elif isinstance(ev, ToolCallStart):
                out += self.close()
                out += self._start("tool_use", {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
            elif isinstance(ev, ToolCallDelta) and self._open == "tool_use" and ev.arguments:
                self._args += ev.arguments
                out.append(self._delta({"type": "input_json_delta", "partial_json": ev.arguments}))
            elif isinstance(ev, ToolCallEnd) and self._open == "tool_use":
                out += self.close()
        return out

    def close(self) -> list[Block]:
        """Stop the open block (a thinking block first gets its signature); nothing when none is open."""
        if self._open is None:
            return []
        out: list[Block] = []
        block = self.blocks[-1]
        if self._open == "thinking":
            block["signature"] = signature(block["thinking"])
            out.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        elif self._open == "tool_use":
            block["input"] = parse_input(self._args)
            self._args = ""
        self._open = None
        return out + [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _ensure(self, kind: str, empty: Block) -> list[Block]:
        return [] if self._open == kind else self.close() + self._start(kind, empty)

    def _start(self, kind: str, block: Block) -> list[Block]:
        self._open = kind
        self.blocks.append(block)
        return [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _delta(self, delta: Block) -> Block:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}


def stop_reason(ev: ChoiceStep) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) of a choice's last event."""
    if ev.finish_reason == "tool_calls":
        return "tool_use", None
    if ev.finish_reason == "length":
        return "max_tokens", None
    if ev.finish_reason == "stop" and ev.stop is not None:
        return "stop_sequence", ev.stop
    return "end_turn", None


def usage(prompt_tokens: int, cached: int, output_tokens: int, thinking_tokens: int) -> Block:
    """Anthropic's ``usage`` (``input_tokens`` + ``cache_read_input_tokens`` = the prompt)."""
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens_details": {"thinking_tokens": thinking_tokens}}


def message(msg_id: str, model: str, content: list[Block], reason: str | None, stop_seq: str | None,
            use: Block) -> Block:
    """The ``Message`` object (``message_start`` carries it with no content and no stop reason yet)."""
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": stop_seq, "usage": use}


def sse(event: Block) -> str:
    """One SSE frame: Anthropic names every event (``event:``) and repeats the name as ``type``."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
