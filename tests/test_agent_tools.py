"""Tool and schema behaviour agents rely on (issue 29 item 4): ``parallel_tool_calls: false`` closes the
block after one call in the grammar; a schema without ``additionalProperties`` generates only its
listed properties; a tool call cut by ``length`` is detectable."""

from __future__ import annotations

import json

import httpx
import pytest

from ds4serve.chat import dsml
from ds4serve.chat.schema_closed import closed
from grammar_helpers import NOARGS, SEARCH, WEATHER, drive, matcher, parse, tiny
from server_harness import serve

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
PING = {"type": "function", "function": {"name": "ping", "description": "Check the line"}}


@pytest.fixture(scope="module")
def server(random_ckpt):
    """Room for the DS4 tools preamble (the byte tokenizer spells it in ~1000 tokens)."""
    with serve(random_ckpt, settings={"max_seqs": 8, "max_model_len": 4096}) as s:
        yield s


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base + path, json={"model": "tiny", **body}, timeout=60)


def _two_calls() -> list[int]:
    calls = [{"function": {"name": "search", "arguments": {"q": "a"}}},
             {"function": {"name": "ping", "arguments": {}}}]
    return tiny()[0].encode_text(dsml.render_tool_calls(calls, "c"))


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_two_calls_are_a_sentence_only_when_parallel_calls_are_allowed(choice):
    tok = tiny()[0]
    tools = [SEARCH, NOARGS]
    ids = _two_calls() + [tok.eos_id]
    for kw in ({}, {"parallel_tool_calls": True}):
        m = matcher(tools=tools, tool_choice=choice, **kw)
        assert m.accept_many(ids) and m.is_terminated()
    single = matcher(tools=tools, tool_choice=choice, parallel_tool_calls=False)
    assert not (single.accept_many(ids) and single.is_terminated())


@pytest.mark.parametrize("seed", range(6))
def test_required_without_parallel_calls_makes_exactly_one_call(seed):
    tools = [WEATHER, SEARCH, NOARGS]
    ids = drive(matcher(tools=tools, tool_choice="required", parallel_tool_calls=False), seed, max_steps=5000)
    p = parse(ids)
    assert not p.malformed and not p.output.incomplete_calls and p.output.content == ""
    assert len(p.output.tool_calls) == 1


@pytest.mark.parametrize("seed", range(4))
def test_http_parallel_tool_calls_false_returns_one_call(server, seed):
    body = {"messages": USER, "tools": [PING], "tool_choice": "required", "max_tokens": 200,
            "temperature": 1.0, "seed": seed, "parallel_tool_calls": False}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert len(choice["message"]["tool_calls"]) == 1


def test_http_parallel_calls_by_default_can_still_make_several(server):
    """With ``parallel_tool_calls`` true (the default) the block may hold more than one call: over seeds
    the random model, forced to call a no-argument tool, makes a second one at least once."""
    counts = set()
    for seed in range(12):
        r = _post(server, "/v1/chat/completions", {"messages": USER, "tools": [PING], "tool_choice": "required",
                                                   "max_tokens": 200, "temperature": 1.0, "seed": seed})
        assert r.status_code == 200, r.text
        counts.add(len(r.json()["choices"][0]["message"]["tool_calls"] or []))
    assert max(counts) > 1, counts


def test_anthropic_disable_parallel_tool_use_is_honoured(server):
    """Anthropic's flag maps onto ``parallel_tool_calls: false`` (it was a 400 before the grammar took it)."""
    tool = {"name": "ping", "description": "Check the line", "input_schema": {"type": "object", "properties": {}}}
    r = httpx.post(server.base + "/v1/messages", timeout=60, json={
        "model": "tiny", "max_tokens": 200, "messages": USER, "tools": [tool], "temperature": 0,
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert r.status_code == 200, r.text
    assert [b["name"] for b in r.json()["content"] if b["type"] == "tool_use"] == ["ping"], r.json()


# ---- schemas without additionalProperties ----------------------------------------------------

TWO = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"enum": ["x", "yz"]}}}


def test_closed_copies_and_closes_only_what_lists_its_properties():
    schema = {"type": "object", "properties": {
        "inner": {"type": "object", "properties": {"k": {"type": "string"}}},
        "free": {"type": "object"},
        "none": {"type": "object", "properties": {}},
        "open": {"type": "object", "properties": {"k": {}}, "additionalProperties": True},
        "list": {"type": "array", "items": {"properties": {"k": {}}}},
        "either": {"anyOf": [{"properties": {"p": {}}}, {"type": "null"}]},
        "both": {"allOf": [{"properties": {"p": {}}}, {"properties": {"q": {}}}]},
        "ref": {"$ref": "#/$defs/Item"},
        "neg": {"not": {"properties": {"k": {}}}}},
        "$defs": {"Item": {"properties": {"id": {}}}}}
    before = json.dumps(schema)
    out = closed(schema)
    assert json.dumps(schema) == before
    props = out["properties"]
    assert out["additionalProperties"] is False and props["inner"]["additionalProperties"] is False
    assert "additionalProperties" not in props["free"] and props["open"]["additionalProperties"] is True
    assert props["none"]["additionalProperties"] is False
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert all("additionalProperties" not in m for m in props["both"]["allOf"])
    assert out["$defs"]["Item"]["additionalProperties"] is False and "additionalProperties" not in props["ref"]
    assert "additionalProperties" not in props["neg"]["not"]


def test_defs_extended_by_all_of_stay_open():
    schema = {"allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"extra": {}}}],
              "$defs": {"Base": {"properties": {"id": {}}}}}
    assert "additionalProperties" not in closed(schema)["$defs"]["Base"]


def _json_keys(seed: int, schema: dict) -> set[str]:
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    return set(json.loads(parse(drive(matcher(response_format=fmt), seed, max_steps=3000)).output.content))


@pytest.mark.parametrize("seed", range(8))
def test_json_schema_without_additional_properties_gets_only_its_keys(seed):
    assert _json_keys(seed, TWO) <= {"a", "b"}


def test_explicit_additional_properties_true_keeps_its_meaning():
    extra = set().union(*(_json_keys(s, {**TWO, "additionalProperties": True}) for s in range(8))) - {"a", "b"}
    assert extra


@pytest.mark.parametrize("seed", range(4))
def test_nested_tool_argument_objects_get_only_their_keys(seed):
    tool = {"type": "function", "function": {"name": "put", "parameters": {
        "type": "object", "properties": {"item": TWO}, "required": ["item"]}}}
    ids = drive(matcher(tools=[tool], tool_choice={"type": "function", "function": {"name": "put"}}), seed,
                max_steps=3000)
    (call,) = parse(ids).output.tool_calls
    assert set(json.loads(call["function"]["arguments"])["item"]) <= {"a", "b"}


@pytest.mark.parametrize("seed", range(4))
def test_http_json_schema_without_strict_gets_only_its_keys(server, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": TWO}}
    r = _post(server, "/v1/chat/completions", {"messages": USER, "response_format": fmt, "max_tokens": 60,
                                               "temperature": 1.0, "seed": seed})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert set(json.loads(choice["message"]["content"])) <= {"a", "b"}


# ---- a tool call cut by length ---------------------------------------------------------------

CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                                                "maximum": 9}},
    "required": ["city", "days"]}}}
FORCED = {"messages": USER, "tools": [CITY], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
          "temperature": 0}


def _call_answer(server, max_tokens: int) -> dict:
    r = _post(server, "/v1/chat/completions", {**FORCED, "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def whole_tokens(server) -> int:
    """How many tokens the whole forced call takes (greedy, so every cut below is a prefix of it)."""
    r = _post(server, "/v1/chat/completions", {**FORCED, "max_tokens": 400})
    return r.json()["usage"]["completion_tokens"]


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_a_call_cut_by_length_is_the_last_one_with_arguments_that_never_parse(server):
    """The README's rule: ``finish_reason: "length"``, and a cut call is the last one, its ``arguments``
    the text so far, which never parses as JSON (its closing brace comes only with the closing markup;
    the text of a value cut inside a tag may end with what the tag had begun); a call that does parse
    was written whole."""
    whole = _call_answer(server, 400)
    assert whole["finish_reason"] == "tool_calls"
    (call,) = whole["message"]["tool_calls"]
    full_args = call["function"]["arguments"]
    assert json.loads(full_args)["city"] in ("Paris", "Oslo")
    seen_cut = seen_whole = False
    for limit in range(whole_tokens(server) - 1, 0, -23):  # cuts in every part of the markup
        cut = _call_answer(server, limit)
        assert cut["finish_reason"] == "length", cut
        calls = cut["message"].get("tool_calls") or []
        if not calls:
            continue
        args = calls[-1]["function"]["arguments"]
        assert args.startswith("{") and calls[-1]["function"]["name"] == "get_weather"
        if _parses(args):
            assert args == full_args
            seen_whole = True
        else:
            seen_cut = True
    assert seen_cut and seen_whole


def test_a_cut_call_streams_as_it_is_returned(server):
    full_args = _call_answer(server, 400)["message"]["tool_calls"][0]["function"]["arguments"]
    limit = next(n for n in range(whole_tokens(server) - 1, 0, -23)
                 if (c := _call_answer(server, n)["message"].get("tool_calls"))
                 and not _parses(c[0]["function"]["arguments"]))
    whole = _call_answer(server, limit)
    with httpx.stream("POST", server.base + "/v1/chat/completions", timeout=60,
                      json={"model": "tiny", **FORCED, "max_tokens": limit, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    args = "".join(tc["function"].get("arguments") or "" for c in chunks for tc in c["choices"][0]["delta"].get(
        "tool_calls") or [])
    assert args == whole["message"]["tool_calls"][0]["function"]["arguments"] != full_args
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
