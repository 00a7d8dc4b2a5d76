"""Pure parts of prefix caching: refcounted pages, content keys, snapshot cut points (property tests)."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from ds4serve.cache.pages import PageAllocator
from ds4serve.cache.prefix_keys import BLOCK, PrefixKeys
from ds4serve.multimodal.records import ImageSpan
from ds4serve.scheduler.reuse import PrefixReuse

# ---- pages ---------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["reserve", "adopt", "release", "hold", "unhold"]),
                          st.integers(0, 3), st.integers(0, 6)), max_size=60))
def test_refcounts_match_an_independent_tally(ops):
    """Random reserve/share/release/hold sequences against a plain model of who references what."""
    pages = PageAllocator(12)
    holds: list[list[int]] = []  # the cache's holds, one list per "snapshot"
    for op, owner, n in ops:
        table = pages.table(owner)
        if op == "reserve":
            pages.reserve(owner, len(table) + n)
        elif op == "adopt" and not table:
            donors = [t for o in pages.owners() if (t := pages.table(o))]
            if donors:
                pages.adopt(owner, donors[0][: n % (len(donors[0]) + 1)])
        elif op == "release":
            pages.release(owner)
        elif op == "hold" and table:
            held = table[: n % (len(table) + 1)]
            pages.hold(held)
            holds.append(held)
        elif op == "unhold" and holds:
            pages.unhold(holds.pop(n % len(holds)))
        tally: dict[int, int] = {}
        for h in holds:
            for p in h:
                tally[p] = tally.get(p, 0) + 1
        assert pages.problems(tally) == []
        referenced = {p for o in pages.owners() for p in pages.table(o)} | set(tally)
        assert pages.used_pages == len(referenced)
        cache_only = set(tally) - {p for o in pages.owners() for p in pages.table(o)}
        assert pages.cache_only_pages == len(cache_only)


def test_a_shared_page_is_freed_by_its_last_reference():
    pages = PageAllocator(4)
    assert pages.reserve(0, 2)
    shared = pages.table(0)
    pages.hold(shared)
    pages.adopt(1, shared)
    assert pages.release(0) == 0 and pages.release(1) == 0  # the cache still holds them
    assert pages.cache_only_pages == 2 and pages.free_pages == 2
    assert pages.unhold(shared) == 2 and pages.free_pages == 4


# ---- keys ----------------------------------------------------------------------------------------


def _keys(ids, salt="", images=()):
    return PrefixKeys(salt, lambda a, b: ids[a:b], images)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=3 * BLOCK), st.data())
def test_a_key_names_exactly_its_prefix(ids, data):
    """Equal prefixes give equal keys, whatever follows; changing one token below H changes key(H)."""
    h = data.draw(st.integers(1, len(ids)))
    tail = data.draw(st.lists(st.integers(0, 50), max_size=BLOCK))
    assert _keys(ids).key(h) == _keys(ids[:h] + tail).key(h)
    i = data.draw(st.integers(0, h - 1))
    changed = ids[:i] + [ids[i] + 1] + ids[i + 1:]
    assert _keys(changed).key(h) != _keys(ids).key(h)
    assert _keys(ids, salt="a").key(h) != _keys(ids, salt="b").key(h)


def test_image_content_is_part_of_the_key():
    """Two images of one shape have the same sentinel ids: only their content hash tells them apart."""
    ids = list(range(200))
    a = _keys(ids, images=[(10, "aa" * 32)])
    b = _keys(ids, images=[(10, "bb" * 32)])
    assert a.key(10) == b.key(10)  # the image starts at 10: [0, 10) does not contain it
    assert a.key(150) != b.key(150) and a.boundary(2) != b.boundary(2)


# ---- snapshot points ------------------------------------------------------------------------------


def _req(total, spans, points=()):
    return SimpleNamespace(total_len=total, cache_points=tuple(points),
                           spans=tuple(ImageSpan(a, b, a, b - 1) for a, b in spans), prompt_ids=[0] * total)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_snapshot_points_never_fall_inside_an_image_block(data):
    """Points inside a chunk: every interval multiple and cache point, moved to the start of the block
    it falls in, kept if strictly inside the chunk and past the cache's minimum (an independent oracle)."""
    interval = data.draw(st.sampled_from([16, 64, 256]))
    total = data.draw(st.integers(2, 1200))
    spans, pos = [], 0
    while True:
        a = pos + data.draw(st.integers(0, 300))
        b = a + data.draw(st.integers(2, 400))
        if b > total:
            break
        spans.append((a, b))
        pos = b
    edges = sorted({0, total, *[a for a, _ in spans], *[b for _, b in spans]})
    lo = data.draw(st.sampled_from(edges[:-1]))
    hi = data.draw(st.sampled_from([e for e in edges if e > lo]))
    points = data.draw(st.lists(st.integers(1, total), max_size=3))
    reuse = PrefixReuse(SimpleNamespace(prefix=SimpleNamespace(min_tokens=64)), interval)
    got = reuse._points(_req(total, spans, points), lo, hi)
    want = set()
    for p in [*range(interval, total, interval), *points]:
        if not lo < p < hi:
            continue
        inside = [a for a, b in spans if a < p < b]
        q = inside[0] if inside else p
        if q > lo and q >= 64:
            want.add(q)
    assert got == sorted(want)
    assert not any(a < p < b for p in got for a, b in spans)


# ---- the cache itself, without a model ----------------------------------------------------------


def _manager(n_pages: int):
    import torch

    from ds4serve.cache.layout import StateLayout
    from ds4serve.cache.manager import CacheManager
    from ds4serve.config import ModelConfig
    from checkpoints import APPENDIX_A

    layout = StateLayout.build(ModelConfig.from_dict(APPENDIX_A), torch.float32)
    return CacheManager(layout, n_slots=3, n_pages=n_pages, device="cpu", host_budget_bytes=0, staging_rows=16,
                        prefix_budget_bytes=4 * 2**20)


def test_attaching_never_evicts_the_snapshot_being_attached():
    """A hit whose partial page needs the last free page, held only by that very snapshot: making room
    used to evict the snapshot itself and then share its freed pages (a crash). Now it is a miss."""
    cache = _manager(n_pages=3)
    ids = list(range(2, 200))
    keys = PrefixKeys("", lambda a, b: ids[a:b])
    a = cache.alloc_slot()
    assert cache.reserve({a: 150})
    assert cache.prefix.store(keys, 150, a)  # pages 0, 1 shared, the partial third one copied
    cache.drop(a)
    b = cache.alloc_slot()
    assert cache.reserve({b: 64})  # the one free page: nothing is free now but the cache's own pages
    c = cache.alloc_slot()
    snap = cache.prefix.lookup(keys, 190)
    assert snap is not None and snap.position == 150 and snap.tail
    assert not cache.prefix.attach(snap, c)
    assert cache.prefix.snapshots == 1 and cache.state.pages.table(c) == []
    cache.drop(b)
    assert cache.prefix.attach(snap, c) and cache.state.pages.table(c)[:2] == list(snap.pages)
    cache.drop(c)
    assert cache.leaks() == ""
