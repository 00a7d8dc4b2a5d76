"""Malformed and hostile requests get the right 4xx (OpenAI-shaped) while a healthy stream runs."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from image_helpers import image_url
from server_harness import serve

OK_MSG = [{"role": "user", "content": "hi"}]
IMG = "<｜deepseek_image｜>"


def chat(**kw):
    return {"model": "tiny", "messages": OK_MSG, "max_tokens": 4} | kw


# (name, method, path, body or raw bytes, headers, expected status, expected error param/code fragment)
CASES = [
    ("not json", "POST", "/v1/chat/completions", b"{nope", {}, 400, "JSON"),
    ("invalid utf-8", "POST", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}', {}, 400, None),
    ("json array body", "POST", "/v1/chat/completions", b"[1, 2]", {}, 400, None),
    ("empty body", "POST", "/v1/chat/completions", b"", {}, 400, None),
    ("missing model", "POST", "/v1/chat/completions", {"messages": OK_MSG}, {}, 400, "model"),
    ("missing messages", "POST", "/v1/chat/completions", {"model": "tiny"}, {}, 400, "messages"),
    ("empty messages", "POST", "/v1/chat/completions", chat(messages=[]), {}, 400, "messages"),
    ("messages not a list", "POST", "/v1/chat/completions", chat(messages="hi"), {}, 400, "messages"),
    ("bad role", "POST", "/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "x"}]), {}, 400, "role"),
    ("content wrong type", "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": 5}]), {}, 400, "content"),
    ("bad content part", "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "video"}]}]), {}, 400, "type"),
    ("only system", "POST", "/v1/chat/completions", chat(messages=[{"role": "system", "content": "x"}]), {}, 400, "user"),
    ("last is assistant", "POST", "/v1/chat/completions", chat(messages=OK_MSG + [{"role": "assistant", "content": "y"}]), {}, 400, None),
    ("unknown model", "POST", "/v1/chat/completions", chat(model="gpt-9"), {}, 404, "model_not_found"),
    ("negative max_tokens", "POST", "/v1/chat/completions", chat(max_tokens=-1), {}, 400, "max_tokens"),
    ("zero max_tokens", "POST", "/v1/chat/completions", chat(max_tokens=0), {}, 400, "max_tokens"),
    ("huge max_tokens", "POST", "/v1/chat/completions", chat(max_tokens=10**9), {}, 400, "context_length_exceeded"),
    ("string max_tokens", "POST", "/v1/chat/completions", chat(max_tokens="lots"), {}, 400, "max_tokens"),
    ("huge max_completion_tokens", "POST", "/v1/chat/completions", chat(max_completion_tokens=10**7), {}, 400, "context"),
    ("temperature too high", "POST", "/v1/chat/completions", chat(temperature=5), {}, 400, "temperature"),
    ("negative temperature", "POST", "/v1/chat/completions", chat(temperature=-0.1), {}, 400, "temperature"),
    ("top_p zero", "POST", "/v1/chat/completions", chat(top_p=0), {}, 400, "top_p"),
    ("n too large", "POST", "/v1/chat/completions", chat(n=100), {}, 400, "n"),
    ("n zero", "POST", "/v1/chat/completions", chat(n=0), {}, 400, "n"),
    ("presence penalty range", "POST", "/v1/chat/completions", chat(presence_penalty=9), {}, 400, "presence_penalty"),
    ("too many stops", "POST", "/v1/chat/completions", chat(stop=[str(i) for i in range(40)]), {}, 400, "stop"),
    ("stop wrong type", "POST", "/v1/chat/completions", chat(stop=5), {}, 400, "stop"),
    ("top_logprobs without logprobs", "POST", "/v1/chat/completions", chat(top_logprobs=3), {}, 400, "top_logprobs"),
    ("top_logprobs too big", "POST", "/v1/chat/completions", chat(logprobs=True, top_logprobs=50), {}, 400, "top_logprobs"),
    ("tool_choice unknown", "POST", "/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function", "function": {"name": "g"}}), {}, 400, "tool_choice"),
    ("tool_choice unknown function", "POST", "/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function", "function": {"name": "g"}}), {}, 400, "tool_choice"),
    ("thinking ignored before", "POST", "/v1/chat/completions", chat(thinking={"type": "sometimes"}), {}, 400, "thinking"),
    ("structured_outputs", "POST", "/v1/chat/completions", chat(structured_outputs={"json": {}}), {}, 400, "structured_outputs"),
    ("response_format bad schema", "POST", "/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}), {}, 400, "response_format"),
    ("logit_bias out of vocab", "POST", "/v1/chat/completions", chat(logit_bias={"1000000": 10}), {}, 400, "logit_bias"),
    ("image placeholder injection", "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": f"look {IMG}"}]), {}, 400, "placeholder"),
    ("placeholder in text part", "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "text", "text": IMG}]}]), {}, 400, "placeholder"),
    ("placeholder in system", "POST", "/v1/chat/completions", chat(messages=[{"role": "system", "content": IMG}] + OK_MSG), {}, 400, "placeholder"),
    ("undecodable image", "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]), {}, 400, "invalid_image"),
    ("remote image url disabled", "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest"}}]}]), {}, 400, "disabled"),
    ("file url", "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]), {}, 400, "invalid_image"),
    ("bad detail level", "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "ultra"}}]}]), {}, 400, "detail"),
    ("too many images", "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}] * 40}]), {}, 400, "image"),
    ("image in assistant turn", "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}, {"role": "user", "content": "b"}]), {}, 400, "text"),
    ("stop_token_ids out of vocab", "POST", "/v1/chat/completions", chat(stop_token_ids=[10**6]), {}, 400, "stop_token_ids"),
    ("oversized body", "POST", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"x" * 300_000 + b'"}]}', {}, 413, "request_too_large"),
    ("completions max_tokens 0 without echo", "POST", "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 0}, {}, 400, "echo=true"),
    ("completions suffix", "POST", "/v1/completions", {"model": "tiny", "prompt": "a", "suffix": "z"}, {}, 400, "suffix"),
    ("completions bad token ids", "POST", "/v1/completions", {"model": "tiny", "prompt": [1, -5]}, {}, 400, "prompt"),
    ("completions empty prompt list", "POST", "/v1/completions", {"model": "tiny", "prompt": []}, {}, 400, "prompt"),
    ("completions prompt object", "POST", "/v1/completions", {"model": "tiny", "prompt": {"a": 1}}, {}, 400, "prompt"),
    ("completions best_of", "POST", "/v1/completions", {"model": "tiny", "prompt": "a", "best_of": 3}, {}, 400, "best_of"),
    ("user message without content", "POST", "/v1/chat/completions", chat(messages=[{"role": "user"}]), {}, 400, "messages[0].content"),
    ("user content null", "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": None}]), {}, 400, "messages[0].content"),
    ("system without content", "POST", "/v1/chat/completions", chat(messages=[{"role": "system"}] + OK_MSG), {}, 400, "messages[0].content"),
    ("tool result without content", "POST", "/v1/chat/completions", chat(messages=OK_MSG + [{"role": "tool", "tool_call_id": "c1"}]), {}, 400, "messages[1].content"),
    ("text part without text", "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), {}, 400, "messages[0].content[0].text"),
    ("text part with null text", "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "text", "text": None}]}]), {}, 400, "messages[0].content[0].text"),
    ("image part without image_url", "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), {}, 400, "messages[0].content[0].image_url"),
    ("lone surrogate in content", "POST", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}', {}, 400, "surrogate"),
    ("lone low surrogate in a text part", "POST", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}', {}, 400, "messages[0].content[0].text"),
    ("lone surrogate in stop", "POST", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "a"}], "stop": ["\\ud800"]}', {}, 400, "stop[0]"),
    ("lone surrogate in completion prompt", "POST", "/v1/completions", b'{"model": "tiny", "prompt": "x\\udc00"}', {}, 400, "prompt"),
    ("lone surrogate in image url", "POST", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,\\ud800"}}]}]}', {}, 400, "image_url.url"),
    ("lone surrogate in a field name", "POST", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "a"}], "\\ud800": 1}', {}, 400, "field name"),
    ("wrong method", "GET", "/v1/chat/completions", None, {}, 405, None),
    ("unknown route", "GET", "/v1/nope", None, {}, 404, None),
]


def _send(base: str, method: str, path: str, body, headers) -> httpx.Response:
    h = {"content-type": "application/json"} | headers
    if body is None:
        return httpx.request(method, base + path, headers=headers, timeout=60)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.request(method, base + path, content=content, headers=h, timeout=60)


@pytest.fixture(scope="module")
def limited(random_ckpt):
    with serve(random_ckpt, limits={"max_body_bytes": 200_000}, settings={"max_seqs": 4}) as srv:
        yield srv


def test_hostile_requests_while_a_healthy_stream_runs(limited):
    assert len(CASES) >= 40
    healthy: dict = {}

    def stream():
        with httpx.stream("POST", limited.base + "/v1/chat/completions", timeout=120,
                          json=chat(max_tokens=150, stream=True, ignore_eos=True, temperature=0)) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        healthy["status"] = r.status_code
        healthy["lines"] = lines

    t = threading.Thread(target=stream)
    t.start()
    failures = []
    for name, method, path, body, headers, status, fragment in CASES:
        r = _send(limited.base, method, path, body, headers)
        if r.status_code != status:
            failures.append(f"{name}: got {r.status_code} {r.text[:200]}, expected {status}")
            continue
        err = r.json().get("error")
        if err is None or not {"message", "type", "param", "code"} <= set(err):
            failures.append(f"{name}: not an OpenAI error body: {r.text[:200]}")
            continue
        if fragment and fragment.lower() not in json.dumps(err).lower():
            failures.append(f"{name}: error does not mention {fragment!r}: {err}")
    t.join(timeout=120)
    assert not failures, "\n".join(failures)
    assert healthy["status"] == 200
    final = json.loads(healthy["lines"][-2][len("data: "):])
    assert healthy["lines"][-1] == "data: [DONE]" and final["choices"][0]["finish_reason"] == "length"
    assert limited.loop.call(lambda core: core.leaks()) == ""


def test_api_key(random_ckpt):
    with serve(random_ckpt, api_key="s3cret") as srv:
        assert httpx.get(srv.base + "/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(srv.base + "/v1/chat/completions", json=chat(), headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["x-request-id"].startswith("req-")  # refused requests have ids too
            assert httpx.get(srv.base + "/metrics", headers=headers).status_code == 401
            assert httpx.get(srv.base + "/v1/models", headers=headers).status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert httpx.post(srv.base + "/v1/chat/completions", json=chat(), headers=ok).status_code == 200
        assert httpx.get(srv.base + "/metrics", headers=ok).status_code == 200


def test_binding_policy():
    from ds4serve.server.launch import BindError, check_binding

    check_binding("127.0.0.1", None, False)
    check_binding("0.0.0.0", "key", False)
    check_binding("0.0.0.0", None, True)
    with pytest.raises(BindError, match="--api-key"):
        check_binding("0.0.0.0", None, False)


# A valid request using every string field the server reads (and two it ignores), for the surrogate sweep.
FULL_CHAT = {
    "model": "tiny", "max_tokens": 2, "stop": ["zz", "yy"], "user": "u1", "some_future_field": "f",
    "chat_template_kwargs": {"thinking": True, "reasoning_effort": "high"},
    "messages": [
        {"role": "system", "content": "be brief", "name": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": image_url(1, (64, 48))}}]},
        {"role": "assistant", "content": "ok", "reasoning_content": "hm"},
        {"role": "tool", "content": "42", "tool_call_id": "call-1"},
        {"role": "user", "content": "and now?"},
    ],
}


def _string_paths(value, path=""):
    """(OpenAI-style param path, setter) for every string leaf of a JSON-like value."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _string_paths(v, f"{path}.{k}" if path else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _string_paths(v, f"{path}[{i}]")
    elif isinstance(value, str):
        yield path


def _with_value(body, path: str, new):
    """A deep copy of ``body`` with the string at ``path`` replaced (paths from ``_string_paths``)."""
    body = json.loads(json.dumps(body))
    keys = [int(k) if k.isdigit() else k for k in path.replace("[", ".").replace("]", "").split(".")]
    node = body
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = new
    return body


def test_a_lone_surrogate_in_any_string_is_a_400_naming_it(limited):
    """Every string of a rich request, one at a time, gets a lone surrogate: never a 500, and the
    error's param is that string's path (json.dumps writes it as the escape ``\\ud800``)."""
    paths = list(_string_paths(FULL_CHAT))
    assert len(paths) >= 14
    assert httpx.post(limited.base + "/v1/chat/completions", json=FULL_CHAT, timeout=60).status_code == 200
    bad = []
    for path in paths:
        body = _with_value(FULL_CHAT, path, "ok \ud800 then")
        r = _send(limited.base, "POST", "/v1/chat/completions", json.dumps(body).encode(), {})
        err = r.json().get("error") or {}
        if r.status_code != 400 or err.get("param") != path or "surrogate" not in err.get("message", ""):
            bad.append(f"{path}: {r.status_code} {r.text[:200]}")
    for prompt, param in (("x\udc00", "prompt"), (["fine", "\ud800"], "prompt[1]")):
        r = _send(limited.base, "POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": prompt}).encode(), {})
        if r.status_code != 400 or r.json()["error"]["param"] != param:
            bad.append(f"completions {param}: {r.status_code} {r.text[:200]}")
    assert not bad, "\n".join(bad)


def test_valid_unicode_and_null_assistant_content_are_accepted(limited):
    """The new checks refuse only what they should: a surrogate *pair* is an astral character, and an
    assistant turn may have ``content: null`` (OpenAI allows it; it renders as an empty answer)."""
    pair = b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "smile \\ud83d\\ude00"}]}'
    assert _send(limited.base, "POST", "/v1/chat/completions", pair, {}).status_code == 200
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}, {"role": "user", "content": "b"}]
    r = httpx.post(limited.base + "/v1/chat/completions", json=chat(messages=turns), timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    parts = [{"type": "text", "text": ""}]  # an empty text is text; only a missing one is refused
    assert httpx.post(limited.base + "/v1/chat/completions", json=chat(messages=[{"role": "user", "content": parts}]),
                      timeout=60).status_code == 200


def test_error_bodies_survive_text_that_is_not_utf8():
    """Defence in depth: an error message echoing a lone surrogate still renders valid JSON."""
    from ds4serve.server.app import _error_response
    from ds4serve.server.protocol import APIError

    resp = _error_response(APIError(400, "bad value 'x\ud800'", param="stop"))
    assert json.loads(resp.body)["error"]["message"] == "bad value 'x\ud800'"
