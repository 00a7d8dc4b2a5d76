"""Mechanism: executes step plans over the model and its state (``executor.Executor``)."""

from .executor import Executor

__all__ = ["Executor"]
