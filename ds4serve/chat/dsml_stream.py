"""Incremental reader of ``｜DSML｜`` tool-call markup inside the answer text.

The model writes (``encode_messages`` renders history the same way)::

    answer text\\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

Text is read character by character, so the result never depends on how the text was split into
tokens or chunks. Anything that could still become ``<｜DSML｜`` or ``</｜DSML｜`` is held back
until it is decided, and whitespace before a tool-call block belongs to the markup (the reference
ends the answer at ``\\n\\n<｜DSML｜tool_calls``), so markup never reaches the answer text. Arguments
are the reference's JSON: ``{"city": "Paris", "days": 3}``; string values stream as they arrive,
other values are checked as JSON when they close (text that is not JSON is sent as a string).

Malformed markup never raises: a stray tag in the answer is dropped; inside a block, everything up
to ``</｜DSML｜tool_calls>`` is dropped and an open call ends incomplete (``malformed`` is set).
"""

from __future__ import annotations

import json
import re
from typing import Callable

from .dsml import DSML, TOOL_CALLS_CLOSE, to_json
from .events import ContentDelta, Event, ToolCallDelta, ToolCallEnd, ToolCallStart

OPEN, CLOSE = f"<{DSML}", f"</{DSML}"
PARAM_CLOSE = f"</{DSML}parameter>"
MAX_TAG = 1024  # a tag longer than this is not markup the model meant
_TAG = re.compile(r'<(/?)' + DSML + r'([A-Za-z_]+)((?:\s+[A-Za-z_]+="[^"]*")*)\s*>')
_ATTR = re.compile(r'([A-Za-z_]+)="([^"]*)"')


def _json_value(raw: str) -> str | None:
    """``raw`` if it is strict JSON (no NaN/Infinity), else None."""
    def reject(_: str) -> None:
        raise ValueError
    try:
        json.loads(raw, parse_constant=reject)
    except ValueError:
        return None
    return raw


class DsmlScanner:
    """Feeds answer text; emits content deltas and tool-call events (see the module docstring)."""

    def __init__(self, id_factory: Callable[[int], str]):
        self._new_id = id_factory
        self.where = "text"  # text | block | invoke | value | broken
        self.ws = ""  # whitespace held at the end of the answer text
        self.tag = ""  # held text that is, or may become, a DSML tag
        self.tail = ""  # in "broken": the last characters, to find the block's end
        self.calls: list[dict] = []  # {"args": str, "open": bool}
        self.param: dict | None = None  # {"name", "kind": "string"|"json"|"auto", "raw": str}
        self.malformed = False
        self._out: list[Event] = []
        self._content = ""  # answer text ready to send
        self._guard = ""  # answer text that, with what follows, could still spell an opener

    # ------------------------------------------------------------ driving

    def feed(self, text: str) -> list[Event]:
        if self.where == "text" and not self.tag and not self._guard and "<" not in text:
            body = text.rstrip()  # fast path, same result as the loop: no "<", nothing to hold but spaces
            if body:
                self._content += self.ws + body
                self.ws = ""
            self.ws += text[len(body):]
            return self._drain()
        for c in text:
            self._step(c)
        return self._drain()

    def finish(self) -> list[Event]:
        """End of output: held answer text is released, open markup ends incomplete."""
        if self.where == "text":
            if self.tag.startswith(OPEN) or self.tag.startswith(CLOSE):
                self.malformed = True  # the output ended inside a tag: dropped
            else:
                self._text(self.ws + self.tag)  # a prefix of a tag only: plain text
        elif self.where == "value" and self.param is not None:
            self._value(self.tag)
            self._flush_value()
        self.ws = self.tag = ""
        if self.calls and self.calls[-1]["open"]:
            self._end_call(complete=False)
        self._content += self._guard  # held across any markup, released only now
        self.where, self._guard = "text", ""
        return self._drain()

    def _drain(self) -> list[Event]:
        if self.where == "value":
            self._flush_value()
        if self._content:
            self._out.append(ContentDelta(self._content))
        out, self._out, self._content = self._out, [], ""
        return out

    def _text(self, text: str) -> None:
        """Answer text out, guarded: a tag dropped between ``<`` and ``｜DSML｜`` must not leave the
        two to spell an opener, so any opener the answer text would contain is removed too."""
        for c in text:
            self._guard += c
            while self._guard and not (OPEN.startswith(self._guard) or CLOSE.startswith(self._guard)):
                self._content += self._guard[0]
                self._guard = self._guard[1:]
            if self._guard in (OPEN, CLOSE):  # keep the "<" / "</": it can never join what went before
                self._guard, self.malformed = self._guard[:-len(DSML)], True

    def _emit(self, ev: Event) -> None:
        if self._content:
            self._out.append(ContentDelta(self._content))
            self._content = ""
        self._out.append(ev)

    def _step(self, c: str) -> None:
        if self.where == "value":
            self._step_value(c)
        elif self.where == "broken":
            self.tail = (self.tail + c)[-len(TOOL_CALLS_CLOSE):]
            if self.tail == TOOL_CALLS_CLOSE:
                self.where, self.tail = "text", ""
        elif self.tag.startswith(OPEN) or self.tag.startswith(CLOSE):
            self._step_tag(c)
        else:
            self._step_plain(c)

    # ------------------------------------------------------------ lexing

    def _step_plain(self, c: str) -> None:
        """Answer text, or the whitespace between tags of a block."""
        if self.tag:
            cand = self.tag + c
            if OPEN.startswith(cand) or CLOSE.startswith(cand):
                self.tag = cand
                if cand in (OPEN, CLOSE) and self.where == "text":
                    self.ws = ""  # the blank line before markup is the markup's
                return
            held, self.tag = self.tag, ""
            if self.where != "text":
                self._break()
                for ch in held + c:  # the block's end may start inside what was held
                    self._step(ch)
                return
            self._text(self.ws + held)
            self.ws = ""
        if c == "<":
            self.tag = "<"
        elif self.where != "text":
            if not c.isspace():
                self._break()
        elif c.isspace():
            self.ws += c
        else:
            self._text(self.ws + c)
            self.ws = ""

    def _step_tag(self, c: str) -> None:
        """Inside ``<｜DSML｜...``: read to ``>``, then act on the tag."""
        if c == ">":
            tag, self.tag = self.tag + c, ""
            return self._on_tag(tag)
        if c in "<\n" or len(self.tag) >= MAX_TAG:
            self.tag = ""
            self._bad_tag()
            return self._step(c)
        self.tag += c

    def _step_value(self, c: str) -> None:
        """A parameter value: everything up to ``</｜DSML｜parameter>``."""
        if self.tag:
            cand = self.tag + c
            if PARAM_CLOSE.startswith(cand):
                self.tag = cand
                if cand == PARAM_CLOSE:
                    self.tag = ""
                    self._close_param()
                return
            self._value(self.tag)
            self.tag = ""
        if c == "<":
            self.tag = "<"
        else:
            self._value(c)

    # ------------------------------------------------------------ structure

    def _on_tag(self, tag: str) -> None:
        m = _TAG.fullmatch(tag)
        if m is None:
            return self._bad_tag()
        closing, name, attrs = m.group(1) == "/", m.group(2), dict(_ATTR.findall(m.group(3)))
        key = (self.where, closing, name)
        if key in (("text", False, "tool_calls"), ("invoke", True, "invoke")):
            if self.where == "invoke":
                self._end_call(complete=True)
            self.where = "block"
        elif not closing and name == "invoke" and self.where in ("text", "block", "invoke") and "name" in attrs:
            if self.where == "invoke":  # the model forgot </invoke>: the call is still whole
                self._end_call(complete=True)
            self._start_call(attrs["name"])
        elif key == ("invoke", False, "parameter") and "name" in attrs:
            self._open_param(attrs["name"], attrs.get("string"))
        elif closing and name == "tool_calls" and self.where in ("block", "invoke"):
            if self.where == "invoke":
                self._end_call(complete=True)
            self.where = "text"
        else:
            self._bad_tag()

    def _bad_tag(self) -> None:
        """A tag that does not fit: dropped in the answer, breaks the block inside one."""
        self.malformed = True
        if self.where != "text":
            self._break()

    def _break(self) -> None:
        self.malformed = True
        self.tag = ""
        if self.calls and self.calls[-1]["open"]:
            self._end_call(complete=False)
        self.param = None
        self.where, self.tail = "broken", ""

    def _start_call(self, name: str) -> None:
        index = len(self.calls)
        self.calls.append({"args": "", "open": True, "n": 0})
        self._emit(ToolCallStart(index, self._new_id(index), name))
        self._args("{")
        self.where = "invoke"

    def _end_call(self, complete: bool) -> None:
        call = self.calls[-1]
        if complete:
            self._args("}")
        call["open"] = False
        self._emit(ToolCallEnd(len(self.calls) - 1, call["args"], complete))

    def _args(self, piece: str) -> None:
        if piece:
            self.calls[-1]["args"] += piece
            self._emit(ToolCallDelta(len(self.calls) - 1, piece))

    def _open_param(self, name: str, string: str | None) -> None:
        call = self.calls[-1]
        sep = ", " if call["n"] else ""
        call["n"] += 1
        kind = {"true": "string", "false": "json"}.get(string or "", "auto")
        self.param = {"name": name, "kind": kind, "raw": "", "prefix": sep + to_json(name) + ": "}
        if kind == "string":
            self._args(self.param["prefix"] + '"')
        self.where = "value"

    def _value(self, text: str) -> None:
        if text and self.param is not None:
            self.param["raw"] += text

    def _flush_value(self) -> None:
        """String values stream: send what arrived so far (JSON escaping is per character)."""
        p = self.param
        if p is not None and p["kind"] == "string" and p["raw"]:
            self._args(to_json(p["raw"])[1:-1])
            p["raw"] = ""

    def _close_param(self) -> None:
        p = self.param
        assert p is not None
        if p["kind"] == "string":
            self._flush_value()
            self._args('"')
        else:
            value = _json_value(p["raw"])
            self._args(p["prefix"] + (value if value is not None else to_json(p["raw"])))
        self.param = None
        self.where = "invoke"
