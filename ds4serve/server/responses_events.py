"""DS4 output events (reasoning, text, tool calls) -> Responses output items and stream events.

One ``ResponseBuilder`` per request is fed the chat path's parsed output events
(``chat.ReasoningDelta`` / ``ContentDelta`` / ``ToolCall*``) in order and keeps the output items; a
stream sends every event it returns, a plain answer ignores them and returns the final ``response``,
so the two are built by the same code and cannot disagree. The items, in the order DS4 writes them:

* ``reasoning`` (thinking mode): the raw reasoning as ``content`` ``[{"type": "reasoning_text"}]``,
  streamed as ``response.reasoning_text.delta``. DS4 writes no separate summary; a request with
  ``reasoning.summary`` gets the same text as its summary too (``response.reasoning_summary_*``
  events once the reasoning is complete). Send the item back in ``input`` and its text is the turn's
  reasoning again.
* ``message``: the answer as one ``output_text`` part (``response.output_text.delta``). A completed
  response without text or calls still has one (empty) message, as a chat answer has ``content: ""``.
* ``function_call`` per tool call: ``call_id``, ``name`` and ``arguments`` (a JSON string, streamed
  as ``response.function_call_arguments.delta``).

Every event carries ``sequence_number`` (0, 1, 2... per response). ``max_output_tokens`` reached:
the item being written is ``incomplete`` (a cut call's arguments are not whole JSON), the response
is ``incomplete`` with ``incomplete_details.reason: "max_output_tokens"`` and ends with
``response.incomplete``; otherwise ``response.completed``. A failure mid-stream is an ``error`` event
followed by ``response.failed``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..chat import ContentDelta, Event, ReasoningDelta, ToolCallDelta, ToolCallEnd, ToolCallStart
from .responses_output import Echo, response_object

PREFIX = {"reasoning": "rs_", "message": "msg_", "function_call": "fc_"}


@dataclass
class Item:
    """One output item being written (its text: reasoning, answer or arguments)."""

    kind: str  # "reasoning" | "message" | "function_call"
    index: int  # output_index
    id: str
    text: str = ""
    call_id: str = ""
    name: str = ""
    status: str = "in_progress"

    def view(self, summary: bool = False) -> dict[str, Any]:
        """The item as the API shows it now (``summary``: a reasoning item repeats its text there)."""
        base: dict[str, Any] = {"id": self.id, "type": self.kind, "status": self.status}
        shown = self.status != "in_progress" or bool(self.text)  # a new item has no parts yet
        if self.kind == "message":
            return {**base, "role": "assistant", "content": [text_part(self.text)] if shown else []}
        if self.kind == "reasoning":
            done = self.status != "in_progress"
            return {**base, "summary": [{"type": "summary_text", "text": self.text}] if summary and done else [],
                    "content": [{"type": "reasoning_text", "text": self.text}] if shown else []}
        return {**base, "call_id": self.call_id, "name": self.name, "arguments": self.text}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseBuilder:
    """The output items and stream events of one response (module docstring)."""

    def __init__(self, echo: Echo, response_id: str):
        self.echo, self.id = echo, response_id
        self.created = int(time.time())
        self.items: list[Item] = []
        self.open: Item | None = None
        self.seq = 0

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def snapshot(self, status: str, usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The ``response`` object as it stands."""
        output = [it.view(self.echo.summary) for it in self.items]
        return response_object(self.echo, self.id, self.created, status, output, usage, error)

    def start(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        snap = self.snapshot("in_progress")
        return [self._event("response.created", response=snap), self._event("response.in_progress", response=snap)]

    def feed(self, ev: Event) -> list[dict[str, Any]]:
        """The stream events of one parsed output event."""
        if isinstance(ev, ReasoningDelta):
            out, item = self._ensure("reasoning")
            item.text += ev.text
            return out + [self._event("response.reasoning_text.delta", item_id=item.id, output_index=item.index,
                                      content_index=0, delta=ev.text)]
        if isinstance(ev, ContentDelta):
            out, item = self._ensure("message")
            item.text += ev.text
            return out + [self._event("response.output_text.delta", item_id=item.id, output_index=item.index,
                                      content_index=0, delta=ev.text, logprobs=[])]
        if isinstance(ev, ToolCallStart):
            out = self._close("completed")
            item = self._add("function_call")
            item.call_id, item.name = ev.id, ev.name
            return out + [self._event("response.output_item.added", output_index=item.index, item=item.view())]
        if isinstance(ev, ToolCallDelta) and self.open is not None:
            self.open.text += ev.arguments
            return [self._event("response.function_call_arguments.delta", item_id=self.open.id,
                                output_index=self.open.index, delta=ev.arguments)]
        if isinstance(ev, ToolCallEnd):
            return self._close("completed" if ev.complete else "incomplete")
        return []

    def finish(self, finish_reason: str, usage: dict[str, Any]) -> list[dict[str, Any]]:
        """Close the last item and end the response (``length``: incomplete, else completed)."""
        status = "incomplete" if finish_reason == "length" else "completed"
        out = self._close(status)
        if status == "completed" and not any(it.kind != "reasoning" for it in self.items):
            out += self._ensure("message")[0] + self._close("completed")
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + [self._event(kind, response=self.snapshot(status, usage))]

    def fail(self, message: str, code: str) -> list[dict[str, Any]]:
        """An ``error`` event, then ``response.failed`` (the items so far stay as they are)."""
        error = {"code": "server_error", "message": message}
        return [self._event("error", code=code, message=message, param=None),
                self._event("response.failed", response=self.snapshot("failed", error=error))]

    def _add(self, kind: str) -> Item:
        item = Item(kind, len(self.items), PREFIX[kind] + uuid.uuid4().hex)
        self.items.append(item)
        self.open = item
        return item

    def _ensure(self, kind: str) -> tuple[list[dict[str, Any]], Item]:
        """The open item of ``kind``, opening it (and closing the one before) if needed."""
        if self.open is not None and self.open.kind == kind:
            return [], self.open
        out = self._close("completed")
        item = self._add(kind)
        out.append(self._event("response.output_item.added", output_index=item.index, item=item.view()))
        part = text_part("") if kind == "message" else {"type": "reasoning_text", "text": ""}
        out.append(self._event("response.content_part.added", item_id=item.id, output_index=item.index,
                               content_index=0, part=part))
        return out, item

    def _close(self, status: str) -> list[dict[str, Any]]:
        """The events that finish the open item, which then has ``status``."""
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = status
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call":
            out = [self._event("response.function_call_arguments.done", **where, arguments=item.text)]
        elif item.kind == "message":
            out = [self._event("response.output_text.done", **where, content_index=0, text=item.text, logprobs=[]),
                   self._event("response.content_part.done", **where, content_index=0, part=text_part(item.text))]
        else:
            part = {"type": "reasoning_text", "text": item.text}
            out = [self._event("response.reasoning_text.done", **where, content_index=0, text=item.text),
                   self._event("response.content_part.done", **where, content_index=0, part=part)]
            out += self._summary(item) if self.echo.summary else []
        return out + [self._event("response.output_item.done", output_index=item.index,
                                  item=item.view(self.echo.summary))]

    def _summary(self, item: Item) -> list[dict[str, Any]]:
        """The reasoning as its one summary part (DS4 writes no other summary)."""
        where = {"item_id": item.id, "output_index": item.index, "summary_index": 0}
        part = {"type": "summary_text", "text": item.text}
        return [self._event("response.reasoning_summary_part.added", **where, part={**part, "text": ""}),
                self._event("response.reasoning_summary_text.delta", **where, delta=item.text),
                self._event("response.reasoning_summary_text.done", **where, text=item.text),
                self._event("response.reasoning_summary_part.done", **where, part=part)]
