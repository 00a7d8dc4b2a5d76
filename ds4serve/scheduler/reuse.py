"""Prefix reuse, the scheduler's side: where prefills are cut, when snapshots are taken, hits.

The cache (``cache/prefix.py``) keeps snapshots only at positions where a sequence's state covers
exactly ``[0, H)``, i.e. at chunk boundaries. So the planner ends chunks at the *snapshot points*:

* every ``interval`` input tokens (256 by default), so any shared prefix of at least that many tokens
  hits, however the prompts go on;
* the end of the prompt (a chunk boundary anyway) and the request's ``cache_points`` (the server adds
  the end of the user turn in DS4 thinking mode, where the next turn drops the reasoning);
* the end of the output, when the request completes (the next turn of a conversation starts there).

A point inside an image block moves to the block's start (a cut never falls inside a block). A hit
at ``H`` skips the encoder for the images below ``H``; the request then pins the snapshot, so a
drop-and-recompute can always come back through it instead of needing rows that were never made.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..cache.manager import CacheManager
from ..cache.prefix import Snapshot
from ..cache.prefix_keys import PrefixKeys
from .request import Request

log = logging.getLogger(__name__)


@dataclass
class PrefixState:
    keys: PrefixKeys
    pinned: Snapshot | None = None


class PrefixReuse:
    def __init__(self, cache: CacheManager, interval: int):
        self.cache = cache
        self.interval = interval

    @property
    def enabled(self) -> bool:
        return self.cache.prefix is not None

    def _state(self, req: Request) -> PrefixState:
        if req.prefix is None:
            images = [(im.span.start, im.content_hash) for im in req.images] if req.images else []
            req.prefix = PrefixState(PrefixKeys(req.cache_salt, req.input_ids, images))
        return req.prefix

    # ---- hits ----------------------------------------------------------------------------------
    def attach(self, req: Request, first: bool) -> None:
        """Start ``req`` (holding a fresh slot, nothing computed) from its longest cached prefix.

        ``first``: its first admission (counted in the hit statistics and in ``cached_tokens``; a
        recompute after a drop may hit too, but the user's prompt was looked up once)."""
        prefix = self.cache.prefix
        if prefix is None:
            return
        st = self._state(req)
        snap = prefix.lookup(st.keys, req.total_len - 1)  # at least one token left to compute
        if snap is not None and not prefix.attach(snap, req.slot):
            snap = None
        if first:
            prefix.stats.queried_tokens += len(req.prompt_ids)
            prefix.stats.hits += snap is not None
            prefix.stats.misses += snap is None
        if snap is None:
            return
        req.computed = snap.position
        if first:
            req.cached_tokens = min(snap.position, len(req.prompt_ids))
            prefix.stats.hit_tokens += req.cached_tokens
            req.first_image = sum(1 for sp in req.spans if sp.end <= snap.position)
        if req.first_image and (st.pinned is None or st.pinned.position < snap.position):
            self.release(req)
            prefix.pin(snap)
            st.pinned = snap
        log.debug("prefix hit for %s: %d of %d tokens", req.request_id, snap.position, req.total_len)

    def release(self, req: Request) -> None:
        """Drop ``req``'s pin (it ended, or a longer snapshot covers its skipped images now)."""
        st = req.prefix
        if st is not None and st.pinned is not None:
            self.cache.prefix.unpin(st.pinned)
            st.pinned = None

    # ---- cuts and snapshots --------------------------------------------------------------------
    def _points_after(self, req: Request, pos: int) -> int | None:
        step = self.interval
        extra = [p for p in req.cache_points if p > pos]
        return min([(pos // step + 1) * step, *extra])

    def cut(self, req: Request) -> int | None:
        """The next snapshot point after ``req.computed`` where its next chunk should end, or None."""
        if self.cache.prefix is None:
            return None
        pos = req.computed
        while True:
            point = self._points_after(req, pos)
            if point >= req.total_len:
                return None
            inside = next((sp for sp in req.spans if sp.start < point < sp.end), None)
            if inside is None:
                return point
            if inside.start > req.computed:
                return inside.start
            pos = inside.end - 1  # the block starts at or before us: the next point after it

    def is_point(self, req: Request) -> bool:
        pos = req.computed
        return pos % self.interval == 0 or pos in req.cache_points or pos == len(req.prompt_ids)

    def after_prefill(self, req: Request) -> None:
        """Snapshot ``req`` if its prefill just reached a snapshot point (state is exactly ``[0, computed)``)."""
        if self.cache.prefix is not None and req.slot is not None and req.suspect is None and self.is_point(req):
            self.cache.prefix.store(self._state(req).keys, req.computed, req.slot)

    def at_finish(self, req: Request, completed: bool) -> None:
        """Snapshot the end of a completed request's output (the next turn starts there); unpin."""
        prefix = self.cache.prefix
        if prefix is None:
            return
        if completed and req.slot is not None and req.suspect is None and req.pass_id is None:
            prefix.store(self._state(req).keys, req.computed, req.slot)
        self.release(req)
