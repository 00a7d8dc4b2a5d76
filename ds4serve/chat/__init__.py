"""Tokenizer and DS4 chat protocol (a leaf package used by the server and the tiny-model tools).

``render_chat`` is the original minimal encoding; ``render_ds4`` is the full DS4 protocol (DeepSeek's
reference encoding: tools, thinking, reasoning effort, response format), and ``OutputParser`` reads
the model's output back into reasoning, content and tool calls.
"""

from .detok import IncrementalDetokenizer, StopMatcher
from .encoding import ChatOptions, EncodedChat, encode_chat
from .events import (ContentDelta, Event, ParsedOutput, ReasoningDelta, ToolCallDelta, ToolCallEnd,
                     ToolCallStart, fold)
from .output_parser import OutputParser, parse_output, token_pieces
from .prompt import DS4Prompt, render_ds4
from .template import ChatFormatError, RenderedPrompt, render_chat, render_completion
from .tokenizer import Tokenizer, TokenizerError

__all__ = ["ChatFormatError", "ChatOptions", "ContentDelta", "DS4Prompt", "EncodedChat", "Event",
           "IncrementalDetokenizer", "OutputParser", "ParsedOutput", "ReasoningDelta", "RenderedPrompt",
           "StopMatcher", "Tokenizer", "TokenizerError", "ToolCallDelta", "ToolCallEnd", "ToolCallStart",
           "encode_chat", "fold", "parse_output", "render_chat", "render_completion", "render_ds4", "token_pieces"]
