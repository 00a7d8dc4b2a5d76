"""Several named API keys: how they are given (flags, key files), matched, and reported (by name only).

No model is needed: the app runs on a state without an engine (the lifespan never starts), so only
the routes that answer before the engine (auth, validation, /metrics, an unknown model id) are used.
The prefix-cache side of keys (one tenant never hits another's prefixes) is tests/test_prefix_http.py.
"""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from ds4serve.cli import _ENGINE_FLAGS, _settings, build_parser, main
from ds4serve.server.app import create_app
from ds4serve.server.keys import ApiKeys, KeyConfigError, load_keys, parse_key_args, parse_key_file, tenant_salt
from ds4serve.server.state import ServerState
from ds4serve.server.webui import ASSETS
from ds4serve.settings import EngineSettings

ALICE, BOB = "sk-alice-0123456789", "sk-bob-9876543210"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _client(**keys) -> TestClient:
    state = ServerState(loop=None, tokenizer=None, model_id="m", **keys)  # type: ignore[arg-type]
    return TestClient(create_app(state))


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _samples(c: TestClient, key: str, name: str) -> dict[tuple, float]:
    text = c.get("/metrics", headers=_bearer(key)).text
    return {tuple(sorted(s.labels.items())): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name}


# ---- naming and parsing -----------------------------------------------------------------------
def test_key_flags_name_keys_in_order():
    assert parse_key_args(["s1", "alice=s2", "s3", "bob=a=b=="]) == {
        "key-1": "s1", "alice": "s2", "key-2": "s3", "bob": "a=b=="}
    assert parse_key_args(["=abc"]) == {"key-1": "=abc"}  # no valid name before the "=": a bare key
    assert parse_key_args(["bad name=x"]) == {"key-1": "bad name=x"}
    with pytest.raises(KeyConfigError, match="'alice' is used twice"):
        parse_key_args(["alice=x", "alice=y"])
    with pytest.raises(KeyConfigError, match="'key-1' is used twice"):
        parse_key_args(["key-1=x", "bare"])


def test_key_file_format_and_line_numbers():
    text = "# tenants\n\nalice  sk-a\n   # indented comment\nbob\tsk-b\n"
    assert parse_key_file(text, "keys.txt") == {"alice": "sk-a", "bob": "sk-b"}
    for bad, lineno, fragment in [("alice sk-a\nbob\n", 2, "got 1 field"),
                                  ("alice sk-a\n\n\nbob sk b\n", 4, "got 3 field"),
                                  ("# c\nbad/name sk-x\n", 2, "invalid API key name"),
                                  ("alice sk-a\nalice sk-b\n", 2, "used twice")]:
        with pytest.raises(KeyConfigError) as exc:
            parse_key_file(bad, "keys.txt")
        assert f"keys.txt:{lineno}: " in str(exc.value) and fragment in str(exc.value)
        assert "sk-" not in str(exc.value)  # a key is never echoed in an error


def test_keys_from_flags_and_files_together(tmp_path):
    f = tmp_path / "keys"
    f.write_text("bob sk-b\n")
    assert load_keys(["alice=sk-a"], [f]) == {"alice": "sk-a", "bob": "sk-b"}
    with pytest.raises(KeyConfigError, match="'bob' is used twice"):
        load_keys(["bob=sk-x"], [f])
    with pytest.raises(KeyConfigError, match="cannot read the API key file"):
        load_keys([], [tmp_path / "missing"])
    with pytest.raises(KeyConfigError, match="are the same key"):
        ApiKeys({"alice": "same", "bob": "same"})


def test_matching_names_the_key_and_never_shows_it():
    keys = ApiKeys({"alice": ALICE, "bob": BOB})
    assert (keys.match(ALICE), keys.match(BOB), keys.match("nope"), keys.match("")) == ("alice", "bob", None, None)
    assert keys.match(ALICE[:-1]) is None and keys.match(ALICE + "x") is None
    assert ALICE not in repr(keys) and "alice" in repr(keys)
    state = ServerState(loop=None, tokenizer=None, model_id="m", api_keys={"alice": ALICE})  # type: ignore[arg-type]
    assert ALICE not in repr(state)


def test_the_single_key_api_still_works():
    assert ApiKeys.of("k").names == ("key-1",) and not ApiKeys.of()
    assert ApiKeys.of(api_keys={"a": "1", "b": "2"}).names == ("a", "b")
    with pytest.raises(KeyConfigError, match="not both"):
        ApiKeys.of("k", {"a": "1"})
    with pytest.raises(KeyConfigError, match="invalid API key name"):
        ApiKeys({'a"b': "x"})  # names go into log lines and label values as they are


def test_tenant_salt_keeps_keys_apart():
    assert tenant_salt("", None) == "\x00" and tenant_salt("alice", "s") == "alice\x00s"
    assert tenant_salt("alice", "s") != tenant_salt("bob", "s")
    assert tenant_salt("a", "b.c") != tenant_salt("a.b", "c")


# ---- the command line -------------------------------------------------------------------------
def test_serve_flags_for_keys_and_the_prefix_cache():
    p = build_parser()
    args = p.parse_args(["serve", "--api-key", "a", "--api-key", "bob=b", "--api-key-file", "f1",
                         "--no-enable-prefix-caching", "--prefix-cache-budget", "64MiB", "--prefix-interval", "128"])
    assert args.api_key == ["a", "bob=b"] and args.api_key_file == ["f1"]
    s = _settings(args, EngineSettings, _ENGINE_FLAGS)
    assert (s.enable_prefix_caching, s.prefix_cache_budget, s.prefix_interval) == (False, "64MiB", 128)
    defaults = _settings(p.parse_args(["serve"]), EngineSettings, _ENGINE_FLAGS)
    assert (defaults.enable_prefix_caching, defaults.prefix_cache_budget, defaults.prefix_interval) == (True, None, 256)
    assert _settings(p.parse_args(["serve", "--enable-prefix-caching"]), EngineSettings,
                     _ENGINE_FLAGS).enable_prefix_caching is True
    assert p.parse_args(["serve"]).api_key is None  # $DS4SERVE_API_KEY is read only when no flag is given


def test_serve_refuses_a_malformed_key_file(tmp_path, capsys):
    f = tmp_path / "keys"
    f.write_text("alice sk-a\nbob\n")
    assert main(["serve", "--api-key-file", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"{f}:2: expected 'NAME KEY'" in err and "sk-a" not in err


# ---- over HTTP --------------------------------------------------------------------------------
def test_each_key_is_accepted_and_a_wrong_one_is_401():
    c = _client(api_keys={"alice": ALICE, "bob": BOB})
    for key in (ALICE, BOB):
        assert c.get("/metrics", headers=_bearer(key)).status_code == 200
        assert c.get("/v1/models/other", headers=_bearer(key)).status_code == 404  # past auth
        assert c.get("/v1/models/other", headers={"x-api-key": key}).status_code == 404
    for headers in ({}, _bearer("wrong"), _bearer(ALICE + BOB), {"Authorization": ALICE}):
        for method, path in (("GET", "/metrics"), ("GET", "/v1/models"), ("POST", "/reset_prefix_cache"),
                             ("POST", "/tokenize")):
            r = c.request(method, path, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
    assert c.get("/").status_code == 200  # the chat page stays open


def test_access_log_and_metrics_carry_the_key_name_never_the_key(caplog):
    c = _client(api_keys={"alice": ALICE, "bob": BOB})
    bad = {**CHAT, "temperature": 9}
    with caplog.at_level(logging.INFO, logger="ds4serve.access"):
        assert c.post("/v1/chat/completions", json=bad, headers=_bearer(ALICE)).status_code == 400
        assert c.post("/v1/chat/completions", json=bad, headers=_bearer(BOB)).status_code == 400
        assert c.post("/v1/chat/completions", json=CHAT, headers=_bearer("wrong")).status_code == 401
    lines = [r for r in caplog.records if r.name == "ds4serve.access" and r.access["path"] == "/v1/chat/completions"]
    assert [r.access["key_name"] for r in lines] == ["alice", "bob", None]
    assert "key_name=alice" in lines[0].getMessage() and "key_name" not in lines[2].getMessage()
    assert not any(k in r.getMessage() for r in caplog.records for k in (ALICE, BOB))
    errors = _samples(c, ALICE, "ds4serve_error_responses_total")
    label = lambda key, status: (("key_name", key), ("model_name", "m"), ("status", status))  # noqa: E731
    assert errors[label("alice", "400")] == 1 and errors[label("bob", "400")] == 1
    assert errors[label("", "401")] == 1  # refused before any key matched
    assert not any(k in c.get("/metrics", headers=_bearer(ALICE)).text for k in (ALICE, BOB))


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT),
                                       ("/v1/completions", {"model": "m", "prompt": "hi"})])
@pytest.mark.parametrize("salt,fragment", [(7, "valid string"), ("x" * 257, "at most 256"), ("", "at least 1"),
                                           (["a"], "valid string")])
def test_cache_salt_must_be_a_short_string(path, body, salt, fragment):
    r = _client().post(path, json={**body, "cache_salt": salt})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "cache_salt" and fragment in err["message"] and err["type"] == "invalid_request_error"


def test_chat_page_stays_open_with_several_keys():
    c = _client(api_keys={"alice": ALICE, "bob": BOB})
    page = c.get("/")
    assert page.status_code == 200 and ALICE not in page.text and "alice" not in page.text
    for name in ASSETS:
        body = c.get(f"/webui/{name}")
        assert body.status_code == 200 and ALICE.encode() not in body.content
    assert c.get("/v1/models").status_code == 401  # what the page calls: 401 until the user gives a key
