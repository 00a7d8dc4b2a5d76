"""The prefix cache over HTTP, on the bundled model: ``usage.prompt_tokens_details.cached_tokens``,
tenant isolation (API key name + ``cache_salt``), ``/reset_prefix_cache``, thinking-mode cache points,
streamed usage, the access log and the Prometheus series.

Every test sends its own long system message (about 330 tokens: more than one 256-token snapshot
interval), so no test sees another's cached prefixes and the order of the tests does not matter.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ds4serve.chat import ChatOptions, render_ds4
from ds4serve.server.chat_request import ChatSetup
from ds4serve.server.inprocess import serve
from ds4serve.server.jobs import user_turn_end

BUNDLED = Path(__file__).resolve().parent.parent / "models" / "ds4v-tiny"
KEYS = {"alice": "sk-alice-test", "bob": "sk-bob-test"}
INTERVAL = 256  # EngineSettings.prefix_interval's default


def system(tag: str) -> str:
    """A system message of ~330 tokens, different for every ``tag``."""
    return f"[{tag}] " + " ".join(f"Rule {i}: answer briefly and name the colour." for i in range(12))


def messages(tag: str, question: str = "What is 7 + 5?") -> list[dict]:
    return [{"role": "system", "content": system(tag)}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def srv():
    with serve(BUNDLED, name="tiny", random_weights=False, api_keys=KEYS) as s:
        yield s


def chat(srv, key: str, msgs: list[dict], **kw) -> dict:
    body = {"model": "tiny", "messages": msgs, "max_tokens": 4, "temperature": 0} | kw
    r = httpx.post(srv.base + "/v1/chat/completions", json=body, headers=_auth(key), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[key]}"}


def sse(srv, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", srv.base + path, json={**body, "stream": True}, headers=_auth("alice"),
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        frames = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def metric(srv, name: str, **labels) -> float:
    text = httpx.get(srv.base + "/metrics", headers=_auth("alice"), timeout=30).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_the_same_prompt_hits_only_under_the_same_key_and_salt(srv):
    msgs = messages("tenants")
    first = chat(srv, "alice", msgs)
    assert first["usage"]["prompt_tokens"] > 300 and cached(first) == 0
    assert cached(chat(srv, "alice", msgs)) >= INTERVAL
    assert cached(chat(srv, "bob", msgs)) == 0  # another tenant, same prompt
    assert cached(chat(srv, "alice", msgs, cache_salt="s1")) == 0  # same tenant, another salt
    assert cached(chat(srv, "alice", msgs, cache_salt="s1")) >= INTERVAL
    assert cached(chat(srv, "bob", msgs, cache_salt="s1")) == 0  # the same salt never crosses keys
    assert cached(chat(srv, "bob", msgs)) >= INTERVAL  # bob's own first request was stored under bob


def test_reset_prefix_cache_drops_what_was_cached(srv):
    msgs = messages("reset")
    chat(srv, "alice", msgs)
    assert cached(chat(srv, "alice", msgs)) >= INTERVAL
    r = httpx.post(srv.base + "/reset_prefix_cache", headers=_auth("bob"), timeout=60)
    assert r.status_code == 200 and r.json()["reset"] is True and r.json()["snapshots_dropped"] >= 1
    assert cached(chat(srv, "alice", msgs)) == 0
    assert httpx.post(srv.base + "/reset_prefix_cache", timeout=60).status_code == 401
    assert httpx.get(srv.base + "/reset_prefix_cache", headers=_auth("bob")).status_code == 405


def test_streamed_usage_carries_cached_tokens(srv):
    msgs = messages("stream")
    chat(srv, "alice", msgs)
    frames = sse(srv, "/v1/chat/completions", {"model": "tiny", "messages": msgs, "max_tokens": 4, "temperature": 0,
                                               "stream_options": {"include_usage": True}})
    assert frames[-1]["choices"] == [] and frames[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= INTERVAL
    assert all(f["usage"] is None for f in frames[:-1])
    frames = sse(srv, "/v1/chat/completions", {"model": "tiny", "messages": msgs, "max_tokens": 4, "temperature": 0,
                                               "stream_options": {"continuous_usage_stats": True}})
    assert all(f["usage"]["prompt_tokens_details"]["cached_tokens"] >= INTERVAL for f in frames)


def test_completions_report_cached_tokens_too(srv):
    prompt = system("completions")
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    r = httpx.post(srv.base + "/v1/completions", json=body, headers=_auth("alice"), timeout=120).json()
    assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": 0} and r["usage"]["prompt_tokens"] > 300
    frames = sse(srv, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert frames[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= INTERVAL


def test_thinking_mode_caches_the_end_of_the_user_turn(srv):
    """Turn 2 renders turn 1's answer with its reasoning dropped, so it shares turn 1's prompt up to
    (not including) the final ``<think>``; the cache point there makes all of it a hit."""
    think = {"chat_template_kwargs": {"thinking": True}}
    turn1 = messages("thinking")
    first = chat(srv, "alice", turn1, **think)
    n1 = first["usage"]["prompt_tokens"]
    assert n1 % INTERVAL not in (0, 1)  # the point is not also an interval snapshot
    turn2 = [*turn1, {"role": "assistant", "content": "12", "reasoning_content": "seven plus five"},
             {"role": "user", "content": "And 9 - 4?"}]
    second = chat(srv, "alice", turn2, **think)
    assert second["usage"]["prompt_tokens"] > n1 and cached(second) == n1 - 1


def test_why_the_cache_point_is_one_before_the_end(srv):
    tok = srv.state.tokenizer
    opts = ChatOptions(thinking=True)
    turn1 = messages("why")
    ids1 = render_ds4(tok, turn1, opts).ids
    ids2 = render_ds4(tok, [*turn1, {"role": "assistant", "content": "12", "reasoning_content": "r"},
                            {"role": "user", "content": "more"}], opts).ids
    assert ids1[-1] == tok.think_id and ids2[:len(ids1) - 1] == ids1[:-1] and ids2[len(ids1) - 1] != tok.think_id
    assert user_turn_end(srv.state, ChatSetup(turn1, opts), ids1) == (len(ids1) - 1,)
    chat_mode = render_ds4(tok, turn1, ChatOptions(thinking=False)).ids
    assert chat_mode[-1] == tok.think_end_id
    assert user_turn_end(srv.state, ChatSetup(turn1, ChatOptions(thinking=False)), chat_mode) == ()


def _access_line(caplog, cached_tokens: int, timeout: float = 30.0):
    """The chat access-log record with ``cached_tokens`` (the log is written after the response is sent,
    so the first request's line can land inside the capture late, and the second's a moment after the
    client returns); the last chat record if none matches in time."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [r for r in caplog.records if r.name == "ds4serve.access" and r.access["path"] == "/v1/chat/completions"]
        match = [r for r in lines if r.access["cached_tokens"] == cached_tokens]
        if match or time.monotonic() > deadline:
            return match[-1] if match else lines[-1]
        time.sleep(0.05)


def test_metrics_and_the_access_log_show_the_hits(srv, caplog):
    msgs = messages("metrics")
    hit_before = metric(srv, "ds4serve_prefix_cache_hit_tokens_total")
    queried_before = metric(srv, "ds4serve_prefix_cache_queried_tokens_total")
    alice_before = metric(srv, "ds4serve_prompt_cached_tokens_total", key_name="alice")
    chat(srv, "alice", msgs)
    with caplog.at_level(logging.INFO, logger="ds4serve.access"):  # until the line is read: it is written
        got = cached(chat(srv, "alice", msgs))                      # after the response, and at a lower
        line = _access_line(caplog, got)                            # level it would be dropped
    assert got >= INTERVAL
    assert metric(srv, "ds4serve_prefix_cache_hit_tokens_total") - hit_before >= got
    assert metric(srv, "ds4serve_prefix_cache_queried_tokens_total") - queried_before >= 2 * got
    assert metric(srv, "ds4serve_prompt_cached_tokens_total", key_name="alice") - alice_before == got
    assert metric(srv, "ds4serve_prefix_cache_enabled") == 1
    assert metric(srv, "ds4serve_prefix_cache_snapshots") >= 1 and metric(srv, "ds4serve_prefix_cache_bytes") > 0
    assert metric(srv, "ds4serve_prefix_cache_budget_bytes") >= metric(srv, "ds4serve_prefix_cache_bytes")
    assert line.access["key_name"] == "alice" and line.access["cached_tokens"] == got
    assert f"cached_tokens={got}" in line.getMessage() and KEYS["alice"] not in line.getMessage()


def test_with_caching_off_nothing_is_cached(random_ckpt):
    with serve(random_ckpt, settings={"enable_prefix_caching": False}) as off:
        body = {"model": "tiny", "messages": messages("off"), "max_tokens": 2, "temperature": 0}
        for _ in range(2):
            r = httpx.post(off.base + "/v1/chat/completions", json=body, timeout=120).json()
            assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        reset = httpx.post(off.base + "/reset_prefix_cache", timeout=60).json()
        assert reset == {"reset": True, "snapshots_dropped": 0}
        text = httpx.get(off.base + "/metrics").text
        assert 'ds4serve_prefix_cache_enabled{model_name="tiny"} 0.0' in text
