"""The DS4 output parser: token-id state switches, DSML tool calls, and a fuzz of token splits."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4serve.chat import Tokenizer
from ds4serve.chat.dsml import render_tool_calls
from ds4serve.chat.events import ContentDelta, ToolCallDelta, ToolCallEnd, ToolCallStart, fold
from ds4serve.chat.output_parser import OutputParser, parse_output, token_pieces

ROOT = Path(__file__).resolve().parent.parent
D = "｜DSML｜"
THINK_END, EOS, BOS, TEXT = 5, 1, 0, 100  # ids of a toy vocabulary; TEXT is any ordinary token
ARGS = {"thinking": True, "think_end_id": THINK_END, "eos_ids": (EOS,), "silent_ids": (BOS, 2, 3, 4, 6),
        "id_factory": lambda i: f"call_{i}"}


def tokens(*items, size: int = 3, rng: random.Random | None = None) -> tuple[list[int], list[str]]:
    """Items are text (cut into ``size``-char tokens, or random cuts) or a special id."""
    ids, texts = [], []
    for item in items:
        if isinstance(item, int):
            ids.append(item)
            texts.append("<special>")
            continue
        k = 0
        while k < len(item):
            n = rng.randint(1, 6) if rng else size
            ids.append(TEXT)
            texts.append(item[k:k + n])
            k += n
    return ids, texts


def parse(*items, thinking: bool = True, **kw):
    out, parser = parse_output(*tokens(*items, **kw), **{**ARGS, "thinking": thinking})
    return out, parser


def call_markup(*calls) -> str:
    return render_tool_calls([{"function": {"name": n, "arguments": json.dumps(a)}} for n, a in calls], "t")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(ROOT / "models" / "ds4v-tiny")


def test_published_turn_through_the_real_tokenizer(tok):
    gold = (ROOT / "tests/data/ds4_encoding/test_output_1.txt").read_text()
    start = gold.find("<｜Assistant｜><think>") + len("<｜Assistant｜><think>")
    turn = gold[start:gold.find("<｜User｜>", start)]
    ids = tok.encode_markup(turn)
    assert tok.think_end_id in ids and ids[-1] == tok.eos_id
    parser = OutputParser.for_tokenizer(tok, thinking=True, id_factory=lambda i: f"call_{i}")
    events = [ev for i, t in zip(ids, token_pieces(tok, ids)) for ev in parser.feed(i, t)] + parser.finish()
    out = fold(events)
    assert out.reasoning == "The user wants to know the weather in Beijing. I should use the get_weather tool."
    assert out.content == ""
    assert out.tool_calls == [{"id": "call_0", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"location": "Beijing", "unit": "celsius"}'}}]
    assert parser.finish_reason("stop") == "tool_calls" and parser.saw_eos and not parser.malformed
    assert sum(isinstance(e, ToolCallDelta) for e in events) > 2  # the arguments stream in pieces


def test_typed_think_end_never_switches_state(tok):
    typed = tok.encode_text("</think>")
    assert tok.think_end_id not in typed
    p = OutputParser.for_tokenizer(tok, thinking=True)
    evs = p.feed_many(typed, token_pieces(tok, typed))
    assert p.in_reasoning and fold(evs).reasoning == "</think>"
    p.feed(tok.think_end_id, "</think>")
    assert not p.in_reasoning
    assert fold(p.feed_many(typed, token_pieces(tok, typed))).content == "</think>"


def test_eos_is_stripped_and_ends_the_output():
    out, p = parse("r", THINK_END, "answer", EOS, "after")
    assert (out.reasoning, out.content, p.saw_eos, p.stopped_in_reasoning) == ("r", "answer", True, False)
    assert p.feed_text("late") == [] and p.finish() == []
    p = OutputParser(**{**ARGS, "thinking": False})
    assert fold(p.feed(TEXT, "a") + p.feed_text("\ufffd") + p.finish()).content == "a\ufffd"


def test_stop_inside_reasoning_is_flagged():
    out, p = parse("still thinking <｜DSML｜tool_calls>")
    assert (out.reasoning, out.content, p.stopped_in_reasoning) == ("still thinking <｜DSML｜tool_calls>", "", True)
    out, p = parse("r", EOS)
    assert p.stopped_in_reasoning and p.saw_eos
    assert not parse("r", THINK_END)[1].stopped_in_reasoning


def test_chat_mode_is_all_content_and_special_text_is_dropped():
    out, p = parse(BOS, "hello", THINK_END, " world", thinking=False)
    assert (out.reasoning, out.content, p.stopped_in_reasoning) == ("", "hello world", False)


def test_content_then_calls_whitespace_belongs_to_markup():
    markup = call_markup(("f", {"a": 1}), ("g", {"s": "x"}))
    out, p = parse("r", THINK_END, "Sure.", markup, EOS)
    assert out.content == "Sure."
    assert [c["function"]["name"] for c in out.tool_calls] == ["f", "g"]
    assert [json.loads(c["function"]["arguments"]) for c in out.tool_calls] == [{"a": 1}, {"s": "x"}]
    assert p.finish_reason("stop") == "tool_calls" and p.finish_reason("length") == "length"
    assert parse("a \n", EOS, thinking=False)[0].content == "a \n"  # trailing space without markup stays


def test_parameter_values():
    args = {"s": 'q"uo\\te\nline <b> </｜DSML｜param é', "n": 3, "f": -1.5, "l": [1, {"k": None}], "t": True}
    out, _ = parse(call_markup(("f", args)), EOS, thinking=False)
    assert json.loads(out.tool_calls[0]["function"]["arguments"]) == args
    odd = (f'<{D}tool_calls>\n<{D}invoke name="f">\n'
           f'<{D}parameter name="bad" string="false">not json</{D}parameter>\n'
           f'<{D}parameter name="nan" string="false">NaN</{D}parameter>\n'
           f'<{D}parameter name="auto">[1, 2]</{D}parameter>\n'
           f'<{D}parameter name="auto_s">plain</{D}parameter>\n'
           f'</{D}invoke>\n</{D}tool_calls>')
    out, _ = parse(odd, thinking=False)
    assert json.loads(out.tool_calls[0]["function"]["arguments"]) == {
        "bad": "not json", "nan": "NaN", "auto": [1, 2], "auto_s": "plain"}


def test_truncated_call_is_incomplete():
    markup = call_markup(("f", {"city": "Paris"}))
    out, p = parse("ok", markup[:markup.find("Paris") + 3], thinking=False)
    assert out.content == "ok" and out.incomplete_calls == [0]
    assert out.tool_calls[0]["function"]["arguments"] == '{"city": "Par'
    assert p.finish_reason("length") == "length" and p.finish_reason("stop") == "stop"


def test_malformed_markup_is_dropped_never_shown():
    out, p = parse(f"a</{D}invoke>b", thinking=False)
    assert out.content == "ab" and p.malformed
    junk = f'<{D}tool_calls>\n<{D}invoke name="f">\ngarbage <x> here\n</{D}invoke>\n</{D}tool_calls> after'
    out, p = parse("pre", junk, thinking=False)
    assert out.content == "pre after" and out.incomplete_calls == [0] and p.malformed
    assert parse(f"x <｜DS", thinking=False)[0].content == "x <｜DS"  # a prefix only is text
    assert parse(f"x <{D}tool_ca", thinking=False)[0].content == "x"  # a started tag is not


def test_no_wrapper_and_missing_close_are_tolerated():
    text = f'<{D}invoke name="f">\n<{D}parameter name="a" string="true">1</{D}parameter>\n</{D}tool_calls>'
    out, p = parse(text, thinking=False)
    assert out.tool_calls[0]["function"]["arguments"] == '{"a": "1"}' and not out.incomplete_calls


def test_events_stream_in_order():
    ids, texts = tokens(call_markup(("f", {"a": "bc"})), size=1)
    p = OutputParser(**{**ARGS, "thinking": False})
    evs = [ev for i, t in zip(ids, texts) for ev in p.feed(i, t)] + p.finish()
    kinds = [type(e) for e in evs]
    assert kinds[0] is ToolCallStart and kinds[-1] is ToolCallEnd and ContentDelta not in kinds
    assert evs[-1].arguments == "".join(e.arguments for e in evs if isinstance(e, ToolCallDelta))


# ------------------------------------------------------------------ fuzz

def _pieces(alphabet: list[str], max_size: int) -> st.SearchStrategy[str]:
    """Text made of characters and whole tricky fragments."""
    return st.lists(st.sampled_from(alphabet), max_size=max_size).map("".join)


_TEXT = _pieces(list("ab <>/\"\\\n é｜DSML") + ["<｜DSML｜", "</｜DSML｜", "</think>", "<｜DS"], 12)
_NAME = st.text(st.sampled_from("abcxyz_"), min_size=1, max_size=6)
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-99, 99) | st.text("ab\"\\\n", max_size=4),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(_NAME, kids, max_size=2), max_leaves=5)
_VALUE = _pieces(list("ab <>/\"\\\n é｜") + ["</｜DSML｜param"], 10) | _JSON
_CALL = st.tuples(_NAME, st.dictionaries(_NAME, _VALUE, max_size=3))
_CALLS = st.lists(_CALL, max_size=2)
_NOISE = st.sampled_from([f"<{D}", f"</{D}", ">", "\n", '"', "x", f"</{D}invoke>", f"</{D}tool_calls>",
                          f'<{D}parameter name="k">', f'<{D}invoke name="f">', f"<{D}tool_calls>"])


def _safe(text: str) -> bool:
    return f"<{D}" not in text and f"</{D}" not in text


def _check_invariants(items, seed: int, thinking: bool = True) -> None:
    rng = random.Random(seed)
    args = {**ARGS, "thinking": thinking}
    whole, _ = parse_output(*tokens(*items, size=10 ** 6), **args)
    for _ in range(2):
        ids, texts = tokens(*items, rng=rng)
        p = OutputParser(**args)
        evs = [ev for i, t in zip(ids, texts) for ev in p.feed(i, t)] + p.finish()
        assert fold(evs) == whole == p.output  # streaming == non-streaming, whatever the split
    assert _safe(whole.content)
    for k, call in enumerate(whole.tool_calls):
        if k not in whole.incomplete_calls:
            assert isinstance(json.loads(call["function"]["arguments"]), dict)


@settings(max_examples=60, deadline=None)
@given(_TEXT, _TEXT.filter(_safe), _CALLS, st.booleans(), st.integers(0, 2 ** 16))
def test_fuzz_valid_outputs_round_trip(reasoning, content, calls, eos, seed):
    calls = [(n, {k: v for k, v in a.items() if not (isinstance(v, str) and "</｜DSML｜parameter>" in v)})
             for n, a in calls]
    items = [reasoning, THINK_END, content] + ([call_markup(*calls)] if calls else []) + ([EOS] if eos else [])
    _check_invariants(items, seed)
    out, parser = parse_output(*tokens(*items), **ARGS)
    assert out.reasoning == reasoning
    assert out.content == (content.rstrip() if calls else content)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out.tool_calls] == calls
    assert not parser.malformed and not out.incomplete_calls


@settings(max_examples=80, deadline=None)
@given(_TEXT, st.lists(_CALL, min_size=1, max_size=2), st.lists(st.tuples(st.integers(0, 400), _NOISE | st.just("")),
                                                               max_size=4),
       st.none() | st.integers(0, 400), st.booleans(), st.integers(0, 2 ** 16))
def test_fuzz_invalid_outputs_never_leak_or_raise(content, calls, edits, cut, think, seed):
    text = content + (call_markup(*calls) if calls else "")
    for pos, noise in edits:
        pos %= len(text) + 1
        text = text[:pos] + noise + text[pos + (0 if noise else 3):]
    text = text if cut is None else text[:cut]  # None: the output was not cut off
    items = (["r", THINK_END] if think else []) + [text]
    _check_invariants(items, seed, thinking=think)
