"""Every response body validates against OpenAI's response schemas, strictly.

The openai client's pydantic types are lenient (unknown fields are kept, missing optional ones are
defaulted), so a body the client accepts can still break a strict consumer (a typed SDK in another
language, a proxy that validates). Here real requests go over raw HTTP (httpx, raw JSON) and every
body, and every SSE chunk of a stream, is checked against the JSON Schemas in
``tests/data/openai_schemas`` (transcribed from openai/openai-openapi, see its README):
``additionalProperties: false`` at every level except the extensions listed there on purpose.

The bundled trained model (``models/ds4v-tiny``) serves all of it: it has real weights (so the
model card is the production one) and its BPE vocabulary keeps tool prompts short.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import httpx
import jsonschema_rs
import pytest

SCHEMAS = Path(__file__).resolve().parent / "data" / "openai_schemas"
BUNDLED = Path(__file__).resolve().parent.parent / "models" / "ds4v-tiny"
NAMES = ["chat.completion", "chat.completion.chunk", "text_completion", "text_completion.chunk", "model", "list",
         "error", "usage"]
ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": ARGS}},
         {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
USER = [{"role": "user", "content": "Tell me."}]
THINK = {"chat_template_kwargs": {"thinking": True}, "ignore_eos": True}  # the tiny model would end at once


def _load(name: str) -> dict:
    """One schema with the shared ``defs.json`` components merged into its ``$defs``."""
    defs = json.loads((SCHEMAS / "defs.json").read_text())["$defs"]
    schema = json.loads((SCHEMAS / f"{name}.json").read_text())
    return {**schema, "$defs": {**defs, **schema.get("$defs", {})}}


VALIDATORS = {name: jsonschema_rs.validator_for(_load(name)) for name in NAMES}


def violations(name: str, body) -> list[str]:
    return [f"/{'/'.join(map(str, e.instance_path))}: {e.message}" for e in VALIDATORS[name].iter_errors(body)]


def check(name: str, body) -> None:
    bad = violations(name, body)
    assert not bad, f"{name} violates the OpenAI schema:\n  " + "\n  ".join(bad) + "\n" + json.dumps(body)[:3000]


@pytest.fixture(scope="module")
def base():
    from ds4serve.server.inprocess import serve

    with serve(BUNDLED, name="tiny", random_weights=False, settings={"max_model_len": 2048}) as srv:
        yield srv.base


def post(base: str, path: str, body: dict) -> dict:
    r = httpx.post(base + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    return r.json()


def stream(base: str, path: str, body: dict) -> list[dict]:
    """Every ``data:`` payload of an SSE answer, parsed; the stream must end with ``[DONE]``."""
    frames: list[str] = []
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                frames.append(line[len("data: "):])
            else:
                assert line == "" or line.startswith(":"), line  # blank separators and keep-alive comments only
    assert frames and frames[-1] == "[DONE]", frames[-3:]
    return [json.loads(f) for f in frames[:-1]]


def chat(base: str, **kw) -> dict:
    body = post(base, "/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 12, **kw})
    check("chat.completion", body)
    check("usage", body["usage"])
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert [c["index"] for c in body["choices"]] == list(range(kw.get("n", 1)))
    return body


def chat_stream(base: str, **kw) -> list[dict]:
    chunks = stream(base, "/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 12, **kw})
    for c in chunks:
        check("chat.completion.chunk", c)
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    return chunks


def _usage_rules(chunks: list[dict], opts: dict) -> None:
    """``include_usage``: null on every chunk but the extra last one (choices empty) that carries it;
    ``continuous_usage_stats``: a usage object on every chunk; neither: no ``usage`` key at all."""
    if opts.get("continuous_usage_stats"):
        assert all(isinstance(c.get("usage"), dict) for c in chunks)
    elif opts.get("include_usage"):
        assert all(c["usage"] is None and c["choices"] for c in chunks[:-1])
        assert chunks[-1]["choices"] == [] and isinstance(chunks[-1]["usage"], dict)
    else:
        assert all("usage" not in c for c in chunks)
    for c in chunks:
        if c.get("usage"):
            check("usage", c["usage"])


# ---- the schemas themselves are strict -------------------------------------------------------
GOOD_CHAT = {"id": "chat-1", "object": "chat.completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                          "message": {"role": "assistant", "content": "hi", "refusal": None}}],
             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2,
                       "completion_tokens_details": {"reasoning_tokens": 0}}}


@pytest.mark.parametrize("mutate", [
    lambda b: b.update(extra=1),
    lambda b: b["choices"][0].update(extra=1),
    lambda b: b["choices"][0]["message"].update(extra=1),
    lambda b: b["choices"][0]["message"].pop("refusal"),
    lambda b: b["choices"][0].pop("logprobs"),
    lambda b: b["choices"][0].update(logprobs={"content": []}),
    lambda b: b["choices"][0].update(finish_reason="error"),
    lambda b: b["usage"]["completion_tokens_details"].update(thinking_tokens=0),
    lambda b: b.update(object="chat.completion.chunk"),
], ids=["top", "choice", "message", "no-refusal", "no-logprobs", "logprobs-no-refusal", "finish", "usage", "object"])
def test_the_schemas_refuse_what_the_spec_refuses(mutate):
    assert not violations("chat.completion", GOOD_CHAT)
    bad = copy.deepcopy(GOOD_CHAT)
    mutate(bad)
    assert violations("chat.completion", bad)
    assert violations("error", {"error": {"message": "m", "type": "t"}})  # param and code are required (nullable)
    assert violations("model", {"id": "m", "object": "model", "created": 1, "owned_by": "o", "root": "m"})


# ---- chat completions -----------------------------------------------------------------------
def test_chat_plain_logprobs_and_n(base):
    body = chat(base)
    assert body["choices"][0]["logprobs"] is None and "completion_tokens_details" in body["usage"]
    # greedy: an unseeded draw at temperature 1 may pick EOS first, leaving no content to carry logprobs
    lp = chat(base, logprobs=True, top_logprobs=3, temperature=0)["choices"][0]["logprobs"]
    assert lp["content"] and all(len(e["top_logprobs"]) == 3 for e in lp["content"])
    chat(base, n=2, temperature=1.0, seed=1, logprobs=True)


def test_chat_thinking_returns_reasoning_content(base):
    body = chat(base, max_tokens=16, **THINK)
    msg = body["choices"][0]["message"]
    assert isinstance(msg["reasoning_content"], str) and msg["reasoning_content"] == msg["reasoning"]
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0


def test_chat_forced_tool_call(base):
    body = chat(base, max_tokens=300, temperature=0, tools=TOOLS, tool_choice=NAMED)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]


@pytest.mark.parametrize("opts", [{}, {"include_usage": True}, {"continuous_usage_stats": True},
                                  {"include_usage": True, "continuous_usage_stats": True}],
                         ids=["no-usage", "include_usage", "continuous", "both"])
def test_chat_stream_chunks(base, opts):
    kw = {"stream_options": opts} if opts else {}
    chunks = chat_stream(base, n=2, temperature=1.0, seed=2, logprobs=True, top_logprobs=2, **kw)
    _usage_rules(chunks, opts)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant" and mine[-1]["finish_reason"] in ("stop", "length")
        assert all(ch["finish_reason"] is None for ch in mine[:-1])


def test_chat_stream_thinking_and_tool_call_deltas(base):
    chunks = chat_stream(base, max_tokens=16, stream_options={"include_usage": True}, **THINK)
    assert any(c["choices"] and c["choices"][0]["delta"].get("reasoning_content") for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    chunks = chat_stream(base, max_tokens=300, temperature=0, tools=TOOLS, tool_choice=NAMED)
    calls = [tc for c in chunks if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert calls and calls[0]["id"] and calls[0]["type"] == "function" and calls[0]["function"]["name"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# ---- completions ----------------------------------------------------------------------------
def test_completions_plain_logprobs_and_stream(base):
    for kw in ({}, {"logprobs": 2, "n": 2, "temperature": 1.0, "seed": 3}):
        body = post(base, "/v1/completions", {"model": "tiny", "prompt": "Once upon", "max_tokens": 8, **kw})
        check("text_completion", body)
        check("usage", body["usage"])
        if kw:
            lp = body["choices"][0]["logprobs"]
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    for opts in ({}, {"include_usage": True}, {"continuous_usage_stats": True}):
        kw = {"stream_options": opts} if opts else {}
        chunks = stream(base, "/v1/completions", {"model": "tiny", "prompt": "Once upon", "max_tokens": 8,
                                                  "logprobs": 1, **kw})
        for c in chunks:
            check("text_completion.chunk", c)
        _usage_rules(chunks, opts)
        ends = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert ends[-1] in ("stop", "length") and all(e is None for e in ends[:-1])


# ---- models and errors ----------------------------------------------------------------------
def test_models(base):
    listing = httpx.get(base + "/v1/models", timeout=30).json()
    check("list", listing)
    one = httpx.get(base + "/v1/models/tiny", timeout=30).json()
    check("model", one)
    assert listing["data"] == [one]


@pytest.mark.parametrize("method,path,body,status", [
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": USER, "temperature": 9}, 400),
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": []}, 400),
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": USER, "guided_json": {"type": "object"}}, 400),
    ("POST", "/v1/completions", {"model": "tiny"}, 400),
    ("POST", "/v1/completions", "{not json", 400),
    ("GET", "/v1/models/nope", None, 404),
    ("GET", "/v1/nowhere", None, 404),
], ids=["range", "empty-messages", "unsupported", "missing-prompt", "bad-json", "model-404", "route-404"])
def test_errors(base, method, path, body, status):
    if isinstance(body, str):
        r = httpx.request(method, base + path, content=body, headers={"content-type": "application/json"},
                          timeout=30)
    else:
        r = httpx.request(method, base + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    check("error", r.json())


def test_models_of_a_random_checkpoint(server):
    """The shared random-weights server's card carries the ``ds4serve_note`` extension; it validates too."""
    listing = httpx.get(server.base + "/v1/models", timeout=30).json()
    check("list", listing)
    assert "ds4serve_note" in listing["data"][0]
    check("model", httpx.get(server.base + f"/v1/models/{listing['data'][0]['id']}", timeout=30).json())
