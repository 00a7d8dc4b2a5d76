"""DS4 output -> reasoning, answer text and OpenAI tool calls, token by token.

State switches are driven by token *ids*, never by text: in thinking mode everything is reasoning
until the ``</think>`` token, then answer; the end-of-sentence token ends the output and its text is
never shown. A user-visible ``"</think>"`` spelled by ordinary tokens therefore stays text, in the
reasoning or the answer. Tool-call markup (``｜DSML｜``, several ordinary tokens in the DS4 vocabulary,
possibly one token elsewhere) is recognised in the text, and only in the answer, by
``dsml_stream.DsmlScanner``; it never reaches the answer text.

Feed ``(token_id, text)`` pairs where ``text`` is that token's share of the decoded output,
**decoded with special tokens kept** (``skip_special_tokens=False``): a vocabulary that spells DSML
with special tokens would otherwise lose the markup and leak its remains. The parser drops the text
of the special tokens it is told about (BOS, role markers, ``<think>``...) itself.

If the output ends while still in reasoning (no ``</think>`` token: ``max_tokens``, a stop string,
or EOS straight from the reasoning), ``stopped_in_reasoning`` is set; the text stays reasoning and
the answer is empty. The server reports this one way, whatever ended the output.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Callable, Iterable, Sequence

from .detok import IncrementalDetokenizer
from .dsml_stream import DsmlScanner
from .events import Event, ParsedOutput, ReasoningDelta, fold, merge


def random_call_id(_: int) -> str:
    """OpenAI-looking tool call ids (``call_`` + 24 hex)."""
    return "call_" + uuid.uuid4().hex[:24]


class OutputParser:
    """One request's output. ``feed`` per token, ``finish`` once at the end; both return events."""

    def __init__(self, *, thinking: bool, think_end_id: int | None, eos_ids: Iterable[int] = (),
                 silent_ids: Iterable[int] = (), id_factory: Callable[[int], str] = random_call_id):
        if thinking and think_end_id is None:
            raise ValueError("thinking mode needs the vocabulary's </think> token id")
        self.thinking = thinking
        self.think_end_id = think_end_id
        self.eos_ids = frozenset(eos_ids)
        self.silent_ids = frozenset(silent_ids) | ({think_end_id} if think_end_id is not None else set())
        self.in_reasoning = thinking
        self.saw_eos = False
        self.stopped_in_reasoning = False
        self.finished = False
        self._scanner = DsmlScanner(id_factory)
        self._summary = ParsedOutput()

    @classmethod
    def for_tokenizer(cls, tok, *, thinking: bool, id_factory: Callable[[int], str] = random_call_id) -> "OutputParser":
        """A parser with the ids of ``tok`` (a ``chat.Tokenizer``)."""
        return cls(thinking=thinking, think_end_id=tok.think_end_id, eos_ids=(tok.eos_id,),
                   silent_ids=tok.special_ids, id_factory=id_factory)

    def feed(self, token_id: int, text: str) -> list[Event]:
        """Events this token completes (often none while markup is being held back)."""
        if self.finished:
            return []
        if token_id in self.eos_ids:
            self.saw_eos = True
            return self.finish()
        if token_id == self.think_end_id and self.in_reasoning:
            self.in_reasoning = False
            return []
        if token_id in self.silent_ids:
            return []
        return self.feed_text(text)

    def feed_text(self, text: str) -> list[Event]:
        """Text that belongs to no new token (the detokenizer's ``flush()`` at the end)."""
        if self.finished or not text:
            return []
        return self._record([ReasoningDelta(text)] if self.in_reasoning else self._scanner.feed(text))

    def feed_many(self, ids: Sequence[int], texts: Sequence[str]) -> list[Event]:
        out: list[Event] = []
        for token_id, text in zip(ids, texts):
            out += self.feed(token_id, text)
        return merge(out)

    def finish(self) -> list[Event]:
        """The output ended (EOS, a stop string, max_tokens, abort): release or close what is held."""
        if self.finished:
            return []
        self.finished = True
        self.stopped_in_reasoning = self.in_reasoning
        return self._record(self._scanner.finish())

    def _record(self, events: list[Event]) -> list[Event]:
        events = merge(events)
        for ev in events:
            self._summary.add(ev)
        return events

    @property
    def output(self) -> ParsedOutput:
        """Everything so far, folded: what a non-streaming response returns."""
        return self._summary

    @property
    def malformed(self) -> bool:
        """Tool-call markup that did not parse was dropped."""
        return self._scanner.malformed

    def finish_reason(self, engine_reason: str) -> str:
        """``"tool_calls"`` when the model ended on its own after a complete call, else the engine's."""
        done = [i for i in range(len(self._summary.tool_calls)) if i not in self._summary.incomplete_calls]
        return "tool_calls" if engine_reason == "stop" and done else engine_reason


def token_pieces(tok, ids: Sequence[int]) -> list[str]:
    """Each token's share of the decoded text, specials kept (what ``feed`` wants per token).

    Characters split over several byte tokens arrive with the token that completes them, as in a
    streaming response."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    pieces = [detok.push([i]) for i in ids]
    if pieces:
        pieces[-1] += detok.flush()
    return pieces


def parse_output(ids: Sequence[int], texts: Sequence[str], **parser_args) -> tuple[ParsedOutput, OutputParser]:
    """Non-streaming parse: the same parser over every token, then ``finish``."""
    parser = OutputParser(**parser_args)
    events = list(itertools.chain(parser.feed_many(ids, texts), parser.finish()))
    out = fold(events)
    return out, parser
