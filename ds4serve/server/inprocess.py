"""Run a ds4serve HTTP server inside this process (uvicorn in a thread), for tests and chaos runs.

The caller keeps a handle on the engine loop (``.loop``) so it can probe internal invariants (leaks,
counters) between or after requests, which an out-of-process server would hide.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

import uvicorn

from ..runtime import EngineLoop
from ..runtime.tp_group import ParallelSettings
from ..settings import EngineSettings
from .app import create_app
from .launch import build_state
from .limits import ServerLimits
from .state import ServerState


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    def __init__(self, state: ServerState, port: int):
        self.state = state
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> "RunningServer":
        self.thread.start()
        deadline = time.time() + 120
        while time.time() < deadline:
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(self.base + "/health", timeout=1).status == 200:
                    return self
            time.sleep(0.05)
        raise RuntimeError("server did not start")

    def stop(self) -> None:
        self.state.loop.begin_shutdown("the server is shutting down")
        self.server.should_exit = True
        self.thread.join(timeout=30)

    @property
    def loop(self) -> EngineLoop:
        """The engine loop (tests probe it with ``loop.call(fn)``)."""
        return self.state.loop


@contextlib.contextmanager
def serve(model_dir: Path, *, api_key: str | None = None, api_keys: Mapping[str, str] | None = None,
          settings: dict | None = None, limits: dict | None = None, name: str = "tiny", random_weights: bool = True,
          parallel: ParallelSettings | None = None, chat_encoding: str | None = None):
    """A started server on a free loopback port for the ``with`` block. ``api_key``: one key (named
    ``key-1``); ``api_keys``: several, ``{name: key}``. ``parallel``: a tensor-parallel group (this
    process is rank 0; the others are started and stopped with the server). ``chat_encoding``: as
    ``serve --chat-encoding`` (None: the checkpoint's edition)."""
    s = EngineSettings(**({"max_seqs": 8, "max_model_len": 1024, "warmup": False} | (settings or {})))
    state = build_state(model_dir, settings=s, limits=ServerLimits(**(limits or {})), api_key=api_key,
                        api_keys=api_keys, served_name=name, random_weights=random_weights, parallel=parallel,
                        chat_encoding=chat_encoding)
    # a lost rank (tensor-parallel) stops this server, not the calling process
    state.loop.on_rank_lost(lambda why: state.loop.begin_shutdown(why))
    srv = RunningServer(state, free_port()).start()
    try:
        yield srv
    finally:
        srv.stop()
