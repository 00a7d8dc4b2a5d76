"""Response bodies: the SSE frames of a stream and the JSON of a collected answer.

SSE frames are ``data: <json>\\n\\n`` (plain LF); the first chunk of each choice carries the role
*and* its first token; with ``include_usage`` a final chunk with ``choices: []`` carries usage.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from ..chat import ParsedOutput
from ..chat import Event as ChatEvent
from .chat_stream import deltas_of, message_of
from .jobs import Job
from .protocol import APIError


@dataclass
class ChoiceStep:
    """One step of one choice: new text, its logprob entries, and the finish reason when done."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    usage: tuple[int, int] | None = None  # (prompt, completion) when finished
    deltas: tuple[ChatEvent, ...] = ()  # a chat choice's parsed output events (its ``text`` stays "")
    completion: int = 0  # the choice's completion tokens so far
    reasoning_tokens: int = 0  # of those, tokens of reasoning (chat, thinking mode)
    cached: int = 0  # the choice's prompt tokens served from the prefix cache
    stop: str | None = None  # the stop string that ended the choice (finish_reason "stop" by a stop string)
    prompt_logprobs: list | None = None  # vLLM's prompt_logprobs, on the choice's first event (prompt_echo.py)


def usage_of(job: Job, completion: list[int], reasoning: list[int]) -> dict:
    """The ``usage`` object: OpenAI's ``prompt_tokens_details.cached_tokens`` (prompt tokens whose state
    came from the prefix cache, ``Job.cached_tokens``) on every one; chat answers also count their
    reasoning tokens."""
    usage = {"prompt_tokens": sum(len(p) for p in job.prompts), "completion_tokens": sum(completion)}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    usage["prompt_tokens_details"] = {"cached_tokens": job.cached_tokens()}
    if job.kind == "chat":
        usage["completion_tokens_details"] = {"reasoning_tokens": sum(reasoning)}
    return usage


class StreamFrames:
    """The SSE frames of one streaming job: chunks (the first per choice carries the role), usage, errors."""

    def __init__(self, job: Job, model_id: str):
        self.job, self.model_id = job, model_id
        self.created = int(time.time())
        self.obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
        self.started: set[int] = set()
        self.completion = [0] * len(job.params)
        self.reasoning = [0] * len(job.params)

    def event(self, ev: ChoiceStep) -> str | None:
        """The frame(s) for one event, or None when it carries nothing the client needs."""
        if ev.finish_reason == "error":
            return self.error(f"generation failed: {ev.error}", "generation_failed")
        self.completion[ev.index] = ev.usage[1] if ev.usage else ev.completion
        self.reasoning[ev.index] = ev.reasoning_tokens
        first = ev.index not in self.started
        if self.job.kind == "chat":
            chunks = _chat_chunks(self.job, ev, first)
        else:
            chunks = [_chunk(self.job, ev)] if ev.text or ev.finish_reason or first or ev.logprobs else []
        if not chunks:
            return None
        self.started.add(ev.index)
        frames = [self._envelope([c]) for c in chunks]
        if ev.prompt_logprobs is not None:  # vLLM: on the choice (completions), on the chunk (chat)
            (frames[0] if self.job.kind == "chat" else frames[0]["choices"][0])["prompt_logprobs"] = ev.prompt_logprobs
        return "".join(_frame(f) for f in frames)

    def _envelope(self, choices: list[dict]) -> dict:
        body = {"id": self.job.request_id, "object": self.obj, "created": self.created, "model": self.model_id,
                "choices": choices}
        if self.job.continuous_usage:
            body["usage"] = usage_of(self.job, self.completion, self.reasoning)
        elif self.job.include_usage:
            body["usage"] = None
        return body

    def usage(self) -> str:
        return _frame({"id": self.job.request_id, "object": self.obj, "created": self.created,
                       "model": self.model_id, "choices": [],
                       "usage": usage_of(self.job, self.completion, self.reasoning)})

    @staticmethod
    def error(message: str, code: str) -> str:
        return _frame({"error": {"message": message, "type": "server_error", "param": None, "code": code}})


class Collected:
    """A non-streaming answer, gathered event by event; a failed choice fails the request."""

    def __init__(self, job: Job):
        n = len(job.params)
        self.job = job
        self.texts = [""] * n
        self.parsed = [ParsedOutput() for _ in range(n)]
        self.lps: list[list[dict]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.completion = [0] * n
        self.reasoning = [0] * n
        self.prompt_lps: list[list | None] = [None] * n

    def add(self, ev: ChoiceStep) -> None:
        self.texts[ev.index] += ev.text
        if ev.prompt_logprobs is not None:
            self.prompt_lps[ev.index] = ev.prompt_logprobs
        for d in ev.deltas:
            self.parsed[ev.index].add(d)
        self.lps[ev.index] += ev.logprobs
        self.reasoning[ev.index] = ev.reasoning_tokens
        if ev.finish_reason:
            self.finish[ev.index] = ev.finish_reason
            self.completion[ev.index] = ev.usage[1] if ev.usage else 0
            if ev.finish_reason == "error":
                status = 503 if "shutting down" in (ev.error or "") else 500
                raise APIError(status, f"generation failed: {ev.error}", type_="server_error",
                               code="generation_failed")

    def body(self, model_id: str) -> dict:
        job = self.job
        choices = [self._choice(i) for i in range(len(job.params))]
        obj = "chat.completion" if job.kind == "chat" else "text_completion"
        body = {"id": job.request_id, "object": obj, "created": int(time.time()), "model": model_id,
                "choices": choices, "usage": usage_of(job, self.completion, self.reasoning)}
        if job.kind == "chat" and job.prompt_logprobs is not None:  # vLLM: one prompt, on the response
            body["prompt_logprobs"] = self.prompt_lps[0]
        return body

    def _choice(self, i: int) -> dict:
        job, text, lps, finish = self.job, self.texts[i], self.lps[i], self.finish[i]
        if job.kind == "chat":
            return {"index": i, "message": message_of(self.parsed[i]),
                    "logprobs": _chat_logprobs(lps) if job.logprobs is not None else None, "finish_reason": finish}
        choice = {"index": i, "text": text,
                  "logprobs": _completion_logprobs(lps) if job.logprobs is not None else None, "finish_reason": finish}
        if job.prompt_logprobs is not None:  # vLLM: per choice
            choice["prompt_logprobs"] = self.prompt_lps[i]
        return choice


def _chat_chunks(job: Job, ev: ChoiceStep, first: bool) -> list[dict]:
    """One chunk per delta; the step's logprobs ride on the first, its finish reason on the last."""
    deltas = deltas_of(ev.deltas, first)
    if not deltas and (ev.finish_reason or ev.logprobs):
        deltas = [{}]
    lp = _chat_logprobs(ev.logprobs) if job.logprobs is not None else None
    return [{"index": ev.index, "delta": d, "logprobs": lp if k == 0 else None,
             "finish_reason": ev.finish_reason if k == len(deltas) - 1 else None} for k, d in enumerate(deltas)]


def _chat_logprobs(entries: list[dict]) -> dict:
    """A chat choice's ``logprobs``: OpenAI requires both lists (each nullable); nothing is ever refused here."""
    return {"content": entries, "refusal": None}


def _chunk(job: Job, ev: ChoiceStep) -> dict:
    lp = _completion_logprobs(ev.logprobs) if job.logprobs is not None else None
    return {"index": ev.index, "text": ev.text, "logprobs": lp, "finish_reason": ev.finish_reason}


def _completion_logprobs(entries: list[dict]) -> dict:
    offsets, pos = [], 0
    for e in entries:
        offsets.append(pos)
        pos += len(e["token"])
    # an echoed prompt's first token has neither a logprob nor alternatives: null in both lists
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top_logprobs"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
                             for e in entries],
            "text_offset": offsets}


def _frame(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
