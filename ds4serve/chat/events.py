"""Events of the DS4 output parser, and the fold that turns a stream of them into one message.

A streaming response sends each event as it comes; a non-streaming one is ``fold(all events)``.
Because both are built from the same events, the two can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Union


@dataclass(frozen=True)
class ReasoningDelta:
    """More reasoning text (``delta.reasoning_content`` / ``delta.reasoning``)."""
    text: str


@dataclass(frozen=True)
class ContentDelta:
    """More answer text (``delta.content``); never holds tool-call markup."""
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call began: ``delta.tool_calls[index]`` with ``id``, ``type`` and ``function.name``."""
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of ``function.arguments`` (a JSON object text, streamed in order)."""
    index: int
    arguments: str


@dataclass(frozen=True)
class ToolCallEnd:
    """The call's markup closed (``complete``) or the output ended inside it (arguments unfinished)."""
    index: int
    arguments: str
    complete: bool


Event = Union[ReasoningDelta, ContentDelta, ToolCallStart, ToolCallDelta, ToolCallEnd]


@dataclass
class ParsedOutput:
    """One assistant message, as the non-streaming response carries it."""
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI shape, in call order
    incomplete_calls: list[int] = field(default_factory=list)  # indices whose markup never closed

    def add(self, ev: Event) -> None:
        if isinstance(ev, ReasoningDelta):
            self.reasoning += ev.text
        elif isinstance(ev, ContentDelta):
            self.content += ev.text
        elif isinstance(ev, ToolCallStart):
            self.tool_calls.append({"id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": ""}})
        elif isinstance(ev, ToolCallDelta):
            self.tool_calls[ev.index]["function"]["arguments"] += ev.arguments
        elif isinstance(ev, ToolCallEnd) and not ev.complete:
            self.incomplete_calls.append(ev.index)


def fold(events: Iterable[Event]) -> ParsedOutput:
    """The message a sequence of events describes."""
    out = ParsedOutput()
    for ev in events:
        out.add(ev)
    return out


def merge(events: list[Event]) -> list[Event]:
    """Adjacent deltas of one kind joined, so one token's worth of text is one event."""
    out: list[Event] = []
    for ev in events:
        prev = out[-1] if out else None
        if isinstance(ev, (ReasoningDelta, ContentDelta)) and type(prev) is type(ev):
            out[-1] = type(ev)(prev.text + ev.text)  # type: ignore[union-attr]
        elif isinstance(ev, ToolCallDelta) and isinstance(prev, ToolCallDelta) and prev.index == ev.index:
            out[-1] = ToolCallDelta(ev.index, prev.arguments + ev.arguments)
        else:
            out.append(ev)
    return [ev for ev in out if not isinstance(ev, (ReasoningDelta, ContentDelta)) or ev.text]
