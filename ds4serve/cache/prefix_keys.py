"""Content keys of sequence prefixes: hash chains over token ids and image content (pure functions).

A prefix ``[0, H)`` of a sequence is identified by what it contains, never by where it came from:
the token ids, and for every image block that starts inside it the image's content hash (sha256 of
the decoded pixels plus the resize geometry, ``ImageInput.content_hash``; block token ids are only
sentinels, equal for every image of one shape). The chain starts from the tenant's salt, so two
tenants never share a key.

The chain runs over blocks of ``BLOCK`` tokens: ``boundary(j)`` identifies ``[0, j * BLOCK)``, and
``key(H)`` extends the boundary below ``H`` by the tokens (and image starts) of ``[j * BLOCK, H)``.
A lookup walks the boundaries of a new prompt from the longest down and only hashes a key for the
snapshot positions stored under a matching boundary, so it costs one pass over the prompt.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

BLOCK = 64

TokenSource = Callable[[int, int], Sequence[int]]  # (start, stop) -> token ids of [start, stop)


def root(salt: str) -> bytes:
    return hashlib.sha256(b"ds4serve-prefix-v1\x00" + salt.encode()).digest()


def _fold(tag: bytes, prev: bytes, ids: Sequence[int], images: Sequence[tuple[int, str]]) -> bytes:
    h = hashlib.sha256(tag + prev)
    h.update(array("q", ids).tobytes())
    for offset, content in images:
        h.update(b"\x00image %d %s" % (offset, content.encode()))
    return h.digest()


class PrefixKeys:
    """The keys of one sequence, computed on demand and remembered (the input only ever grows).

    ``images``: ``(start, content_hash)`` of every image block, by absolute start position."""

    def __init__(self, salt: str, tokens: TokenSource, images: Sequence[tuple[int, str]] = ()):
        self._tokens = tokens
        self._images = sorted(images)
        self._bounds = [root(salt)]

    def __reduce__(self):
        """By value (tensor-parallel ranks replay prefix-cache calls): the keys computed so far and the
        tokens as they stand, not the token source (a request's method)."""
        return _thawed, (list(self._bounds), list(self._tokens(0, 1 << 62)), self._images)

    def _images_in(self, lo: int, hi: int) -> list[tuple[int, str]]:
        return [(s - lo, h) for s, h in self._images if lo <= s < hi]

    def boundary(self, j: int) -> bytes:
        """Key of ``[0, j * BLOCK)``; the sequence must hold that many tokens."""
        while len(self._bounds) <= j:
            k = len(self._bounds) - 1
            lo, hi = k * BLOCK, (k + 1) * BLOCK
            ids = self._tokens(lo, hi)
            if len(ids) != BLOCK:
                raise ValueError(f"block {k} needs tokens [{lo}, {hi}); the sequence has only {lo + len(ids)}")
            self._bounds.append(_fold(b"B", self._bounds[k], ids, self._images_in(lo, hi)))
        return self._bounds[j]

    def key(self, position: int) -> bytes:
        """Key of the prefix ``[0, position)``."""
        j = position // BLOCK
        lo = j * BLOCK
        ids = self._tokens(lo, position)
        if len(ids) != position - lo:
            raise ValueError(f"prefix [0, {position}) is longer than the sequence")
        return _fold(b"K", self.boundary(j), ids, self._images_in(lo, position))

    def anchor(self, position: int) -> bytes:
        """The boundary a snapshot at ``position`` is filed under."""
        return self.boundary(position // BLOCK)


class _Tokens:
    """A fixed token list as a ``TokenSource``."""

    def __init__(self, ids: list[int]):
        self.ids = ids

    def __call__(self, lo: int, hi: int) -> list[int]:
        return self.ids[lo:hi]


def _thawed(bounds: list[bytes], ids: list[int], images: list[tuple[int, str]]) -> PrefixKeys:
    keys = PrefixKeys.__new__(PrefixKeys)
    keys._tokens, keys._images, keys._bounds = _Tokens(ids), images, bounds
    return keys
