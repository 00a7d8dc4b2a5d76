"""ASGI middleware: the body-size limit and the API key (both answer before FastAPI parses anything)."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import Request

from .errors import send_error
from .protocol import APIError


class BodyLimit:
    """Refuse bodies over the limit with 413 (declared or streamed length)."""

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await send_error(scope, send, APIError(413, f"request body of {int(declared)} bytes exceeds the "
                                                          f"limit of {self.limit} bytes", code="request_too_large"))
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge()
            return msg

        try:
            return await self.app(scope, limited, send)
        except _TooLarge:
            return await send_error(scope, send, APIError(413, f"request body exceeds the limit of {self.limit} "
                                                          "bytes", code="request_too_large"))


class _TooLarge(Exception):
    pass


GUARDED = frozenset({"/metrics", "/tokenize", "/detokenize", "/apply-template"})


class Auth:
    """The API key guards ``/v1/*``, ``/metrics`` and the tokenizer endpoints (``/health`` stays open)."""

    def __init__(self, app: Any, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and self.api_key and (path.startswith("/v1/") or path in GUARDED):
            if not _authorized(Request(scope), self.api_key):
                return await send_error(scope, send, APIError(
                    401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                    type_="invalid_request_error", code="invalid_api_key"))
        return await self.app(scope, receive, send)


def _authorized(request: Request, key: str) -> bool:
    header = request.headers.get("authorization", "")
    token = header[7:] if header[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
    return hmac.compare_digest(token.encode("utf-8", "surrogateescape"), key.encode("utf-8"))
