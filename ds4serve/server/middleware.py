"""ASGI middleware: the body-size limit and the API keys (both answer before FastAPI parses anything)."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from .access_log import record_of
from .errors import send_error
from .keys import ApiKeys
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


class _TooLarge(BaseException):
    """Raised from ``receive`` past the limit. Not an ``Exception``: FastAPI turns any exception while it
    reads a body into a 400 "error parsing the body", so a streamed (chunked) oversized body was a 400,
    not the 413 a declared one gets; this passes through to ``BodyLimit``."""


GUARDED = frozenset({"/metrics", "/tokenize", "/detokenize", "/apply-template", "/reset_prefix_cache"})
KEY_SCOPE = "ds4serve.key_name"


class Auth:
    """The API keys guard ``/v1/*``, ``/metrics``, the tokenizer endpoints and ``/reset_prefix_cache``
    (``/health`` and the chat page stay open). The matching key's *name* is put in the scope
    (``key_name_of``) and on the access-log record, where the routes, the log line and the metrics
    read it; the key itself goes no further than this layer."""

    def __init__(self, app: Any, keys: ApiKeys):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and self.keys and (path.startswith("/v1/") or path in GUARDED):
            name = self.keys.match(_token(Request(scope)))
            if name is None:
                return await send_error(scope, send, APIError(
                    401, "invalid or missing API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                    type_="invalid_request_error", code="invalid_api_key"))
            scope[KEY_SCOPE] = name
            rec = record_of(scope)
            if rec is not None:
                rec.key_name = name
        return await self.app(scope, receive, send)


def _token(request: Request) -> str:
    """The offered key: ``Authorization: Bearer KEY`` (OpenAI's form) or ``x-api-key: KEY``."""
    header = request.headers.get("authorization", "")
    return header[7:] if header[:7].lower() == "bearer " else request.headers.get("x-api-key", "")


def key_name_of(scope_or_request: Any) -> str:
    """The name of the key a request came with ("" on a server without keys, or an open route)."""
    scope = getattr(scope_or_request, "scope", scope_or_request)
    return scope.get(KEY_SCOPE, "")
