"""The OpenAI API through the real `openai` client against a real server on a loopback port."""

from __future__ import annotations

import httpx
import openai
import pytest


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)


MSG = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


def _stream_chat(client, **kw):
    chunks = list(client.chat.completions.create(model="tiny", stream=True, **kw))
    return chunks


def test_chat_stream_equals_non_stream_for_same_seed(client):
    kw = dict(messages=MSG, max_tokens=24, temperature=0.9, seed=1234)
    full = client.chat.completions.create(model="tiny", **kw)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 24
    chunks = _stream_chat(client, stream_options={"include_usage": True}, **kw)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    first = chunks[0]
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content is not None
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    assert full.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 10


def test_n_two_and_seeds(client):
    out = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=12, n=2, temperature=1.0, seed=5)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].message.content != out.choices[1].message.content
    again = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=12, n=2, temperature=1.0, seed=5)
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]
    assert out.usage.completion_tokens == 24
    chunks = _stream_chat(client, messages=MSG, max_tokens=12, n=2, temperature=1.0, seed=5)
    for i in (0, 1):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert text == out.choices[i].message.content


def _clean_substring(text: str) -> str | None:
    for start in range(1, len(text) - 2):
        piece = text[start:start + 2]
        if "\ufffd" not in piece and piece.strip() and text.find(piece) == start:
            return piece
    return None


def test_stop_strings_across_token_boundaries(client):
    base = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=40, temperature=0)
    text = base.choices[0].message.content
    stop = _clean_substring(text)
    assert stop, f"no usable stop string in {text!r}"
    cut = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=40, temperature=0, stop=[stop, "@@@@"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.find(stop)]
    streamed = _stream_chat(client, messages=MSG, max_tokens=40, temperature=0, stop=stop)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[: text.find(stop)]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_logprobs(client):
    out = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the best token
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob


def test_completions_stream_and_not(client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0.7, seed=9)
    full = client.completions.create(**kw)
    assert full.object == "text_completion" and full.usage.completion_tokens == 16
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    two = client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=4, n=2, temperature=0, logprobs=2)
    assert sorted(c.index for c in two.choices) == [0, 1, 2, 3]
    assert all(len(c.logprobs.tokens) == 4 and len(c.logprobs.top_logprobs[0]) == 2 for c in two.choices)


def test_extra_body_extensions_and_request_id(client, server):
    out = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=8, temperature=0.8, seed=3,
                                         extra_body={"top_k": 1, "min_p": 0.1, "repetition_penalty": 1.1,
                                                     "ignore_eos": True, "min_tokens": 2})
    greedy = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=8, temperature=0,
                                            extra_body={"repetition_penalty": 1.1})
    assert out.choices[0].message.content == greedy.choices[0].message.content  # top_k=1 is greedy
    r = httpx.post(server.base + "/v1/chat/completions", headers={"x-request-id": "abc-123"},
                   json={"model": "tiny", "messages": MSG, "max_tokens": 2, "some_future_field": 1})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"


def test_models_health_metrics_openapi(server):
    models = httpx.get(server.base + "/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and "random" in models["data"][0]["ds4serve_note"]
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}
    metrics = httpx.get(server.base + "/metrics").text
    for name in ("ds4serve_queue_depth", "ds4serve_requests_running", "ds4serve_requests_suspended",
                 "ds4serve_requests_parked", "ds4serve_pages_in_use", "ds4serve_time_to_first_token_seconds",
                 "ds4serve_inter_token_latency_seconds", "ds4serve_prompt_tokens_total",
                 "ds4serve_generation_tokens_total", "ds4serve_preemptions_total", "ds4serve_rejections_total"):
        assert name in metrics, name
    spec = httpx.get(server.base + "/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"} <= set(spec["paths"])
    chat_schema = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "max_completion_tokens", "top_k", "stream_options", "logprobs"} <= set(chat_schema)
