"""n-gram (prompt lookup) drafting for any model (issue 28 item 1).

``propose(tokens, k, min_n, max_n, window)``: the last ``window`` tokens of prompt + output are the
history. For n from ``max_n`` down to ``min_n``, look for the **most recent earlier occurrence** of the
last n tokens (an occurrence that is not the suffix itself) and propose the up to k tokens that
followed it (they may run into the suffix itself: a repeating pattern continues). The longest n with
any occurrence wins; nothing matches: no draft. Deterministic and pure.

Why the most recent occurrence: text edited in place (the workload n-gram drafting is for) repeats its
latest version, not its first. vLLM's v1 proposer takes the earliest occurrence of the longest match,
which always has k tokens after it; ours may offer fewer when the match sits near the end (a short
period), and the verify row costs are then lower too.

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
    return tuple(int(t) for t in h[best + 1:best + 1 + k])
