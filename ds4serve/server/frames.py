"""Response bodies: the SSE frames of a stream and the JSON of a collected answer.

SSE frames are ``data: <json>\\n\\n`` (plain LF); the first chunk of each choice carries the role
*and* its first token; with ``include_usage`` a final chunk with ``choices: []`` carries usage.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from .jobs import Job
from .protocol import APIError


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


class StreamFrames:
    """The SSE frames of one streaming job: chunks (the first per choice carries the role), usage, errors."""

    def __init__(self, job: Job, model_id: str):
        self.job, self.model_id = job, model_id
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
        chunk = _chunk(self.job, ev, ev.index not in self.started)
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


class Collected:
    """A non-streaming answer, gathered event by event; a failed choice fails the request."""

    def __init__(self, job: Job):
        n = len(job.params)
        self.job = job
        self.texts = [""] * n
        self.lps: list[list[dict]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.completion = [0] * n

    def add(self, ev: Event) -> None:
        self.texts[ev.index] += ev.text
        self.lps[ev.index] += ev.logprobs
        if ev.finish_reason:
            self.finish[ev.index] = ev.finish_reason
            self.completion[ev.index] = ev.usage[1] if ev.usage else 0
            if ev.finish_reason == "error":
                status = 503 if "shutting down" in (ev.error or "") else 500
                raise APIError(status, f"generation failed: {ev.error}", type_="server_error",
                               code="generation_failed")

    def body(self, model_id: str) -> dict:
        job = self.job
        usage = {"prompt_tokens": sum(len(p) for p in job.prompts), "completion_tokens": sum(self.completion)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        choices = [self._choice(i) for i in range(len(job.params))]
        obj = "chat.completion" if job.kind == "chat" else "text_completion"
        return {"id": job.request_id, "object": obj, "created": int(time.time()), "model": model_id,
                "choices": choices, "usage": usage}

    def _choice(self, i: int) -> dict:
        job, text, lps, finish = self.job, self.texts[i], self.lps[i], self.finish[i]
        if job.kind == "chat":
            return {"index": i, "message": {"role": "assistant", "content": text},
                    "logprobs": {"content": lps} if job.logprobs is not None else None, "finish_reason": finish}
        return {"index": i, "text": text, "logprobs": _completion_logprobs(lps) if job.logprobs is not None else None,
                "finish_reason": finish}


def _chunk(job: Job, ev: Event, first: bool) -> dict:
    if job.kind == "chat":
        delta = {"role": "assistant", "content": ev.text} if first else ({"content": ev.text} if ev.text else {})
        lp = {"content": ev.logprobs} if job.logprobs is not None else None
        return {"index": ev.index, "delta": delta, "logprobs": lp, "finish_reason": ev.finish_reason}
    lp = _completion_logprobs(ev.logprobs) if job.logprobs is not None else None
    return {"index": ev.index, "text": ev.text, "logprobs": lp, "finish_reason": ev.finish_reason}


def _completion_logprobs(entries: list[dict]) -> dict:
    offsets, pos = [], 0
    for e in entries:
        offsets.append(pos)
        pos += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def _frame(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
