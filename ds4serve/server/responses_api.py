"""``POST /v1/responses``: the OpenAI Responses API as an adapter over the chat completions path.

The request becomes a chat request (``responses_request``), which ``jobs.build_chat`` validates and
renders exactly as for ``/v1/chat/completions``; ``serving.admit`` / ``serving.events`` run it on the
engine with the same admission, cancellation, deadline and keep-alive rules (``watch.race``). Only
the answer's shape differs: the parsed output events are turned into Responses items and stream
events by ``responses_events.ResponseBuilder``. A 4xx raised on the chat path names the Responses
field (``responses_request.responses_error``).

Nothing is stored (``store`` is accepted and echoed): ``GET /v1/responses/{id}`` answers 404 saying
so, and a request that refers to a stored response is a 400 (``responses_protocol``).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from .access_log import record_of
from .frames import ChoiceStep
from .jobs import Job, build_chat
from .middleware import key_name_of
from .protocol import APIError
from .responses_events import ResponseBuilder
from .responses_output import Echo, usage_of
from .responses_protocol import ResponsesRequest
from .responses_request import chat_request, responses_error
from .serving import Gone, admit, deadline_error, deadline_message, mark_cancelled, watched
from .state import ServerState, state_of
from .watch import Outcome, disconnected

log = logging.getLogger(__name__)

FINISHED = ("stop", "length", "tool_calls")


class Run:
    """One response being answered: engine events in, Responses stream events out."""

    def __init__(self, job: Job, builder: ResponseBuilder):
        self.job, self.builder = job, builder
        self.final: dict[str, Any] | None = None  # the last response object, once it ended
        self.error: str | None = None  # why it failed, if it did

    def feed(self, ev: ChoiceStep) -> list[dict[str, Any]]:
        """The stream events of one engine step (the last ones end the response)."""
        out = [e for d in ev.deltas for e in self.builder.feed(d)]
        if ev.finish_reason is None:
            return out
        if ev.finish_reason not in FINISHED:
            return out + self.fail(f"generation failed: {ev.error or ev.finish_reason}", "generation_failed")
        completion = ev.usage[1] if ev.usage else ev.completion
        out += self.builder.finish(ev.finish_reason, usage_of(self.job, completion, ev.reasoning_tokens))
        self.final = out[-1]["response"]
        return out

    def fail(self, message: str, code: str) -> list[dict[str, Any]]:
        self.error = message
        out = self.builder.fail(message, code)
        self.final = out[-1]["response"]
        return out


async def create_response(body: ResponsesRequest, request: Request) -> Response | dict:
    """Validate and render as a chat request, admit it, answer as one ``response`` or as SSE events."""
    state = state_of(request)
    chat_body, inp = chat_request(body)
    response_id = "resp_" + uuid.uuid4().hex
    try:
        job = await build_chat(state, chat_body, response_id, key_name_of(request))
        job.record = record_of(request)
        if job.record is not None:
            job.record.completion_id = response_id
        await admit(state, job)
    except APIError as exc:
        raise responses_error(exc, inp) from None
    run = Run(job, ResponseBuilder(Echo.of(body, chat_body.tools), response_id))
    gone = partial(disconnected, request)
    if body.stream:
        return StreamingResponse(sse(state, run, gone), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await collect(state, run, gone)


async def collect(state: ServerState, run: Run, gone: Gone | None = None) -> Response | dict:
    """The whole ``response`` as one body; a disconnect (499) or the deadline (504) cancels it, and a
    failed generation is a 5xx, as on the chat route."""
    async with aclosing(watched(state, run.job, gone)) as items:
        async for item in items:
            if item is Outcome.DISCONNECT:
                return Response(status_code=499)
            if item is Outcome.TIMEOUT:
                raise deadline_error(state)
            run.feed(item)
    if run.error is not None or run.final is None:
        message = run.error or "the generation ended without a finish reason"
        status = 503 if "shutting down" in message else 500
        raise APIError(status, message, type_="server_error", code="generation_failed")
    return run.final


def frame(ev: dict[str, Any]) -> str:
    """One SSE frame, named like OpenAI's (``event: response.created``)."""
    return f"event: {ev['type']}\ndata: {json.dumps(ev, ensure_ascii=False)}\n\n"


async def sse(state: ServerState, run: Run, gone: Gone | None = None) -> AsyncIterator[str]:
    """The stream: ``response.created``, ``response.in_progress``, the items' events, then
    ``response.completed`` / ``response.incomplete`` (or ``error`` + ``response.failed``). A bug
    while streaming fails this response with those two events, not the connection silently."""
    finished = False
    try:
        async for piece in _pieces(state, run, gone):
            yield piece if isinstance(piece, str) else frame(piece)
        finished = True
    except Exception:  # noqa: BLE001 - one response fails, the server goes on
        log.exception("responses stream %s failed", run.job.log_id)
        finished = True
        if run.final is None:
            for ev in run.fail("internal server error while streaming", "internal_error"):
                yield frame(ev)
    finally:
        if not finished:  # torn down mid-stream (Starlette saw the disconnect first)
            mark_cancelled(run.job, "client_disconnect")


async def _pieces(state: ServerState, run: Run, gone: Gone | None) -> AsyncIterator[dict[str, Any] | str]:
    """The stream's events in order, and keep-alive comments (str) while nothing comes."""
    for ev in run.builder.start():
        yield ev
    async with aclosing(watched(state, run.job, gone, keepalive=True)) as items:
        async for item in items:
            if item is Outcome.DISCONNECT:
                return
            if item is Outcome.KEEPALIVE:
                yield ": keep-alive\n\n"
                continue
            if item is Outcome.TIMEOUT:
                out = run.fail(deadline_message(state), "timeout")
            else:
                out = run.feed(item)
            for ev in out:
                yield ev
    if run.final is None:
        for ev in run.fail("the generation ended without a finish reason", "generation_failed"):
            yield ev


async def get_response(response_id: str) -> Response:
    """Nothing is stored, so no id is ever found; the 404 says why (clients retrieve after ``store``)."""
    raise APIError(404, f"response {response_id!r} not found: this server does not store responses (it is "
                   "stateless); read the response from the POST /v1/responses answer", param="response_id",
                   code="response_not_found")
