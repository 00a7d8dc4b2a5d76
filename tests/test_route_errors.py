"""Unknown routes and wrong methods answer with an error body a client can act on: the route asked
for, the routes served (404) or the methods allowed (405); Anthropic's body under ``/v1/messages``."""

from __future__ import annotations

import httpx


def test_unknown_route_names_it_and_lists_the_served_routes(server):
    r = httpx.post(server.base + "/v1/chat/completion", json={}, timeout=30)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "not_found"
    msg = err["message"]
    assert "POST /v1/chat/completion;" in msg
    for route in ("POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models",
                  "GET /v1/models/{model_id}", "POST /v1/messages", "POST /tokenize"):
        assert route in msg
    for noise in ("/docs", "/openapi.json", "/webui", "HEAD "):
        assert noise not in msg


def test_wrong_method_names_the_allowed_ones(server):
    r = httpx.get(server.base + "/v1/chat/completions", timeout=30)
    assert r.status_code == 405
    err = r.json()["error"]
    assert err["code"] == "method_not_allowed"
    assert err["message"] == "method GET is not allowed on /v1/chat/completions; allowed: POST"
    assert r.headers["allow"] == "POST"
    r = httpx.delete(server.base + "/v1/models/tiny", timeout=30)
    assert r.status_code == 405 and r.json()["error"]["message"].endswith("allowed: GET")


def test_anthropic_paths_keep_their_own_error_shape(server):
    r = httpx.post(server.base + "/v1/messages/nothing", json={}, timeout=30)
    assert r.status_code == 404
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    assert "no route POST /v1/messages/nothing" in body["error"]["message"]
    assert "POST /v1/messages/count_tokens" in body["error"]["message"]
    r = httpx.get(server.base + "/v1/messages", timeout=30)
    assert r.status_code == 405 and r.json()["error"]["message"].endswith("allowed: POST")
