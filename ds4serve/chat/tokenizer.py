"""The checkpoint's tokenizer (``tokenizer.json``, via the ``tokenizers`` library), safe to share.

Every thread gets its own ``tokenizers.Tokenizer`` built from the same JSON (the Rust object keeps
per-instance settings such as padding/truncation and ``encode_special_tokens``, so one instance is
never mutated across threads). User text is encoded with special-token matching *off*: a user
typing ``<｜User｜>`` gets plain text, never a role switch.
"""

from __future__ import annotations

import threading
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import ByteLevel as _ByteLevelDecoder

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
THINK_END = "</think>"
IMAGE = "<｜deepseek_image｜>"
SPECIALS = (BOS, EOS, USER, ASSISTANT, THINK, THINK_END, IMAGE)


class TokenizerError(RuntimeError):
    """The tokenizer file is missing or lacks a token the DS4 chat format needs."""


class Tokenizer:
    def __init__(self, path: str | Path):
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.exists():
            raise TokenizerError(f"no tokenizer.json at {path}")
        self._json = path.read_text()
        self._local = threading.local()
        base = self._tok()
        self.vocab_size = base.get_vocab_size(with_added_tokens=True)
        missing = [s for s in (BOS, EOS, USER, ASSISTANT, THINK_END) if base.token_to_id(s) is None]
        if missing:
            raise TokenizerError(f"{path} lacks the DS4 special tokens {missing}")
        self.bos_id = base.token_to_id(BOS)
        self.eos_id = base.token_to_id(EOS)
        self.user_id = base.token_to_id(USER)
        self.assistant_id = base.token_to_id(ASSISTANT)
        self.think_id = base.token_to_id(THINK)
        self.think_end_id = base.token_to_id(THINK_END)
        self.image_id = base.token_to_id(IMAGE)
        self.special_ids = frozenset(i for i in (base.token_to_id(s) for s in SPECIALS) if i is not None)

    def _tok(self) -> _HFTokenizer:
        tok = getattr(self._local, "tok", None)
        if tok is None:
            tok = _HFTokenizer.from_str(self._json)
            tok.encode_special_tokens = True  # user text: specials are plain text
            self._local.tok = tok
        return tok

    def _markup_tok(self) -> _HFTokenizer:
        tok = getattr(self._local, "markup", None)
        if tok is None:
            tok = _HFTokenizer.from_str(self._json)  # special-token strings are matched (trusted text)
            self._local.markup = tok
        return tok

    def encode_markup(self, text: str) -> list[int]:
        """Ids of prompt text whose markup is meant: our own template, or a raw ``/v1/completions``
        prompt (its client writes the whole prompt, role markers included, as vLLM reads it).
        Special-token strings in it become their tokens, exactly as the reference tokenizes a rendered
        prompt. Never for text inside a chat message, where a typed marker must stay text."""
        if not text:
            return []
        return self._markup_tok().encode(text, add_special_tokens=False).ids

    @cached_property
    def added_texts(self) -> tuple[str, ...]:
        """Contents of every added token: client text holding one of them must not be matched."""
        return tuple(t.content for t in self._tok().get_added_tokens_decoder().values())

    @cached_property
    def added_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special: what ``skip_special_tokens`` hides from output text
        (added tokens that are not special, such as markup pieces, stay text)."""
        return frozenset(i for i, t in self._tok().get_added_tokens_decoder().items() if t.special)

    def encode_text(self, text: str) -> list[int]:
        """Ids of untrusted text; special-token strings in it stay plain text."""
        if not text:
            return []
        return self._tok().encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = [i for i in ids if 0 <= i < self.vocab_size]
        return self._tok().decode(ids, skip_special_tokens=skip_special_tokens)

    @cached_property
    def _byte_of_char(self) -> dict[str, int] | None:
        """ByteLevel's alphabet read backwards (GPT-2's bytes_to_unicode: printable bytes stand for
        themselves, the other 68 for U+0100 on), or None when the decoder is not ByteLevel."""
        if not isinstance(self._tok().decoder, _ByteLevelDecoder):
            return None
        keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
        rest = [b for b in range(256) if b not in keep]
        return {chr(b): b for b in keep} | {chr(0x100 + n): b for n, b in enumerate(rest)}

    def token_bytes(self, ids, skip_special_tokens: bool = True) -> bytes | None:
        """The bytes ``ids`` decode from (added tokens: their text; skipped specials: nothing), or None
        when the tokenizer is not byte-level (then only the decoded text is known)."""
        table = self._byte_of_char
        if table is None:
            return None
        tok, out = self._tok(), bytearray()
        for i in ids:
            if not 0 <= i < self.vocab_size or (skip_special_tokens and i in self.added_ids):
                continue
            piece = tok.id_to_token(i) or ""
            out += bytes(table[c] for c in piece) if all(c in table for c in piece) else piece.encode()
        return bytes(out)

    def token_text(self, token_id: int) -> str:
        """Readable text of one token (for logprobs); specials by name. A token that is only part of a
        UTF-8 character is shown as ``bytes:<vocab entry>`` so distinct tokens never share a label."""
        if not 0 <= token_id < self.vocab_size:
            return ""
        text = self._tok().decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            return "bytes:" + (self._tok().id_to_token(token_id) or str(token_id))
        return text
