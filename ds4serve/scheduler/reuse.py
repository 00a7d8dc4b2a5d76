"""Prefix reuse, the scheduler's side: where snapshots are taken, and hits.

A snapshot at ``H`` needs the state of exactly ``[0, H)``. The *snapshot points* are:

* every ``interval`` input tokens (256 by default), so any shared prefix of at least that many tokens
  hits, however the prompts go on;
* the end of the prompt and the request's ``cache_points`` (the server adds the end of the user turn
  in DS4 thinking mode, where the next turn drops the reasoning);
* the end of the output, when the request completes (the next turn of a conversation starts there).

A point that is a chunk's end is snapshotted after the step (``store``: a copy of the slot). A point
strictly inside a chunk is *captured by the forward itself*: the chunk's member carries ``(H, arena
entry)`` and every layer copies its rings as they stood at ``H`` before writing them
(``model.batch.capture_ring``), so prefill is never cut for the cache. The pages below ``H`` are final
once the chunk has run; the entry becomes a snapshot when its pass completes (``commit``).

A point inside an image block moves to the block's start (a snapshot never falls inside a block). A
hit at ``H`` skips the encoder for the images below ``H``; the request then pins the snapshot, so a
drop-and-recompute can always come back through it instead of needing rows that were never made.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..cache.manager import CacheManager
from ..cache.prefix import Snapshot
from ..cache.prefix_keys import PrefixKeys
from .request import Request

log = logging.getLogger(__name__)


@dataclass
class PrefixState:
    keys: PrefixKeys
    pinned: Snapshot | None = None
    pending: list[tuple[int, int]] = field(default_factory=list)  # captures in flight: (position, entry)


class PrefixReuse:
    def __init__(self, cache: CacheManager, interval: int):
        self.cache = cache
        self.interval = interval

    def _state(self, req: Request) -> PrefixState:
        if req.prefix is None:
            images = [(im.span.start, im.content_hash) for im in req.images] if req.images else []
            req.prefix = PrefixState(PrefixKeys(req.cache_salt, req.input_ids, images))
        return req.prefix

    # ---- hits ----------------------------------------------------------------------------------
    def attach(self, req: Request, first: bool) -> bool:
        """Start ``req`` (holding a fresh slot, nothing computed) from its longest cached prefix;
        True on a hit.

        ``first``: its first admission (counted in the hit statistics and in ``cached_tokens``; a
        recompute after a drop may hit too, but the user's prompt was looked up once).

        A request still owed its prompt logprobs never hits: a hit skips computing the very positions it
        asks to have scored (``prompt_scores``). It is not counted as a lookup either; it still stores
        snapshots for others."""
        prefix = self.cache.prefix
        if prefix is None or req.wants_prompt_logprobs:
            return False
        st = self._state(req)
        snap = prefix.lookup(st.keys, req.total_len - 1)  # at least one token left to compute
        if snap is not None and not prefix.attach(snap, req.slot):
            snap = None
        if first:
            prefix.stats.queried_tokens += len(req.prompt_ids)
            prefix.stats.hits += snap is not None
            prefix.stats.misses += snap is None
        if snap is None:
            return False
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
        return True

    def release(self, req: Request) -> None:
        """Drop ``req``'s pin (it ended, or a longer snapshot covers its skipped images now)."""
        st = req.prefix
        if st is not None and st.pinned is not None:
            self.cache.prefix.unpin(st.pinned)
            st.pinned = None

    # ---- snapshot points ----------------------------------------------------------------------
    def _points(self, req: Request, lo: int, hi: int) -> list[int]:
        """Snapshot points strictly inside ``(lo, hi)``, moved out of image blocks, ascending."""
        step = self.interval
        raw = set(range((lo // step + 1) * step, hi, step)) | {p for p in req.cache_points if lo < p < hi}
        out = set()
        for p in raw:
            inside = next((sp for sp in req.spans if sp.start < p < sp.end), None)
            p = p if inside is None else inside.start
            if lo < p and p >= self.cache.prefix.min_tokens:
                out.add(p)
        return sorted(out)

    def captures(self, req: Request, lo: int, hi: int) -> tuple[tuple[int, int], ...]:
        """Arena entries for the snapshot points inside the chunk ``[lo, hi)`` (as many as fit)."""
        prefix = self.cache.prefix
        if prefix is None or req.suspect is not None:
            return ()
        st = self._state(req)
        self.drop_pending(req)  # a chunk planned before and never run (refused) asked for these
        for h in self._points(req, lo, hi):
            entry = prefix.take_entry()
            if entry is None:
                break
            st.pending.append((h, entry))
        return tuple(st.pending)

    def drop_pending(self, req: Request) -> None:
        """Give back arena entries of captures that will never complete (failed or refused steps)."""
        st = req.prefix
        if st is not None and st.pending:
            for _, entry in st.pending:
                self.cache.prefix.give_back(entry)
            st.pending = []

    def is_point(self, req: Request) -> bool:
        pos = req.computed
        return pos % self.interval == 0 or pos in req.cache_points or pos == len(req.prompt_ids)

    def _commit_pending(self, req: Request) -> None:
        st = req.prefix
        if st is None or not st.pending:
            return
        for h, entry in st.pending:
            self.cache.prefix.commit(st.keys, h, req.slot, entry)
        st.pending = []

    def after_prefill(self, req: Request) -> None:
        """``req``'s chunk is in the cache: its captures become snapshots, and its end too if it is a
        snapshot point (the state is then exactly ``[0, computed)``)."""
        if self.cache.prefix is None or req.slot is None:
            return
        if req.suspect is not None:
            self.drop_pending(req)
            return
        self._commit_pending(req)
        if self.is_point(req):
            self.cache.prefix.store(self._state(req).keys, req.computed, req.slot)

    def at_finish(self, req: Request, completed: bool) -> None:
        """Snapshot the end of a completed request's output (the next turn starts there); unpin."""
        prefix = self.cache.prefix
        if prefix is None:
            return
        if completed and req.slot is not None and req.suspect is None and req.pass_id is None:
            self._commit_pending(req)
            prefix.store(self._state(req).keys, req.computed, req.slot)
        self.drop_pending(req)
        self.release(req)
