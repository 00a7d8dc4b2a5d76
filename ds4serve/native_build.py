"""Compiling the host's C kernels once, on first use: one helper for every native part.

The native parts (``model/native.py``: Sinkhorn, RoPE, MXFP4; ``model/host_forward.py``: the host forward;
``cache/native_view.py``: the index view) are C sources shipped in the package, compiled with the system
C compiler into ``cache_root()/native/<hash>/`` and loaded with ctypes. The hash covers the source, the
flags and anything else the build depends on (the CPU it is tuned for), so a cache shared between
machines or versions never serves a wrong build. ``OnceLibrary`` loads each part once per process and
remembers (and logs once) why it could not. A leaf: it imports nothing of the package.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path


def build_library(root: Path, name: str, source: str, flags: list[str], libs: list[str], key: str = "") -> Path:
    """Compile C ``source`` into ``root/<hash>/<name>.so`` unless it is already there (``key``: anything
    else the build depends on, e.g. the CPU it is tuned for). Raises ``RuntimeError`` when it cannot."""
    digest = hashlib.sha256((source + " ".join(flags + libs) + key).encode()).hexdigest()[:16]
    out = root / digest / f"{name}.so"
    if out.exists():
        return out
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src, built = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
        src.write_text(source)
        done = subprocess.run([cc, *flags, "-o", str(built), str(src), *libs], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[:500]}")
        os.replace(built, out)  # atomic: a concurrent process sees the whole library or none
    return out


SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g"]


def sanitized(flags: list[str], on: bool) -> list[str]:
    """``flags`` plus AddressSanitizer and UndefinedBehaviorSanitizer when ``on`` (``environment.native_build``:
    ``DS4SERVE_NATIVE_SANITIZE=1``, run by ``scripts/sanitize.sh``, which preloads their runtime)."""
    return flags + SANITIZE_FLAGS if on else flags


def cpu_key() -> str:
    """What ``-march=native`` tunes for: the CPU's model and feature flags (the cache may be shared)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return " ".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features"))}))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


class OnceLibrary:
    """A native library loaded on first use, once per process; a failure is remembered and logged once.

    ``load`` builds and binds the library (raising ``OSError`` or ``RuntimeError`` when it cannot);
    ``unavailable`` is the warning logged then, with ``%s`` for the reason. Callers fall back to their
    torch forms whenever ``get()`` is ``None``."""

    def __init__(self, load: Callable[[], ctypes.CDLL], logger: logging.Logger, unavailable: str):
        self._load, self._log, self._unavailable = load, logger, unavailable
        self._lock = threading.Lock()
        self.lib: ctypes.CDLL | None = None
        self.failure: str | None = None

    def get(self) -> ctypes.CDLL | None:
        if self.lib is not None or self.failure is not None:
            return self.lib
        with self._lock:
            if self.lib is None and self.failure is None:
                try:
                    self.lib = self._load()
                except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                    self.failure = f"{type(exc).__name__}: {exc}"
                    self._log.warning(self._unavailable, self.failure)
        return self.lib

    def fresh(self) -> OnceLibrary:
        """A new one with the same loader that has not tried yet (tests swap it in, then back)."""
        return OnceLibrary(self._load, self._log, self._unavailable)
