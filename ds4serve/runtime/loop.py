"""EngineLoop: the engine loop in its own thread, an asyncio API in front of it.

One thread (the engine loop) owns the model state and the scheduler. Other threads and the event
loop only put small typed messages on a queue (``Add``, ``Abort``, ``Call``, ``Shutdown``) and
receive ``RequestOutput``s through per-request asyncio queues (``call_soon_threadsafe``). A caller
that stops iterating (client disconnect, cancellation, timeout) aborts its request; the abort is
applied before the next step, so its slot and pages are free when that step is planned.

The server talks to this object only, and only through named methods: ``limits``, ``eos_ids``,
``logits_width``, ``model_config`` and ``fit_limits`` to validate and prepare, ``submit`` (one
``RequestSpec`` and an id) to run, ``abort`` to cancel,
``alive`` for health, ``stats`` (the core's latest ``EngineStats``) for metrics,
``reset_prefix_cache`` and ``on_rank_lost`` for the rest. It never reaches the core behind it (an
architecture test holds it to that); ``call`` (any function of the core) is for tests and probes.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Union

from ..config import ModelConfig
from ..scheduler.admission import FitLimits, fit
from ..scheduler.request import Request, RequestOutput
from ..scheduler.scheduler import QueueFull, RequestTooLarge, SchedulerLimits
from ..scheduler.spec import RequestSpec
from .core import EngineCore, FatalStepError
from .stats import EngineStats

log = logging.getLogger(__name__)


# ---- messages to the loop thread -------------------------------------------------------------
@dataclass(frozen=True)
class Add:
    """Admit ``request``; ``ack`` resolves (on the caller's event loop) when it is queued or refused."""

    request: Request
    ack: asyncio.Future


@dataclass(frozen=True)
class Abort:
    """Cancel a request (the client left); its slot and pages are free before the next step."""

    request_id: str


@dataclass(frozen=True)
class Call:
    """Run ``job(core)`` between steps (probes, tests); ``job`` reports back itself."""

    job: Callable[[EngineCore], None]


@dataclass(frozen=True)
class Shutdown:
    """Answer every outstanding request with ``reason`` as an error, then stop the thread."""

    reason: str


Message = Union[Add, Abort, Call, Shutdown]
StepHook = Callable[[float], None]  # the step's wall time, after the core published its stats


@dataclass
class _Waiter:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    submitted: float = field(default_factory=time.monotonic)


class EngineLoop:
    def __init__(self, core: EngineCore):
        self.core = core  # the loop thread's; other threads use the API below
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._waiters: dict[str, _Waiter] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._in_flight = 0  # submitted, not yet finished (for queue-bound checks off the loop thread)
        self.fatal: str | None = None
        self.on_step: StepHook | None = None  # callback(elapsed) from the loop thread after each step (metrics)

    # ---- what the server may know ----------------------------------------------------------
    @property
    def limits(self) -> SchedulerLimits:
        """The resolved limits requests are admitted by (``max_model_len``, ``max_queue``, ...)."""
        return self.core.limits

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.core.eos_ids

    @property
    def logits_width(self) -> int:
        """Columns of the model's logits (grammar bitmasks are this wide; it may exceed the tokenizer)."""
        return self.core.cfg.vocab_size

    @property
    def model_config(self) -> ModelConfig:
        """The served model's configuration (vision, vocabulary: what request preparation needs)."""
        return self.core.cfg

    @property
    def fit_limits(self) -> FitLimits:
        """What ``admission.fit`` decides by (the server asks it before it builds a job's grammars;
        ``check`` and the scheduler ask the same function with the same numbers)."""
        return self.core.fit_limits

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.fatal is None

    @property
    def stats(self) -> EngineStats:
        """The engine's figures as the core last published them (after its latest step, add or abort;
        any thread: the snapshot is immutable, and swapping it in is one reference store)."""
        return self.core.stats

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> EngineLoop:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ds4serve-engine-loop", daemon=True)
            self._thread.start()
        return self

    def begin_shutdown(self, reason: str = "the server is shutting down") -> None:
        """Non-blocking: answer every outstanding request with an error and stop after that."""
        self._send(Shutdown(reason))

    def shutdown(self, reason: str = "the server is shutting down") -> None:
        """Finish every outstanding request with an error, then stop the loop thread."""
        self.begin_shutdown(reason)
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._thread = None
        self.core.close()

    # ---- API -----------------------------------------------------------------------------------
    def check(self, spec: RequestSpec) -> None:
        """Raise ``RequestTooLarge`` (``admission.fit``'s answer, the same the scheduler gives) /
        ``QueueFull`` / ``FatalStepError`` before a stream opens (any thread)."""
        problem = fit(spec, self.fit_limits)
        if problem:
            raise RequestTooLarge(problem)
        if self._in_flight >= self.limits.max_queue + self.core.resolved.max_seqs:
            raise QueueFull(f"the server is at capacity ({self._in_flight} requests in flight)")
        if not self.alive:
            raise FatalStepError(self.fatal or "the engine is not running")

    async def submit(self, spec: RequestSpec, request_id: str) -> RequestStream:
        """Hand a request to the engine loop and wait until it is accepted (or refused).

        Raises ``RequestTooLarge`` / ``QueueFull`` / ``FatalStepError`` *before* any output, so an
        HTTP handler can answer 400 / 503 before it opens a stream. ``spec`` is the whole request
        (prompt, sampling, images, grammar state, prefix-cache salt and points); it reaches the
        scheduler as it is.
        """
        self.check(spec)
        req = self.core.make_request(spec, request_id)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop, asyncio.Queue())
        with self._lock:
            if request_id in self._waiters:
                raise ValueError(f"duplicate request id {request_id}")
            self._waiters[request_id] = waiter
            self._in_flight += 1
        ack: asyncio.Future = loop.create_future()
        self._send(Add(req, ack))
        try:
            await ack
        except BaseException:
            self._forget(request_id)
            raise
        return RequestStream(self, request_id, waiter)

    async def generate(self, spec: RequestSpec, request_id: str) -> AsyncIterator[RequestOutput]:
        """Submit and iterate over the outputs; leaving the loop early aborts the request."""
        stream = await self.submit(spec, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    def reset_prefix_cache(self, timeout: float = 30.0) -> int:
        """Empty the prefix cache on the loop thread between steps (snapshots that running requests
        still hold are the core's to keep); returns how many snapshots went. Blocks: call it off the
        event loop."""
        return self.call(EngineCore.reset_prefix_cache, timeout)

    def on_rank_lost(self, callback: Callable[[str], None]) -> bool:
        """Have ``callback(why)`` called (on the tensor-parallel watchdog's thread) when another rank dies
        or hangs; False, and nothing to watch, without a tensor-parallel group. Set it before ``start``."""
        group = self.core.parallel
        if group is None:
            return False
        group.on_lost = callback
        return True

    def call(self, fn: Callable[[EngineCore], Any], timeout: float = 30.0) -> Any:
        """Run ``fn(core)`` on the loop thread between steps and return its result (tests and probes; the
        server asks through the named methods above)."""
        done = threading.Event()
        box: dict = {}

        def job(core: EngineCore) -> None:
            try:
                box["value"] = fn(core)
            except Exception as exc:  # noqa: BLE001 - handed back to the caller
                box["error"] = exc
            finally:
                done.set()

        self._send(Call(job))
        if not done.wait(timeout):
            raise TimeoutError("the engine loop did not answer")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _send(self, msg: Message) -> None:
        self._inbox.put(msg)
        self._wake.set()

    def _forget(self, request_id: str) -> None:
        with self._lock:
            if self._waiters.pop(request_id, None) is not None:
                self._in_flight -= 1

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
                self._publish(core.scheduler.take_outputs())
                self._fail_all(f"engine stopped: {exc}")
                break
            except Exception as exc:  # a scheduler bug: fail the work in hand, keep the process alive
                log.exception("engine loop iteration failed")
                self.fatal = f"{type(exc).__name__}: {exc}"
                self._fail_all(f"internal error: {self.fatal}")
                break
            self._publish(outs)
            if self.on_step is not None:
                self.on_step(time.perf_counter() - t0)

    def _drain(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, Shutdown):
                self._fail_all(msg.reason)
                self._stop.set()
                return
            self._handle(msg)

    def _handle(self, msg: Add | Abort | Call) -> None:
        if isinstance(msg, Add):
            try:
                self.core.add(msg.request)
            except (QueueFull, RequestTooLarge, ValueError, FatalStepError) as exc:
                _resolve(msg.ack, exc)
            else:
                _resolve(msg.ack, None)
        elif isinstance(msg, Abort):
            self.core.abort(msg.request_id)
            self._publish(self.core.scheduler.take_outputs())
        else:
            msg.job(self.core)

    def _fail_all(self, reason: str) -> None:
        for rid in list(self.core.scheduler.requests):
            self.core.abort(rid, reason=reason)
        self._publish(self.core.scheduler.take_outputs())
        with self._lock:
            left = list(self._waiters)
        self._publish([_error_output(rid, 0, reason) for rid in left])

    def _publish(self, outs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up per event loop per step (a wake-up is a
        write to the loop's self-pipe; one per output cost ~1 ms a step at 16 streams)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._lock:
            for out in outs:
                w = self._waiters.get(out.request_id)
                if w is not None:
                    by_loop.setdefault(w.loop, []).append((w.queue, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening
                pass


class RequestStream:
    """Outputs of one accepted request. Closing it (or dropping it) before the end aborts the request."""

    def __init__(self, loop: EngineLoop, request_id: str, waiter: _Waiter):
        self.loop, self.request_id, self._waiter = loop, request_id, waiter
        self.finished = False
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        out = await self._waiter.queue.get()
        if out.finished:
            self.finished = True
            self.loop._forget(self.request_id)
        return out

    async def aclose(self) -> None:
        self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.finished:
            self.loop.abort(self.request_id)
            self.loop._forget(self.request_id)

    def __del__(self) -> None:  # never consumed (e.g. the client vanished before the stream started)
        self._close()


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    """On the caller's event loop: put each output on its stream's queue, in the step's order."""
    for q, out in items:
        q.put_nowait(out)


def _resolve(fut: asyncio.Future, exc: BaseException | None) -> None:
    def set_result() -> None:
        if fut.done():
            return
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)

    try:
        fut.get_loop().call_soon_threadsafe(set_result)
    except RuntimeError:
        pass


def _error_output(request_id: str, prompt_tokens: int, message: str) -> RequestOutput:
    return RequestOutput(request_id=request_id, new_token_ids=(), logprobs=None, finished=True,
                         finish_reason="error", error=message, prompt_tokens=prompt_tokens, completion_tokens=0)
