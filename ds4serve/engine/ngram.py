"""n-gram (prompt lookup) drafting for any model (issue 28 item 1).

``propose(tokens, k, min_n, max_n, window)``: the last ``window`` tokens of prompt + output are the
history. For n from ``max_n`` down to ``min_n``, look for the **most recent earlier occurrence** of the
last n tokens (an occurrence that is not the suffix itself) and propose the k tokens that followed it
(they may run into the suffix itself); where they reach the end of the history, the text is taken to
repeat with the distance between the occurrence and the suffix as its period (the d tokens after an
occurrence ending d tokens before the suffix's end, again and again: a loop goes on looping). The
longest n with any occurrence wins; nothing matches: no draft. Deterministic and pure.

Why the most recent occurrence: text edited in place (the workload n-gram drafting is for) repeats its
latest version, not its first. vLLM's v1 proposer takes the earliest occurrence of the longest match,
which in a loop always has k tokens after it; the latest occurrence of a short loop sits next to the
suffix, so without the periodic continuation its drafts were as short as the loop's period (a 2-token
loop drafted 2 tokens a step where 5 would have been accepted).

Cost: one vectorised pass per n (``max_n`` comparisons of the history with one token each), so
O(window * max_n) numpy work and O(max_n) Python steps; the default window of 4096 tokens keeps a
proposal in tens of microseconds whatever the context length. An ``np.ndarray`` of tokens is used
without copying the whole context.

Which requests draft, and how long (their acceptance history and the step's load), is the scheduler's
call (``scheduler/drafting.py``); this module only proposes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _history(tokens: Sequence[int] | np.ndarray, window: int) -> np.ndarray:
    """The last ``window`` tokens as an int64 array (a view when ``tokens`` already is one)."""
    tail = tokens[-window:] if len(tokens) > window else tokens
    return np.asarray(tail, dtype=np.int64)


def _check(k: int, min_n: int, max_n: int, window: int) -> None:
    if k < 0 or min_n < 1 or max_n < min_n or window < 1:
        raise ValueError(f"need k >= 0, 1 <= min_n <= max_n and window >= 1 (k={k}, n={min_n}..{max_n}, "
                         f"window={window})")


def propose(tokens: Sequence[int] | np.ndarray, k: int, min_n: int, max_n: int, window: int = 4096
            ) -> tuple[int, ...]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix of
    ``tokens`` (length ``min_n..max_n``) within the last ``window`` tokens; () when none occurs."""
    _check(k, min_n, max_n, window)
    h = _history(tokens, window)
    m = len(h)
    if k == 0 or m < min_n + 1:
        return ()
    # alive[e]: h[e-j..e] == h[m-1-j..m-1] for every j so far; e is the end of a candidate occurrence,
    # e <= m - 2 so it is earlier than the suffix and has a token after it
    ends = np.arange(m - 1)
    alive = np.ones(m - 1, dtype=bool)
    best: int | None = None
    for j in range(min(max_n, m - 1)):
        ok = ends >= j
        alive &= ok & (h[np.maximum(ends - j, 0)] == h[m - 1 - j])
        if not alive.any():
            break
        if j + 1 >= min_n:  # a match of length j + 1 exists: the latest one is the best so far
            best = int(np.flatnonzero(alive)[-1])
    if best is None:
        return ()
    return _continued([int(t) for t in h[best + 1:]], k)


def _continued(after: list[int], k: int) -> tuple[int, ...]:
    """The first ``k`` tokens of ``after`` (the tokens from an occurrence's end to the history's end: one
    period of the text) repeated as often as ``k`` needs."""
    if len(after) >= k:
        return tuple(after[:k])
    return tuple(after[i % len(after)] for i in range(k))


class SuffixIndex:
    """``propose``'s rule for one growing token stream, kept as an index: each n-gram (``min_n..max_n``)
    maps to the end of its latest occurrence, so a proposal is ``max_n`` dictionary look-ups instead of a
    pass over the window, and each new token adds ``max_n - min_n + 1`` entries.

    Why: prompt lookup runs every decode step of every drafting request; on a small model the numpy
    pass (tens of array operations of a few microseconds each) cost as much as a quarter of the
    forward it saved. The answer is ``propose``'s exactly (``tests/test_ngram_drafter.py`` checks every
    prefix of random streams): the latest occurrence of a key is the only one that can win (a later end
    beats an earlier one, and if the latest starts before the window so does every earlier one).

    ``tokens`` passed to ``propose`` must extend the ones passed before (a request's prompt + output
    only ever grows); a shorter or different stream starts the index over. Entries older than the window
    are dropped by a rebuild once the index holds more than ``4 * window`` of them, so memory stays
    bounded by the window, not the context."""

    def __init__(self, min_n: int, max_n: int, window: int = 4096):
        _check(0, min_n, max_n, window)
        self.min_n, self.max_n, self.window = min_n, max_n, window
        self._tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}
        self._done = 0  # occurrences ending below this are indexed (each has a token after it)

    def _catch_up(self, parts: tuple[Sequence[int], ...]) -> None:
        """Take in the tokens of ``parts`` (their concatenation is the stream) not seen yet."""
        seen = len(self._tokens)
        if sum(len(p) for p in parts) < seen or (seen and _at(parts, seen - 1) != self._tokens[-1]):
            self._tokens, self._last, self._done = [], {}, 0
            seen = 0
        for p in parts:
            if seen < len(p):
                self._tokens.extend(int(t) for t in p[seen:])
            seen = max(0, seen - len(p))
        h, m = self._tokens, len(self._tokens)
        lo = max(0, m - self.window)
        if len(self._last) > 4 * self.window:  # forget what the window left behind
            self._last, self._done = {}, lo
        last = self._last
        for e in range(max(self._done, lo), m - 1):
            for n in range(self.min_n, min(self.max_n, e + 1) + 1):
                last[tuple(h[e - n + 1:e + 1])] = e
        self._done = max(self._done, m - 1)

    def propose(self, *parts: Sequence[int], k: int) -> tuple[int, ...]:
        """``propose(tokens, k, min_n, max_n, window)``, from the index; ``tokens`` is the concatenation of
        ``parts`` (a request's prompt and output, without joining them every step)."""
        if k < 0:
            raise ValueError(f"need k >= 0, got {k}")
        self._catch_up(parts)
        h, m = self._tokens, len(self._tokens)
        if k == 0:
            return ()
        lo = max(0, m - self.window)
        for n in range(min(self.max_n, m - 1 - lo), self.min_n - 1, -1):
            e = self._last.get(tuple(h[m - n:]))
            if e is not None and e - n + 1 >= lo:
                return _continued(h[e + 1:e + 1 + k], k)
        return ()


def _at(parts: tuple[Sequence[int], ...], i: int) -> int:
    """Token ``i`` of the concatenation of ``parts``."""
    for p in parts:
        if i < len(p):
            return int(p[i])
        i -= len(p)
    raise IndexError(i)
