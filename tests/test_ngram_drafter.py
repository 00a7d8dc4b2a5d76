"""n-gram (prompt lookup) drafting (issue 28 item 1) and its acceptance history (item 3).

An oracle in plain loops written from the rule (most recent earlier occurrence of the longest suffix
of length max_n..min_n within the window, the up to k tokens after it), and hypothesis properties
that each say one part of the rule on its own.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4serve.engine.ngram import SuffixIndex, propose


def oracle(tokens: list[int], k: int, min_n: int, max_n: int, window: int) -> tuple[int, ...]:
    """The rule, literally: the window, then n from max_n down, then start positions from the latest; the
    tokens after the occurrence, and past the history's end the text repeating with period d (the
    distance from the occurrence's end to the suffix's end), one token at a time."""
    h = tokens[max(0, len(tokens) - window):]
    for n in range(max_n, min_n - 1, -1):
        suffix = h[len(h) - n:] if n <= len(h) else None
        for s in range(len(h) - n - 1, -1, -1):  # an earlier start than the suffix's own
            if h[s:s + n] == suffix:
                ext, d = list(h), len(h) - (s + n)  # the occurrence ends at s + n - 1, the suffix at len - 1
                while len(ext) < s + n + k:
                    ext.append(ext[len(ext) - d])
                return tuple(ext[s + n:s + n + k])
    return ()


# small alphabets make repeats (and so matches) common
sequences = st.lists(st.integers(0, 3), max_size=60)
settings_ = dict(max_examples=300, deadline=None)


@st.composite
def cases(draw):
    tokens = draw(sequences)
    min_n = draw(st.integers(1, 4))
    max_n = draw(st.integers(min_n, 6))
    return tokens, draw(st.integers(0, 7)), min_n, max_n, draw(st.integers(1, 70))


def _after(h: list[int], start: int, k: int) -> tuple[int, ...]:
    """The k tokens from ``start`` on, the tokens ``h[start:]`` repeated past the end (one period)."""
    period = h[start:]
    return tuple(period[i % len(period)] for i in range(k)) if period else ()


def _occurrences(h: list[int], n: int) -> list[int]:
    """Starts s < len(h) - n with h[s:s+n] equal to the last n tokens."""
    return [s for s in range(len(h) - n) if h[s:s + n] == h[len(h) - n:]]


@given(cases())
@settings(**settings_)
def test_matches_the_oracle(case):
    tokens, k, min_n, max_n, window = case
    assert propose(tokens, k, min_n, max_n, window) == oracle(tokens, k, min_n, max_n, window)
    assert propose(np.array(tokens, dtype=np.int32), k, min_n, max_n, window) == oracle(tokens, k, min_n, max_n, window)


@given(cases())
@settings(**settings_)
def test_a_proposal_follows_an_earlier_occurrence_of_the_suffix(case):
    tokens, k, min_n, max_n, window = case
    got = propose(tokens, k, min_n, max_n, window)
    assert len(got) <= k
    if not got:
        return
    h = tokens[-window:]
    follows = [n for n in range(min_n, max_n + 1) for s in _occurrences(h, n) if _after(h, s + n, len(got)) == got]
    assert follows, "the proposal is not what follows any occurrence of a suffix"


@given(cases())
@settings(**settings_)
def test_the_longest_then_the_most_recent_occurrence_wins(case):
    tokens, k, min_n, max_n, window = case
    got = propose(tokens, k, min_n, max_n, window)
    h = tokens[-window:]
    lengths = [n for n in range(min_n, max_n + 1) if _occurrences(h, n)]
    if k == 0 or not lengths:
        assert got == ()  # empty when nothing matches (or nothing is wanted)
        return
    n = max(lengths)
    latest = max(_occurrences(h, n))
    assert got == _after(h, latest + n, k)
    assert len(got) == k  # what followed, and past the end the same period again


@given(cases(), st.lists(st.integers(0, 3), min_size=1, max_size=20))
@settings(**settings_)
def test_never_proposes_from_beyond_the_window(case, earlier):
    """Tokens before the window change nothing, and every proposed token sits inside the window."""
    tokens, k, min_n, max_n, window = case
    got = propose(tokens, k, min_n, max_n, window)
    if len(tokens) >= window:
        assert propose(earlier + tokens, k, min_n, max_n, window) == got
    assert got == propose(tokens[-window:], k, min_n, max_n, len(tokens) + 1)


def test_examples():
    assert propose([1, 2, 3, 4, 1, 2, 3, 9, 9, 1, 2, 3], 3, 1, 3) == (9, 9, 1)  # latest "1 2 3"
    assert propose([7, 1, 2, 8, 5, 2, 6, 1, 2], 2, 1, 2) == (8, 5)  # "1 2" beats the later "2"
    assert propose([7, 1, 2, 8, 5, 2, 6, 1, 2], 2, 1, 1) == (6, 1)  # max_n 1: the latest "2"
    assert propose([1, 2, 3, 4, 1, 2, 3, 9, 9, 1, 2, 3], 3, 1, 3, window=5) == ()
    assert propose([5, 5, 5, 5], 4, 1, 3) == (5, 5, 5, 5)  # the latest occurrence overlaps the suffix: a loop
    assert propose([3, 1, 2, 1, 2], 5, 1, 3) == (1, 2, 1, 2, 1)  # "2 1 2" two back: period 2, continued
    assert propose([1, 2, 3, 9, 1, 2, 3], 6, 3, 3) == (9, 1, 2, 3, 9, 1)  # period 4
    assert propose([], 3, 1, 3) == () and propose([4], 3, 1, 1) == ()
    with pytest.raises(ValueError):
        propose([1, 2], 3, 0, 2)
    with pytest.raises(ValueError):
        propose([1, 2], 3, 3, 2)


@given(sequences, st.integers(0, 7), st.integers(1, 4), st.integers(0, 3), st.integers(1, 70),
       st.lists(st.integers(1, 9), max_size=12))
@settings(**settings_)
def test_the_suffix_index_proposes_what_the_rule_does_at_every_prefix(tokens, k, min_n, extra, window, steps):
    """``SuffixIndex`` fed a growing stream (a token at a time, or several: accepted drafts) proposes
    exactly ``propose``'s answer at every length; a stream that does not extend the last one (a new
    request in the slot) starts it over."""
    max_n = min_n + extra
    index = SuffixIndex(min_n, max_n, window)
    at, cuts = 0, []
    for s in steps:
        at = min(len(tokens), at + s)
        cuts.append(at)
    for m in cuts + list(range(at, len(tokens) + 1)):
        split = m // 2  # a prompt and an output
        got = index.propose(tokens[:split], tokens[split:m], k=k)
        assert got == oracle(tokens[:m], k, min_n, max_n, window), m
    other = [t + 1 for t in tokens]
    assert index.propose(other, k=k) == oracle(other, k, min_n, max_n, window)


def test_the_suffix_index_stays_bounded_by_its_window():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=3000).tolist()
    index = SuffixIndex(1, 3, window=64)
    for m in range(1, len(tokens) + 1, 7):
        assert index.propose(tokens[:m], k=5) == oracle(tokens[:m], 5, 1, 3, 64)
    assert len(index._last) <= 4 * 64 + 3 * 8
