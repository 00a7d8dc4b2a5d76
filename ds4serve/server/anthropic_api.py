"""The Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

An adapter over the chat route: ``anthropic_convert`` translates the body into a chat completion
request, ``jobs.build_chat`` validates and renders it into a ``Job`` and ``serving`` admits and runs
it, exactly as for ``/v1/chat/completions``; only the answer is shaped here (``anthropic_output``).
``count_tokens`` renders the same prompt the same way, so it equals what ``create`` reports.

A stream sends Anthropic's named events: ``message_start`` (once the first output is in, or when a
keep-alive is due first), the content-block events, ``ping`` as the keep-alive, then ``message_delta``
(stop reason and the final usage) and ``message_stop``. A failure after the stream opened is an
``error`` event, after which the stream ends. Errors before it are HTTP errors in Anthropic's shape
(``anthropic_errors``, applied by ``errors`` to every response on these paths).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, contextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response

from .anthropic_convert import chat_request
from .anthropic_errors import error_body
from .anthropic_output import BlockWriter, message, sse, stop_reason, usage
from .anthropic_protocol import CountTokensRequest, MessagesRequest
from .frames import ChoiceStep
from .jobs import Job, build_chat, chat_messages, chat_setup_of, prompt_ids
from .middleware import key_name_of
from .protocol import APIError
from .serving import Gone, deadline_error, deadline_message, mark_cancelled, respond, watched
from .state import ServerState, state_of
from .watch import Outcome


def _model_check(state: ServerState, model: str) -> None:
    if model != state.model_id:
        raise APIError(404, f"model {model!r} does not exist; this server serves {state.model_id!r}",
                       param="model", code="model_not_found")


# the chat route's names for what this API calls otherwise (in the messages of its refusals)
_TERMS = (("function.parameters", "input_schema"), ("max_reasoning_tokens", "thinking.budget_tokens"),
          ("response_format.json_schema.schema", "output_config.format.schema"))


def _in_our_terms(exc: APIError) -> APIError:
    """A refusal of the chat route said with this API's field names."""
    message = exc.message
    for theirs, ours in _TERMS:
        message = message.replace(theirs, ours)
    if message == exc.message:
        return exc
    return APIError(exc.status, message, exc.type, exc.param, exc.code, exc.headers)


@contextmanager
def _our_terms() -> Iterator[None]:
    """Refusals of the chat route's checks inside the block are re-raised in this API's terms."""
    try:
        yield
    except APIError as exc:
        ours = _in_our_terms(exc)
        if ours is exc:
            raise
        raise ours from exc


async def create_message(body: MessagesRequest, request: Request) -> Response | dict:
    """``POST /v1/messages``: the chat route's job, answered as an Anthropic message or stream."""
    state = state_of(request)
    chat = chat_request(body)
    with _our_terms():
        job = await build_chat(state, chat, f"msg_{uuid.uuid4().hex}", key_name_of(request))
    return await respond(state, job, request, _stream, _collect)


async def count_tokens(body: CountTokensRequest, request: Request) -> dict:
    """``POST /v1/messages/count_tokens``: the length of the prompt ``create`` would prefill."""
    state = state_of(request)
    _model_check(state, body.model)
    chat = chat_request(body)
    with _our_terms():
        setup = chat_setup_of(state, chat, chat_messages(chat.messages))
        ids, _ = await state.run_blocking(prompt_ids, state, setup)
    return {"input_tokens": len(ids)}


def _failure(ev: ChoiceStep) -> APIError:
    status = 503 if "shutting down" in (ev.error or "") else 500
    return APIError(status, f"generation failed: {ev.error}", type_="server_error", code="generation_failed")


async def _collect(state: ServerState, job: Job, gone: Gone) -> Response | dict:
    """The whole answer as one ``Message``; a disconnect is 499, the deadline a 504."""
    writer, last = BlockWriter(), None
    async with aclosing(watched(state, job, gone)) as items:
        async for item in items:
            if item is Outcome.DISCONNECT:
                return Response(status_code=499)
            if item is Outcome.TIMEOUT:
                raise deadline_error(state)
            if item.finish_reason == "error":
                raise _failure(item)
            writer.feed(item.deltas)
            last = item if item.finish_reason else last
    writer.close()
    if last is None or last.usage is None:  # the engine always ends a choice with its finish; never hang on it
        raise APIError(500, "generation ended without a finish reason", type_="server_error",
                       code="generation_failed")
    reason, stop_seq = stop_reason(last)
    use = usage(last.usage[0], job.cached_tokens(), last.usage[1], last.reasoning_tokens)
    return message(job.request_id, state.model_id, writer.blocks, reason, stop_seq, use)


class _Stream:
    """The SSE frames of one streaming answer."""

    def __init__(self, job: Job, model: str):
        self.job, self.model = job, model
        self.writer = BlockWriter()
        self.started = False
        self.ended = False  # message_stop or an error event was sent: nothing may follow

    def start(self, cached: int) -> list[str]:
        """``message_start`` once, before anything else."""
        if self.started:
            return []
        self.started = True
        use = usage(len(self.job.prompts[0]), cached, 0, 0)
        return [sse({"type": "message_start", "message": message(self.job.request_id, self.model, [], None, None,
                                                                  use)})]

    def event(self, ev: ChoiceStep) -> list[str]:
        frames = self.start(ev.cached)
        if ev.finish_reason == "error":
            return frames + self.error(_failure(ev))
        frames += [sse(e) for e in self.writer.feed(ev.deltas)]
        if ev.finish_reason is None:
            return frames
        frames += [sse(e) for e in self.writer.close()]
        reason, stop_seq = stop_reason(ev)
        prompt, completion = ev.usage or (len(self.job.prompts[0]), ev.completion)
        self.ended = True
        return frames + [sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop_seq},
                              "usage": usage(prompt, ev.cached, completion, ev.reasoning_tokens)}),
                         sse({"type": "message_stop"})]

    def error(self, err: APIError) -> list[str]:
        """An ``error`` event (after ``message_start``, which a client reads first); the stream ends."""
        self.ended = True
        return self.start(0) + [sse(error_body(err.message, err.status))]


async def _stream(state: ServerState, job: Job, gone: Gone) -> AsyncIterator[str]:
    """The stream, with ``ping`` keep-alives and the request deadline (an ``error`` event at it)."""
    frames = _Stream(job, state.model_id)
    finished = False
    try:
        async with aclosing(watched(state, job, gone, keepalive=True)) as items:
            async for item in items:
                if item is Outcome.DISCONNECT:
                    return
                if item is Outcome.TIMEOUT:
                    for frame in frames.error(APIError(504, deadline_message(state))):
                        yield frame
                elif item is Outcome.KEEPALIVE:
                    for frame in frames.start(0) + [sse({"type": "ping"})]:
                        yield frame
                else:
                    for frame in frames.event(item):
                        yield frame
        if not frames.ended:  # the engine always ends a choice with its finish; a client must not wait on it
            for frame in frames.error(APIError(500, "generation ended without a finish reason")):
                yield frame
        finished = True
    finally:
        if not finished:  # torn down mid-stream (Starlette saw the disconnect first)
            mark_cancelled(job, "client_disconnect")


def install_anthropic_routes(app: FastAPI) -> None:
    """The two Messages API routes (behind the API keys like every ``/v1`` route)."""
    app.add_api_route("/v1/messages", create_message, methods=["POST"], response_model=None,
                      summary="Anthropic Messages API: a message (streaming or not)")
    app.add_api_route("/v1/messages/count_tokens", count_tokens, methods=["POST"], response_model=None,
                      summary="Anthropic Messages API: the prompt's token count")
