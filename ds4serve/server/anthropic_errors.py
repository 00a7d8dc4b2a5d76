"""Anthropic-shaped error bodies for the Messages API routes (``/v1/messages...``).

An Anthropic client reads ``{"type": "error", "error": {"type": ..., "message": ...}}`` and picks
its exception class by status; the OpenAI body the rest of the server answers with would reach it
as an unreadable error. Every error on these routes (validation, auth and body-size refusals from
the middleware, 404s, engine refusals, internal failures) goes through ``anthropic_error`` in
``errors``, which branches on the path, so no route can forget it.

The status is kept, except that a full queue (OpenAI: 503 ``server_overloaded``) is Anthropic's
529 ``overloaded_error``, the status its SDK retries as "overloaded".
"""

from __future__ import annotations

from .protocol import APIError

PREFIX = "/v1/messages"

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 504: "timeout_error",
          529: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    """Whether ``path`` is one of the Messages API routes (or below them: a 404 there is theirs too)."""
    return path == PREFIX or path.startswith(PREFIX + "/")


def error_type(status: int) -> str:
    """Anthropic's ``error.type`` for an HTTP status (other 4xx are request errors, other 5xx ``api_error``)."""
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(message: str, status: int) -> dict:
    """The Anthropic error body for ``status``."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def anthropic_error(err: APIError) -> tuple[int, dict]:
    """(status, body) of ``err`` as the Messages API answers it."""
    status = 529 if err.code == "server_overloaded" else err.status
    return status, error_body(err.message, status)


_SCHEMA = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"type": "string", "enum": ["error"]},
    "error": {"type": "object", "required": ["type", "message"],
              "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}
_STATUSES = {"400": "invalid request", "401": "missing or wrong API key", "404": "unknown model",
             "413": "request body too large", "500": "internal error", "503": "shutting down",
             "504": "request timeout", "529": "at capacity (overloaded_error, Retry-After)"}


def document_routes(schema: dict) -> None:
    """Put the Messages API's error statuses, with Anthropic's error body, into the served OpenAPI
    schema (after ``openapi`` documented every route's OpenAI errors and ``x-request-id``)."""
    schema.setdefault("components", {}).setdefault("schemas", {})["AnthropicErrorResponse"] = _SCHEMA
    body = {"application/json": {"schema": {"$ref": "#/components/schemas/AnthropicErrorResponse"}}}
    for path, ops in schema.get("paths", {}).items():
        if not is_anthropic_path(path):
            continue
        codes = list(_STATUSES) if path == PREFIX else ["400", "401", "404", "413", "500"]
        for op in ops.values():
            responses = op.setdefault("responses", {})
            headers = dict(responses.get("200", {}).get("headers", {}))
            for code in codes:
                responses[code] = {"description": _STATUSES[code], "content": body, "headers": headers}
            if path == PREFIX:
                ok = responses.setdefault("200", {"description": "Successful Response"})
                ok.setdefault("content", {})["text/event-stream"] = {"schema": {"type": "string"}}
