"""The DS4 chat protocol through HTTP (issue 15): rendering endpoints, request controls, and the
reasoning / content / tool-call split of the output, streaming equal to non-streaming.

The random checkpoint cannot be made to write tool-call markup, so the output tests that need
markup script the engine's token ids (``scripted``: the real server path from ``ChoiceStream`` to
the SSE frames, only the engine replaced); the rest drive the real engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import replace

import httpx
import openai
import pytest

from ds4serve.chat import Tokenizer
from ds4serve.chat.dsml import EFFORT_PROMPTS
from ds4serve.runtime import RequestOutput
from ds4serve.server.chat_request import chat_setup
from ds4serve.server.protocol import ChatCompletionRequest
from image_helpers import image_url
from test_chat_encoding import published

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string"}, "days": {"type": "integer"}}}}}
D = "｜DSML｜"
CALL = (f'\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Paris'
        f'</{D}parameter>\n<{D}parameter name="days" string="false">3</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>')


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base + path, json={"model": "tiny", **body}, timeout=60)


class _Scripted:
    """A stand-in for the engine's ``RequestStream``: fixed outputs, ``chunk`` tokens each."""

    def __init__(self, ids: list[int], chunk: int, reason: str, logprobs: bool):
        self.outs, done = [], 0
        for k in range(0, len(ids), chunk):
            new = tuple(ids[k:k + chunk])
            done += len(new)
            last = k + chunk >= len(ids)
            lps = tuple((-0.5, ((t, -0.5),)) for t in new) if logprobs else None
            self.outs.append(RequestOutput("r", new, lps, last, reason if last else None, None, 10, done))

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if not self.outs:
            raise StopAsyncIteration
        await asyncio.sleep(0)
        return self.outs.pop(0)

    async def aclose(self) -> None:
        self.outs = []


@contextlib.contextmanager
def scripted(server, ids: list[int], chunk: int = 3, reason: str = "stop"):
    """Every request submitted meanwhile produces ``ids`` (the real server code reads them)."""
    loop = server.state.loop

    async def submit(spec, request_id):
        return _Scripted(ids, chunk, reason, spec.params.logprobs is not None)

    loop.submit = submit
    try:
        yield
    finally:
        del loop.submit  # the instance attribute hid the method


def _tok(server) -> Tokenizer:
    return server.state.tokenizer


def _stream(client, **kw) -> tuple[dict, list]:
    """A streamed answer folded the way a client does: (message-like dict, chunks)."""
    chunks = list(client.chat.completions.create(model="tiny", stream=True, **kw))
    msg = {"content": "", "reasoning_content": "", "tool_calls": {}, "finish_reason": None}
    for c in chunks:
        if not c.choices:
            continue
        d, extra = c.choices[0].delta, c.choices[0].delta.model_extra or {}
        msg["content"] += d.content or ""
        assert extra.get("reasoning_content") == extra.get("reasoning")
        msg["reasoning_content"] += extra.get("reasoning_content") or ""
        for tc in d.tool_calls or ():
            slot = msg["tool_calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": "", "pieces": 0})
            if tc.id:
                assert slot["id"] is None and tc.function.name and tc.type == "function"  # id, type, name first
                slot["id"], slot["name"] = tc.id, tc.function.name
            if tc.function and tc.function.arguments:
                slot["arguments"] += tc.function.arguments
                slot["pieces"] += 1
        msg["finish_reason"] = c.choices[0].finish_reason or msg["finish_reason"]
    return msg, chunks


# ---- rendering endpoints --------------------------------------------------------------------

@pytest.mark.parametrize("case", [1, 2, 3, 4])
def test_apply_template_returns_the_published_vectors(server, case):
    messages, gold, thinking = published(case)
    body = {"messages": messages, "chat_template_kwargs": {"thinking": thinking}}
    if case == 1:  # request-level tools land on the first (system) message, as the reference test has them
        body["tools"] = messages[0].pop("tools")
    r = post(server, "/apply-template", body)
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": gold}
    tokens = post(server, "/tokenize", body).json()["tokens"]
    assert tokens == _tok(server).encode_markup(gold)  # the reference's tokenizer.encode(prompt)
    assert post(server, "/detokenize", {"tokens": tokens}).json() == {"prompt": gold}


def test_tokenize_agrees_with_the_ids_the_engine_prefills(server, client):
    seen = []
    loop = server.state.loop
    real = loop.submit

    async def spy(spec, *a, **kw):
        seen.append(list(spec.prompt_ids))
        return await real(spec, *a, **kw)

    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(2)}},
                                             {"type": "text", "text": "What is this?"}]}]
    controls = {"chat_template_kwargs": {"thinking": True, "reasoning_effort": "high"}}
    loop.submit = spy
    try:
        out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, extra_body=controls)
    finally:
        del loop.submit
    tok = post(server, "/tokenize", {"messages": messages, **controls}).json()
    assert tok["tokens"] == seen[0] and tok["count"] == out.usage.prompt_tokens
    assert tok["max_model_len"] == loop.limits.max_model_len
    plain = post(server, "/tokenize", {"prompt": "hello"}).json()["tokens"]
    completion = client.completions.create(model="tiny", prompt="hello", max_tokens=1)
    assert len(plain) == completion.usage.prompt_tokens and plain[0] == _tok(server).bos_id


def test_tokenize_refuses_what_it_cannot_honour(server):
    assert post(server, "/tokenize", {"prompt": "a", "messages": USER}).status_code == 400
    assert post(server, "/tokenize", {"prompt": "a", "tools": [TOOL]}).status_code == 400
    r = post(server, "/tokenize", {"messages": USER, "add_generation_promt": True})  # misspelt: refused
    assert r.status_code == 400
    assert post(server, "/detokenize", {"tokens": [10**7]}).json()["error"]["param"] == "tokens"


def test_models_retrieve(client):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-9")
    assert err.value.body["code"] == "model_not_found"


# ---- request controls -----------------------------------------------------------------------

def _prompt(server, **body) -> str:
    r = post(server, "/apply-template", {"messages": USER, **body})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def test_thinking_and_effort_mapping(server):
    assert _prompt(server).endswith("<｜Assistant｜></think>")  # the server's default: off
    assert _prompt(server, thinking={"type": "enabled"}).endswith("<｜Assistant｜><think>")
    assert _prompt(server, chat_template_kwargs={"enable_thinking": True}).endswith("<think>")
    assert _prompt(server, reasoning_effort="none").endswith("</think>")
    high, top = EFFORT_PROMPTS["v4-vision"]["high"], EFFORT_PROMPTS["v4-vision"]["max"]
    assert _prompt(server, reasoning_effort="medium") == _prompt(
        server, chat_template_kwargs={"thinking": True, "reasoning_effort": "high"})
    assert high in _prompt(server, reasoning_effort="medium")
    assert top in _prompt(server, reasoning_effort="xhigh") and _prompt(server, reasoning_effort="xhigh").endswith(
        "<think>")
    assert _prompt(server, reasoning_effort="low") == _prompt(server, thinking={"type": "enabled"})
    for bad, param in [({"thinking": {"type": "enabled"}, "chat_template_kwargs": {"thinking": False}}, "thinking"),
                       ({"thinking": {"type": "disabled"}, "reasoning_effort": "high"}, "reasoning_effort"),
                       ({"chat_template_kwargs": {"reasoning_effort": "medium", "thinking": True}},
                        "chat_template_kwargs.reasoning_effort"),
                       ({"chat_template_kwargs": {"temperature": 1}}, "chat_template_kwargs.temperature"),
                       ({"reasoning_effort": "extreme"}, "reasoning_effort"),
                       ({"thinking": {"type": "auto"}}, "thinking.type")]:
        r = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 1, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)


def test_default_thinking_comes_from_the_server():
    body = ChatCompletionRequest(model="m", messages=USER)
    msgs = [m.model_dump(exclude_none=True) for m in body.messages]
    assert chat_setup(body, msgs, True).options.thinking and not chat_setup(body, msgs, False).options.thinking
    off = ChatCompletionRequest(model="m", messages=USER, thinking={"type": "disabled"})
    assert not chat_setup(off, msgs, True).options.thinking


def test_reasoning_in_history_accepted_under_both_names(server):
    history = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
               {"role": "user", "content": "q2"}]
    prompts = set()
    for name in ("reasoning_content", "reasoning"):
        history[1] = {"role": "assistant", "content": "a1", name: "because"}
        prompts.add(_prompt(server, messages=history, chat_template_kwargs={"thinking": True, "drop_thinking": False}))
    assert len(prompts) == 1 and "because</think>a1" in prompts.pop()


def test_tools_and_tool_history_are_rendered(server, client):
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    with scripted(server, _tok(server).encode_text("ok")):  # the byte tokenizer's tools block outgrows the context
        out = client.chat.completions.create(model="tiny", messages=history, tools=[TOOL], tool_choice="auto",
                                             max_tokens=2)
    assert out.choices[0].message.content == "ok"
    prompt = _prompt(server, messages=history, tools=[TOOL])
    assert "## Tools" in prompt and "<tool_result>sunny</tool_result>" in prompt and f'<{D}invoke name="get_weather">' in prompt


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"messages": USER + [{"role": "assistant", "content": "x"}]}, "messages[1]"),
    ({"messages": USER + [{"role": "assistant", "content": "x", "prefix": True}, USER[0]]}, "messages[1].prefix"),
    ({"stream_options": {"include_usage": True, "continuous_usage": True}, "stream": True}, "stream_options"),
    ({"max_reasoning_tokens": 10}, "max_reasoning_tokens"),
    ({"messages": [{"role": "user", "content": "q", "reasoning_content": "r"}]}, "messages[0].reasoning_content"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(server, body, param):
    r = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 1, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.json()


def test_json_response_format_is_rendered_by_apply_template(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}
    assert "## Response Format" in _prompt(server, response_format=fmt)


def test_prefix_completion_continues_the_assistant_text(server, client):
    messages = USER + [{"role": "assistant", "content": "The weather is", "prefix": True}]
    tokens = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    tok = _tok(server)
    assert tok.decode(tokens, False).endswith("<｜Assistant｜></think>The weather is") and tokens[-1] != tok.eos_id
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0)
    assert out.usage.prompt_tokens == len(tokens) and out.choices[0].message.content is not None


# ---- output: the real engine ----------------------------------------------------------------

def test_thinking_output_stream_equals_collected_with_usage_on_every_chunk(client):
    kw = dict(messages=USER, max_tokens=12, temperature=0, extra_body={"thinking": {"type": "enabled"}})
    whole = client.chat.completions.create(model="tiny", **kw)
    msg, chunks = _stream(client, stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw)
    got = whole.choices[0].message
    assert msg["content"] == (got.content or "")
    assert msg["reasoning_content"] == (got.model_extra["reasoning_content"] or "")
    assert got.model_extra["reasoning"] == got.model_extra["reasoning_content"]
    assert msg["finish_reason"] == whole.choices[0].finish_reason
    details = whole.usage.completion_tokens_details
    assert details.reasoning_tokens <= whole.usage.completion_tokens
    if not got.content:  # no </think> came: every token was reasoning
        assert details.reasoning_tokens == whole.usage.completion_tokens
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks) and counts == sorted(counts)
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


# ---- output: scripted token ids -------------------------------------------------------------

def _reply(server, reasoning: str, answer: str, eos: bool = True) -> list[int]:
    tok = _tok(server)
    ids = tok.encode_text(reasoning) + [tok.think_end_id] + tok.encode_text(answer)
    return ids + [tok.eos_id] if eos else ids


def test_tool_calls_stream_equals_collected(server, client):
    ids = _reply(server, "Let me check </think> it.", "Sure." + CALL)
    kw = dict(messages=USER, tools=[TOOL], max_tokens=200, extra_body={"thinking": {"type": "enabled"}})
    with scripted(server, ids, chunk=3):
        whole = client.chat.completions.create(model="tiny", **kw)
        msg, _ = _stream(client, stream_options={"include_usage": True}, **kw)
    got = whole.choices[0]
    assert got.finish_reason == "tool_calls" == msg["finish_reason"]
    assert got.message.content == "Sure." == msg["content"]  # no markup, no trailing blank line
    assert got.message.model_extra["reasoning_content"] == "Let me check </think> it." == msg["reasoning_content"]
    (call,) = got.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    (streamed,) = msg["tool_calls"].values()
    assert streamed["name"] == "get_weather" and streamed["arguments"] == call.function.arguments
    assert streamed["pieces"] > 1  # arguments arrive in pieces
    reasoning_ids = len(_tok(server).encode_text("Let me check </think> it."))
    assert whole.usage.completion_tokens_details.reasoning_tokens == reasoning_ids


def test_tool_choice_none_never_returns_markup(server, client):
    with scripted(server, _reply(server, "", "Sure." + CALL)[1:], chunk=2):
        kw = dict(messages=USER, tools=[TOOL], tool_choice="none", max_tokens=100)
        whole = client.chat.completions.create(model="tiny", **kw)
        msg, _ = _stream(client, **kw)
    assert whole.choices[0].message.content == "Sure." == msg["content"]
    assert not whole.choices[0].message.tool_calls and not msg["tool_calls"]
    assert whole.choices[0].finish_reason == "stop" == msg["finish_reason"]


def test_stopping_inside_reasoning_keeps_it_reasoning(server, client):
    tok = _tok(server)
    with scripted(server, tok.encode_text("still thinking"), reason="length"):
        whole = client.chat.completions.create(model="tiny", messages=USER, extra_body={"thinking": {"type": "enabled"}})
    got = whole.choices[0]
    assert got.finish_reason == "length" and got.message.content == ""
    assert got.message.model_extra["reasoning_content"] == "still thinking"


def test_eos_is_not_a_logprobs_entry(server, client):
    tok = _tok(server)
    ids = tok.encode_text("hi") + [tok.eos_id]
    with scripted(server, ids, chunk=2):
        whole = client.chat.completions.create(model="tiny", messages=USER, logprobs=True, top_logprobs=1)
        chunks = list(client.chat.completions.create(model="tiny", messages=USER, logprobs=True, stream=True))
    assert whole.choices[0].message.content == "hi"
    assert len(whole.choices[0].logprobs.content) == len(ids) - 1
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in whole.choices[0].logprobs.content]


def test_stop_string_in_content_after_reasoning(server, client):
    ids = _reply(server, "plan", "one two three")
    with scripted(server, ids, chunk=1):
        whole = client.chat.completions.create(model="tiny", messages=USER, stop=["two"],
                                               extra_body={"thinking": {"type": "enabled"}})
        msg, _ = _stream(client, messages=USER, stop=["two"], extra_body={"thinking": {"type": "enabled"}})
    assert whole.choices[0].message.content == "one " == msg["content"]
    assert whole.choices[0].message.model_extra["reasoning_content"] == "plan" == msg["reasoning_content"]
    assert whole.choices[0].finish_reason == "stop" == msg["finish_reason"]


def test_default_thinking_flag_is_a_server_limit():
    from ds4serve.server.limits import ServerLimits

    assert ServerLimits().default_thinking == "off"
    assert replace(ServerLimits(), default_thinking="on").default_thinking == "on"
    with pytest.raises(ValueError):
        ServerLimits(default_thinking="maybe")


def test_the_tiny_models_trained_template_is_the_ds4_chat_encoding():
    """Why one encoder serves every model: the bundled tiny model was trained on ``render_chat``
    prompts, which are exactly the DS4 chat-mode encoding of its (single-turn) conversations."""
    from ds4serve.chat import render_chat, render_ds4
    from ds4serve.tiny.data import examples, messages
    from ds4serve.tiny.random_model import BUNDLED

    if not (BUNDLED / "tokenizer.json").exists():
        pytest.skip("bundled model not present")
    tok = Tokenizer(BUNDLED)
    for ex in examples(3, 60):
        msgs = messages(ex, ["data:,"] * len(ex.images))
        old, new = render_chat(tok, msgs), render_ds4(tok, msgs)
        assert (old.ids, old.image_positions) == (new.ids, new.image_positions)


FINISH = {"stop", "length", "tool_calls", "content_filter", "function_call", None}


def _check_tool_call(tc: dict, streamed: bool) -> None:
    assert isinstance(tc["index" if streamed else "id"], (int, str))
    if "id" in tc:
        assert tc["type"] == "function" and isinstance(tc["id"], str) and isinstance(tc["function"]["name"], str)
    assert isinstance(tc["function"]["arguments"], str)


def _check_chunk(c: dict) -> None:
    """A ``chat.completion.chunk`` as OpenAI's schema has it, field by field (no extra top-level keys)."""
    assert set(c) <= {"id", "object", "created", "model", "choices", "usage"} and c["object"] == "chat.completion.chunk"
    for ch in c["choices"]:
        assert set(ch) == {"index", "delta", "logprobs", "finish_reason"} and ch["finish_reason"] in FINISH
        d = ch["delta"]
        assert set(d) <= {"role", "content", "reasoning_content", "reasoning", "tool_calls"}
        assert all(isinstance(d[k], str) for k in ("content", "reasoning_content", "reasoning") if k in d)
        for tc in d.get("tool_calls", ()):
            _check_tool_call(tc, streamed=True)


def test_responses_have_openai_shapes(server):
    body = {"messages": USER, "tools": [TOOL], "max_tokens": 200, "thinking": {"type": "enabled"}}
    with scripted(server, _reply(server, "hm", "Sure." + CALL)):
        whole = post(server, "/v1/chat/completions", body).json()
        with httpx.stream("POST", server.base + "/v1/chat/completions", timeout=60,
                          json={"model": "tiny", "stream": True, "stream_options": {"include_usage": True}, **body}) as s:
            frames = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    for f in frames[:-1]:
        _check_chunk(json.loads(f))
    assert set(whole) == {"id", "object", "created", "model", "choices", "usage"}
    (choice,) = whole["choices"]
    assert set(choice) == {"index", "message", "logprobs", "finish_reason"} and choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert set(msg) == {"role", "content", "refusal", "reasoning_content", "reasoning", "tool_calls"}
    assert msg["role"] == "assistant" and msg["refusal"] is None  # refusal: required (nullable) by OpenAI
    for tc in msg["tool_calls"]:
        assert set(tc) == {"id", "type", "function"} and set(tc["function"]) == {"name", "arguments"}
        _check_tool_call(tc, streamed=False)
    usage = whole["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": len(_tok(server).encode_text("hm"))}
