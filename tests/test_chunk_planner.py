"""Prefill chunk planner: no chunk boundary inside an image block, progress, no stubs, budget.

The invariants are checked on every chunk of many walks (spec ds4-vision §4.3, §10 "Scheduler"):
a sampled exhaustive grid of layouts × budgets × minimum sizes, plus hypothesis layouts.
The budget invariant uses the planner's documented effective budget ``max(budget, min_chunk)``.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4serve.multimodal.chunking import max_chunk_len, next_chunk, plan_chunks, validate_blocks
from ds4serve.multimodal.layout import block_length

Block = tuple[int, int]


def _around(t: int, blocks: list[Block]) -> Block | None:
    return next(((b0, b1) for b0, b1 in blocks if b0 < t < b1), None)


def _check_chunk(pos: int, n: int, end: int, budget: int, blocks: list[Block], min_chunk: int,
                 sizes: list[int]) -> None:
    """All per-chunk invariants; the message names everything needed to replay the failure."""
    ctx = (f"pos={pos} n={n} budget={budget} min_chunk={min_chunk} end={end} blocks={blocks} "
           f"chunks so far={sizes}")
    stop = pos + n
    eff = max(budget, min_chunk)
    assert n >= 1, f"no progress: {ctx}"
    widest = max((b1 - b0 for b0, b1 in blocks), default=0)
    assert n <= max_chunk_len(budget, min_chunk, widest), f"chunk longer than staging is sized for: {ctx}"
    assert stop <= end, f"chunk runs past the prompt end: {ctx}"
    cut = _around(stop, blocks)
    assert cut is None, f"chunk ends strictly inside block {cut}: {ctx}"
    if stop < end:
        assert n >= min_chunk, f"stub chunk shorter than min_chunk: {ctx}"
        assert end - stop >= min_chunk, f"leaves a stub tail of {end - stop}: {ctx}"
    if n > eff:  # only to finish a block the chunk entered, or to swallow a stub tail
        entered = _around(pos + eff, blocks)
        natural = entered[1] if entered else pos + eff
        finishes_block = entered is not None and entered[0] >= pos and stop == entered[1]
        swallows_tail = stop == end and 0 < end - natural < min_chunk
        assert finishes_block or swallows_tail, f"over budget without a reason: {ctx}"
    if n < min(eff, end - pos):  # only to leave a block for the next chunk
        entered = _around(pos + eff, blocks)
        assert entered is not None and stop == entered[0], f"needlessly short chunk: {ctx}"


def _walk(start: int, end: int, budget: int, blocks: list[Block], min_chunk: int) -> list[int]:
    sizes: list[int] = []
    pos = start
    while pos < end:
        assert len(sizes) <= end - start, f"walk does not terminate: chunks so far={sizes}"
        n = next_chunk(pos, end, budget, blocks, min_chunk)
        _check_chunk(pos, n, end, budget, blocks, min_chunk, sizes)
        sizes.append(n)
        pos += n
    assert pos == end
    assert plan_chunks(start, end, budget, blocks, min_chunk) == sizes
    return sizes


def _layout(rng: random.Random, max_end: int = 300) -> tuple[int, list[Block]]:
    """A prompt of up to ~``max_end`` tokens with 0-3 blocks of length 5..60 at random offsets."""
    lengths = [rng.randint(5, 60) for _ in range(rng.randint(0, 3))]
    gaps = [rng.choice([0, 0, 1, 2, 3, rng.randint(0, 40)]) for _ in range(len(lengths) + 1)]
    blocks, pos = [], gaps[0]
    for gap, length in zip(gaps[1:], lengths):
        blocks.append((pos, pos + length))
        pos += length + gap
    if not blocks:
        pos = rng.randint(1, max_end)
    return max(pos, 1), blocks


# Hand-picked edge layouts: blocks at 0 and at the end, adjacent blocks, 1-3 text tokens before
# a block, a block as the whole prompt, and real block lengths (lead pads included).
EDGE_LAYOUTS: list[tuple[int, list[Block]]] = [
    (1, []),
    (300, []),
    (17, [(0, 17)]),
    (60, [(0, 60)]),
    (61, [(1, 61)]),
    (63, [(3, 63)]),
    (70, [(3, 63)]),
    (100, [(0, 5), (5, 10), (10, 70)]),
    (120, [(2, 32), (32, 62), (62, 120)]),
    (300, [(10, 70), (71, 131), (240, 300)]),
    (300, [(100, 160), (160, 220), (294, 300)]),
    (64, [(1, 7), (9, 15), (58, 64)]),
    (400, [(10, 10 + block_length(14, 25, 10))]),
    (200, [(4, 4 + block_length(3, 2, 4)), (30, 30 + block_length(2, 2, 30))]),
]

BUDGETS = list(range(1, 65))
MIN_CHUNKS = list(range(1, 9))


@pytest.mark.parametrize("end,blocks", EDGE_LAYOUTS, ids=[str(i) for i in range(len(EDGE_LAYOUTS))])
def test_edge_layouts_all_budgets(end, blocks):
    validate_blocks(blocks, end)
    for budget in BUDGETS:
        for min_chunk in MIN_CHUNKS:
            _walk(0, end, budget, blocks, min_chunk)


def test_exhaustive_walk_over_sampled_layouts():
    """200 seeded random layouts, each walked for every budget 1..64 × min_chunk 1..8."""
    rng = random.Random(20240731)
    for _ in range(200):
        end, blocks = _layout(rng)
        starts = [0] + [b1 for _, b1 in blocks if b1 < end]
        for budget in BUDGETS:
            for min_chunk in MIN_CHUNKS:
                _walk(rng.choice(starts), end, budget, blocks, min_chunk)


@st.composite
def layouts(draw):
    segments = draw(st.lists(st.tuples(st.integers(0, 30), st.integers(5, 384)), max_size=4))
    blocks, pos = [], 0
    for gap, length in segments:
        blocks.append((pos + gap, pos + gap + length))
        pos += gap + length
    end = pos + draw(st.integers(0 if blocks else 1, 40))
    return end, blocks


@settings(max_examples=300, deadline=None)
@given(layout=layouts(), budget=st.integers(1, 1024), min_chunk=st.integers(1, 64),
       start_idx=st.integers(0, 4))
def test_random_layouts(layout, budget, min_chunk, start_idx):
    end, blocks = layout
    starts = [0] + [b1 for _, b1 in blocks if b1 < end]
    _walk(starts[start_idx % len(starts)], end, budget, blocks, min_chunk)


# --- the documented rule, case by case -----------------------------------------------------------


def test_max_chunk_len_is_reached():
    """The staging bound is tight: both overshoots occur (a bound too small would overflow staging)."""
    # tail rule: 1024 + 15 text tokens (the 1,039-token prompt after a 10-token head)
    assert next_chunk(0, 1039, 1024, [], 16) == 1039 == max_chunk_len(1024, 16, 0)
    # swallow: 15 text tokens, a 384-token block, then a 15-token tail, with a budget of 16
    assert next_chunk(0, 15 + 384 + 15, 16, [(15, 399)], 16) == 414 == max_chunk_len(16, 16, 384)
    with pytest.raises(ValueError):
        max_chunk_len(0, 16, 0)


def test_shrinks_to_block_start():
    assert next_chunk(0, 100, 10, [(5, 20)], 1) == 5


def test_swallows_short_text_and_block():
    assert next_chunk(0, 100, 10, [(3, 20)], 4) == 20  # 3 text tokens < min_chunk 4


def test_chunk_at_block_takes_whole_block():
    assert next_chunk(5, 100, 4, [(5, 20)], 1) == 15


def test_boundary_at_block_edges_is_fine():
    assert next_chunk(0, 100, 5, [(5, 20)], 1) == 5
    assert next_chunk(5, 100, 15, [(5, 20)], 1) == 15


def test_stub_tail_is_swallowed():
    assert next_chunk(0, 12, 10, [], 4) == 12
    assert next_chunk(0, 14, 10, [], 4) == 10


def test_min_chunk_outranks_small_budget():
    assert next_chunk(0, 100, 2, [], 5) == 5


def test_staged_prefill_example():
    """Short system text, one 366-token block, then a question (lucebox-style staging)."""
    blocks = [(10, 10 + block_length(14, 25, 10))]
    assert blocks == [(10, 377)]
    assert plan_chunks(0, 400, 256, blocks, 16) == [377, 23]
    assert plan_chunks(0, 400, 256, blocks, 8) == [10, 367, 23]  # text alone, then the block
    assert plan_chunks(0, 400, 8, blocks, 8) == [8, 369, 8, 15]  # 2 text + block; 7-token tail


def test_plan_chunks_empty_and_sum():
    assert plan_chunks(7, 7, 4, [], 1) == []
    assert sum(plan_chunks(0, 1000, 33, [(100, 480), (480, 700)], 8)) == 1000


@pytest.mark.parametrize("args,match", [
    ((5, 5, 4, [], 1), "pos"),
    ((6, 5, 4, [], 1), "pos"),
    ((-1, 5, 4, [], 1), "pos"),
    ((0, 10, 0, [], 1), "budget"),
    ((0, 10, 4, [], 0), "min_chunk"),
    ((0, 10, 4, [(5, 8), (2, 4)], 1), "unsorted"),
    ((0, 10, 4, [(2, 6), (5, 8)], 1), "overlaps"),
    ((0, 10, 4, [(4, 4)], 1), "empty"),
    ((0, 10, 4, [(5, 12)], 1), "outside"),
    ((0, 10, 4, [(-1, 3)], 1), "outside"),
    ((3, 10, 4, [(2, 6)], 1), "inside"),
])
def test_invalid_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        next_chunk(*args)
    if args[0] < args[1]:
        with pytest.raises(ValueError, match=match):
            plan_chunks(*args)
