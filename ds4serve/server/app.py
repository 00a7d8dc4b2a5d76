"""The FastAPI application: OpenAI routes, errors, auth, limits, metrics.

Everything slow runs elsewhere: the model in the engine-loop thread, templating / tokenizing /
image decoding in a worker pool. Every error body is OpenAI-shaped (``{"error": {...}}``);
validation failures are 400, never FastAPI's default 422.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..chat import Tokenizer
from ..scheduler.async_engine import AsyncEngine
from .metrics import Metrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest
from .serving import ServerLimits, Serving, new_request_id

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Tokenizer
    model_id: str
    limits: ServerLimits = field(default_factory=ServerLimits)
    api_key: str | None = None
    random_weights: bool = False
    metrics: Metrics = field(default_factory=Metrics)
    image_pipeline: Any = None  # multimodal preprocessing (DS4V); None for text-only models
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(4, "ds4serve-prep"))
    started: float = field(default_factory=time.time)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.engine.core.eos_ids

    async def run_blocking(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def prepare_images(self, rendered):
        """Decode, resize and expand the request's images (worker thread)."""
        from ..multimodal.images import ImageError  # noqa: PLC0415 - the leaf package imports PIL

        if self.image_pipeline is None:
            raise APIError(400, f"model {self.model_id!r} does not accept images; send text only",
                           param="messages", code="images_not_supported")
        try:
            return self.image_pipeline.prepare(rendered)
        except ImageError as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_image") from exc


class _BodyLimit:
    """ASGI middleware: refuse bodies over the limit with 413 (declared or streamed length)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await _send_error(send, APIError(413, f"request body of {int(declared)} bytes exceeds the limit "
                                                    f"of {self.limit} bytes", code="request_too_large"))
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
            return await _send_error(send, APIError(413, f"request body exceeds the limit of {self.limit} bytes",
                                                    code="request_too_large"))


class _TooLarge(Exception):
    pass


async def _send_error(send, err: APIError) -> None:
    resp = _error_response(err)
    await send({"type": "http.response.start", "status": resp.status_code, "headers": resp.raw_headers})
    await send({"type": "http.response.body", "body": resp.body})


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


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
    e = max(errors, key=lambda err: len(err.get("loc", ())))
    param = ""
    for part in e.get("loc", ()):
        if part == "body" or (isinstance(part, str) and ("[" in part or part.split("-")[0].lower() in _TYPE_TAGS)):
            continue
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
    msg = e.get("msg", "invalid value")
    return (f"{param}: {msg}" if param else msg), (param or None)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.on_step = state.metrics.on_step
        state.engine.on_change = state.metrics.on_change
        state.engine.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, state.engine.shutdown)
        state.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="ds4serve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server for DeepSeek-V4 / DS4V models")
    app.state.ds4 = state
    app.openapi = lambda: _openapi(app)
    serving = Serving(state)
    app.add_middleware(_BodyLimit, limit=state.limits.max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        return _error_response(APIError(400, msg, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error_response(APIError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return _error_response(APIError(500, "internal server error", type_="server_error", code="internal_error"))

    @app.middleware("http")
    async def _auth_and_ids(request: Request, call_next):
        path = request.url.path
        protected = path.startswith("/v1/") or path == "/metrics"
        if state.api_key and protected and not _authorized(request, state.api_key):
            return _error_response(APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                            type_="invalid_request_error", code="invalid_api_key"))
        response = await call_next(request)
        rid = request.headers.get("x-request-id")
        if rid:
            response.headers["x-request-id"] = rid[:256]
        return response

    @app.get("/health", summary="liveness: 200 when the engine is running")
    async def health():
        if not state.engine.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", summary="the served model")
    async def models():
        card = {"id": state.model_id, "object": "model", "created": int(state.started), "owned_by": "ds4serve",
                "max_model_len": state.engine.core.limits.max_model_len}
        if state.random_weights:
            card["ds4serve_note"] = ("random placeholder weights: answers are noise (the trained tiny DS4V is "
                                     "models/ds4v-tiny)")
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions", summary="chat completions (streaming or not)")
    async def chat(body: ChatCompletionRequest, request: Request):
        job = await serving.build_chat(body, new_request_id("chat"))
        return await _run(job, request)

    @app.post("/v1/completions", summary="text completions (streaming or not)")
    async def completions(body: CompletionRequest, request: Request):
        job = await serving.build_completion(body, new_request_id("completion"))
        return await _run(job, request)

    async def _run(job, request: Request):
        await serving.admit(job)
        if job.stream:
            return StreamingResponse(serving.sse(job, state.model_id, disconnected=lambda: _disconnect(request)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _collect_watching(job, request)

    async def _disconnect(request: Request) -> None:
        """Resolve when the client disconnects (the body is already read, so the next ASGI message
        is the disconnect)."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    async def _collect_watching(job, request: Request):
        """Collect a non-streaming answer; a client disconnect or the timeout cancels it."""
        task = asyncio.ensure_future(serving.collect(job, state.model_id))
        deadline = job.arrival + state.limits.request_timeout_s
        try:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=0.1)
                if done:
                    break
                if await request.is_disconnected():
                    task.cancel()
                    log.info("client disconnected; cancelled %s", job.request_id)
                    return Response(status_code=499)
                if time.monotonic() > deadline:
                    task.cancel()
                    raise APIError(504, f"the request did not finish within {state.limits.request_timeout_s:.0f} s",
                                   type_="server_error", code="timeout")
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    return app


_ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_ERRORS = {"400": "invalid request (OpenAI error body)", "401": "missing or wrong API key",
           "404": "unknown model", "413": "request body too large", "500": "internal error",
           "503": "at capacity (Retry-After) or shutting down", "504": "request timeout"}


def _openapi(app: FastAPI) -> dict:
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
            if path.startswith("/v1/") or path == "/metrics":
                responses["401"] = {"description": _ERRORS["401"], "content": err}
            if path in ("/v1/chat/completions", "/v1/completions"):
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
    for comp in ("HTTPValidationError", "ValidationError"):
        schema["components"]["schemas"].pop(comp, None)
    app.openapi_schema = schema
    return schema


def _authorized(request: Request, key: str) -> bool:
    header = request.headers.get("authorization", "")
    token = header[7:] if header[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
    return hmac.compare_digest(token.encode("utf-8", "surrogateescape"), key.encode("utf-8"))
