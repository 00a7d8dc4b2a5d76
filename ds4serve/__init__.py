"""ds4serve: a serving engine for DeepSeek-V4 and DeepSeek-V4-Flash-Vision-Exp (DS4V)."""

from __future__ import annotations

from .environment import set_openmp_defaults

set_openmp_defaults()  # before anything here imports torch

__version__ = "0.1.0"

__all__ = ["LLM", "__version__"]


def __getattr__(name: str):
    # Lazy so that `ds4serve --help` and config tooling do not pay for importing torch.
    if name == "LLM":
        from .llm import LLM

        return LLM
    raise AttributeError(name)
