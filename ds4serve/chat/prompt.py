"""DS4 prompt pieces -> token ids, the way the reference tokenizes its rendered string.

DeepSeek's usage is ``tokenizer.encode(encode_messages(...))``: the rendered string is split at the
vocabulary's added tokens and the text between them is BPE-encoded. When no client text contains
an added-token string we do exactly that on the whole prompt, so our ids are the reference's ids.
When a client did type one (``<｜User｜>`` in a user message, say), that text is encoded on its own
with special-token matching off: a typed role marker stays text and can never switch roles. Only
then may a token boundary differ from a plain encode of the string, which is the point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .encoding import ChatOptions, EncodedChat, Piece, encode_chat
from .template import ChatFormatError, RenderedPrompt
from .tokenizer import Tokenizer


@dataclass
class DS4Prompt(RenderedPrompt):
    """A rendered chat: ``ids`` for the engine, ``text`` for ``/apply-template``, images in order."""
    text: str = ""


def render_ds4(tok: Tokenizer, messages: list[dict[str, Any]], options: ChatOptions | None = None) -> DS4Prompt:
    """Render and tokenize ``messages`` (``ChatFormatError`` names the field that cannot be rendered)."""
    opts = options or ChatOptions()
    enc = encode_chat(messages, opts)
    if opts.thinking and tok.think_id is None:
        raise ChatFormatError("this model's tokenizer has no <think> token; thinking mode is unavailable")
    if enc.images and tok.image_id is None:
        raise ChatFormatError("this model does not accept images", "messages")
    ids = _tokenize(tok, enc)
    positions = [k for k, t in enumerate(ids) if t == tok.image_id] if enc.images else []
    if len(positions) != len(enc.images):  # cannot happen: typed placeholders are refused upstream
        raise ChatFormatError("image placeholders do not match the image parts", "messages")
    return DS4Prompt(ids=ids, images=enc.images, image_positions=positions, text=enc.text)


def _injected(tok: Tokenizer, piece: Piece) -> bool:
    return piece.kind == "user" and any(s in piece.text for s in tok.added_texts)


def _tokenize(tok: Tokenizer, enc: EncodedChat) -> list[int]:
    if not any(_injected(tok, p) for p in enc.pieces):
        return tok.encode_markup(enc.text)
    ids: list[int] = []
    run: list[str] = []  # trusted text (and clean client text) encoded together, as in one string
    for p in enc.pieces:
        if _injected(tok, p):
            ids += tok.encode_markup("".join(run)) + tok.encode_text(p.text)
            run = []
        else:
            run.append(p.text)
    return ids + tok.encode_markup("".join(run))
