"""Incremental detokenization and stop strings, for streaming.

``IncrementalDetokenizer.push(ids)`` returns only text that is final: it re-decodes a short window
of recent tokens and holds back output that ends in an incomplete UTF-8 sequence (the decoder's
U+FFFD), so a stream never emits broken characters. ``StopMatcher`` finds stop strings across token
boundaries and holds back text that could still become a stop string.
"""

from __future__ import annotations

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
        if len(full) > len(prefix_text) and not full.endswith(_REPLACEMENT):
            delta = full[len(prefix_text):]
            self._prefix, self._read = self._read, len(self.ids)
            return delta
        return ""

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
