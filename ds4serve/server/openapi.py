"""The OpenAPI schema as served: FastAPI's, corrected to what the server really answers.

Validation errors are 400 (not FastAPI's 422) with the OpenAI error body, the other error statuses
are documented, streaming answers are SSE. The fuzz test checks every answer against this schema.
"""

from __future__ import annotations

from fastapi import FastAPI

from .anthropic_errors import document_routes
from .middleware import GUARDED

_ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_ERRORS = {"400": "invalid request (OpenAI error body)", "401": "missing or wrong API key",
           "404": "unknown model", "413": "request body too large", "500": "internal error",
           "503": "at capacity (Retry-After) or shutting down", "504": "request timeout"}

# the errors of the non-generating routes (a generation route also answers 503 / 504)
_PLAIN_ERRORS = {**dict.fromkeys(("/tokenize", "/detokenize", "/apply-template"), ("400", "404", "413", "500")),
                 "/v1/models/{model_id}": ("404",), "/reset_prefix_cache": ("500", "503"),
                 "/v1/responses/{response_id}": ("404",)}

_REQUEST_ID = {"description": "the request's id: the client's x-request-id when it is visible ASCII of at most 256 "
                              "characters, else one made by the server; it names the request in the server's logs",
               "schema": {"type": "string"}}


def custom_openapi(app: FastAPI) -> dict:
    """FastAPI's schema, corrected to what is served: validation errors are 400 (not 422) with the
    OpenAI error body, the other error statuses are documented, streaming answers are SSE."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schema.setdefault("components", {}).setdefault("schemas", {})["ErrorResponse"] = _ERROR_SCHEMA
    err = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path, ops in schema.get("paths", {}).items():
        for op in ops.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            if path.startswith("/v1/") or path in GUARDED:
                responses["401"] = {"description": _ERRORS["401"], "content": err}
            for code in _PLAIN_ERRORS.get(path, ()):
                responses[code] = {"description": _ERRORS[code], "content": err}
            if path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
                for code in ("400", "404", "413", "500", "503", "504"):
                    responses[code] = {"description": _ERRORS[code], "content": err}
                ok = responses.setdefault("200", {"description": "Successful Response"})
                ok.setdefault("content", {})["text/event-stream"] = {"schema": {"type": "string"}}
            if path == "/health":
                responses["503"] = {"description": "the engine is not running",
                                    "content": {"application/json": {"schema": {"type": "object"}}}}
            if path == "/metrics":
                responses["200"] = {"description": "Prometheus text format",
                                    "content": {"text/plain": {"schema": {"type": "string"}}}}
            for resp in responses.values():
                resp.setdefault("headers", {})["x-request-id"] = _REQUEST_ID
    document_routes(schema)  # the Messages API answers with Anthropic's error body
    for comp in ("HTTPValidationError", "ValidationError"):
        schema["components"]["schemas"].pop(comp, None)
    app.openapi_schema = schema
    return schema
