"""Running a job: admit it, turn engine outputs into text, answer as SSE or as one JSON body.

One ``ChoiceStream`` per generated choice turns engine outputs into text: incremental
detokenization (never broken UTF-8), stop strings across token boundaries (then the request is
aborted in the engine), logprobs, and the finish reason. Both answers iterate the merged events
through ``watch.race``, which also watches the client and the deadline: a disconnect or a timeout
stops the job, and leaving early aborts every engine request of that HTTP request. Streams send
keep-alive comments while nothing is produced.

A job carries its request's access-log record (``access_log.RequestRecord``, when it came over
HTTP); the code here fills in its tokens, time to first token, finish reasons, errors and
cancellation, and the access-log middleware writes the line when the answer is over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Any
from contextlib import aclosing
from functools import partial

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..chat import IncrementalDetokenizer, StopMatcher
from ..runtime import FatalStepError, QueueFull, RequestOutput, RequestStream, RequestTooLarge
from . import prompt_echo
from .access_log import record_of
from .chat_stream import ChatChoice
from .frames import Collected, ChoiceStep, StreamFrames
from .jobs import Job
from .protocol import APIError
from .state import ServerState
from .watch import Outcome, disconnected, race

log = logging.getLogger(__name__)

Gone = Callable[[], Awaitable[object]]


class ChoiceStream:
    """One choice's engine outputs as events: detokenized text (or, for chat, the parsed reasoning,
    content and tool calls of ``chat_stream.ChatChoice``), stop strings, logprobs, metrics."""

    def __init__(self, state: ServerState, index: int, prompt_len: int, job: Job):
        self.state, self.index = state, index
        self.detok = IncrementalDetokenizer(state.tokenizer, job.skip_special)
        self.stops = StopMatcher(job.stops)
        self.chat = ChatChoice(state.tokenizer, job.chat, job.stops, job.skip_special) if job.chat else None
        self.logprobs = job.logprobs
        self.prompt_len = prompt_len
        self.completion = 0
        self.arrival = job.arrival
        self.key_name = job.key_name
        self.last_token_at: float | None = None
        self.cached: int | None = None  # prompt tokens from the prefix cache, once the first output says
        self.job = job
        self.first = True  # the next output is the choice's first: it carries the prompt (echo, prompt_logprobs)

    def feed(self, out: RequestOutput) -> ChoiceStep:
        self._observe(out)
        self.completion = out.completion_tokens
        eos = self.state.loop.eos_ids
        ended_by_eos = out.finish_reason == "stop"
        ids = [t for t in out.new_token_ids if not (ended_by_eos and t in eos)]
        finish = out.finish_reason if out.finished else None
        # the EOS that ended a chat answer is not part of it, so not an entry either; completions keep its
        # entry (vLLM does): echo + max_tokens then always has prompt + completion_tokens entries (lm-eval)
        hidden = eos if ended_by_eos and self.chat is not None else ()
        lps = self._logprobs(out, hidden) if self.logprobs is not None else []
        head, head_lps, prompt_lps = self._prompt(out)
        if self.chat is not None:
            deltas = tuple(self.chat.feed(ids, finish is not None))
            if self.chat.stopped:
                finish = "stop"
            if finish is not None:
                finish = self.chat.finish_reason(finish)
            return ChoiceStep(self.index, "", tuple(out.new_token_ids), lps, finish, out.error,
                         (self.prompt_len, self.completion) if finish else None, deltas, self.completion,
                         self.chat.reasoning_tokens, cached=out.cached_tokens, stop=self.chat.stops.matched,
                         prompt_logprobs=prompt_lps)
        text = self.stops.feed(self.detok.push(ids))
        if self.stops.stopped:
            finish = "stop"
        elif finish is not None:
            text += self.stops.feed(self.detok.flush()) + self.stops.flush()
        return ChoiceStep(self.index, head + text, tuple(out.new_token_ids), head_lps + lps, finish, out.error,
                     (self.prompt_len, self.completion) if finish else None, completion=self.completion,
                     cached=out.cached_tokens, stop=self.stops.matched, prompt_logprobs=prompt_lps)

    def _prompt(self, out: RequestOutput) -> tuple[str, list[dict], list | None]:
        """On a choice's first output: the echoed prompt's text and logprob entries (completions with
        ``echo``), and vLLM's ``prompt_logprobs`` (see ``prompt_echo``); nothing on later outputs."""
        if not self.first:
            return "", [], None
        self.first = False
        job, tok = self.job, self.state.tokenizer
        prompt = job.specs[self.index].prompt_ids
        scores = out.prompt_logprobs or ()
        text, entries, vllm = "", [], None
        if job.echo:
            text = prompt_echo.echo_text(tok, prompt, job.skip_special)
            if job.logprobs is not None and scores:
                entries = prompt_echo.echo_entries(tok, prompt, scores, job.logprobs)
        if job.prompt_logprobs is not None and scores:
            vllm = prompt_echo.vllm_prompt_logprobs(tok, prompt, scores, job.prompt_logprobs)
        return text, entries, vllm

    def _observe(self, out: RequestOutput) -> None:
        m = self.state.metrics
        if self.cached is None:  # fixed at admission and carried by every output: counted once
            self.cached = out.cached_tokens
            m.cached_tokens.labels(self.key_name).inc(out.cached_tokens)
        if not out.new_token_ids:
            return
        now = time.monotonic()
        if self.last_token_at is None:
            m.ttft.observe(now - self.arrival)
        else:
            m.itl.observe(now - self.last_token_at)
        self.last_token_at = now
        m.generation_tokens.labels(self.key_name).inc(len(out.new_token_ids))

    def _logprobs(self, out: RequestOutput, hidden: Collection[int]) -> list[dict]:
        """Entries of the new tokens, except the end-of-sequence token that ended the output (``hidden``):
        it is not part of the answer, so it is not a logprobs entry either."""
        tok = self.state.tokenizer
        entries = []
        for t, lp in zip(out.new_token_ids, out.logprobs or ()):
            if lp is None or t in hidden:
                continue
            value, tops = lp
            text = tok.token_text(t)
            entries.append({"token": text, "logprob": value, "bytes": list(text.encode("utf-8", "replace")),
                            "top_logprobs": [{"token": tok.token_text(i), "logprob": v,
                                              "bytes": list(tok.token_text(i).encode("utf-8", "replace"))}
                                             for i, v in tops[: self.logprobs]]})
        return entries


# ---- the one entry from the routes ----------------------------------------------------------
Answer = Callable[[ServerState, Job, Gone], Any]


async def respond(state: ServerState, job: Job, request: Request, stream: Answer | None = None,
                  whole: Answer | None = None) -> Response | dict:
    """Admit the job (a refusal is an HTTP error before any stream opens), then answer it: as SSE frames
    from ``stream(state, job, gone)`` or as one body from ``await whole(state, job, gone)`` (the chat and
    completions shapes by default; the Responses and Anthropic routes pass their own)."""
    job.record = record_of(request)
    if job.record is not None:
        job.record.completion_id = job.request_id
    await admit(state, job)
    gone = partial(disconnected, request)
    if job.stream:
        return StreamingResponse((stream or sse)(state, job, gone), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await (whole or collect)(state, job, gone)


async def admit(state: ServerState, job: Job) -> None:
    """Submit every choice and wait for the engine to accept them all, so a refusal is an HTTP
    error before any stream opens: too large (400) or at capacity (503)."""
    try:
        for idx, spec in enumerate(job.specs):
            job.streams.append(await state.loop.submit(spec, f"{job.request_id}-{idx}"))
    except BaseException as exc:
        for st in job.streams:
            await st.aclose()
        job.streams.clear()
        _refusal(state, job, exc)
        raise
    for p in job.prompts:
        state.metrics.prompt_tokens.labels(job.key_name).inc(len(p))
    if job.record is not None:
        job.record.prompt_tokens = sum(len(p) for p in job.prompts)


def _refusal(state: ServerState, job: Job, exc: BaseException) -> None:
    """Turn an engine refusal into the HTTP error the client should see (other errors pass)."""
    if isinstance(exc, RequestTooLarge):
        state.metrics.rejections.labels(job.key_name, "too_large").inc()
        raise APIError(400, str(exc), param="max_tokens", code="context_length_exceeded") from exc
    if isinstance(exc, QueueFull):
        state.metrics.rejections.labels(job.key_name, "queue_full").inc()
        raise APIError(503, str(exc), type_="server_error", code="server_overloaded",
                       headers={"Retry-After": str(state.limits.retry_after_s)}) from exc
    if isinstance(exc, FatalStepError):
        raise APIError(503, f"the engine is not available: {exc}", type_="server_error",
                       code="engine_unavailable") from exc


def mark_cancelled(job: Job, reason: str) -> None:
    """The server stops a job before its end ("client_disconnect" or "timeout"): say so once. A
    client that leaves after the last finish reason (before ``[DONE]``) cancelled nothing."""
    if job.cancelled is not None or job.finished_choices == len(job.params):
        return
    job.cancelled = reason
    if job.record is not None:
        job.record.cancelled = reason
    log.info("cancelled %s (%s; engine requests %s-*)", job.log_id, reason.replace("_", " "), job.request_id)


# ---- events ---------------------------------------------------------------------------------
async def events(state: ServerState, job: Job) -> AsyncIterator[ChoiceStep]:
    """Merge every choice's events; aborts whatever is still running when the consumer stops."""
    queue: asyncio.Queue[ChoiceStep | None] = asyncio.Queue()
    choices = [ChoiceStream(state, idx, spec.prompt_tokens, job) for idx, spec in enumerate(job.specs)]
    tasks = [asyncio.create_task(_pump(state, job, cs, stream, queue)) for cs, stream in zip(choices, job.streams)]
    remaining = len(tasks)
    try:
        while remaining:
            ev = await queue.get()
            if ev is None:
                remaining -= 1
                continue
            _note_event(job, ev)
            yield ev
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(state: ServerState, job: Job, cs: ChoiceStream, stream: RequestStream,
                queue: asyncio.Queue[ChoiceStep | None]) -> None:
    prompt = job.specs[cs.index].prompt_ids
    try:
        async for out in stream:
            ev = cs.feed(out)
            await queue.put(ev)
            if ev.finish_reason is not None:
                state.metrics.requests.labels(job.key_name, ev.finish_reason).inc()
                state.metrics.e2e.observe(time.monotonic() - job.arrival)
                break
    except (RequestTooLarge, QueueFull, FatalStepError) as exc:
        await queue.put(ChoiceStep(cs.index, "", (), finish_reason="error", error=str(exc), usage=(len(prompt), 0)))
    finally:
        await stream.aclose()
        await queue.put(None)


def _note_event(job: Job, ev: ChoiceStep) -> None:
    """Count finished choices and cached prompt tokens; fill the access-log record: first token time,
    finish reason, tokens, cached tokens."""
    job.finished_choices += ev.finish_reason is not None
    job.note_cached(ev.index, ev.cached)
    rec = job.record
    if rec is None:
        return
    rec.cached_tokens = job.cached_tokens()
    if ev.token_ids:
        rec.tokens_out(ev.index, len(ev.token_ids))
    if ev.finish_reason is not None:
        rec.finished(ev.index, ev.finish_reason, ev.usage[1] if ev.usage else None)
        if ev.error:
            rec.error = f"generation_failed: {ev.error}"


# ---- the two answers ------------------------------------------------------------------------
async def watched(state: ServerState, job: Job, gone: Gone | None, keepalive: bool = False
                  ) -> AsyncIterator[ChoiceStep | Outcome]:
    """The job's events raced against the client and the deadline (``watch.race``), for every answer
    shape: a disconnect or the deadline cancels the job here and is yielded last (DISCONNECT, TIMEOUT);
    with ``keepalive``, KEEPALIVE whenever ``keepalive_s`` passes without an event."""
    limits = state.limits
    async with aclosing(events(state, job)) as evs, aclosing(race(
            evs, gone, job.arrival + limits.request_timeout_s, limits.keepalive_s if keepalive else None)) as items:
        async for item in items:
            if item in (Outcome.DISCONNECT, Outcome.TIMEOUT):
                mark_cancelled(job, item.value)
            yield item


def deadline_message(state: ServerState) -> str:
    return f"the request did not finish within {state.limits.request_timeout_s:g} s"


def deadline_error(state: ServerState) -> APIError:
    """The 504 of a whole-body answer that missed the request deadline."""
    return APIError(504, deadline_message(state), type_="server_error", code="timeout")


async def collect(state: ServerState, job: Job, gone: Gone | None = None) -> Response | dict:
    """The whole answer as one JSON body; a client disconnect (499) or the timeout (504) cancels it."""
    answer = Collected(job)
    async with aclosing(watched(state, job, gone)) as items:
        async for item in items:
            if item is Outcome.DISCONNECT:
                return Response(status_code=499)
            if item is Outcome.TIMEOUT:
                raise deadline_error(state)
            answer.add(item)
    return answer.body(state.model_id)


async def sse(state: ServerState, job: Job, gone: Gone | None = None) -> AsyncIterator[str]:
    """SSE frames for a streaming job, with keep-alive comments and the request deadline."""
    frames = StreamFrames(job, state.model_id)
    finished = timed_out = False
    try:
        async with aclosing(watched(state, job, gone, keepalive=True)) as items:
            async for item in items:
                if item is Outcome.DISCONNECT:
                    return
                if item is Outcome.TIMEOUT:
                    timed_out = True
                    yield frames.error(deadline_message(state), "timeout")
                elif item is Outcome.KEEPALIVE:
                    yield ": keep-alive\n\n"
                elif (frame := frames.event(item)) is not None:
                    yield frame
        if job.include_usage and not timed_out:
            yield frames.usage()
        yield "data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:  # the response was torn down mid-stream (Starlette saw the disconnect first)
            mark_cancelled(job, "client_disconnect")
