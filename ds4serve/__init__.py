"""ds4serve: a serving engine for DeepSeek-V4 and DeepSeek-V4-Flash-Vision-Exp (DS4V)."""

from __future__ import annotations

import os

# OpenMP threads (torch's intra-op pool) spin for ~300,000 iterations after every parallel region by
# default. On a CPU the native host forward runs each step on its own thread pool right after torch's
# small per-step ops (sampling over [rows, vocab]), so spinning OpenMP threads took the same cores from
# it: a 16-stream decode step on 2 cores took 11.6 ms instead of 7.6. A short spin keeps torch's own
# forward as fast as before (its ops follow each other closely). Read by libgomp when torch loads, so
# it only takes effect when ds4serve is imported before torch; a value the user set is kept.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

__version__ = "0.1.0"

__all__ = ["LLM", "__version__"]


def __getattr__(name: str):
    # Lazy so that `ds4serve --help` and config tooling do not pay for importing torch.
    if name == "LLM":
        from .llm import LLM

        return LLM
    raise AttributeError(name)
