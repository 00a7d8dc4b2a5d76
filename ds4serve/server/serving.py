"""Request handling behind the routes: validate, render, submit, stream or collect.

One ``ChoiceStream`` per generated choice turns engine outputs into text: incremental
detokenization (never broken UTF-8), stop strings across token boundaries (then the request is
aborted in the engine), logprobs, and the finish reason. Streaming responses merge the choices into
SSE frames (``data: <json>\\n\\n``), send keep-alive comments while nothing is produced, and the
first frame of each choice carries the role *and* its first token. Leaving a stream early (client
disconnect, timeout) aborts every engine request of that HTTP request.

A job carries its request's access-log record (``access_log.RequestRecord``, when it came over
HTTP); the code here fills in its tokens, time to first token, finish reasons, errors and
cancellation, and the access-log middleware writes the line when the answer is over.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..chat import ChatFormatError, IncrementalDetokenizer, StopMatcher, render_chat, render_completion
from ..engine.sampling import SamplingError, SamplingParams
from ..scheduler.core import FatalStepError
from ..scheduler.scheduler import QueueFull, RequestTooLarge
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingFields, check_extra_fields

log = logging.getLogger(__name__)


@dataclass
class ServerLimits:
    request_timeout_s: float = 600.0
    keepalive_s: float = 10.0
    default_max_tokens: int = 1024
    max_body_bytes: int = 48 * 2**20
    retry_after_s: int = 2


@dataclass
class Event:
    """One step of one choice: new text, its logprob entries, and the finish reason when done."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    usage: tuple[int, int] | None = None  # (prompt, completion) when finished


class ChoiceStream:
    def __init__(self, state, index: int, prompt_len: int, stops: list[str], skip_special: bool,
                 logprobs: int | None, arrival: float):
        self.state, self.index = state, index
        self.detok = IncrementalDetokenizer(state.tokenizer, skip_special)
        self.stops = StopMatcher(stops)
        self.logprobs = logprobs
        self.prompt_len = prompt_len
        self.completion = 0
        self.arrival = arrival
        self.last_token_at: float | None = None

    def feed(self, out) -> Event:
        m = self.state.metrics
        now = time.monotonic()
        if out.new_token_ids:
            if self.last_token_at is None:
                m.ttft.observe(now - self.arrival)
            else:
                m.itl.observe(now - self.last_token_at)
            self.last_token_at = now
            m.generation_tokens.inc(len(out.new_token_ids))
        self.completion = out.completion_tokens
        ids = [t for t in out.new_token_ids if not (out.finish_reason == "stop" and t in self.state.eos_ids)]
        text = self.stops.feed(self.detok.push(ids))
        finish = out.finish_reason if out.finished else None
        if self.stops.stopped:
            finish = "stop"
        elif finish is not None:
            text += self.stops.feed(self.detok.flush()) + self.stops.flush()
        lps = self._logprobs(out) if self.logprobs is not None else []
        return Event(self.index, text, tuple(out.new_token_ids), lps, finish, out.error,
                     (self.prompt_len, self.completion) if finish else None)

    def _logprobs(self, out) -> list[dict]:
        tok = self.state.tokenizer
        entries = []
        for t, lp in zip(out.new_token_ids, out.logprobs or ()):
            if lp is None:
                continue
            value, tops = lp
            text = tok.token_text(t)
            entries.append({"token": text, "logprob": value, "bytes": list(text.encode("utf-8", "replace")),
                            "top_logprobs": [{"token": tok.token_text(i), "logprob": v,
                                              "bytes": list(tok.token_text(i).encode("utf-8", "replace"))}
                                             for i, v in tops[: self.logprobs]]})
        return entries


@dataclass
class Job:
    """A validated request ready to run: one prompt per entry of ``prompts``, ``n`` choices each."""

    kind: str  # "chat" | "completion"
    request_id: str
    prompts: list[list[int]]
    params: list[SamplingParams]  # one per choice (index = prompt_index * n + i)
    n: int
    stops: list[str]
    skip_special: bool
    logprobs: int | None
    stream: bool
    include_usage: bool
    arrival: float
    images: list[Any] | None = None
    streams: list = field(default_factory=list)  # accepted engine requests, one per choice
    record: Any = None  # the request's access_log.RequestRecord (None outside HTTP)
    cancelled: str | None = None  # why the server stopped it early, once it has
    finished_choices: int = 0  # choices whose finish reason the consumer has seen

    @property
    def log_id(self) -> str:
        """The id that names this request in log lines: its HTTP request id when it has one."""
        return self.record.request_id if self.record is not None else self.request_id


def sampling_params(body: SamplingFields, max_tokens: int, logprobs: int | None, choice: int,
                    stop_ids: tuple[int, ...]) -> SamplingParams:
    seed = None if body.seed is None else (body.seed + choice) % 2**63
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, min_p=body.min_p or 0.0,
            seed=seed, presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, min_tokens=min(body.min_tokens, max_tokens),
            stop_token_ids=stop_ids, ignore_eos=body.ignore_eos, logprobs=logprobs)
    except SamplingError as exc:
        raise APIError(400, str(exc)) from exc


class Serving:
    def __init__(self, state):
        self.state = state

    # ---- building jobs -------------------------------------------------------------------------
    def _check_model(self, body: SamplingFields) -> None:
        if body.model != self.state.model_id:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {self.state.model_id!r}",
                           type_="invalid_request_error", param="model", code="model_not_found")

    def _max_tokens(self, requested: int | None, prompt_len: int) -> int:
        limit = self.state.engine.core.limits.max_model_len
        if requested is not None:
            return requested
        room = limit - prompt_len
        if room < 1:
            raise APIError(400, f"the prompt ({prompt_len} tokens) fills the context limit of {limit} tokens",
                           param="messages", code="context_length_exceeded")
        return min(self.state.limits.default_max_tokens, room)

    def _stop_ids(self, body: SamplingFields) -> tuple[int, ...]:
        ids = tuple(body.stop_token_ids or ())
        bad = [i for i in ids if not 0 <= i < self.state.tokenizer.vocab_size]
        if bad:
            raise APIError(400, f"stop_token_ids {bad} are outside the vocabulary", param="stop_token_ids")
        return ids

    async def build_chat(self, body: ChatCompletionRequest, request_id: str) -> Job:
        check_extra_fields(body, "chat.completions")
        self._check_model(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        thinking = bool((body.chat_template_kwargs or {}).get("thinking", False))
        rendered = await self.state.run_blocking(self._render_chat, messages, thinking)
        prompt = rendered.ids
        max_tokens = self._max_tokens(body.max_completion_tokens or body.max_tokens, len(prompt))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        stop_ids = self._stop_ids(body)
        params = [sampling_params(body, max_tokens, logprobs, i, stop_ids) for i in range(body.n)]
        return Job("chat", request_id, [prompt], params, body.n, body.stop_list(), body.skip_special_tokens, logprobs,
                   body.stream, bool(body.stream_options and body.stream_options.include_usage), time.monotonic(),
                   images=rendered.images or None)

    def _render_chat(self, messages, thinking):
        try:
            rendered = render_chat(self.state.tokenizer, messages, thinking=thinking)
        except ChatFormatError as exc:
            raise APIError(400, str(exc), param=exc.param) from exc
        if rendered.images:
            rendered = self.state.prepare_images(rendered)
        return rendered

    async def build_completion(self, body: CompletionRequest, request_id: str) -> Job:
        check_extra_fields(body, "completions")
        self._check_model(body)
        if body.echo:
            raise APIError(400, "echo=true is not supported", param="echo", code="unsupported_parameter")
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_parameter")
        if body.best_of not in (None, 1):
            raise APIError(400, "best_of other than 1 is not supported", param="best_of", code="unsupported_parameter")
        prompts = await self.state.run_blocking(self._completion_prompts, body.prompt)
        if len(prompts) * body.n > 64:
            raise APIError(400, "at most 64 choices (prompts x n) per request", param="prompt")
        longest = max(len(p) for p in prompts)
        max_tokens = self._max_tokens(body.max_tokens, longest)
        stop_ids = self._stop_ids(body)
        logprobs = body.logprobs
        params = [sampling_params(body, max_tokens, logprobs, i, stop_ids) for _ in prompts for i in range(body.n)]
        return Job("completion", request_id, prompts, params, body.n, body.stop_list(), body.skip_special_tokens,
                   logprobs, body.stream, bool(body.stream_options and body.stream_options.include_usage),
                   time.monotonic())

    def _completion_prompts(self, prompt) -> list[list[int]]:
        tok = self.state.tokenizer
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            prompt = [prompt]
        out = []
        for i, p in enumerate(prompt):
            try:
                ids = render_completion(tok, p) if isinstance(p, str) else list(p)
            except ChatFormatError as exc:
                raise APIError(400, str(exc), param="prompt") from exc
            if not ids or (isinstance(p, str) and len(ids) == 1 and not p):
                raise APIError(400, f"prompt[{i}] is empty", param="prompt")
            bad = [t for t in ids if not 0 <= t < tok.vocab_size]
            if bad:
                raise APIError(400, f"prompt[{i}] has token ids outside the vocabulary: {bad[:5]}", param="prompt")
            out.append(ids)
        return out

    # ---- running jobs --------------------------------------------------------------------------
    async def admit(self, job: Job) -> None:
        """Submit every choice and wait for the engine to accept them all, so a refusal is an HTTP
        error before any stream opens: too large (400) or at capacity (503)."""
        engine = self.state.engine
        prompts = [p for p in job.prompts for _ in range(job.n)]
        try:
            for idx, (p, params) in enumerate(zip(prompts, job.params)):
                job.streams.append(await engine.submit(p, params, f"{job.request_id}-{idx}", images=job.images))
        except BaseException as exc:
            for st in job.streams:
                await st.aclose()
            job.streams.clear()
            self._refusal(exc)
            raise
        for p in job.prompts:
            self.state.metrics.prompt_tokens.inc(len(p))
        if job.record is not None:
            job.record.prompt_tokens = sum(len(p) for p in job.prompts)

    def mark_cancelled(self, job: Job, reason: str) -> None:
        """The server stops a job before its end ("client_disconnect" or "timeout"): say so once. A
        client that leaves after the last finish reason (before ``[DONE]``) cancelled nothing."""
        if job.cancelled is not None or job.finished_choices == len(job.params):
            return
        job.cancelled = reason
        if job.record is not None:
            job.record.cancelled = reason
        log.info("cancelled %s (%s; engine requests %s-*)", job.log_id, reason.replace("_", " "), job.request_id)

    def _refusal(self, exc: BaseException) -> None:
        """Turn an engine refusal into the HTTP error the client should see (other errors pass)."""
        if isinstance(exc, RequestTooLarge):
            self.state.metrics.rejections.labels("too_large").inc()
            raise APIError(400, str(exc), param="max_tokens", code="context_length_exceeded") from exc
        if isinstance(exc, QueueFull):
            self.state.metrics.rejections.labels("queue_full").inc()
            raise APIError(503, str(exc), type_="server_error", code="server_overloaded",
                           headers={"Retry-After": str(self.state.limits.retry_after_s)}) from exc
        if isinstance(exc, FatalStepError):
            raise APIError(503, f"the engine is not available: {exc}", type_="server_error",
                           code="engine_unavailable") from exc

    async def events(self, job: Job) -> AsyncIterator[Event]:
        """Merge every choice's events; aborts whatever is still running when the consumer stops."""
        queue: asyncio.Queue = asyncio.Queue()
        choices = []
        for idx, params in enumerate(job.params):
            prompt = job.prompts[idx // job.n]
            cs = ChoiceStream(self.state, idx, len(prompt), job.stops, job.skip_special, job.logprobs, job.arrival)
            choices.append(cs)
        tasks = [asyncio.create_task(self._pump(job, cs, stream, queue)) for cs, stream in zip(choices, job.streams)]
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

    async def _pump(self, job: Job, cs: ChoiceStream, stream, queue: asyncio.Queue) -> None:
        prompt = job.prompts[cs.index // job.n]
        try:
            async for out in stream:
                ev = cs.feed(out)
                await queue.put(ev)
                if ev.finish_reason is not None:
                    self.state.metrics.requests.labels(ev.finish_reason).inc()
                    self.state.metrics.e2e.observe(time.monotonic() - job.arrival)
                    break
        except (RequestTooLarge, QueueFull, FatalStepError) as exc:
            await queue.put(Event(cs.index, "", (), finish_reason="error", error=str(exc), usage=(len(prompt), 0)))
        finally:
            await stream.aclose()
            await queue.put(None)

    # ---- responses -----------------------------------------------------------------------------
    async def collect(self, job: Job, model_id: str) -> dict:
        texts = [""] * len(job.params)
        lps: list[list[dict]] = [[] for _ in job.params]
        tokens: list[list[int]] = [[] for _ in job.params]
        finish: list[str | None] = [None] * len(job.params)
        usage_completion = [0] * len(job.params)
        async for ev in self.events(job):
            texts[ev.index] += ev.text
            lps[ev.index] += ev.logprobs
            tokens[ev.index] += ev.token_ids
            if ev.finish_reason:
                finish[ev.index] = ev.finish_reason
                usage_completion[ev.index] = ev.usage[1] if ev.usage else 0
                if ev.finish_reason == "error":
                    status = 503 if "shutting down" in (ev.error or "") else 500
                    raise APIError(status, f"generation failed: {ev.error}", type_="server_error",
                                   code="generation_failed")
        usage = {"prompt_tokens": sum(len(p) for p in job.prompts), "completion_tokens": sum(usage_completion)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        choices = [self._choice(job, i, texts[i], lps[i], finish[i]) for i in range(len(job.params))]
        obj = "chat.completion" if job.kind == "chat" else "text_completion"
        return {"id": job.request_id, "object": obj, "created": int(time.time()), "model": model_id,
                "choices": choices, "usage": usage}

    def _choice(self, job: Job, i: int, text: str, lps: list[dict], finish: str | None) -> dict:
        if job.kind == "chat":
            return {"index": i, "message": {"role": "assistant", "content": text},
                    "logprobs": {"content": lps} if job.logprobs is not None else None, "finish_reason": finish}
        return {"index": i, "text": text, "logprobs": _completion_logprobs(lps) if job.logprobs is not None else None,
                "finish_reason": finish}

    async def sse(self, job: Job, model_id: str,
                  disconnected: Callable[[], Awaitable[object]] | None = None) -> AsyncIterator[str]:
        """SSE frames for a streaming job, with keep-alive comments and the request deadline.

        ``disconnected`` resolves when the client goes away. It is watched alongside the engine's events
        because a server only notices a dead socket when it next writes to it: without the watch, a
        client that leaves during a long (image) prefill would keep its request computing until the
        first token or keep-alive."""
        limits = self.state.limits
        deadline = job.arrival + limits.request_timeout_s
        frames = _StreamFrames(job, model_id, self._chunk)
        events = self.events(job)
        next_event = None
        gone = asyncio.ensure_future(disconnected()) if disconnected is not None else None
        finished = False
        try:
            while True:
                if next_event is None:
                    next_event = asyncio.ensure_future(events.__anext__())
                waiting = {next_event} if gone is None else {next_event, gone}
                wait = max(0.0, min(limits.keepalive_s, deadline - time.monotonic()))
                done, _ = await asyncio.wait(waiting, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                if gone is not None and gone in done:
                    self.mark_cancelled(job, "client_disconnect")
                    return
                if not done:
                    if time.monotonic() >= deadline:
                        self.mark_cancelled(job, "timeout")
                        yield frames.error(f"the request did not finish within {limits.request_timeout_s:.0f} s",
                                           "timeout")
                        break
                    yield ": keep-alive\n\n"
                    continue
                try:
                    ev = next_event.result()
                except StopAsyncIteration:
                    next_event = None
                    break
                next_event = None
                frame = frames.event(ev)
                if frame:
                    yield frame
            if job.include_usage and next_event is None:
                yield frames.usage()
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:  # the response was torn down mid-stream (Starlette saw the disconnect first)
                self.mark_cancelled(job, "client_disconnect")
            for fut in (next_event, gone):
                if fut is not None and not fut.done():
                    fut.cancel()
                    await asyncio.gather(fut, return_exceptions=True)
            await events.aclose()

    def _chunk(self, job: Job, ev: Event, first: bool) -> dict:
        if job.kind == "chat":
            delta = {"role": "assistant", "content": ev.text} if first else ({"content": ev.text} if ev.text else {})
            lp = {"content": ev.logprobs} if job.logprobs is not None else None
            return {"index": ev.index, "delta": delta, "logprobs": lp, "finish_reason": ev.finish_reason}
        lp = _completion_logprobs(ev.logprobs) if job.logprobs is not None else None
        return {"index": ev.index, "text": ev.text, "logprobs": lp, "finish_reason": ev.finish_reason}


class _StreamFrames:
    """The SSE frames of one streaming job: chunks (the first per choice carries the role), usage, errors."""

    def __init__(self, job: Job, model_id: str, chunk: Callable[[Job, Event, bool], dict]):
        self.job, self.model_id, self.chunk = job, model_id, chunk
        self.created = int(time.time())
        self.obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
        self.started: set[int] = set()
        self.completion = [0] * len(job.params)

    def event(self, ev: Event) -> str | None:
        """The frame for one event, or None when it carries nothing the client needs."""
        if ev.finish_reason == "error":
            return self.error(f"generation failed: {ev.error}", "generation_failed")
        if ev.usage:
            self.completion[ev.index] = ev.usage[1]
        if not ev.text and not ev.finish_reason and ev.index in self.started and not ev.logprobs:
            return None
        chunk = self.chunk(self.job, ev, ev.index not in self.started)
        self.started.add(ev.index)
        return _frame({"id": self.job.request_id, "object": self.obj, "created": self.created, "model": self.model_id,
                       "choices": [chunk], **({"usage": None} if self.job.include_usage else {})})

    def usage(self) -> str:
        usage = {"prompt_tokens": sum(len(p) for p in self.job.prompts), "completion_tokens": sum(self.completion)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return _frame({"id": self.job.request_id, "object": self.obj, "created": self.created,
                       "model": self.model_id, "choices": [], "usage": usage})

    @staticmethod
    def error(message: str, code: str) -> str:
        return _frame({"error": {"message": message, "type": "server_error", "param": None, "code": code}})


def _completion_logprobs(entries: list[dict]) -> dict:
    offsets, pos = [], 0
    for e in entries:
        offsets.append(pos)
        pos += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def _note_event(job: Job, ev: Event) -> None:
    """Count finished choices; fill the access-log record: first token time, finish reason, tokens."""
    job.finished_choices += ev.finish_reason is not None
    rec = job.record
    if rec is None:
        return
    if ev.token_ids:
        rec.tokens_out(ev.index, len(ev.token_ids))
    if ev.finish_reason is not None:
        rec.finished(ev.index, ev.finish_reason, ev.usage[1] if ev.usage else None)
        if ev.error:
            rec.error = f"generation_failed: {ev.error}"


def _frame(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def new_request_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
