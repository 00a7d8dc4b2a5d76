"""Start ``ds4serve serve`` in a child process for the length of a benchmark.

A child process (not an in-process server) so the bench client and the server do not share an
interpreter lock, and so each run of a comparison (prefix cache on, then off) gets a fresh server
whose cache and memory start empty.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence

from .memory import describe

# what `bench serve --launch` has always passed: enough slots that the bench's clients never queue
DEFAULT_SERVE_ARGS = ("--max-seqs", "32")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float) -> None:
    """Poll /health until it answers; a server that exits first (a bad flag, a missing checkpoint)
    ends the bench at once instead of after the whole timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(base + "/health", timeout=1)
            return
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"ds4serve serve exited during start-up (status {proc.returncode})")
            time.sleep(0.2)
    raise SystemExit(f"ds4serve serve did not answer /health within {timeout_s:.0f} s")


@contextlib.contextmanager
def launched_server(serve_args: Sequence[str] = (), timeout_s: float = 600.0,
                    label: str = "the launched ds4serve server") -> Iterator[str]:
    """Yield the base URL of a fresh ``ds4serve serve`` on a free loopback port, with
    ``DEFAULT_SERVE_ARGS`` then ``serve_args`` (later flags win in argparse); stopped on exit, with
    its peak memory printed."""
    port = _free_port()
    cmd = [sys.executable, "-m", "ds4serve.cli", "--log-level", "WARNING", "serve", "--port", str(port),
           *DEFAULT_SERVE_ARGS, *serve_args]
    proc = subprocess.Popen(cmd)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base, timeout_s)
        yield base
    finally:
        print(describe(label, proc.pid))
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
