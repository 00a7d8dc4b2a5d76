"""Request ids and the access log: one line per HTTP request, written when its answer is over.

uvicorn's own access log is off (it knows neither tokens nor finish reasons, and logs a stream when
its headers go out, not when it ends). This ASGI middleware replaces it. It is the outermost layer
below Starlette's error handler, so it sees every answer: auth failures, oversized bodies,
validation errors, streams that end normally and streams the client walked away from.

Every request gets an id: the client's ``x-request-id`` when it is a sane token (visible ASCII, at
most 256 characters), otherwise one made here (``req-<hex>``). It is sent back as ``x-request-id`` on
every response (the 500 handler adds it itself, being outside this layer) and names the request in
every log line about it. The route handlers fill the request's :class:`RequestRecord` (tokens, first
token time, finish reasons, error, cancellation, cached prompt tokens) and the auth layer its API
key's name (never the key); this layer times it, logs it and counts errors and cancellations in the
Prometheus metrics, by key name.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .protocol import APIError

log = logging.getLogger("ds4serve.access")

SCOPE_KEY = "ds4serve.access"
MAX_ID_LEN = 256
QUIET_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapes: logged at DEBUG, not INFO


@dataclass
class RequestRecord:
    """What the access log line says about one HTTP request; filled in as the request runs."""

    request_id: str
    method: str
    path: str
    start: float = field(default_factory=time.monotonic)
    status: int | None = None
    completion_id: str | None = None  # the body's ``id`` (chatcmpl-...), when a job was built
    prompt_tokens: int | None = None
    tokens: dict[int, int] = field(default_factory=dict)  # choice index -> tokens generated so far
    first_token_at: float | None = None
    finish: dict[int, str] = field(default_factory=dict)  # choice index -> finish reason
    error: str | None = None
    cancelled: str | None = None  # why it stopped early: "client_disconnect" | "timeout" | "server_shutdown"
    key_name: str = ""  # the name of the API key it came with (middleware.Auth); never the key itself
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache (summed over prompts)

    def note_error(self, err: APIError) -> None:
        self.error = f"{err.code or err.type}: {err.message}"

    def tokens_out(self, index: int, n: int) -> None:
        """Choice ``index`` produced ``n`` tokens; the first call fixes the request's time to first
        token. Counted as they come, so a stream the client left still says how far it got."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.tokens[index] = self.tokens.get(index, 0) + n

    def finished(self, index: int, reason: str, completion_tokens: int | None) -> None:
        self.finish[index] = reason
        if completion_tokens is not None:  # the engine's own count is the one usage reports
            self.tokens[index] = completion_tokens

    @property
    def completion_tokens(self) -> int:
        return sum(self.tokens.values())

    def fields(self, now: float) -> dict[str, Any]:
        reasons = sorted(set(self.finish.values()))
        ttft = None if self.first_token_at is None else round(1e3 * (self.first_token_at - self.start), 1)
        return {"request_id": self.request_id, "method": self.method, "path": self.path, "status": self.status,
                "key_name": self.key_name or None, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens if self.prompt_tokens is not None else None,
                "ttft_ms": ttft, "duration_ms": round(1e3 * (now - self.start), 1),
                "finish": ",".join(reasons) if reasons else None, "cancelled": self.cancelled,
                "error": self.error, "completion_id": self.completion_id}


def record_of(scope_or_request: Any) -> RequestRecord | None:
    """The record of a request (an ASGI scope or a Starlette request), if this middleware saw it."""
    scope = getattr(scope_or_request, "scope", scope_or_request)
    return scope.get(SCOPE_KEY)


def request_id_of(scope_or_request: Any) -> str | None:
    rec = record_of(scope_or_request)
    return rec.request_id if rec is not None else None


def client_request_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The client's ``x-request-id`` if it is safe to echo and to put in a log line, else None."""
    for name, value in headers:
        if name.lower() == b"x-request-id":
            rid = value.decode("latin-1").strip()
            if 0 < len(rid) <= MAX_ID_LEN and all(0x21 <= ord(c) <= 0x7E for c in rid):
                return rid
            return None
    return None


def format_line(f: dict[str, Any]) -> str:
    """``key=value`` pairs (logfmt); free text is JSON-quoted so a line can always be split back."""
    parts = []
    for key, value in f.items():
        if value is None:
            continue
        text = str(value)
        if key == "error" or any(c in text for c in ' "=\\') or not text.isprintable():
            text = json.dumps(text)
        parts.append(f"{key}={text}")
    return " ".join(parts)


class AccessLog:
    """ASGI middleware: give the request an id, echo it, log one line when the answer is over."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = client_request_id(scope.get("headers") or []) or f"req-{uuid.uuid4().hex}"
        rec = RequestRecord(rid, scope.get("method", ""), scope.get("path", ""))
        scope[SCOPE_KEY] = rec
        header = (b"x-request-id", rid.encode("latin-1"))

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                rec.status = message["status"]
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, header]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except asyncio.CancelledError:  # uvicorn gave up on the request (shutdown): nobody gets an answer
            rec.cancelled = rec.cancelled or "server_shutdown"
            raise
        except BaseException as exc:
            if rec.status is None:  # Starlette's error handler answers 500 outside this layer
                rec.status = 500
                rec.error = rec.error or f"internal_error: {type(exc).__name__}"
            raise
        finally:
            self.finish(rec)

    def finish(self, rec: RequestRecord) -> None:
        """Count and log a request whose answer is over (or abandoned)."""
        if rec.status is None:  # the app returned without answering: nobody was left to answer
            rec.status = 499
        status = rec.status
        if rec.cancelled is not None:
            self.metrics.cancellations.labels(rec.key_name, rec.cancelled).inc()
        if status >= 400 and status != 499:  # 499 is no answer: the client had already left
            self.metrics.error_responses.labels(rec.key_name, str(status)).inc()
        f = rec.fields(time.monotonic())
        level = logging.DEBUG if rec.path in QUIET_PATHS and status < 400 else logging.INFO
        log.log(level, "%s", format_line(f), extra={"access": f, "request_id": rec.request_id})
