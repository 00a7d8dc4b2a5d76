"""One race for every response: the next output event, the client leaving, the deadline.

A server notices a dead socket only when it next writes to it, so a client that leaves during a
long (image) prefill would keep its request computing until the first token. Both response paths
(SSE and a plain JSON body) therefore iterate their events through ``race``, which also watches
the disconnect and the request deadline, and, for streams, says when a keep-alive is due.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from enum import Enum
from typing import TypeVar

from fastapi import Request

E = TypeVar("E")


class Outcome(Enum):
    """What ``race`` yields besides events; DISCONNECT and TIMEOUT end it."""

    KEEPALIVE = "keepalive"  # nothing for ``keepalive_s``: a stream should send a comment
    DISCONNECT = "client_disconnect"  # the client went away
    TIMEOUT = "timeout"  # the request deadline passed


async def disconnected(request: Request) -> None:
    """Resolve when the client disconnects (the body is already read, so the next ASGI message
    is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def race(events: AsyncIterator[E], gone: Callable[[], Awaitable[object]] | None, deadline: float,
               keepalive_s: float | None = None) -> AsyncIterator[E | Outcome]:
    """Yield ``events`` as they come, until they end or the client (``gone`` resolves) or the
    ``deadline`` (monotonic) wins; the winner is yielded last. With ``keepalive_s``, KEEPALIVE is
    yielded whenever that long passes without an event. Close it (``aclosing``) to stop early."""
    next_event: asyncio.Future | None = None
    watch = asyncio.ensure_future(gone()) if gone is not None else None
    try:
        while True:
            if next_event is None:
                next_event = asyncio.ensure_future(events.__anext__())
            left = deadline - time.monotonic()
            wait = max(0.0, left if keepalive_s is None else min(keepalive_s, left))
            done, _ = await asyncio.wait({next_event} if watch is None else {next_event, watch}, timeout=wait,
                                         return_when=asyncio.FIRST_COMPLETED)
            if watch is not None and watch in done:
                yield Outcome.DISCONNECT
                return
            if not done:
                if time.monotonic() >= deadline:
                    yield Outcome.TIMEOUT
                    return
                yield Outcome.KEEPALIVE
                continue
            try:
                event = next_event.result()
            except StopAsyncIteration:
                next_event = None
                return
            next_event = None
            yield event
    finally:
        for fut in (next_event, watch):
            if fut is None:
                continue
            if not fut.done():
                fut.cancel()
                await asyncio.gather(fut, return_exceptions=True)
            elif not fut.cancelled():  # a finished loser (the stream's end beside the disconnect): retrieve
                fut.exception()        # its exception, or asyncio logs "Task exception was never retrieved"
