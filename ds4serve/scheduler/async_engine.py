"""AsyncEngine: the engine loop in its own thread, an asyncio API in front of it.

One thread (the engine loop) owns the model state and the scheduler. Other threads and the event
loop only put commands on a queue (add, abort) and receive ``RequestOutput``s through per-request
asyncio queues (``call_soon_threadsafe``). A caller that stops iterating (client disconnect,
cancellation, timeout) aborts its request; the abort is applied before the next step, so its slot
and pages are free when that step is planned.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..engine.sampling import SamplingParams
from .core import EngineCore, FatalStepError
from .request import RequestOutput
from .scheduler import QueueFull, RequestTooLarge

log = logging.getLogger(__name__)


@dataclass
class _Waiter:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    submitted: float = field(default_factory=time.monotonic)


class AsyncEngine:
    def __init__(self, core: EngineCore):
        self.core = core
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._waiters: dict[str, _Waiter] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._in_flight = 0  # submitted, not yet finished (for queue-bound checks off the loop thread)
        self.fatal: str | None = None
        self.on_step = None  # optional callback(core, outputs, elapsed) from the loop thread (metrics)

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> "AsyncEngine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ds4serve-engine-loop", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, reason: str = "the server is shutting down") -> None:
        """Finish every outstanding request with an error, then stop the loop thread."""
        self._cmds.put(("shutdown", reason))
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.fatal is None

    # ---- API -----------------------------------------------------------------------------------
    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise ``RequestTooLarge`` / ``QueueFull`` before a stream opens (any thread)."""
        limits = self.core.limits
        total = prompt_tokens + max_tokens
        if total > limits.max_model_len:
            raise RequestTooLarge(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds the context limit "
                f"of {limits.max_model_len} tokens; shorten the prompt or lower max_tokens")
        pages = self.core.cache.layout.pages_for(total)
        if pages > self.core.cache.state.n_pages:
            raise RequestTooLarge(f"the request needs {pages} cache pages but the pool has "
                                  f"{self.core.cache.state.n_pages}; lower max_tokens or shorten the prompt")
        if self._in_flight >= limits.max_queue + self.core.resolved.max_seqs:
            raise QueueFull(f"the server is at capacity ({self._in_flight} requests in flight)")
        if not self.alive:
            raise FatalStepError(self.fatal or "the engine is not running")

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       images=None) -> AsyncIterator[RequestOutput]:
        """Submit a request and iterate over its outputs; leaving the loop early aborts it."""
        self.check(len(prompt_ids), params.max_tokens)
        req = self.core.make_request(prompt_ids, params, request_id=request_id, images=images)
        waiter = _Waiter(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._waiters:
                raise ValueError(f"duplicate request id {request_id}")
            self._waiters[request_id] = waiter
            self._in_flight += 1
        self._cmds.put(("add", req))
        self._wake.set()
        finished = False
        try:
            while True:
                out = await waiter.queue.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)
            with self._lock:
                if self._waiters.pop(request_id, None) is not None:
                    self._in_flight -= 1

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))
        self._wake.set()

    def call(self, fn, timeout: float = 30.0):
        """Run ``fn(core)`` on the loop thread between steps and return its result (probes, tests)."""
        done = threading.Event()
        box: dict = {}

        def job(core):
            try:
                box["value"] = fn(core)
            except Exception as exc:  # noqa: BLE001 - handed back to the caller
                box["error"] = exc
            finally:
                done.set()

        self._cmds.put(("call", job))
        self._wake.set()
        if not done.wait(timeout):
            raise TimeoutError("the engine loop did not answer")
        if "error" in box:
            raise box["error"]
        return box["value"]

    # ---- the loop thread -----------------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        while not self._stop.is_set():
            self._drain()
            if self._stop.is_set():
                break
            if not core.has_work:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            t0 = time.perf_counter()
            try:
                outs = core.step()
            except FatalStepError as exc:
                self.fatal = str(exc)
                outs = core.scheduler.take_outputs()
                self._publish(outs)
                self._fail_all(f"engine stopped: {exc}")
                break
            except Exception as exc:  # a scheduler bug: fail the work in hand, keep the process alive
                log.exception("engine loop iteration failed")
                self.fatal = f"{type(exc).__name__}: {exc}"
                self._fail_all(f"internal error: {self.fatal}")
                break
            self._publish(outs)
            if self.on_step is not None:
                self.on_step(core, outs, time.perf_counter() - t0)

    def _drain(self) -> None:
        while True:
            try:
                cmd, arg = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd == "add":
                try:
                    self.core.add(arg)
                except (QueueFull, RequestTooLarge, ValueError, FatalStepError) as exc:
                    self._publish([_error_output(arg.request_id, len(arg.prompt_ids), str(exc))])
            elif cmd == "abort":
                self.core.abort(arg)
                self._publish(self.core.scheduler.take_outputs())
            elif cmd == "call":
                arg(self.core)
            elif cmd == "shutdown":
                self._fail_all(arg)
                self._stop.set()
                return

    def _fail_all(self, reason: str) -> None:
        for rid in list(self.core.scheduler.requests):
            self.core.abort(rid, reason=reason)
        self._publish(self.core.scheduler.take_outputs())
        with self._lock:
            left = list(self._waiters)
        self._publish([_error_output(rid, 0, reason) for rid in left])

    def _publish(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            with self._lock:
                w = self._waiters.get(out.request_id)
            if w is not None:
                w.loop.call_soon_threadsafe(w.queue.put_nowait, out)


def _error_output(request_id: str, prompt_tokens: int, message: str) -> RequestOutput:
    return RequestOutput(request_id=request_id, new_token_ids=(), logprobs=None, finished=True,
                         finish_reason="error", error=message, prompt_tokens=prompt_tokens, completion_tokens=0)
