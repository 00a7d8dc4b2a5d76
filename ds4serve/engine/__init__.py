"""Mechanism: executes step plans over the model and its state."""

from .runner import ModelRunner

__all__ = ["ModelRunner"]
