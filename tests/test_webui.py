"""The chat page's serving, without a browser or a model: what ``/`` answers, with which headers,
that every asset the page names loads, that ``--no-webui`` makes ``/`` a 404, and that the page is
open while the API stays behind the key (the page never carries the key)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from ds4serve.cli import _SERVER_FLAGS, _settings, build_parser
from ds4serve.server.app import create_app
from ds4serve.server.limits import ServerLimits
from ds4serve.server.state import ServerState
from ds4serve.server.webui import ASSETS, WEBUI_DIR

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-page-test-0123456789"


def _client(api_key: str | None = None, webui: bool = True) -> TestClient:
    """The real app (middleware, routes, page) on a state with no engine: the lifespan never runs,
    so nothing below the routes is touched by these requests."""
    state = ServerState(loop=None, tokenizer=None, model_id="m", api_key=api_key,  # type: ignore[arg-type]
                        limits=ServerLimits(webui=webui))
    return TestClient(create_app(state))


def _assets_named(html: str) -> list[str]:
    return re.findall(r'(?:src|href)="/webui/([^"]+)"', html)


def test_page_and_its_assets():
    c = _client()
    r = c.get("/")
    assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    named = _assets_named(r.text)
    assert set(named) == set(ASSETS), named  # every shipped asset is used, every used one is served
    for name in named:
        a = c.get(f"/webui/{name}")
        assert a.status_code == 200 and a.headers["content-type"] == ASSETS[name], name
        assert a.content == (WEBUI_DIR / name).read_bytes()
    assert not re.search(r"<[^>]+\son[a-z]+=", r.text), "inline event handlers would be blocked by the CSP"
    assert not re.search(r"<script(?![^>]*\ssrc=)[^>]*>", r.text), "inline scripts would be blocked by the CSP"


def test_unknown_assets_are_404():
    c = _client()
    for path in ("/webui/nope.js", "/webui/..%2Fwebui.py", "/webui/%2e%2e/limits.py", "/webui/index.html"):
        assert c.get(path).status_code == 404, path


def test_shipped_files_are_package_data():
    on_disk = {p.name for p in WEBUI_DIR.iterdir() if p.is_file()}
    assert on_disk == set(ASSETS) | {"index.html"}
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "webui/*" in data["ds4serve.server"]


def test_no_webui_flag_turns_the_page_off():
    parser = build_parser()
    assert _settings(parser.parse_args(["serve"]), ServerLimits, _SERVER_FLAGS).webui is True
    limits = _settings(parser.parse_args(["serve", "--no-webui"]), ServerLimits, _SERVER_FLAGS)
    assert limits.webui is False
    c = _client(webui=False)
    assert c.get("/").status_code == 404
    assert c.get("/webui/app.js").status_code == 404


def test_page_is_open_but_the_api_keeps_its_key():
    c = _client(api_key=KEY)
    r = c.get("/")
    assert r.status_code == 200
    for name in ASSETS:
        body = c.get(f"/webui/{name}")
        assert body.status_code == 200 and KEY.encode() not in body.content
    assert KEY not in r.text
    assert c.get("/v1/models").status_code == 401  # the page's calls need the user's key like any other
    assert c.get("/metrics").status_code == 401


@pytest.mark.parametrize("webui", [True, False])
def test_page_is_not_part_of_the_api_schema(webui: bool):
    paths = _client(webui=webui).get("/openapi.json").json()["paths"]
    assert "/" not in paths and not any(p.startswith("/webui") for p in paths)
