"""The FastAPI application: OpenAI routes, errors, auth, limits, metrics.

Everything slow runs elsewhere: the model in the engine-loop thread, templating / tokenizing /
image decoding in a worker pool. Every error body is OpenAI-shaped (``{"error": {...}}``);
validation failures are 400, never FastAPI's default 422. Every request has an id and one access log
line (``access_log``); every error handler notes its error on the request's record for that line.
"""

from __future__ import annotations

import asyncio
import hmac
import json
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
from .access_log import AccessLog, RequestRecord, record_of, request_id_of
from .metrics import Metrics
from .openapi import custom_openapi
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
    metrics: Metrics = field(default=None)  # type: ignore[assignment]  # built for model_id when not given
    image_pipeline: Any = None  # multimodal preprocessing (DS4V); None for text-only models
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(4, "ds4serve-prep"))
    started: float = field(default_factory=time.time)

    def __post_init__(self):
        if self.metrics is None:
            self.metrics = Metrics(self.model_id)

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
            return await _send_error(scope, send, APIError(413, f"request body of {int(declared)} bytes exceeds the "
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
            return await _send_error(scope, send, APIError(413, f"request body exceeds the limit of {self.limit} "
                                                           "bytes", code="request_too_large"))


class _TooLarge(Exception):
    pass


async def _send_error(scope, send, err: APIError) -> None:
    resp = _error_response(err, record_of(scope))
    await send({"type": "http.response.start", "status": resp.status_code, "headers": resp.raw_headers})
    await send({"type": "http.response.body", "body": resp.body})


class _ErrorJSON(JSONResponse):
    """JSON that never fails to encode: text that cannot be UTF-8 (a lone surrogate echoed from the
    request) is written as a ``\\uXXXX`` escape instead of turning the error into a 500."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _error_response(err: APIError, rec: RequestRecord | None = None) -> JSONResponse:
    """The OpenAI error body; the error is noted on the request's access-log record."""
    if rec is not None:
        rec.note_error(err)
    return _ErrorJSON(err.body(), status_code=err.status, headers=err.headers)


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
    app.openapi = lambda: custom_openapi(app)
    # the last added is the outermost: the access log sees the 401s and 413s of the layers inside it
    app.add_middleware(_BodyLimit, limit=state.limits.max_body_bytes)
    app.add_middleware(_Auth, api_key=state.api_key)
    app.add_middleware(AccessLog, metrics=state.metrics)
    _install_error_handlers(app)
    _install_routes(app, state, Serving(state))
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error_response(exc, record_of(request))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        return _error_response(APIError(400, msg, param=param), record_of(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error_response(APIError(exc.status_code, str(exc.detail), code=code), record_of(request))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        """Starlette answers from outside the access-log layer, so the id header is added here."""
        rid = request_id_of(request)
        log.exception("unhandled error in %s %s (request_id=%s)", request.method, request.url.path, rid)
        err = APIError(500, "internal server error", type_="server_error", code="internal_error",
                       headers={"x-request-id": rid} if rid else None)
        return _error_response(err, record_of(request))


def _install_routes(app: FastAPI, state: ServerState, serving: Serving) -> None:
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
        return await _run(serving, job, request)

    @app.post("/v1/completions", summary="text completions (streaming or not)")
    async def completions(body: CompletionRequest, request: Request):
        job = await serving.build_completion(body, new_request_id("completion"))
        return await _run(serving, job, request)


async def _run(serving: Serving, job, request: Request):
    job.record = record_of(request)
    if job.record is not None:
        job.record.completion_id = job.request_id
    await serving.admit(job)
    if job.stream:
        return StreamingResponse(serving.sse(job, serving.state.model_id, disconnected=lambda: _disconnect(request)),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _collect_watching(serving, job, request)


async def _disconnect(request: Request) -> None:
    """Resolve when the client disconnects (the body is already read, so the next ASGI message
    is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect_watching(serving: Serving, job, request: Request):
    """Collect a non-streaming answer; a client disconnect or the timeout cancels it."""
    limits = serving.state.limits
    task = asyncio.ensure_future(serving.collect(job, serving.state.model_id))
    deadline = job.arrival + limits.request_timeout_s
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if done:
                break
            if await request.is_disconnected():
                task.cancel()
                serving.mark_cancelled(job, "client_disconnect")
                return Response(status_code=499)
            if time.monotonic() > deadline:
                task.cancel()
                serving.mark_cancelled(job, "timeout")
                raise APIError(504, f"the request did not finish within {limits.request_timeout_s:.0f} s",
                               type_="server_error", code="timeout")
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class _Auth:
    """ASGI middleware: the API key guards ``/v1/*`` and ``/metrics`` (``/health`` stays open)."""

    def __init__(self, app, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and self.api_key and (path.startswith("/v1/") or path == "/metrics"):
            if not _authorized(Request(scope), self.api_key):
                return await _send_error(scope, send, APIError(
                    401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                    type_="invalid_request_error", code="invalid_api_key"))
        return await self.app(scope, receive, send)


def _authorized(request: Request, key: str) -> bool:
    header = request.headers.get("authorization", "")
    token = header[7:] if header[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
    return hmac.compare_digest(token.encode("utf-8", "surrogateescape"), key.encode("utf-8"))
