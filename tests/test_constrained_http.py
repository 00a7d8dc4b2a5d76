"""Constrained output through HTTP on real weights: the grammar, not the model, guarantees it.

The bundled model never saw these requests in training, so every answer here that is well formed is
so because the sampler masked its logits: JSON that validates against the schema, a named or required tool call
whose arguments validate, ``tool_choice: "none"`` without markup, and a reasoning budget that makes
the answer arrive in thinking mode. Streaming and non-streaming (greedy) give the same answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from grammar_helpers import validate

D = "｜DSML｜"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "role": {"enum": ["admin", "user"]}, "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
    "required": ["name", "age", "role", "tags"], "additionalProperties": False}
FMT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": ARGS}},
         {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]
USER = [{"role": "user", "content": "Tell me."}]


BUNDLED = Path(__file__).resolve().parent.parent / "models" / "ds4v-tiny"


@pytest.fixture(scope="module")
def server():
    """The bundled model (its BPE vocabulary keeps tool prompts short); its answers to these
    prompts are off its training distribution, so the grammar is what shapes them."""
    from ds4serve.server.inprocess import serve

    with serve(BUNDLED, name="tiny", random_weights=False, settings={"max_model_len": 2048}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)


def _both(client, **kw):
    """The greedy answer non-streaming and streaming: (message, finish_reason) and the stream's
    (content, reasoning, {index: (name, arguments)}, finish_reason)."""
    body = dict(model="tiny", messages=USER, temperature=0, max_tokens=300, **kw)
    whole = client.chat.completions.create(**body).choices[0]
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **body):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        content += c.delta.content or ""
        reasoning += getattr(c.delta, "reasoning_content", None) or ""
        for tc in c.delta.tool_calls or []:
            name, args = calls.get(tc.index, ("", ""))
            calls[tc.index] = (name + (tc.function.name or ""), args + (tc.function.arguments or ""))
        finish = c.finish_reason or finish
    return whole, (content, reasoning, calls, finish)


def test_json_schema_answers_validate_and_stream_equals_whole(client):
    whole, (content, _, _, finish) = _both(client, response_format=FMT)
    validate(json.loads(whole.message.content), PERSON)
    assert whole.finish_reason == finish == "stop" and content == whole.message.content


def test_thinking_with_a_reasoning_budget_still_delivers_valid_json(client):
    extra = {"chat_template_kwargs": {"thinking": True}, "max_reasoning_tokens": 12}
    whole, (content, reasoning, _, _) = _both(client, response_format=FMT, extra_body=extra)
    validate(json.loads(whole.message.content), PERSON)
    assert whole.message.reasoning_content == reasoning and content == whole.message.content
    usage = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=300,
                                           response_format=FMT, extra_body=extra).usage
    assert usage.completion_tokens_details.reasoning_tokens <= 12


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_forced_tool_calls_have_arguments_that_validate(client, choice):
    """A named function: exactly one call, and the block closes. ``"required"`` allows any number of
    calls, so the grammar bounds each call but not how many: the robust tiny model, greedy, repeats
    ``ping`` until ``max_tokens`` (the earlier weights happened to stop). Then every complete call must
    still validate, and the cut-off one is left out."""
    whole, (content, _, calls, finish) = _both(client, tools=TOOLS, tool_choice=choice)
    assert whole.finish_reason == finish and D not in (whole.message.content or "")
    assert finish == "tool_calls" if isinstance(choice, dict) else finish in ("tool_calls", "length")
    got = whole.message.tool_calls
    assert got and {i: (c.function.name, c.function.arguments) for i, c in enumerate(got)} == calls
    if finish == "length":
        got = got[:-1]
        assert got, "not one complete call before max_tokens"
    for c in got:
        args = json.loads(c.function.arguments)
        if c.function.name == "get_weather":
            validate(args, ARGS)
        else:
            assert c.function.name == "ping" and args == {}
    if isinstance(choice, dict):
        assert [c.function.name for c in got] == ["get_weather"]


def test_tool_choice_none_never_returns_markup(client):
    for seed in range(3):
        out = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="none",
                                             temperature=1.0, seed=seed, max_tokens=60).choices[0]
        assert not out.message.tool_calls and D not in (out.message.content or "")


def test_an_invalid_schema_is_a_400_naming_the_field(server):
    import httpx

    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "a"}}}
    r = httpx.post(server.base + "/v1/chat/completions", json={"model": "tiny", "messages": USER,
                                                               "response_format": bad}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("response_format"), r.text


@pytest.fixture(scope="module", params=["ngram", "dspark"])
def drafting_client(request):
    """The same model served with drafts (prompt lookup, or the bundled DSpark drafter)."""
    from ds4serve.server.inprocess import serve

    spec = json.dumps({"method": request.param})
    with serve(BUNDLED, name="tiny", random_weights=False,
               settings={"max_model_len": 2048, "speculative": spec}) as srv:
        yield openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0), srv


def _answer(message) -> dict:
    """A message as compared across servers: every field but the tool calls' random ids."""
    out = message.model_dump()
    out["tool_calls"] = [{k: v for k, v in c.items() if k != "id"} for c in out.get("tool_calls") or []]
    return out


def test_constrained_answers_with_drafts_equal_the_plain_servers(client, drafting_client):
    """A JSON schema, a reasoning budget in thinking mode and a forced tool call, greedy, whole and streamed:
    the drafting server answers exactly as the plain one, and it did verify drafts (its metrics)."""
    import httpx

    drafted, srv = drafting_client
    thinking = {"chat_template_kwargs": {"thinking": True}, "max_reasoning_tokens": 12}
    cases = [dict(response_format=FMT), dict(response_format=FMT, extra_body=thinking),
             dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})]
    for kw in cases:
        plain_whole, plain_stream = _both(client, **kw)
        whole, stream = _both(drafted, **kw)
        assert _answer(whole.message) == _answer(plain_whole.message), kw
        assert whole.finish_reason == plain_whole.finish_reason and stream == plain_stream, kw
    metrics = httpx.get(srv.base + "/metrics", timeout=30).text
    accepted = [line for line in metrics.splitlines()
                if line.startswith("ds4serve_spec_decode_num_accepted_tokens_total")]
    assert accepted and float(accepted[0].split()[-1]) > 0, accepted
