"""The chat page at ``/``: static files shipped in the package (``webui/``), no build step, no CDN.

The page is served without auth on purpose: it holds no secret and no data, and every call it makes
goes to the API with the key the user typed (kept in the browser's session storage), so serving it
never makes the API reachable without the key. Model output is rendered by the page's own markdown
renderer, which only builds DOM nodes from text (never HTML from model text); the Content-Security-
Policy below is a second wall: no inline script, no foreign origin, even if a renderer bug let markup
through. ``serve --no-webui`` leaves the routes out, so ``/`` is a 404.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, Response

WEBUI_DIR = Path(__file__).resolve().parent / "webui"

#: the files the page loads, with their content types (anything else under /webui/ is a 404)
ASSETS = {"app.js": "text/javascript; charset=utf-8", "chat.js": "text/javascript; charset=utf-8",
          "markdown.js": "text/javascript; charset=utf-8", "reply.js": "text/javascript; charset=utf-8",
          "style.css": "text/css; charset=utf-8",
          "favicon.svg": "image/svg+xml"}

#: scripts and styles from this origin only; images also from data:/blob: URLs (attached pictures);
#: fetches to this origin only (the API); no plugins, frames or base-URL tricks
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


async def index() -> Response:
    """The page itself."""
    return FileResponse(WEBUI_DIR / "index.html", media_type="text/html; charset=utf-8", headers=_HEADERS)


async def asset(name: str) -> Response:
    """One of the page's files (a fixed list: no path from the URL ever reaches the filesystem)."""
    if name not in ASSETS:
        return Response(status_code=404)
    return FileResponse(WEBUI_DIR / name, media_type=ASSETS[name], headers=_HEADERS)


def mount_webui(app: FastAPI, enabled: bool = True) -> None:
    """Add ``GET /`` and ``GET /webui/{name}`` (left out of the OpenAPI schema: they are not API)."""
    if not enabled:
        return
    app.add_api_route("/", index, methods=["GET"], include_in_schema=False)
    app.add_api_route("/webui/{name}", asset, methods=["GET"], include_in_schema=False)
