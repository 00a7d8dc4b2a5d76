"""LangChain (``langchain-openai``) and instructor, the libraries agents are written with, driven
unchanged against the bundled model served in-process.

Each library is used the way its own docs show; the only ds4serve-specific settings are the base URL,
greedy sampling and a seed. The bundled model answers its trained questions (sums, an image's colours)
and is otherwise off its distribution, so structured shapes are forced (``tool_choice``, a schema) and
the assertions are about the protocol: the library's parsed object validates against the schema, a
tool call has the library's shape, and what the library sent on the wire is what its docs say it sends
(captured with an httpx hook, so a library changing its request shape shows up here). Where the model
was trained (``What is 7 + 5?`` -> ``12``, the sample picture's colour) the content is asserted too,
which shows the request reached the model intact. langchain-openai is in the test extra; instructor is installed by the
README's test command with ``--no-deps`` (its release caps jiter < 0.15, which would pull openai back to
3.3, whose Responses types fail tests/test_responses_api.py; it runs fine with the newer ones).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
import openai
import pytest
from grammar_helpers import validate
from pydantic import BaseModel, Field

from ds4serve.server.inprocess import serve

BUNDLED = Path(__file__).resolve().parent.parent / "models" / "ds4v-tiny"
PNG = base64.b64encode((BUNDLED / "sample.png").read_bytes()).decode()
COLOUR = (BUNDLED / "sample_answer.txt").read_text().strip()
SUM = "What is 7 + 5?"
GREEDY = {"temperature": 0, "seed": 1234}

class Person(BaseModel):
    """A bounded record: every string has a maximum length, so the grammar closes it in a few tokens."""

    name: str = Field(max_length=6, description="first name")
    age: int = Field(ge=0, le=99)
    role: Literal["admin", "user"]


class Weather(BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=9)


@pytest.fixture(scope="module")
def server():
    """Room for the DS4 tools preamble that the function-calling paths render."""
    with serve(BUNDLED, name="tiny", random_weights=False, settings={"max_model_len": 4096}) as srv:
        yield srv


class Wire:
    """The JSON bodies a client sent, captured by an httpx request hook (the request as it left)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def hook(self, request: httpx.Request) -> None:
        if request.method == "POST":
            self.bodies.append(json.loads(request.content))

    def client(self) -> httpx.Client:
        return httpx.Client(event_hooks={"request": [self.hook]}, timeout=120)

    @property
    def last(self) -> dict[str, Any]:
        return self.bodies[-1]


def openai_client(server, wire: Wire) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0,
                         http_client=wire.client())


def prompt_tokens(server, messages: list[dict[str, Any]]) -> int:
    """The prompt length ds4serve renders for these chat messages (``/tokenize``)."""
    r = httpx.post(server.base + "/tokenize", json={"model": "tiny", "messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["count"]


# ---- LangChain --------------------------------------------------------------------------------
@pytest.fixture()
def chat_model(server):
    from langchain_openai import ChatOpenAI  # in the test extra: a missing install fails, it does not skip

    wire = Wire()
    model = ChatOpenAI(model="tiny", base_url=server.base + "/v1", api_key="unused", max_retries=0,
                          max_tokens=400, http_client=wire.client(), stream_usage=True, **GREEDY)
    return model, wire


def test_langchain_invoke_and_stream_give_the_same_answer(chat_model, server):
    model, wire = chat_model
    msg = model.invoke(SUM)
    assert msg.content == "12" and msg.response_metadata["finish_reason"] == "stop"
    assert wire.last["messages"] == [{"role": "user", "content": SUM}] and not wire.last.get("stream")
    usage = msg.usage_metadata
    assert usage["input_tokens"] == prompt_tokens(server, [{"role": "user", "content": SUM}])
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    chunks = list(model.stream(SUM))
    assert wire.last["stream"] is True
    assert len(chunks) >= 2 and "".join(c.content for c in chunks) == "12"
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert merged.usage_metadata == usage


def test_langchain_image_content_parts_reach_the_model(chat_model):
    """The OpenAI ``image_url`` part and LangChain's own cross-provider image block (which it converts)."""
    from langchain_core.messages import HumanMessage

    model, wire = chat_model
    question = {"type": "text", "text": "What colour is the triangle?"}
    for image in ({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                  {"type": "image", "base64": PNG, "mime_type": "image/png"}):
        msg = model.invoke([HumanMessage(content=[image, question])])
        assert msg.content == COLOUR
        sent = wire.last["messages"][0]["content"]
        assert sent[0]["type"] == "image_url" and sent[0]["image_url"]["url"].endswith(PNG)


def get_weather(city: Literal["Paris", "Rome"], days: Annotated[int, Field(ge=1, le=9)]) -> str:
    """The weather in a city for the next days (bounded, as an unbounded integer never ends on this model)."""
    return f"sunny in {city} for {days} days"


def test_langchain_bind_tools_without_parallel_calls_gives_one_call(chat_model):
    """``bind_tools(parallel_tool_calls=False)`` (once a 400) with the call forced: exactly one call, its
    arguments parsed by LangChain into a dict that validates against the tool's schema."""
    model, wire = chat_model
    bound = model.bind_tools([get_weather, Weather], tool_choice="any", parallel_tool_calls=False)
    msg = bound.invoke("What is the weather in Rome for three days?")
    assert wire.last["parallel_tool_calls"] is False and wire.last["tool_choice"] == "required"
    assert [t["function"]["name"] for t in wire.last["tools"]] == ["get_weather", "Weather"]
    [call] = msg.tool_calls
    assert msg.response_metadata["finish_reason"] == "tool_calls" and not msg.invalid_tool_calls
    assert call["name"] in ("get_weather", "Weather") and call["id"] and call["type"] == "tool_call"
    validate(call["args"], Weather.model_json_schema())
    chunks = list(bound.stream("What is the weather in Rome for three days?"))  # the call in pieces, merged
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert len(chunks) > 2 and [(c["name"], c["args"]) for c in merged.tool_calls] == [(call["name"], call["args"])]
    # the call goes back in the history with its result, and the model answers in text
    from langchain_core.messages import HumanMessage, ToolMessage

    history = [HumanMessage("What is the weather in Rome for three days?"), msg,
               ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"])]
    answer = model.bind_tools([get_weather], tool_choice="none").invoke(history)
    assert isinstance(answer.content, str) and answer.content and not answer.tool_calls
    assert wire.last["messages"][-1] == {"role": "tool", "content": get_weather(**call["args"]),
                                         "tool_call_id": call["id"]}


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output_is_a_parsed_object(chat_model, method):
    """``with_structured_output``: function calling (a forced tool, ``parallel_tool_calls`` false) and
    json_schema (``response_format``, strict); either way a ``Person`` instance, parsed by LangChain."""
    model, wire = chat_model
    structured = model.with_structured_output(Person, method=method, include_raw=True)
    out = structured.invoke("Tell me about a person.")
    assert out["parsing_error"] is None and isinstance(out["parsed"], Person)
    sent = wire.last
    if method == "function_calling":
        assert sent["parallel_tool_calls"] is False
        assert sent["tool_choice"] == {"type": "function", "function": {"name": "Person"}}
        [call] = out["raw"].tool_calls
        assert call["name"] == "Person" and Person(**call["args"]) == out["parsed"]
    else:
        fmt = sent["response_format"]
        assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "Person"
        assert Person.model_validate_json(out["raw"].content) == out["parsed"]
    validate(out["parsed"].model_dump(), Person.model_json_schema())


# ---- instructor -------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_gives_a_validated_model(server, mode):
    """instructor's TOOLS mode (a forced function call) and JSON_SCHEMA mode (``response_format``
    json_schema without ``strict``: no unlisted keys may appear, or generation would wander to the
    token limit) each give a validated ``Person`` on the first attempt (no retries allowed)."""
    import instructor
    wire = Wire()
    client = instructor.from_openai(openai_client(server, wire), mode=getattr(instructor.Mode, mode))
    person, completion = client.chat.completions.create_with_completion(
        model="tiny", response_model=Person, max_retries=1, max_tokens=400,
        messages=[{"role": "user", "content": "Tell me about a person."}], **GREEDY)
    assert isinstance(person, Person) and len(wire.bodies) == 1
    validate(person.model_dump(), Person.model_json_schema())
    choice = completion.choices[0]
    if mode == "TOOLS":
        assert wire.last["tool_choice"] == {"type": "function", "function": {"name": "Person"}}
        [call] = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls"
        assert Person.model_validate_json(call.function.arguments).model_dump() == person.model_dump()
    else:
        assert wire.last["response_format"]["type"] == "json_schema"
        assert "strict" not in wire.last["response_format"]["json_schema"]
        assert choice.finish_reason == "stop"
        assert Person.model_validate_json(choice.message.content).model_dump() == person.model_dump()


def test_instructor_retries_on_a_validation_error_and_reports_it(server):
    """A validator the first answer cannot meet: instructor asks again with the error in the history
    (its retry loop over ds4serve), then raises its own error naming the validation failure."""
    import instructor
    from instructor.core.exceptions import InstructorRetryException
    from pydantic import field_validator

    class Impossible(Person):
        @field_validator("age")
        @classmethod
        def never(cls, v: int) -> int:
            raise ValueError("age is never right")

    wire = Wire()
    client = instructor.from_openai(openai_client(server, wire), mode=instructor.Mode.TOOLS)
    with pytest.raises(InstructorRetryException, match="age is never right"):
        client.chat.completions.create(model="tiny", response_model=Impossible, max_retries=2, max_tokens=400,
                                       messages=[{"role": "user", "content": "Tell me about a person."}],
                                       **GREEDY)
    assert len(wire.bodies) == 2 and len(wire.bodies[1]["messages"]) > len(wire.bodies[0]["messages"])
