"""OpenAI-shaped errors: every error body is ``{"error": {...}}``, validation failures are 400.

Every handler notes its error on the request's access-log record (``access_log``), so the one
access line of a request says how it failed.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from .access_log import RequestRecord, record_of, request_id_of
from .anthropic_errors import anthropic_error, is_anthropic_path
from .protocol import APIError

log = logging.getLogger("ds4serve.server.app")


class _ErrorJSON(JSONResponse):
    """JSON that never fails to encode: text that cannot be UTF-8 (a lone surrogate echoed from the
    request) is written as a ``\\uXXXX`` escape instead of turning the error into a 500."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _error_response(err: APIError, rec: RequestRecord | None = None, path: str = "") -> JSONResponse:
    """The OpenAI error body (Anthropic's on the Messages API routes, ``anthropic_errors``); the
    error is noted on the request's access-log record."""
    if rec is not None:
        rec.note_error(err)
    if is_anthropic_path(path):
        status, body = anthropic_error(err)
        return _ErrorJSON(body, status_code=status, headers=err.headers)
    return _ErrorJSON(err.body(), status_code=err.status, headers=err.headers)


async def send_error(scope: dict, send: Any, err: APIError) -> None:
    """Answer from ASGI middleware (below FastAPI's exception handlers)."""
    resp = _error_response(err, record_of(scope), scope.get("path", ""))
    await send({"type": "http.response.start", "status": resp.status_code, "headers": resp.raw_headers})
    await send({"type": "http.response.body", "body": resp.body})


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The most specific pydantic error as ``param: message`` with an OpenAI-style param path.

    For union fields (``content`` is a string or a list of parts) pydantic reports one error per
    alternative; the deepest location is the one that says what the client got wrong."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    if any(e.get("type") in ("json_invalid", "json_type") for e in errors):
        return "the request body is not valid JSON", None
    for e in errors:  # our own checks that name their field (lone surrogates) say it best
        if "param" in (e.get("ctx") or {}):
            return e["msg"], e["ctx"]["param"]
    e = max(errors, key=lambda err: len(err.get("loc", ())))
    param = ""
    for part in e.get("loc", ()):
        if part == "body" or (isinstance(part, str) and ("[" in part or part.split("-")[0].lower() in _TYPE_TAGS)):
            continue
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
    msg = e.get("msg", "invalid value")
    return (f"{param}: {msg}" if param else msg), (param or None)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return _error_response(exc, record_of(request), request.url.path)


async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    msg, param = _validation_message(exc)
    return _error_response(APIError(400, msg, param=param), record_of(request), request.url.path)


def served_routes(app: Any) -> list[tuple[str, str]]:
    """(method, path) of every API route, in the order they were added. Only routes in the OpenAPI
    schema count (the docs pages and the chat page's files are not API); ``HEAD``, which Starlette adds
    to every ``GET``, is left out so the list reads as the API does."""
    return [(method, route.path) for route in app.routes
            if isinstance(route, APIRoute) and route.include_in_schema
            for method in sorted(route.methods - {"HEAD"})]


def _routing_error(request: Request, exc: StarletteHTTPException) -> APIError:
    """A 404 or 405 from routing, told so a client can fix it: the bare "Not Found" says neither what
    was asked for nor what exists, and a wrong base URL or method is the usual cause."""
    method, path = request.method, request.url.path
    if exc.status_code == 405:
        allowed = sorted({m for r in request.app.routes if isinstance(r, APIRoute) and r.path_regex.match(path)
                          for m in r.methods - {"HEAD"}})
        return APIError(405, f"method {method} is not allowed on {path}; allowed: {', '.join(allowed)}",
                        code="method_not_allowed", headers={"Allow": ", ".join(allowed)})
    served = ", ".join(f"{m} {p}" for m, p in served_routes(request.app))
    return APIError(404, f"no route {method} {path}; this server serves: {served}", code="not_found")


async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code in (404, 405):
        err = _routing_error(request, exc)
    else:
        err = APIError(exc.status_code, str(exc.detail))
    return _error_response(err, record_of(request), request.url.path)


async def _internal(request: Request, exc: Exception) -> JSONResponse:
    """Starlette answers from outside the access-log layer, so the id header is added here."""
    rid = request_id_of(request)
    log.exception("unhandled error in %s %s (request_id=%s)", request.method, request.url.path, rid)
    err = APIError(500, "internal server error", type_="server_error", code="internal_error",
                   headers={"x-request-id": rid} if rid else None)
    return _error_response(err, record_of(request), request.url.path)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _internal)
