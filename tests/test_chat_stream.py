"""The server's chat output path without HTTP: ``ChatChoice`` over known token sequences, split at
random, folds to one message whatever the split; its deltas map onto OpenAI's chunk fields."""

from __future__ import annotations

import json
import random

import pytest

from ds4serve.chat import ChatOptions, ContentDelta, ReasoningDelta, Tokenizer, ToolCallDelta, ToolCallStart, fold
from ds4serve.server.chat_request import ChatSetup
from ds4serve.server.chat_stream import ChatChoice, deltas_of, message_of

D = "｜DSML｜"
CALL = (f'\n\n<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="x" string="false">[1, 2]</{D}parameter>'
        f'\n</{D}invoke>\n</{D}tool_calls>')


@pytest.fixture(scope="module")
def tok(random_ckpt) -> Tokenizer:
    return Tokenizer(random_ckpt)


def _setup(thinking: bool, tool_choice: str = "auto") -> ChatSetup:
    return ChatSetup([{"role": "user", "content": "q"}], ChatOptions(thinking=thinking), tool_choice=tool_choice)


def _run(tok, ids, setup, splits, stops=()):
    choice, events, k = ChatChoice(tok, setup, list(stops), True), [], 0
    for n in splits:
        events += choice.feed(ids[k:k + n], k + n >= len(ids))
        k += n
        if choice.stopped:
            break
    return events, choice


def _no_ids(out):
    """The folded message with call ids blanked (ids are random per call)."""
    return out.reasoning, out.content, [dict(c, id="") for c in out.tool_calls], out.incomplete_calls


def _random_splits(rng: random.Random, n: int) -> list[int]:
    out = []
    while sum(out) < n:
        out.append(rng.randint(1, 6))
    return out


def test_any_split_folds_to_the_same_message(tok):
    ids = tok.encode_text("think a < b") + [tok.think_end_id] + tok.encode_text("Answer <not markup>" + CALL)
    whole, choice = _run(tok, ids, _setup(True), [len(ids)])
    want = fold(whole)
    assert want.reasoning == "think a < b" and want.content == "Answer <not markup>"
    assert json.loads(want.tool_calls[0]["function"]["arguments"]) == {"x": [1, 2]}
    assert choice.finish_reason("stop") == "tool_calls" and choice.reasoning_tokens == len(tok.encode_text("think a < b"))
    rng = random.Random(0)
    for _ in range(30):
        events, _ = _run(tok, ids, _setup(True), _random_splits(rng, len(ids)))
        assert _no_ids(fold(events)) == _no_ids(want)
        assert all(D not in ev.text for ev in events if isinstance(ev, ContentDelta))


def test_deltas_carry_openai_fields(tok):
    ids = tok.encode_text("r") + [tok.think_end_id] + tok.encode_text("c" + CALL)
    events, _ = _run(tok, ids, _setup(True), [len(ids)])
    deltas = deltas_of(tuple(events), first=True)
    assert deltas[0] == {"role": "assistant", "reasoning_content": "r", "reasoning": "r"}
    assert deltas[1] == {"content": "c"}
    start = next(d for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0])
    assert start["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert [type(e) for e in events if isinstance(e, (ToolCallStart, ToolCallDelta))][0] is ToolCallStart
    assert deltas_of((), first=True) == [{"role": "assistant", "content": ""}]
    msg = message_of(fold(events))
    assert msg["content"] == "c" and msg["reasoning"] == msg["reasoning_content"] == "r"
    assert msg["tool_calls"][0]["type"] == "function"


def test_tool_choice_none_drops_calls_and_markup(tok):
    ids = tok.encode_text("Sure." + CALL)
    events, choice = _run(tok, ids, _setup(False, "none"), [2] * len(ids))
    assert fold(events).content == "Sure." and not fold(events).tool_calls
    assert choice.finish_reason("stop") == "stop"


def test_special_tokens_never_reach_text_and_end_partial_stops(tok):
    ids = tok.encode_text("ab") + [tok.user_id] + tok.encode_text("cd")
    events, choice = _run(tok, ids, _setup(False), [1] * len(ids), stops=["bc"])
    assert fold(events).content == "abcd" and not choice.stopped  # the special token split "b" from "c"
    events, choice = _run(tok, tok.encode_text("xbcx"), _setup(False), [1] * 4, stops=["bc"])
    assert fold(events).content == "x" and choice.stopped


def test_thinking_text_before_think_end_is_reasoning_only(tok):
    events, choice = _run(tok, tok.encode_text("</think> typed"), _setup(True), [3, 3, 3, 3, 3])
    assert fold(events).reasoning == "</think> typed" and fold(events).content == ""
    assert choice.parser.stopped_in_reasoning
    assert all(isinstance(e, ReasoningDelta) for e in events)
