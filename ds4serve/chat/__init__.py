"""Tokenizer and DS4 chat encoding (a leaf package used by the server and the tiny-model tools)."""

from .detok import IncrementalDetokenizer, StopMatcher
from .template import ChatFormatError, RenderedPrompt, render_chat, render_completion
from .tokenizer import Tokenizer, TokenizerError

__all__ = ["ChatFormatError", "IncrementalDetokenizer", "RenderedPrompt", "StopMatcher", "Tokenizer",
           "TokenizerError", "render_chat", "render_completion"]
