"""What ds4serve reads from the process environment, in one place (DESIGN §8: here and the CLI only).

Where generated files go (``DS4SERVE_CACHE``), how the native parts are compiled (``DS4SERVE_NATIVE_*``)
and torch's OpenMP spin (``GOMP_SPINCOUNT``, set when ds4serve is imported). A leaf: it imports nothing
of the package, so any layer may ask it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path


def cache_root() -> Path:
    """Where generated files (the random placeholder checkpoint) are kept: ``$DS4SERVE_CACHE`` or
    ``~/.cache/ds4serve``. Environment variables are read in this module and the CLI only (DESIGN §8)."""
    return Path(os.environ.get("DS4SERVE_CACHE") or Path.home() / ".cache" / "ds4serve")


@dataclass(frozen=True)
class NativeBuild:
    """How the native host forward is compiled (``model/host_forward.py``), from the environment:

    ``DS4SERVE_NATIVE_TARGET``: the instruction set, ``native`` (default: ``-march=native``, falling back
    to the compiler's baseline where that fails), or any ``-march`` value (``x86-64-v2`` has no FMA,
    ``x86-64-v3`` is AVX2 + FMA, ``x86-64-v4`` AVX-512), or ``baseline`` (no ``-march`` at all). The tests
    build every target the CPU runs and check that each keeps the promised-equal results equal.
    ``DS4SERVE_NATIVE_CHECK=1``: every gather and scatter checked against the size of what it indexes
    (aborts with a message; slower). ``DS4SERVE_NATIVE_SANITIZE=1``: built with AddressSanitizer and
    UndefinedBehaviorSanitizer (``scripts/sanitize.sh``; the process must preload libasan)."""

    target: str = "native"
    check: bool = False
    sanitize: bool = False


def native_build() -> NativeBuild:
    """The ``NativeBuild`` the environment asks for (see there); a malformed target is a ``ValueError``."""
    target = os.environ.get("DS4SERVE_NATIVE_TARGET", "").strip() or "native"
    if not all(c.isalnum() or c in "-_.+" for c in target):
        raise ValueError(f"DS4SERVE_NATIVE_TARGET={target!r} is not a -march name (e.g. native, x86-64-v3)")
    on = ("1", "true", "yes", "on")
    return NativeBuild(target, os.environ.get("DS4SERVE_NATIVE_CHECK", "").lower() in on,
                       os.environ.get("DS4SERVE_NATIVE_SANITIZE", "").lower() in on)


def set_openmp_defaults() -> None:
    """Shorten how long torch's OpenMP threads spin after a parallel region (unless the user chose).

    By default they spin for ~300,000 iterations. On a CPU the native host forward runs each step on its
    own thread pool right after torch's few per-step ops (sampling over ``[rows, vocab]``), so spinning
    OpenMP threads took the same cores from it: a 16-stream decode step on 2 cores took 11.6 ms instead
    of 7.1. A short spin keeps torch's own forward as fast as before (its ops follow each other closely).
    libgomp reads the variable when torch loads, so this only counts when ds4serve is imported first
    (``openmp_spin_advice`` says so when it was not)."""
    global _SPIN_SET_TOO_LATE
    if "GOMP_SPINCOUNT" not in os.environ and "torch" in sys.modules:
        _SPIN_SET_TOO_LATE = True
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")


_SPIN_SET_TOO_LATE = False  # torch (and so libgomp) was loaded before ds4serve could shorten the spin


def openmp_spin_advice() -> str | None:
    """What to do when ``set_openmp_defaults`` came too late (``import torch`` before ``import
    ds4serve`` in a program using ``LLM``): torch's OpenMP threads then spin ~30x longer and slow the
    native forward's steps ~1.6x on 2 cores. None when the spin count took effect or the user set it."""
    if not _SPIN_SET_TOO_LATE:
        return None
    return ("torch was imported before ds4serve, so its OpenMP threads keep their long spin and take cores "
            "from the native forward (decode steps up to ~1.6x slower on small machines): import ds4serve "
            "first, or export GOMP_SPINCOUNT=10000 before starting Python")
