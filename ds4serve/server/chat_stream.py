"""One chat choice's tokens -> DS4 output events -> OpenAI deltas and the final message.

Every token is decoded with special tokens kept and handed to ``chat.OutputParser`` with its id,
so ``</think>`` and EOS are recognised by id, never by text, and ``｜DSML｜`` markup becomes
``tool_calls`` without reaching ``content``. A stream sends each event as a delta; a non-streaming
answer folds the same events (``chat.fold``), so the two cannot disagree.

Stop strings are matched in the decoded text of ordinary tokens (reasoning, content and markup
alike); a special token such as ``</think>`` ends any partial match, because the text on either
side of it goes to different fields.

If the output stops inside the reasoning (``max_tokens``, a stop string, or EOS before
``</think>``), everything stays in ``reasoning_content``, ``content`` is empty and the finish
reason is the engine's: the parser's ``stopped_in_reasoning`` rule, the same for both answers.
"""

from __future__ import annotations

from typing import Any

from ..chat import (ContentDelta, Event, IncrementalDetokenizer, OutputParser, ParsedOutput, ReasoningDelta,
                    StopMatcher, Tokenizer, ToolCallDelta, ToolCallEnd, ToolCallStart)
from ..chat.events import merge
from .chat_request import ChatSetup


class ChatChoice:
    """Detokenizer, stop strings and output parser of one chat choice."""

    def __init__(self, tok: Tokenizer, setup: ChatSetup, stops: list[str], skip_special: bool):
        silent = set(tok.special_ids) | (set(tok.added_ids) if skip_special else set())
        self.think_end = tok.think_end_id
        self.parser = OutputParser(thinking=setup.parse_thinking, think_end_id=tok.think_end_id, eos_ids=(),
                                   silent_ids=silent)
        self.by_id = silent | {tok.think_end_id}  # tokens the parser reads by id, not by text
        self.detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
        self.stops = StopMatcher(stops)
        self.keep_calls = setup.keep_tool_calls
        self.reasoning_tokens = 0

    @property
    def stopped(self) -> bool:
        """A stop string matched: the engine request should end."""
        return self.stops.stopped

    def feed(self, ids: list[int], finished: bool) -> list[Event]:
        """Events of these tokens; ``finished``: the engine ended the output with them."""
        events: list[Event] = []
        for t in ids:
            if self.stops.stopped:
                break
            if self.parser.in_reasoning and t != self.think_end:
                self.reasoning_tokens += 1
            piece = self.detok.push([t])
            if t in self.by_id:
                events += self.parser.feed_text(self.stops.flush())
                events += self.parser.feed(t, piece)
            else:
                events += self.parser.feed_text(self.stops.feed(piece))
        if self.stops.stopped or finished:
            if not self.stops.stopped:
                events += self.parser.feed_text(self.stops.feed(self.detok.flush()) + self.stops.flush())
            events += self.parser.finish()
        return [ev for ev in merge(events) if self.keep_calls or isinstance(ev, (ReasoningDelta, ContentDelta))]

    def finish_reason(self, engine_reason: str) -> str:
        """``tool_calls`` when the model ended after a complete call it may make, else the engine's."""
        return self.parser.finish_reason(engine_reason) if self.keep_calls else engine_reason


def delta_of(ev: Event) -> dict[str, Any] | None:
    """The ``choices[i].delta`` one event becomes (None: nothing to send)."""
    if isinstance(ev, ReasoningDelta):
        return {"reasoning_content": ev.text, "reasoning": ev.text}
    if isinstance(ev, ContentDelta):
        return {"content": ev.text}
    if isinstance(ev, ToolCallStart):
        return {"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                "function": {"name": ev.name, "arguments": ""}}]}
    if isinstance(ev, ToolCallDelta):
        return {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.arguments}}]}
    assert isinstance(ev, ToolCallEnd)
    return None


def deltas_of(events: tuple[Event, ...], first: bool) -> list[dict[str, Any]]:
    """The deltas of one engine step; the choice's first one also carries the role."""
    out = [d for d in map(delta_of, events) if d is not None]
    if first:
        head = out[0] if out else {"content": ""}
        out[:1] = [{"role": "assistant", **head}]
    return out


def message_of(parsed: ParsedOutput) -> dict[str, Any]:
    """``choices[i].message`` of a non-streaming answer (content is null beside tool calls only)."""
    msg: dict[str, Any] = {"role": "assistant",
                           "content": parsed.content if parsed.content or not parsed.tool_calls else None,
                           "refusal": None,  # required (nullable) by OpenAI's ChatCompletionResponseMessage
                           "reasoning_content": parsed.reasoning or None, "reasoning": parsed.reasoning or None}
    if parsed.tool_calls:
        msg["tool_calls"] = [dict(c, function=dict(c["function"])) for c in parsed.tool_calls]
    return msg
