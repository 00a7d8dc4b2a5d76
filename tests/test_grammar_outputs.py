"""Grammar-constrained outputs on the tiny tokenizer, sampled from seeded random logits: JSON that
parses and validates, DSML tool calls that ds4serve's own OutputParser reads back into calls whose
arguments validate, and no markup under ``tool_choice: "none"``."""

from __future__ import annotations

import json

import pytest

from ds4serve.chat import dsml
from grammar_helpers import NOARGS, PERSON, SEARCH, WEATHER, drive, matcher, parse, tiny, validate

SEEDS = range(4)


def _answer(ids: list[int]) -> str:
    tok = tiny()[0]
    return tok.decode([i for i in ids if i != tok.eos_id], skip_special_tokens=False)


@pytest.mark.parametrize("seed", SEEDS)
def test_json_object_parses(seed):
    ids = drive(matcher(response_format={"type": "json_object"}), seed)
    assert isinstance(json.loads(_answer(ids)), dict)


@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema_validates(seed):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    ids = drive(matcher(response_format=rf), seed)
    validate(json.loads(_answer(ids)), PERSON)


@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema_after_think_end(seed):
    """Thinking mode: free reasoning, then the schema from the token after ``</think>`` on."""
    tok = tiny()[0]
    reasoning = tok.encode_text("let me think <｜DSML｜tool_calls> {") + [tok.think_end_id]
    rf = {"type": "json_schema", "json_schema": {"schema": PERSON}}
    ids = drive(matcher(thinking=True, response_format=rf), seed, prefix=reasoning)
    p = parse(ids, thinking=True)
    assert p.output.reasoning == "let me think <｜DSML｜tool_calls> {"
    validate(json.loads(p.output.content), PERSON)


def _check_calls(p, tools: list[dict]) -> list[dict]:
    schemas = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in tools}
    assert not p.malformed and not p.output.incomplete_calls and p.output.content == ""
    assert p.finish_reason("stop") == "tool_calls"
    for call in p.output.tool_calls:
        validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
    return p.output.tool_calls


@pytest.mark.parametrize("seed", SEEDS)
def test_named_tool_call_is_the_encoders_markup(seed):
    ids = drive(matcher(tools=[SEARCH, WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                seed)
    calls = _check_calls(parse(ids), [WEATHER])
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    # byte for byte what the encoder renders for the same call in history
    assert _answer(ids) == dsml.render_tool_calls(calls, "calls")


@pytest.mark.parametrize("seed", SEEDS)
def test_required_calls_any_declared_tool(seed):
    tools = [WEATHER, SEARCH, NOARGS]
    ids = drive(matcher(tools=tools, tool_choice="required"), seed, max_steps=5000)
    calls = _check_calls(parse(ids), tools)
    assert calls and {c["function"]["name"] for c in calls} <= {"get_weather", "search", "ping"}
    assert _answer(ids) == dsml.render_tool_calls(calls, "calls")


def test_tool_without_parameters():
    for seed in SEEDS:
        ids = drive(matcher(tools=[NOARGS], tool_choice={"type": "function", "function": {"name": "ping"}}), seed)
        assert [c["function"]["arguments"] for c in _check_calls(parse(ids), [NOARGS])] == ["{}"]


CODE = {"type": "function", "function": {"name": "code", "parameters": {"type": "object", "properties": {
    "id": {"type": "string", "pattern": "^[a-z]{2,4}[0-9]$"}, "note": {"type": "string", "pattern": "^(ab|cd)$"},
    "when": {"type": "string", "format": "date"}}, "required": ["id", "when"]}}}


@pytest.mark.parametrize("seed", SEEDS)
def test_string_patterns_and_formats_hold(seed):
    """An anchored pattern is enforced on the raw text; other patterns and formats go through
    the JSON compiler (``string="false"`` with a JSON string), and still validate."""
    ids = drive(matcher(tools=[CODE], tool_choice={"type": "function", "function": {"name": "code"}}), seed,
                max_steps=3000)
    calls = _check_calls(parse(ids), [CODE])
    text = _answer(ids)
    assert '<｜DSML｜parameter name="id" string="true">' in text
    assert '<｜DSML｜parameter name="when" string="false">"' in text
    args = json.loads(calls[0]["function"]["arguments"])
    assert len(args["when"]) == 10 and args["when"][4] == "-"


FREE = {"type": "function", "function": {"name": "anything", "parameters": {"type": "object"}}}
RENDERED = [
    (FREE, {"x": "raw < text > with \"quotes\"", "n": 3, "obj": {"a": [1, None]}}),
    (FREE, {}),
    (NOARGS, {}),
    (WEATHER, {"city": "Paris", "days": 3}),
    (WEATHER, {"city": "Köln", "days": 9, "unit": "f", "hourly": False, "tags": [1, 22]}),
    (SEARCH, {"q": "a<b", "n": 0}),
]


@pytest.mark.parametrize("tool,args", RENDERED)
def test_the_encoders_markup_is_accepted(tool, args):
    """What the encoder renders for a call in history is exactly a sentence of the grammar."""
    tok = tiny()[0]
    text = dsml.render_tool_calls([{"function": {"name": tool["function"]["name"], "arguments": args}}], "c")
    m = matcher(tools=[tool] + ([SEARCH] if tool is not SEARCH else []), tool_choice="required")
    assert m.accept_many(tok.encode_text(text)) and m.is_accepting()
    assert m.accept(tok.eos_id) and m.is_terminated()


@pytest.mark.parametrize("tool,args", [(WEATHER, {"city": "Toulouse", "days": 3}),  # maxLength 6
                                       (WEATHER, {"city": "Paris"}),  # days required
                                       (WEATHER, {"city": "Paris", "days": 10}),  # maximum 9
                                       (SEARCH, {"q": "x", "extra": 1}),  # additionalProperties false
                                       (CODE, {"id": "abcde1", "when": "2024-01-01"})])  # pattern
def test_markup_breaking_the_schema_is_refused(tool, args):
    tok = tiny()[0]
    text = dsml.render_tool_calls([{"function": {"name": tool["function"]["name"], "arguments": args}}], "c")
    m = matcher(tools=[tool], tool_choice="required")
    assert not (m.accept_many(tok.encode_text(text) + [tok.eos_id]) and m.is_terminated())


@pytest.mark.parametrize("seed", range(8))
def test_auto_is_text_or_well_formed_calls(seed):
    tools = [WEATHER, SEARCH]
    p = parse(drive(matcher(tools=tools, tool_choice="auto"), seed, max_steps=5000))
    assert not p.malformed
    _check_calls(p, tools) if p.output.tool_calls else None


@pytest.mark.parametrize("seed", SEEDS)
def test_auto_constrains_the_block_once_opened(seed):
    tok = tiny()[0]
    prefix = tok.encode_text("Let me look.\n\n<｜DSML｜tool_calls>")
    ids = drive(matcher(tools=[WEATHER, SEARCH]), seed, max_steps=5000, prefix=prefix)
    p = parse(ids)
    assert p.output.content == "Let me look." and not p.malformed
    assert _check_calls_lenient(p, [WEATHER, SEARCH])


def _check_calls_lenient(p, tools) -> bool:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in p.output.tool_calls:
        validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
    return bool(p.output.tool_calls) and p.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("seed", range(8))
def test_none_never_writes_markup(seed):
    ids = drive(matcher(tools=[WEATHER], tool_choice="none"), seed)
    text = _answer(ids)
    assert "<｜DSML｜" not in text and "</｜DSML｜" not in text
    assert not parse(ids).malformed


def test_none_masks_every_token_that_completes_an_opener():
    tok, comp, _ = tiny()
    for lead in ("x <｜DSML", "y </｜DSM", "<"):
        m = matcher(tools=[WEATHER], tool_choice="none")
        ids = tok.encode_text(lead)
        assert m.accept_many(ids)
        bm = comp.allocate_bitmask(1)
        m.fill_mask(bm[0])
        allowed = [t for t in range(tok.vocab_size) if (int(bm[0, t // 32]) >> (t % 32)) & 1]
        assert allowed
        for t in allowed:
            text = tok.decode(ids + [t], skip_special_tokens=False)
            assert "<｜DSML｜" not in text and "</｜DSML｜" not in text, (lead, t)


def test_auto_with_response_format_is_json_or_a_call():
    """Either the schema's JSON or a tool-call block; the JSON path is taken by starting it."""
    tok = tiny()[0]
    rf = {"type": "json_schema", "json_schema": {"schema": PERSON}}
    kinds = set()
    for seed in range(6):
        prefix = tok.encode_text('{"name": "') if seed % 2 else []
        p = parse(drive(matcher(tools=[SEARCH], response_format=rf), seed, max_steps=5000, prefix=prefix))
        assert not p.malformed
        if p.output.tool_calls:
            kinds.add("call")
            assert _check_calls_lenient(p, [SEARCH]) and p.output.content == ""
        else:
            kinds.add("json")
            validate(json.loads(p.output.content), PERSON)
    assert kinds == {"call", "json"}
