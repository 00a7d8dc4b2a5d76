"""The Anthropic Messages API through the official `anthropic` SDK against a real in-process server.

The server runs the random-weight tiny checkpoint, so its text is noise: the tests assert the
protocol (block types and order, stop reasons, usage, stream event grammar, error shapes), never
content. Every body and stream event is also validated against the SDK's own pydantic types with
``model_validate`` (the SDK itself parses leniently, so a wrong field would otherwise pass).
"""

from __future__ import annotations

import base64
import io
import json

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from PIL import Image
from pydantic import TypeAdapter

from ds4serve.server.inprocess import serve

KEY = "sk-anthropic-test"
STREAM_EVENT = TypeAdapter(RawMessageStreamEvent)
USER = [{"role": "user", "content": "Name three colours."}]
T0 = {"temperature": 0}  # greedy (the SDK sends sampling fields as extra_body since 2.x)
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                             "unit": {"enum": ["c", "f"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                             "required": ["zone"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def srv(random_ckpt):
    """Keys on (the SDK sends ``x-api-key``), room for the DS4 tools preamble, a small body limit."""
    with serve(random_ckpt, api_keys={"alice": KEY}, settings={"max_seqs": 8, "max_model_len": 4096},
               limits={"max_body_bytes": 1_000_000}) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return anthropic.Anthropic(base_url=srv.base, api_key=KEY, max_retries=0, timeout=120)


def _post(srv, path: str, body, headers: dict | None = None) -> httpx.Response:
    """A raw request (the SDK's own checks would stop some hostile bodies before they leave)."""
    if isinstance(body, dict) and "extra_body" in body:
        body = {**{k: v for k, v in body.items() if k != "extra_body"}, **body["extra_body"]}
    kw = {"content": body} if isinstance(body, (bytes, str)) else {"json": body}
    return httpx.post(srv.base + path, headers={"x-api-key": KEY, "content-type": "application/json",
                                                **(headers or {})}, timeout=120, **kw)


def _message(srv, **body) -> dict:
    """A non-streaming answer, validated strictly against the SDK's ``Message``."""
    r = _post(srv, "/v1/messages", {"model": "tiny", "max_tokens": 16, "messages": USER, **body})
    assert r.status_code == 200, r.text
    Message.model_validate(r.json())
    return r.json()


def _frames(srv, **body) -> list[tuple[str, dict]]:
    """(event name, data) of a raw stream, each validated and checked against the stream grammar."""
    r = _post(srv, "/v1/messages", {"model": "tiny", "messages": USER, "stream": True, **body})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    frames = []
    for chunk in r.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.split("\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]
        if data["type"] != "ping":
            STREAM_EVENT.validate_python(data)
        frames.append((lines["event"], data))
    _check_grammar([d for _, d in frames if d["type"] != "ping"])
    return frames


def _check_grammar(events: list[dict]) -> None:
    """message_start, then blocks (start, deltas of that index, stop; indices 0, 1, ...), then
    message_delta and message_stop; thinking blocks end with a signature_delta."""
    assert events[0]["type"] == "message_start" and events[0]["message"]["content"] == []
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]
    index, open_kind, last_delta = -1, None, None
    for e in events[1:-2]:
        if e["type"] == "content_block_start":
            assert open_kind is None and e["index"] == index + 1
            index, open_kind = e["index"], e["content_block"]["type"]
        elif e["type"] == "content_block_delta":
            assert e["index"] == index and open_kind is not None
            expected = {"text": ("text_delta",), "thinking": ("thinking_delta", "signature_delta"),
                        "tool_use": ("input_json_delta",)}[open_kind]
            assert e["delta"]["type"] in expected
            last_delta = e["delta"]["type"]
        else:
            assert e["type"] == "content_block_stop" and e["index"] == index
            assert open_kind != "thinking" or last_delta == "signature_delta"
            open_kind = None
    assert open_kind is None


def _png(colour: str = "red") -> str:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), colour).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _clean_stop(text: str) -> str | None:
    for start in range(1, len(text) - 2):
        piece = text[start:start + 2]
        if "\ufffd" not in piece and piece.strip() and text.find(piece) == start:
            return piece
    return None


# ---- create --------------------------------------------------------------------------------------
def test_create_text_and_system(client, srv):
    out = client.messages.create(model="tiny", max_tokens=12, messages=USER, system="You are terse.",
                                 extra_body=T0, metadata={"user_id": "u-1"})
    assert out.type == "message" and out.role == "assistant" and out.id.startswith("msg_")
    assert [b.type for b in out.content] == ["text"] and out.content[0].text
    assert out.stop_reason == "max_tokens" and out.stop_sequence is None
    assert out.usage.output_tokens == 12
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens > 10
    blocks = client.messages.create(model="tiny", max_tokens=12, messages=USER, extra_body=T0,
                                    system=[{"type": "text", "text": "You are terse."}])
    assert blocks.content[0].text == out.content[0].text  # the same prompt either way
    raw = _message(srv, system="You are terse.", extra_body=T0, max_tokens=12, top_k=5, top_p=0.9)
    assert raw["usage"]["output_tokens"] == 12


def test_stop_sequences(client):
    base = client.messages.create(model="tiny", max_tokens=40, messages=USER, extra_body=T0)
    text = base.content[0].text
    stop = _clean_stop(text)
    assert stop, f"no usable stop sequence in {text!r}"
    cut = client.messages.create(model="tiny", max_tokens=40, messages=USER, extra_body=T0,
                                 stop_sequences=[stop, "@@@@"])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.find(stop)]
    with client.messages.stream(model="tiny", max_tokens=40, messages=USER, extra_body=T0,
                                stop_sequences=[stop]) as s:
        streamed = s.get_final_message()
    assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == stop
    assert streamed.content[0].text == cut.content[0].text


def test_prefill_is_continued(client):
    out = client.messages.create(model="tiny", max_tokens=8, extra_body=T0,
                                 messages=USER + [{"role": "assistant", "content": "Red, green and"}])
    assert [b.type for b in out.content] == ["text"] and out.stop_reason == "max_tokens"


# ---- streaming -----------------------------------------------------------------------------------
def test_stream_equals_create(client, srv):
    kw = dict(model="tiny", max_tokens=20, messages=USER, extra_body=T0)
    full = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        texts = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(texts) == full.content[0].text == final.content[0].text
    assert final.stop_reason == full.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 20
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        full.usage.input_tokens + full.usage.cache_read_input_tokens
    frames = _frames(srv, max_tokens=20, extra_body=T0)
    delta = next(d for n, d in frames if n == "message_delta")
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 20
    assert "".join(d["delta"]["text"] for n, d in frames if n == "content_block_delta") == full.content[0].text


# ---- images --------------------------------------------------------------------------------------
def test_image_blocks(client, srv):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _png()}}
    content = [{"type": "text", "text": "What is in this image?"}, image]
    out = client.messages.create(model="tiny", max_tokens=6, extra_body=T0,
                                 messages=[{"role": "user", "content": content}])
    text_only = client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": content[:1]}])
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens > text_only.input_tokens + 10
    # a remote URL needs --allow-image-hosts: a clear 400, not a fetch
    r = _post(srv, "/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}]})
    body = _error(r, 400)
    assert "remote image" in body["error"]["message"]


# ---- tools ---------------------------------------------------------------------------------------
def _tool_blocks(out: Message) -> list:
    return [b for b in out.content if b.type == "tool_use"]


def test_tool_choice_forces_a_valid_tool_use(client, srv):
    named = client.messages.create(model="tiny", max_tokens=400, extra_body=T0, tools=[WEATHER, TIME],
                                   tool_choice={"type": "tool", "name": "get_time"}, messages=USER)
    calls = _tool_blocks(named)
    assert [c.name for c in calls] == ["get_time"] and named.stop_reason == "tool_use"
    jsonschema.validate(calls[0].input, TIME["input_schema"])
    Message.model_validate(_message(srv, max_tokens=400, extra_body=T0, tools=[WEATHER, TIME],
                                    tool_choice={"type": "tool", "name": "get_time"}))
    anyone = client.messages.create(model="tiny", max_tokens=400, extra_body=T0, tools=[WEATHER, TIME],
                                    tool_choice={"type": "any"}, messages=USER)
    calls = _tool_blocks(anyone)
    assert calls and anyone.content[0].type == "tool_use"
    for c in calls:
        jsonschema.validate(c.input, {"get_weather": WEATHER, "get_time": TIME}[c.name]["input_schema"])
    none = client.messages.create(model="tiny", max_tokens=30, extra_body=T0, tools=[WEATHER],
                                  tool_choice={"type": "none"}, messages=USER)
    assert not _tool_blocks(none)


def test_tool_stream_and_loop(client, srv):
    kw = dict(model="tiny", max_tokens=400, extra_body=T0, tools=[WEATHER],
              tool_choice={"type": "tool", "name": "get_weather"}, messages=USER)
    first = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    assert [(c.name, c.input) for c in _tool_blocks(streamed)] == [(c.name, c.input) for c in _tool_blocks(first)]
    frames = _frames(srv, **{k: v for k, v in kw.items() if k not in ("model", "messages")})
    assert any(d["delta"]["type"] == "input_json_delta" for n, d in frames if n == "content_block_delta")
    call = _tool_blocks(first)[0]
    history = USER + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                      {"role": "user", "content": [
                          {"type": "tool_result", "tool_use_id": call.id, "content": "14 degrees"},
                          {"type": "text", "text": "And tomorrow?"}]}]
    second = client.messages.create(model="tiny", max_tokens=12, extra_body=T0, tools=[WEATHER], messages=history)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    errored = history[:2] + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "is_error": True,
         "content": [{"type": "text", "text": "timeout"},
                     {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _png()}}]}]}]
    assert client.messages.create(model="tiny", max_tokens=4, tools=[WEATHER], messages=errored).type == "message"
    plain = [{**errored[2], "content": [{**errored[2]["content"][0], "is_error": False}]}]
    said = [client.messages.count_tokens(model="tiny", tools=[WEATHER], messages=history[:2] + m).input_tokens
            for m in ([errored[2]], plain)]
    assert said[0] > said[1]  # is_error is in the prompt ("Error:" first)


# ---- thinking ------------------------------------------------------------------------------------
def test_thinking_blocks_returned_and_accepted_back(client, srv):
    kw = dict(model="tiny", max_tokens=24, extra_body=T0, messages=USER,
              thinking={"type": "enabled", "budget_tokens": 6})
    out = client.messages.create(**kw)
    assert out.content[0].type == "thinking" and out.content[0].thinking and out.content[0].signature
    assert out.usage.output_tokens_details.thinking_tokens == 6  # the budget ended the reasoning
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in out.content]
    frames = _frames(srv, **{k: v for k, v in kw.items() if k not in ("model", "messages")})
    kinds = [d["delta"]["type"] for n, d in frames if n == "content_block_delta"]
    assert "thinking_delta" in kinds and "signature_delta" in kinds
    history = USER + [out.to_param(), {"role": "user", "content": "Go on."}]
    again = client.messages.create(model="tiny", max_tokens=8, messages=history, extra_body=T0,
                                   thinking={"type": "enabled", "budget_tokens": 4})
    assert again.content[0].type == "thinking"
    plain = client.messages.create(model="tiny", max_tokens=8, messages=history, thinking={"type": "disabled"},
                                   extra_body=T0)
    assert [b.type for b in plain.content] == ["text"]
    effort = client.messages.create(model="tiny", max_tokens=8, messages=USER, output_config={"effort": "max"},
                                    extra_body=T0)
    assert effort.content[0].type == "thinking"  # an effort asks for thinking
    # in a tool loop the reasoning of the turn that made the call is rendered back (tools keep it)
    def loop(thought: str) -> list[dict]:
        return USER + [{"role": "assistant", "content": [
            {"type": "thinking", "thinking": thought, "signature": "any"},
            {"type": "tool_use", "id": "toolu_9", "name": "get_weather", "input": {"city": "Oslo", "unit": "c"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "3"}]}]
    counts = [client.messages.count_tokens(model="tiny", tools=[WEATHER], messages=loop(t),
                                           thinking={"type": "adaptive"}).input_tokens for t in ("hm", "hm, " * 20)]
    assert counts[1] > counts[0]


def test_output_format_json_schema(client):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}}, "required": ["colour"],
              "additionalProperties": False}
    out = client.messages.create(model="tiny", max_tokens=200, extra_body=T0, messages=USER,
                                 output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(out.content[0].text), schema)


# ---- count_tokens and usage ----------------------------------------------------------------------
@pytest.mark.parametrize("extra", [
    {},
    {"system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use English."}]},
    {"tools": [WEATHER], "tool_choice": {"type": "auto"}},
    {"thinking": {"type": "enabled", "budget_tokens": 3}},
    {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Describe."},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _png("blue")}}]}]},
], ids=["text", "system-blocks", "tools", "thinking", "image"])
def test_count_tokens_equals_create(client, srv, extra):
    body = {"model": "tiny", "messages": USER, **extra}
    counted = client.messages.count_tokens(**body)
    raw = _post(srv, "/v1/messages/count_tokens", body)
    assert raw.status_code == 200 and MessageTokensCount.model_validate(raw.json()).input_tokens == counted.input_tokens
    out = client.messages.create(max_tokens=4, extra_body=T0, **body)
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == counted.input_tokens


def test_cache_reads_are_reported(client):
    """A repeated long prompt is read from the prefix cache; input + cache reads stay the prompt."""
    kw = dict(model="tiny", max_tokens=4, extra_body=T0, tools=[WEATHER, TIME], messages=USER)
    client.messages.create(**kw)
    again = client.messages.create(**kw)
    assert again.usage.cache_read_input_tokens >= 256  # the prefix interval
    total = client.messages.count_tokens(model="tiny", tools=[WEATHER, TIME], messages=USER).input_tokens
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == total
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert final.usage.cache_read_input_tokens >= 256
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == total


# ---- auth ----------------------------------------------------------------------------------------
def test_keys_by_x_api_key_or_bearer(srv):
    bearer = anthropic.Anthropic(base_url=srv.base, auth_token=KEY, max_retries=0)
    assert bearer.messages.count_tokens(model="tiny", messages=USER).input_tokens > 0
    wrong = anthropic.Anthropic(base_url=srv.base, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as exc:
        wrong.messages.create(model="tiny", max_tokens=4, messages=USER)
    ErrorResponse.model_validate(exc.value.body)
    assert exc.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(srv.base + "/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": USER})
    assert _error(r, 401)["error"]["type"] == "authentication_error"
    # the same keys by x-api-key on the OpenAI routes; their errors stay OpenAI-shaped
    assert httpx.get(srv.base + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    openai_shaped = httpx.get(srv.base + "/v1/models")
    assert openai_shaped.status_code == 401 and openai_shaped.json()["error"]["code"] == "invalid_api_key"


# ---- hostile inputs ------------------------------------------------------------------------------
def _error(r: httpx.Response, status: int) -> dict:
    """An Anthropic-shaped error body with this status."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    if body["error"]["type"] != "request_too_large":  # Anthropic's 413 type, absent from the SDK's union
        ErrorResponse.model_validate(body)
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"]
    return body


def _msgs(*content) -> list[dict]:
    return [{"role": "user", "content": list(content)}]


IMG = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGVsbG8="}}
CALL = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]}
HOSTILE = {
    "missing max_tokens": {"model": "tiny", "messages": USER},
    "max_tokens zero": {"model": "tiny", "max_tokens": 0, "messages": USER},
    "no messages": {"model": "tiny", "max_tokens": 4, "messages": []},
    "bad role": {"model": "tiny", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]},
    "content not text": {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": 7}]},
    "empty content": {"model": "tiny", "max_tokens": 4, "messages": _msgs()},
    "unknown block": {"model": "tiny", "max_tokens": 4, "messages": _msgs({"type": "document", "source": {}})},
    "block without type": {"model": "tiny", "max_tokens": 4, "messages": _msgs({"text": "hi"})},
    "text without text": {"model": "tiny", "max_tokens": 4, "messages": _msgs({"type": "text"})},
    "text not a string": {"model": "tiny", "max_tokens": 4, "messages": _msgs({"type": "text", "text": ["x"]})},
    "unknown tool_use id": {"model": "tiny", "max_tokens": 4, "tools": [WEATHER], "messages": USER + [CALL] + _msgs(
        {"type": "tool_result", "tool_use_id": "toolu_other", "content": "1"})},
    "tool_result twice": {"model": "tiny", "max_tokens": 4, "tools": [WEATHER], "messages": USER + [CALL] + _msgs(
        {"type": "tool_result", "tool_use_id": "toolu_1"}, {"type": "tool_result", "tool_use_id": "toolu_1"})},
    "tool_result without a call": {"model": "tiny", "max_tokens": 4, "messages": _msgs(
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"})},
    "tool_result with a document": {"model": "tiny", "max_tokens": 4, "messages": USER + [CALL] + _msgs(
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "document"}]})},
    "tool_result content not blocks": {"model": "tiny", "max_tokens": 4, "messages": USER + [CALL] + _msgs(
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": ["14 degrees"]})},
    "tool_use from the user": {"model": "tiny", "max_tokens": 4, "messages": _msgs(CALL["content"][0])},
    "tool_use input not an object": {"model": "tiny", "max_tokens": 4, "messages": USER + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}] + USER},
    "trailing tool_use": {"model": "tiny", "max_tokens": 4, "messages": USER + [CALL]},
    "image url in a data field": {"model": "tiny", "max_tokens": 4, "messages": _msgs(
        {"type": "image", "source": {"type": "base64", "media_type": "image/bmp", "data": "aGVsbG8="}})},
    "image not an image": {"model": "tiny", "max_tokens": 4, "messages": _msgs(IMG)},
    "image file source": {"model": "tiny", "max_tokens": 4, "messages": _msgs(
        {"type": "image", "source": {"type": "file", "file_id": "file_1"}})},
    "image without source": {"model": "tiny", "max_tokens": 4, "messages": _msgs({"type": "image"})},
    "image from the assistant": {"model": "tiny", "max_tokens": 4, "messages": USER + [
        {"role": "assistant", "content": [IMG]}] + USER},
    "thinking without signature": {"model": "tiny", "max_tokens": 4, "messages": USER + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}]}] + USER},
    "redacted thinking": {"model": "tiny", "max_tokens": 4, "messages": USER + [
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}] + USER},
    "lone surrogate": '{"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "a\\ud800"}]}',
    "not json": "{\"model\": ",
    "temperature above 1": {"model": "tiny", "max_tokens": 4, "temperature": 1.5, "messages": USER},
    "budget over max_tokens": {"model": "tiny", "max_tokens": 4, "messages": USER,
                               "thinking": {"type": "enabled", "budget_tokens": 4}},
    "budget missing": {"model": "tiny", "max_tokens": 40, "messages": USER, "thinking": {"type": "enabled"}},
    "thinking type": {"model": "tiny", "max_tokens": 4, "messages": USER, "thinking": {"type": "sometimes"}},
    "effort with thinking off": {"model": "tiny", "max_tokens": 4, "messages": USER,
                                 "thinking": {"type": "disabled"}, "output_config": {"effort": "high"}},
    "tool_choice unknown tool": {"model": "tiny", "max_tokens": 4, "messages": USER, "tools": [WEATHER],
                                 "tool_choice": {"type": "tool", "name": "nope"}},
    "tool_choice any without tools": {"model": "tiny", "max_tokens": 4, "messages": USER,
                                      "tool_choice": {"type": "any"}},
    "tool without schema": {"model": "tiny", "max_tokens": 4, "messages": USER, "tools": [{"name": "f"}]},
    "tool schema not a schema": {"model": "tiny", "max_tokens": 4, "messages": USER,
                                 "tools": [{"name": "f", "input_schema": {"type": "nonsense"}}]},
    "server tool": {"model": "tiny", "max_tokens": 4, "messages": USER,
                    "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    "mcp servers": {"model": "tiny", "max_tokens": 4, "messages": USER, "mcp_servers": [{"url": "x"}]},
    "context too long": {"model": "tiny", "max_tokens": 100_000, "messages": USER},
}


# refusals of what create adds to the prompt fields: count_tokens takes these bodies
COUNTABLE = {"missing max_tokens", "max_tokens zero", "temperature above 1", "budget over max_tokens",
             "context too long"}


# what the message of some refusals must name (the field, in this API's terms)
NAMED = {"missing max_tokens": "max_tokens", "unknown tool_use id": "messages[2].content[0].tool_use_id",
         "tool schema not a schema": "tools[0].input_schema", "lone surrogate": "messages[0].content",
         "image file source": "source.type", "not json": "JSON", "mcp servers": "mcp_servers",
         "budget over max_tokens": "budget_tokens", "image not an image": "image"}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_inputs_get_anthropic_400s(srv, name):
    body = HOSTILE[name]
    refused = _error(_post(srv, "/v1/messages", body if isinstance(body, str) else json.dumps(body)), 400)
    assert NAMED.get(name, "") in refused["error"]["message"]
    counted = _post(srv, "/v1/messages/count_tokens", body if isinstance(body, str) else
                    {k: v for k, v in body.items() if k not in ("max_tokens", "temperature")})
    if name in COUNTABLE:
        assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
    else:
        _error(counted, 400)


def test_other_refusals_are_anthropic_shaped(srv):
    assert _error(_post(srv, "/v1/messages", {"model": "gpt-4", "max_tokens": 4, "messages": USER}),
                  404)["error"]["type"] == "not_found_error"
    assert _error(_post(srv, "/v1/messages/nothing", {}), 404)["error"]["type"] == "not_found_error"
    r = httpx.get(srv.base + "/v1/messages", headers={"x-api-key": KEY})
    assert _error(r, 405)["error"]["type"] == "invalid_request_error"
    big = {"model": "tiny", "max_tokens": 4, "messages": _msgs(
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "A" * 1_200_000}})}
    assert _error(_post(srv, "/v1/messages", big), 413)["error"]["type"] == "request_too_large"
    chunked = httpx.post(srv.base + "/v1/messages", content=iter([b"x" * 600_000] * 2),
                         headers={"x-api-key": KEY, "content-type": "application/json"})
    assert "content-length" not in chunked.request.headers  # the limit counted the streamed bytes
    assert _error(chunked, 413)["error"]["type"] == "request_too_large"
    chat = httpx.post(srv.base + "/v1/chat/completions", content=iter([b"x" * 600_000] * 2),
                      headers={"x-api-key": KEY, "content-type": "application/json"})
    assert chat.status_code == 413 and chat.json()["error"]["code"] == "request_too_large"  # OpenAI's there


LONG = {"model": "tiny", "max_tokens": 900, "messages": USER, **T0}  # greedy: no early end of sequence


def test_full_queue_is_overloaded_529(random_ckpt):
    with serve(random_ckpt, settings={"max_seqs": 1, "max_queue": 1}) as tight, httpx.Client(timeout=60) as http:
        url = tight.base + "/v1/messages"
        with http.stream("POST", url, json={**LONG, "stream": True}) as first, \
                http.stream("POST", url, json={**LONG, "stream": True}) as second:
            assert first.status_code == second.status_code == 200  # both admitted: one runs, one waits
            refused = http.post(url, json=LONG)
            assert _error(refused, 529)["error"]["type"] == "overloaded_error" and refused.headers["retry-after"]
        client = anthropic.Anthropic(base_url=tight.base, api_key="unused", max_retries=0)
        assert client.messages.create(model="tiny", max_tokens=4, messages=USER).type == "message"


def test_deadline_is_a_timeout_error(random_ckpt):
    """Before a stream opens the deadline is a 504 ``timeout_error``; after, an ``error`` event (which
    the SDK raises), with ``ping`` keep-alives while a request waits."""
    with serve(random_ckpt, settings={"max_seqs": 1}, limits={"request_timeout_s": 0.4, "keepalive_s": 0.05}) \
            as tight, httpx.Client(timeout=60) as http:
        url = tight.base + "/v1/messages"
        with http.stream("POST", url, json={**LONG, "stream": True}) as first, \
                http.stream("POST", url, json={**LONG, "stream": True}) as second:
            texts = [first.read().decode(), second.read().decode()]
        for text in texts:
            names = [line[7:] for line in text.split("\n") if line.startswith("event: ")]
            assert names[0] == "message_start" and names[-1] == "error" and "message_stop" not in names
            assert '"timeout_error"' in text.rsplit("event: error", 1)[1]
        assert "ping" in [line[7:] for line in texts[1].split("\n") if line.startswith("event: ")]
        client = anthropic.Anthropic(base_url=tight.base, api_key="unused", max_retries=0)
        with pytest.raises(anthropic.APIStatusError, match="timeout_error"):
            with client.messages.stream(model="tiny", max_tokens=900, messages=USER, extra_body=T0) as s:
                s.get_final_message()
        assert _error(http.post(url, json=LONG), 504)["error"]["type"] == "timeout_error"
        assert tight.loop.call(lambda core: core.leaks()) == ""


def test_server_healthy_afterwards(srv):
    assert httpx.get(srv.base + "/health").status_code == 200
    assert srv.loop.call(lambda core: core.leaks()) == ""
