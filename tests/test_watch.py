"""server.watch.race: the events, the client leaving and the deadline in one loop."""

from __future__ import annotations

import asyncio
import gc
import time

from ds4serve.server.watch import Outcome, race


async def _events(items: list[int]):
    for item in items:
        yield item


def _run(coro, errors: list[dict]):
    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        result = await coro
        gc.collect()  # an unretrieved task exception is reported when its task is collected
        await asyncio.sleep(0)
        return result
    return asyncio.run(main())


async def _collect(agen) -> list:
    return [x async for x in agen]


def test_events_in_order_then_the_end():
    errors: list[dict] = []
    out = _run(_collect(race(_events([1, 2, 3]), None, time.monotonic() + 5)), errors)
    assert out == [1, 2, 3] and errors == []


def test_a_disconnect_beside_the_streams_end_leaves_no_unretrieved_exception():
    """Both the stream's end (StopAsyncIteration) and the disconnect are ready when ``race`` wakes:
    the disconnect wins and the finished loser must be retrieved, or asyncio logs "Task exception was
    never retrieved" for every such stream (it did, under load, in the server's logs)."""
    errors: list[dict] = []

    async def gone():
        return None

    async def scenario():
        agen = race(_events([]), gone, time.monotonic() + 5)
        return await _collect(agen)

    assert _run(scenario(), errors) == [Outcome.DISCONNECT]
    assert errors == [], [e.get("message") for e in errors]


def test_deadline_and_keepalive():
    """Keep-alives while the stream is silent, then the deadline, and the late event never. The deadline
    is set once the loop runs and each step has 10x room (keep-alive every 50 ms, deadline at 0.5 s, the
    event at 2 s): with 20 / 50 / 200 ms, and the deadline taken before ``asyncio.run`` started, a
    loaded machine holding the loop for 50 ms would skip every keep-alive."""
    errors: list[dict] = []

    async def slow():
        await asyncio.sleep(2.0)
        yield 1

    async def scenario():
        return await _collect(race(slow(), None, time.monotonic() + 0.5, keepalive_s=0.05))

    out = _run(scenario(), errors)
    assert out[-1] is Outcome.TIMEOUT and Outcome.KEEPALIVE in out and 1 not in out
    assert errors == []
