"""The OpenAI Responses API (``POST /v1/responses``) through the official ``openai`` SDK and the OpenAI
Agents SDK, against the bundled model served in-process.

Every response body and every stream event is validated against the SDK's own pydantic types
(``Response.model_validate`` and the ``ResponseStreamEvent`` union), not only parsed leniently as
the client does. The bundled model answers its trained questions (an image's colours, sums) and is
otherwise off its distribution, so shapes are forced with ``tool_choice`` and ``text.format``; the
assertions are about the protocol, plus the trained answers that show the input arrived intact.
"""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from grammar_helpers import validate
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

BUNDLED = Path(__file__).resolve().parent.parent / "models" / "ds4v-tiny"
IMAGE = "data:image/png;base64," + base64.b64encode((BUNDLED / "sample.png").read_bytes()).decode()
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "role": {"enum": ["admin", "user"]}}, "required": ["name", "age", "role"], "additionalProperties": False}
PERSON_FORMAT = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
ARGS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather", "parameters": ARGS,
           "strict": True}
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def server():
    from ds4serve.server.inprocess import serve

    with serve(BUNDLED, name="tiny", random_weights=False, settings={"max_model_len": 2048}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def create(client: openai.OpenAI, **kw: Any) -> tuple[Response, dict[str, Any]]:
    """``responses.create`` (greedy unless told), its raw body validated strictly against ``Response``."""
    kw = {"model": "tiny", "temperature": 0, **kw}
    raw = client.responses.with_raw_response.create(**kw)
    body = raw.http_response.json()
    strict = Response.model_validate(body)
    assert raw.parse().model_dump() == strict.model_dump()
    return strict, body


def stream_events(server, **body: Any) -> list[dict[str, Any]]:
    """The raw SSE events of a streamed request, each validated against the SDK's event union."""
    body = {"model": "tiny", "temperature": 0, "stream": True, **body}
    events = []
    with httpx.stream("POST", server.base + "/v1/responses", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                ev = json.loads(line[6:])
                assert ev["type"] == name and EVENTS.validate_python(ev).type == name
                events.append(ev)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def tokens_of(server, messages: list[dict[str, Any]], **controls: Any) -> int:
    """The prompt length of the equivalent chat request (``/tokenize``, image blocks expanded)."""
    r = httpx.post(server.base + "/tokenize", json={"model": "tiny", "messages": messages, **controls}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def error_of(server, body: dict[str, Any], status: int = 400) -> dict[str, Any]:
    # ASCII JSON: a lone surrogate travels as the escape "\\ud800", as a JSON client would send it
    r = httpx.post(server.base + "/v1/responses", content=json.dumps(body), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    kind = "invalid_request_error" if status < 500 else "server_error"
    assert isinstance(err["message"], str) and err["message"] and err["type"] == kind
    return err


# ---- plain answers --------------------------------------------------------------------------
def test_text_input_is_a_completed_response_with_one_message(client, server):
    resp, body = create(client, input="What is 7 + 5?", max_output_tokens=16, metadata={"run": "a"}, store=True)
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.status == "completed"
    assert resp.model == "tiny" and resp.metadata == {"run": "a"} and resp.incomplete_details is None
    [msg] = resp.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "completed" and msg.id.startswith("msg_")
    assert [p.type for p in msg.content] == ["output_text"] and resp.output_text == msg.content[0].text == "12"
    usage = resp.usage
    assert usage.input_tokens == tokens_of(server, [{"role": "user", "content": "What is 7 + 5?"}])
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens and usage.output_tokens >= 1
    assert usage.output_tokens_details.reasoning_tokens == 0 and usage.input_tokens_details.cached_tokens >= 0
    assert (body["tools"], body["tool_choice"], body["parallel_tool_calls"], body["temperature"]) == ([], "auto",
                                                                                                    True, 0.0)


def test_items_and_instructions_render_as_the_chat_messages_would(client, server):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "What is 2 + 2?"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "4", "annotations": []}]},
             {"type": "message", "role": "user", "content": "What is 7 + 5?"}]
    resp, _ = create(client, input=items, instructions="Answer with a number.", max_output_tokens=16)
    chat = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "What is 7 + 5?"}]
    assert resp.status == "completed" and resp.instructions == "Answer with a number."
    assert resp.usage.input_tokens == tokens_of(server, chat)


def test_an_image_input_reaches_the_model(client, server):
    content = [{"type": "input_image", "image_url": IMAGE, "detail": "auto"},
               {"type": "input_text", "text": "What colour is the triangle?"}]
    resp, _ = create(client, input=[{"role": "user", "content": content}], max_output_tokens=16)
    assert resp.output_text == (BUNDLED / "sample_answer.txt").read_text().strip()
    chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE}},
                                         {"type": "text", "text": "What colour is the triangle?"}]}]
    assert resp.usage.input_tokens == tokens_of(server, chat)


def test_max_output_tokens_makes_an_incomplete_response(client):
    resp, _ = create(client, input="Reverse the letters: c a t", max_output_tokens=2, extra_body={"ignore_eos": True})
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 2 and resp.output[-1].status == "incomplete"


def test_json_schema_text_format_gives_json_that_validates(client):
    resp, body = create(client, input="Tell me about a person.", max_output_tokens=200, text=PERSON_FORMAT)
    validate(json.loads(resp.output_text), PERSON)
    assert body["text"]["format"]["name"] == "person"
    parsed = client.responses.parse(model="tiny", input="Tell me about a person.", max_output_tokens=200,
                                    temperature=0, text=PERSON_FORMAT)
    assert parsed.output_text == resp.output_text


def test_reasoning_comes_back_as_a_reasoning_item_and_goes_back_in(client, server):
    """Thinking mode (an effort): the JSON grammar holds the answer back until ``</think>``, which the
    reasoning budget forces, so there is reasoning and then a valid answer."""
    kw = dict(max_output_tokens=200, text=PERSON_FORMAT, reasoning={"effort": "low", "summary": "auto"},
              extra_body={"max_reasoning_tokens": 12})
    resp, _ = create(client, input="Tell me about a person.", **kw)
    reasoning, message = resp.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.status == "completed"
    [text] = reasoning.content
    assert text.type == "reasoning_text" and text.text and [s.text for s in reasoning.summary] == [text.text]
    validate(json.loads(message.content[0].text), PERSON)
    assert 1 <= resp.usage.output_tokens_details.reasoning_tokens <= 12
    history = [{"role": "user", "content": "Tell me about a person."},
               *[item.model_dump(exclude_none=True) for item in resp.output],
               {"role": "user", "content": "Another one."}]
    again, _ = create(client, input=history, **kw)
    assert again.status == "completed"
    chat = [{"role": "user", "content": "Tell me about a person."},
            {"role": "assistant", "content": message.content[0].text, "reasoning_content": text.text},
            {"role": "user", "content": "Another one."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    assert again.usage.input_tokens == tokens_of(server, chat, reasoning_effort="low", response_format=fmt)


# ---- streaming ------------------------------------------------------------------------------
def _texts(events: list[dict[str, Any]], kind: str, key: str = "delta") -> str:
    return "".join(e[key] for e in events if e["type"] == kind)


def test_a_text_stream_follows_the_documented_sequence_and_equals_the_answer(client, server):
    whole, _ = create(client, input="What is 7 + 5?", max_output_tokens=16)
    events = stream_events(server, input="What is 7 + 5?", max_output_tokens=16)
    assert [e["type"] for e in events[:5]] == ["response.created", "response.in_progress",
                                               "response.output_item.added", "response.content_part.added",
                                               "response.output_text.delta"]
    assert [e["type"] for e in events[-4:]] == ["response.output_text.done", "response.content_part.done",
                                                "response.output_item.done", "response.completed"]
    assert _texts(events, "response.output_text.delta") == events[-4]["text"] == whole.output_text
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == whole.output_text and final.usage == whole.usage
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    with client.responses.stream(model="tiny", input="What is 7 + 5?", max_output_tokens=16, temperature=0) as s:
        deltas = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        assert deltas == s.get_final_response().output_text == whole.output_text


def test_a_reasoning_and_json_stream(server, client):
    kw = dict(input="Tell me about a person.", max_output_tokens=200, text=PERSON_FORMAT,
              reasoning={"effort": "low", "summary": "auto"}, max_reasoning_tokens=12)
    events = stream_events(server, **kw)
    final = Response.model_validate(events[-1]["response"])
    reasoning, message = final.output
    assert _texts(events, "response.reasoning_text.delta") == reasoning.content[0].text
    assert _texts(events, "response.reasoning_summary_text.delta") == reasoning.summary[0].text
    assert _texts(events, "response.output_text.delta") == message.content[0].text
    types = [e["type"] for e in events]
    assert types.index("response.reasoning_text.done") < types.index("response.reasoning_summary_part.added") < \
        types.index("response.output_text.delta")
    kw.pop("max_reasoning_tokens")
    whole, _ = create(client, **kw, extra_body={"max_reasoning_tokens": 12})
    assert [i.model_dump(exclude={"id"}) for i in whole.output] == [i.model_dump(exclude={"id"}) for i in final.output]


# ---- function tools -------------------------------------------------------------------------
def test_a_function_tool_loop(client, server):
    first, body = create(client, input="Weather?", tools=[WEATHER], tool_choice="required", max_output_tokens=300,
                         parallel_tool_calls=True)
    assert body["tools"][0]["name"] == "get_weather" and body["tool_choice"] == "required"
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status in ("completed", "incomplete")
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_") and call.status == "completed"
    validate(json.loads(call.arguments), ARGS)
    history = [{"role": "user", "content": "Weather?"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    second, _ = create(client, input=history, tools=[WEATHER], tool_choice="none", max_output_tokens=40)
    assert [i.type for i in second.output] == ["message"] and second.status in ("completed", "incomplete")
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt, from the prefix cache


def test_a_named_tool_streams_its_arguments(server):
    events = stream_events(server, input="Weather?", tools=[WEATHER], max_output_tokens=300,
                           tool_choice={"type": "function", "name": "get_weather"})
    final = Response.model_validate(events[-1]["response"])
    assert final.status == "completed" and events[-1]["type"] == "response.completed"
    [call] = final.output
    assert _texts(events, "response.function_call_arguments.delta") == call.arguments
    [done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done["arguments"] == call.arguments and done["item_id"] == call.id
    validate(json.loads(call.arguments), ARGS)


def test_the_agents_sdk_default_model_runs_a_tool_loop(server):
    """``OpenAIResponsesModel`` (the Agents SDK's default) runs: a forced call of the one tool, the
    tool's output sent back, a final message; once plain and once streamed. Every body the server
    sends is validated strictly on the way in (an httpx response hook)."""
    import agents  # noqa: PLC0415 - the Agents SDK, in the test extras

    agents.set_tracing_disabled(True)
    seen: list[str] = []
    bodies: list[dict[str, Any]] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        seen.append(city)
        return "sunny"

    async def check(r: httpx.Response) -> None:
        if r.request.url.path == "/v1/responses" and r.headers["content-type"] == "application/json":
            bodies.append(Response.model_validate_json(await r.aread()).model_dump())

    http = httpx.AsyncClient(event_hooks={"response": [check]})
    client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120,
                                http_client=http)
    agent = agents.Agent(name="weather", instructions="Answer.", tools=[get_weather],
                         model=agents.OpenAIResponsesModel(model="tiny", openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=300))

    async def both() -> tuple[Any, Any]:
        plain = await agents.Runner.run(agent, "Weather in Paris?", max_turns=4)
        streamed = agents.Runner.run_streamed(agent, "Weather in Paris?", max_turns=4)
        kinds = [ev.type async for ev in streamed.stream_events()]
        assert "raw_response_event" in kinds
        return plain, streamed

    plain, streamed = asyncio.run(both())
    assert len(bodies) == 2 and len(seen) == 2 and seen[0] == seen[1]
    for result in (plain, streamed):
        kinds = [item.type for item in result.new_items]
        assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
        assert isinstance(result.final_output, str)
    assert plain.final_output == streamed.final_output


# ---- refusals -------------------------------------------------------------------------------
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}
HOSTILE = {
    "no input": ({"model": "tiny"}, "input"),
    "input a number": ({"model": "tiny", "input": 5}, "input"),
    "empty input": ({"model": "tiny", "input": []}, "input"),
    "unknown role": ({"model": "tiny", "input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    "unsupported item": ({"model": "tiny", "input": [{"type": "web_search_call", "id": "w"}]}, "input[0].type"),
    "item reference": ({"model": "tiny", "input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    "text part without text": ({"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
                               "input[0].content[0].text"),
    "unknown call_id": ({"model": "tiny", "input": [{"role": "user", "content": "x"}, CALL, {
        "type": "function_call_output", "call_id": "call_2", "output": "x"}]}, "input[2].call_id"),
    "call without output": ({"model": "tiny", "input": [{"role": "user", "content": "x"}, CALL,
                                                        {"role": "user", "content": "y"}]}, "input[1]"),
    "ends with assistant": ({"model": "tiny", "input": [{"role": "assistant", "content": "x"}]}, "input[0]"),
    "image by file id": ({"model": "tiny", "input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file-1"}]}]}, "input[0].content[0].file_id"),
    "image as a number": ({"model": "tiny", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": 7}]}]}, "input[0].content[0].image_url"),
    "image not an image": ({"model": "tiny", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,aGVsbG8="}]}]}, "input"),
    "image from a host not allowed": ({"model": "tiny", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://127.0.0.1:9/x.png"}]}]}, "input"),
    "image in a system message": ({"model": "tiny", "input": [{"role": "system", "content": [
        {"type": "input_image", "image_url": IMAGE}]}, {"role": "user", "content": "x"}]}, "input[0].content[0].type"),
    "a file": ({"model": "tiny", "input": [{"role": "user", "content": [
        {"type": "input_file", "file_data": "x"}]}]}, "input[0].content[0].type"),
    "lone surrogate": ({"model": "tiny", "input": "a\ud800b"}, "input"),
    "lone surrogate in an item": ({"model": "tiny", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "\udc00"}]}]}, "input[0].content[0].text"),
    "previous_response_id": ({"model": "tiny", "input": "x", "previous_response_id": "resp_1"},
                             "previous_response_id"),
    "conversation": ({"model": "tiny", "input": "x", "conversation": "conv_1"}, "conversation"),
    "truncation auto": ({"model": "tiny", "input": "x", "truncation": "auto"}, "truncation"),
    "hosted tool": ({"model": "tiny", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    "tool without name": ({"model": "tiny", "input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    "tool_choice unknown function": ({"model": "tiny", "input": "x", "tools": [WEATHER],
                                      "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    "tool_choice hosted": ({"model": "tiny", "input": "x", "tool_choice": {"type": "file_search"}},
                           "tool_choice.type"),
    "bad parameters schema": ({"model": "tiny", "input": "x", "tools": [{**WEATHER, "parameters": {
        "type": "object", "properties": {"a": {"type": "text"}}}}]}, "tools[0].parameters.properties.a.type"),
    "bad json_schema for the grammar": ({"model": "tiny", "input": "x", "text": {"format": {
        "type": "json_schema", "name": "p", "schema": {"type": "object", "minProperties": "a"}}}},
        "text.format.schema"),
    "json_schema without schema": ({"model": "tiny", "input": "x", "text": {"format": {
        "type": "json_schema", "name": "p"}}}, "text.format.schema"),
    "bad format type": ({"model": "tiny", "input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    "bad effort": ({"model": "tiny", "input": "x", "reasoning": {"effort": "huge"}}, "reasoning.effort"),
    "temperature out of range": ({"model": "tiny", "input": "x", "temperature": 3}, "temperature"),
    "logprobs include": ({"model": "tiny", "input": "x", "include": ["message.output_text.logprobs"]}, "include[0]"),
    "background": ({"model": "tiny", "input": "x", "background": True}, "background"),
    "arguments a JSON list": ({"model": "tiny", "input": [{"role": "user", "content": "x"}, {**CALL, "arguments": "[1]"},
                                                          {"type": "function_call_output", "call_id": "call_1",
                                                           "output": "x"}]}, "input[1].arguments"),
    "too many turns": ({"model": "tiny", "input": [{"role": "user", "content": "x"}] * 600}, "input"),
    "metadata not a string": ({"model": "tiny", "input": "x", "metadata": {"a": 1}}, "metadata.a"),
    "unknown stream option": ({"model": "tiny", "input": "x", "stream": True, "stream_options": {"x": 1}},
                              "stream_options.x"),
    "tool_choice required without tools": ({"model": "tiny", "input": "x", "tool_choice": "required"},
                                           "tool_choice"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_inputs_are_400s_naming_the_field(server, case):
    body, param = HOSTILE[case]
    err = error_of(server, body)
    assert err["param"] == param, err


def test_unknown_model_and_stored_responses_are_404s(server):
    err = error_of(server, {"model": "gpt-9", "input": "x"}, 404)
    assert err["param"] == "model"
    r = httpx.get(server.base + "/v1/responses/resp_123", timeout=30)
    assert r.status_code == 404 and "stateless" in r.json()["error"]["message"]
    assert httpx.get(server.base + "/health", timeout=30).json() == {"status": "ok"}


def test_the_deadline_mid_stream_is_an_error_event_then_response_failed():
    """A stream past ``--request-timeout`` ends with ``error`` and ``response.failed`` (valid SDK
    events); a plain answer is a 504; the server goes on serving."""
    from ds4serve.server.inprocess import serve

    with serve(BUNDLED, name="tiny", random_weights=False, settings={"max_model_len": 2048},
               limits={"request_timeout_s": 0.25}) as srv:
        body = {"input": "What is 7 + 5?", "max_output_tokens": 2000, "ignore_eos": True}
        events = stream_events(srv, **body)
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"] and events[-2]["code"] == "timeout"
        failed = Response.model_validate(events[-1]["response"])
        assert failed.status == "failed" and failed.error.code == "server_error"
        err = error_of(srv, {"model": "tiny", **body}, 504)
        assert err["code"] == "timeout"
        assert httpx.get(srv.base + "/health", timeout=30).json() == {"status": "ok"}
        assert srv.loop.call(lambda core: core.leaks()) == ""  # both cancelled requests let go of everything
