"""Tensor / expert parallel execution: one scheduler on rank 0, the same engine on every rank.

Every rank holds its slice of the weights (``model.sharding``) and a *full replica* of the sequence
state: DS4's K=V rows, compressed rows and indexer rows are per sequence, so under TP every rank
computes them anyway. That makes the design simple and exact:

* Rank 0 runs the scheduler, the encoder worker and sampling. Its ``CacheManager`` is wrapped in
  ``Mirrored``: every call the scheduler (or warm-up) makes on it, or on its prefix cache, is
  recorded with its arguments (objects a call handed out, such as slot handles and snapshots, travel
  as ``Ref``s).
* Each step, rank 0 broadcasts the recorded calls and the plan (samplers stripped, slots as ints,
  image rows included) in one message. Workers replay the calls on their own ``CacheManager``, which
  therefore makes the same decisions (same slots, same pages, same prefix entries), then run the same
  ``Executor.step``: the forward's two all-reduces per layer meet rank 0's.
* After the step every rank all-reduces a failure flag. A rank whose forward raised first *drains*
  the collectives the plan still owes (zeros of the planned shapes), so nobody waits; then every rank
  treats the step as failed and undoes it as a one-process engine does (its requests fail, the
  engine stays usable).
* A rank that dies or hangs: the collective times out or its connection closes; ``RankFailure``
  (fatal) stops the core with a clear log. Control messages use a separate group with a long timeout
  so idle workers simply wait.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..cache.manager import CacheManager, SlotHandle
from ..multimodal.records import ImageRows
from .plan import StepPlan, StepResult, StepStatus

log = logging.getLogger(__name__)

_PRIMITIVES = (type(None), bool, int, float, str, bytes)
_PRUNE_AT = 4096  # registered objects before rank 0 looks for ones nobody holds any more


class RankFailure(RuntimeError):
    """A collective failed or timed out: a rank died or hangs. The ranks cannot agree any more."""


@dataclass(frozen=True)
class Ref:
    """An object a recorded call returned (host snapshot, prefix snapshot), by number."""

    n: int


class CallRecorder:
    """Rank 0's log of cache calls since the last step, and the objects those calls handed out."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self._by_id: dict[int, int] = {}
        self._objects: dict[int, Any] = {}
        self._next = 0

    def encode(self, x: Any) -> Any:
        n = self._by_id.get(id(x))
        if n is not None and self._objects[n] is x:
            return Ref(n)
        if isinstance(x, dict):
            return {self.encode(k): self.encode(v) for k, v in x.items()}
        if type(x) in (list, tuple):
            return type(x)(self.encode(v) for v in x)
        return x

    def register(self, result: Any) -> int | None:
        # slot handles travel by value (every rank's cache hands out the same index and generation)
        if type(result) in _PRIMITIVES or type(result) in (list, tuple, dict) or isinstance(result, SlotHandle):
            return None
        n = self._by_id.get(id(result))
        if n is not None and self._objects[n] is result:
            return n
        n, self._next = self._next, self._next + 1
        self._by_id[id(result)] = n
        self._objects[n] = result
        return n

    def take(self) -> list[tuple]:
        """The calls to replay, plus a ``forget`` of objects only this log still holds."""
        if len(self._objects) > _PRUNE_AT:
            gone = [n for n, obj in self._objects.items() if sys.getrefcount(obj) <= 3]
            for n in gone:
                del self._by_id[id(self._objects.pop(n))]
            if gone:
                self.calls.append(("forget", gone))
        calls, self.calls = self.calls, []
        return calls


class Mirrored:
    """Rank 0's view of its ``CacheManager`` (or prefix cache): method calls are recorded, then run.
    Attribute reads pass through; ``prefix`` is mirrored too."""

    def __init__(self, target: Any, name: str, recorder: CallRecorder):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_recorder", recorder)

    def __getattr__(self, attr: str) -> Any:
        target = self._target
        if attr == "prefix" and self._name == "cache":
            return None if target.prefix is None else Mirrored(target.prefix, "prefix", self._recorder)
        value = getattr(target, attr)
        if attr.startswith("_") or not callable(value) or isinstance(getattr(type(target), attr, None), property):
            return value
        return self._recording(attr, value)

    def __setattr__(self, attr: str, value: Any) -> None:
        setattr(self._target, attr, value)

    def _recording(self, attr: str, method: Callable) -> Callable:
        rec = self._recorder

        def call(*args, **kwargs):
            entry = [self._name, attr, rec.encode(args), rec.encode(kwargs), None]
            rec.calls.append(entry)
            result = method(*args, **kwargs)
            entry[4] = rec.register(result)
            return result

        return call


class Replayer:
    """A worker's side of ``Mirrored``: applies rank 0's recorded calls to its own cache."""

    def __init__(self, cache: CacheManager):
        self.cache = cache
        self.objects: dict[int, Any] = {}

    def decode(self, x: Any) -> Any:
        if isinstance(x, Ref):
            return self.objects[x.n]
        if isinstance(x, dict):
            return {self.decode(k): self.decode(v) for k, v in x.items()}
        if type(x) in (list, tuple):
            return type(x)(self.decode(v) for v in x)
        return x

    def apply(self, calls: list[tuple]) -> None:
        for call in calls:
            if call[0] == "forget":
                for n in call[1]:
                    self.objects.pop(n, None)
                continue
            name, attr, args, kwargs, ref = call
            target = self.cache if name == "cache" else self.cache.prefix
            try:
                result = getattr(target, attr)(*self.decode(args), **self.decode(kwargs))
            except Exception:  # rank 0's call raised the same way (it saw the same state)
                log.debug("replayed %s.%s raised", name, attr, exc_info=True)
                continue
            if ref is not None:
                self.objects[ref] = result


def strip_plan(plan: StepPlan) -> StepPlan:
    """The plan as workers need it: no samplers (sampling is rank 0's), slots as plain ints, image
    rows on the host (each worker's view moves them to its own device)."""
    decodes = tuple(dataclasses.replace(d, slot=int(d.slot), sampler=None) for d in plan.decodes)

    def member(m):
        images = tuple(ImageRows(pos, None if rows is None else rows.cpu()) for pos, rows in m.image_rows)
        return dataclasses.replace(m, slot=int(m.slot), sampler=None, image_rows=images)

    passes = tuple(dataclasses.replace(p, members=tuple(member(m) for m in p.members)) for p in plan.passes)
    return dataclasses.replace(plan, decodes=decodes, passes=passes)


def planned_reduces(plan: StepPlan, num_layers: int, width: int) -> list[int]:
    """Rows of every all-reduce ``plan``'s step makes, in order: two per layer per forward (a decoder's
    rows are its token and its draft), then, when decoders carry drafts, the one that agrees on their
    accepted counts (``Collectives.agree``: ``width`` counts a row)."""
    out: list[int] = []
    whole = [p for p in plan.passes if p.layer_start == 0 and p.layer_stop == num_layers]
    if plan.decodes or whole:
        out += [sum(1 + len(d.draft) for d in plan.decodes) + sum(p.rows for p in whole)] * (2 * num_layers)
    for p in plan.passes:
        if p not in whole:
            out += [p.rows] * (2 * (p.layer_stop - p.layer_start))
    drafted = sum(1 for d in plan.decodes if d.draft)
    if drafted:
        out.append(-(-drafted // width))
    return out


class Collectives:
    """The process groups of one TP group: ``compute`` for the forward's sums (NCCL on GPUs, gloo on
    CPU, the collective timeout), ``control`` (gloo, long timeout) for rank 0's messages."""

    def __init__(self, compute, control, width: int, dtype: torch.dtype, device: torch.device,
                 send_timeout: timedelta = timedelta(minutes=5)):
        self.compute, self.control, self.send_timeout = compute, control, send_timeout
        self.width, self.dtype, self.device = width, dtype, device
        self.done = 0  # all-reduces made in the current step
        self.lost: Exception | None = None

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's partial ``t`` (in place); the model's ``reduce`` hook."""
        if self.lost is not None:
            raise RankFailure(f"tensor-parallel group lost: {self.lost}")
        try:
            dist.all_reduce(t, group=self.compute)
        except Exception as exc:  # a dead or hung peer: nothing can be agreed any more
            self.lost = exc
            raise RankFailure(f"tensor-parallel all-reduce failed (a rank died or hangs): {exc}") from exc
        self.done += 1
        return t

    def agree(self, counts: list[int]) -> list[int]:
        """Every rank's copy of rank 0's ``counts`` (the accepted drafts of a step: only rank 0 samples, and
        every rank must roll the same rejected rows back): one all-reduce in which the workers, who
        sampled nothing, add zeros. Counts travel as floats, exact at these sizes, ``width`` a row."""
        n = len(counts)
        t = torch.zeros(-(-n // self.width), self.width, dtype=self.dtype, device=self.device)
        t.view(-1)[:n] = torch.tensor(counts, dtype=self.dtype)
        return [int(round(v)) for v in self.reduce(t).view(-1)[:n].tolist()]

    def drain(self, rows: list[int]) -> None:
        """Make the all-reduces of ``rows`` this step has not made yet (after a local failure)."""
        for n in rows[self.done:]:
            self.reduce(torch.zeros(n, self.width, dtype=self.dtype, device=self.device))

    def any_failed(self, failed: bool) -> bool:
        flag = torch.tensor([1.0 if failed else 0.0], device=self.device)
        self.reduce(flag)
        return bool(flag.item() > 0)  # sync-ok: once per step, after the forward

    def send(self, message: Any, timeout: timedelta | None = None) -> None:
        """Rank 0: ``message`` to every worker. Bounded by the collective timeout (or ``timeout``: the
        first message waits for the workers to load their shards): a stopped worker makes it raise
        ``RankFailure`` instead of blocking the engine thread forever."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        timeout = timeout or self.send_timeout
        try:
            for t in (torch.tensor([len(data)], dtype=torch.int64), torch.frombuffer(bytearray(data), dtype=torch.uint8)):
                dist.broadcast(t, src=0, group=self.control, async_op=True).wait(timeout=timeout)
        except Exception as exc:
            self.lost = exc
            raise RankFailure(f"could not reach the other tensor-parallel ranks within {timeout} "
                              f"(a rank died or hangs): {exc}") from exc

    def receive(self) -> Any:
        """A worker: the next message from rank 0 (waits as long as the server idles)."""
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.control)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.control)
        return pickle.loads(data.numpy().tobytes())


def run_step(engine, coll: Collectives, plan: StepPlan, num_layers: int) -> StepResult:
    """One step on this rank, failed here too if it failed on any rank (then undone as a step that
    failed here is). Every rank calls this."""
    coll.done = 0
    result = engine.step(plan)
    if coll.lost is not None:
        raise RankFailure(f"step {plan.step_id}: tensor-parallel group lost: {coll.lost}")
    failed = result.status is StepStatus.FAILED
    if failed:
        coll.drain(planned_reduces(plan, num_layers, coll.width))
    if not coll.any_failed(failed) or failed:
        return result
    for p in plan.passes:  # the same undo as a step that failed here
        engine.cancel_pass(p.pass_id)
    log.error("step %d failed on another rank; failing its requests", plan.step_id)
    return StepResult(step_id=plan.step_id, tokens=(), passes=(), status=StepStatus.FAILED,
                      error="the step failed on another tensor-parallel rank", elapsed_s=result.elapsed_s)


class ParallelExecutor:
    """Rank 0's executor: sends each plan (and the cache calls before it) to the workers, runs it here
    too, and fails the step everywhere if it failed anywhere."""

    def __init__(self, executor, coll: Collectives, recorder: CallRecorder, num_layers: int):
        self.executor, self.coll, self.recorder, self.num_layers = executor, coll, recorder, num_layers

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.executor, attr)

    def step(self, plan: StepPlan) -> StepResult:
        self.coll.send(("step", self.recorder.take(), strip_plan(plan)))
        return run_step(self.executor, self.coll, plan, self.num_layers)

    def close(self) -> None:
        """Tell the workers to exit (best effort: they may be gone already)."""
        try:
            self.coll.send(("stop", self.recorder.take(), None))
        except RankFailure:
            pass


def serve_steps(engine, cache: CacheManager, coll: Collectives, num_layers: int) -> None:
    """A worker's loop: replay rank 0's cache calls, run its plans, until ``stop``."""
    replay = Replayer(cache)
    while True:
        kind, calls, plan = coll.receive()
        replay.apply(calls)
        if kind == "stop":
            return
        run_step(engine, coll, plan, num_layers)
