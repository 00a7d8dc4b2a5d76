"""Incremental detokenization and stop strings, for streaming.

``IncrementalDetokenizer.push(ids)`` returns only text that is final: it re-decodes a short window
of recent tokens and holds back output that ends in an incomplete UTF-8 sequence (the decoder's
U+FFFD), so a stream never emits broken characters. Only a sequence that later bytes could still
complete is held: a byte no continuation can repair (a lone continuation byte, 0xF8, a lead byte
already followed by a wrong one) stays U+FFFD whatever comes next, so its text goes out at once, as
llama-server sends it (holding it cost a stream a whole step: one chunk every two tokens there). ``StopMatcher`` finds stop strings across token
boundaries and holds back text that could still become a stop string.
"""

from __future__ import annotations

import codecs

from .tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True):
        self.tok = tok
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens whose text has been emitted

    def push(self, new_ids) -> str:
        self.ids.extend(new_ids)
        prefix_text = self.tok.decode(self.ids[self._prefix:self._read], self.skip)
        full = self.tok.decode(self.ids[self._prefix:], self.skip)
        if len(full) > len(prefix_text) and not (full.endswith(_REPLACEMENT) and self._completable()):
            delta = full[len(prefix_text):]
            self._prefix, self._read = self._read, len(self.ids)
            return delta
        return ""

    def _completable(self) -> bool:
        """Do the window's last bytes start a UTF-8 character that more bytes could still complete?
        (Unknown bytes, a tokenizer that is not byte-level: assume so, and hold.)"""
        raw = self.tok.token_bytes(self.ids[self._prefix:], self.skip)
        if raw is None:
            return True
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(raw, final=False)
        return bool(decoder.getstate()[0])  # the bytes it holds back, waiting for the rest

    def flush(self) -> str:
        """Whatever is left at the end (a truncated character becomes U+FFFD, as in any decoder)."""
        prefix_text = self.tok.decode(self.ids[self._prefix:self._read], self.skip)
        full = self.tok.decode(self.ids[self._prefix:], self.skip)
        self._prefix = self._read = len(self.ids)
        return full[len(prefix_text):]


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._buf = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that stopped the text (Anthropic's stop_sequence)

    def feed(self, text: str) -> str:
        """Text safe to emit now; sets ``stopped`` when a stop string appears (it is not emitted)."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self._buf += text
        hits = [(self._buf.find(s), s) for s in self.stops if s in self._buf]
        if hits:
            cut, self.matched = min(hits, key=lambda h: h[0])
            out, self._buf, self.stopped = self._buf[:cut], "", True
            return out
        keep = self._partial_suffix()
        out, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return out

    def _partial_suffix(self) -> int:
        """Length of the longest end of the buffer that is the start of some stop string."""
        for n in range(min(self._hold, len(self._buf)), 0, -1):
            tail = self._buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def flush(self) -> str:
        out, self._buf = self._buf, ""
        return "" if self.stopped else out
