"""Prefill chunk planner that never splits an image block (spec ds4-vision §4.3).

Tokens of an image block attend bidirectionally inside the block, so the whole block
``[b0, b1)`` (lead pads included) must be prefilled in one chunk: a chunk boundary strictly inside
a block would leave earlier block tokens without the keys of later ones (silently wrong output).
This module decides where the next chunk of a prompt ends. It is pure and O(#blocks) per call.

The rule (sglang/tokenspeed "shrink, else swallow", plus lucebox's "no stubs"):

Let ``B = max(budget, min_chunk)`` (the minimum chunk outranks a budget below it: a chunk shorter
than ``min_chunk`` is exactly the stub this planner exists to avoid), and ``t = min(pos + B, end)``.

1. **Block rule.** If ``t`` falls strictly inside a block ``[b0, b1)``, i.e. ``b0 < t < b1``:

   - *shrink* to ``t = b0`` when that still gives a chunk of at least ``min_chunk`` tokens
     (``b0 - pos >= min_chunk``), so the block starts the next chunk;
   - otherwise *swallow*: ``t = b1``. The chunk either starts at the block or has only a short
     text run before it, and takes that text plus the whole block. This is where ``n`` may
     exceed the budget, by at most one block (<= 384 tokens) plus ``min_chunk - 1`` text tokens.

2. **Tail rule.** If the remaining tail ``end - t`` is positive but shorter than ``min_chunk``,
   extend to ``t = end``: the short tail is swallowed by this chunk (an overshoot of at most
   ``min_chunk - 1`` tokens) rather than left as a stub. The chunk is never shrunk to make room
   for the tail: extending is always legal (``end`` is never inside a block) and finishes sooner.

The chunk is ``n = t - pos``. Guarantees, for every valid input:

- progress and bounds: ``1 <= n`` and ``pos + n <= end``, so walking the prompt cannot hang;
- ``pos + n`` is never strictly inside a block;
- ``n >= min_chunk`` unless ``pos + n == end``, and never ``0 < end - (pos + n) < min_chunk``;
- ``n <= B`` unless rule 1 swallowed a block (then ``pos + n`` is that block's end, possibly
  followed by rule 2) or rule 2 extended the chunk to ``end``;
- ``n < min(B, end - pos)`` only when rule 1 shrank the chunk to a block start.

The caller still has to reject blocks larger than the largest chunk its engine can run (spec §7.1:
"reject any request with a block wider than the engine's maximum single prefill pass").
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["validate_blocks", "next_chunk", "plan_chunks", "max_chunk_len"]

Block = tuple[int, int]


def validate_blocks(blocks: Sequence[Block], end: int) -> None:
    """Blocks must be non-empty, sorted, non-overlapping and inside ``[0, end]`` (spec §7.10).

    A malformed block list would let the planner cut through an image silently, so it is an error.
    """
    prev_end = 0
    for i, (b0, b1) in enumerate(blocks):
        if not 0 <= b0 < b1 <= end:
            raise ValueError(f"block {i} [{b0}, {b1}) is empty or outside the prompt [0, {end})")
        if b0 < prev_end:
            raise ValueError(f"block {i} [{b0}, {b1}) is unsorted or overlaps the previous block "
                             f"(which ends at {prev_end})")
        prev_end = b1


def _check_args(pos: int, end: int, budget: int, min_chunk: int) -> None:
    """Reject arguments that would make the walk meaningless (no room, no budget, no minimum)."""
    if not 0 <= pos < end:
        raise ValueError(f"chunk start pos={pos} must satisfy 0 <= pos < end={end}")
    if budget < 1:
        raise ValueError(f"chunk budget must be >= 1, got {budget}")
    if min_chunk < 1:
        raise ValueError(f"min_chunk must be >= 1, got {min_chunk}")


def _block_around(t: int, blocks: Sequence[Block]) -> Block | None:
    """The block that strictly contains position ``t`` (``b0 < t < b1``), if any."""
    for b0, b1 in blocks:
        if b0 >= t:
            return None
        if t < b1:
            return b0, b1
    return None


def _next_chunk(pos: int, end: int, budget: int, blocks: Sequence[Block], min_chunk: int) -> int:
    """The rule itself, on already validated input (see the module docstring)."""
    t = min(pos + max(budget, min_chunk), end)
    around = _block_around(t, blocks)
    if around is not None:
        b0, b1 = around
        t = b0 if b0 - pos >= min_chunk else b1
    if 0 < end - t < min_chunk:
        t = end
    return t - pos


def _check_pos_outside_blocks(pos: int, blocks: Sequence[Block]) -> None:
    """A chunk must start on a block boundary; starting inside one means the caller already cut it."""
    around = _block_around(pos, blocks)
    if around is not None:
        raise ValueError(f"chunk start pos={pos} is strictly inside image block "
                         f"[{around[0]}, {around[1]}); a previous chunk split the block")


def next_chunk(pos: int, end: int, budget: int, blocks: Sequence[Block], min_chunk: int) -> int:
    """Length of the next prefill chunk starting at ``pos`` of a prompt ending at ``end``.

    ``blocks`` are the prompt's image blocks as sorted, non-overlapping, half-open ``(b0, b1)``
    absolute ranges, lead pads included. See the module docstring for the exact rule.
    """
    _check_args(pos, end, budget, min_chunk)
    validate_blocks(blocks, end)
    _check_pos_outside_blocks(pos, blocks)
    return _next_chunk(pos, end, budget, blocks, min_chunk)


def plan_chunks(start: int, end: int, budget: int, blocks: Sequence[Block],
                min_chunk: int) -> list[int]:
    """Chunk lengths that prefill ``[start, end)``, walking :func:`next_chunk` to the end.

    Returns an empty list when ``start == end`` (nothing left to prefill).
    """
    if start == end:
        return []
    _check_args(start, end, budget, min_chunk)
    validate_blocks(blocks, end)
    _check_pos_outside_blocks(start, blocks)
    sizes: list[int] = []
    pos = start
    while pos < end:
        n = _next_chunk(pos, end, budget, blocks, min_chunk)
        sizes.append(n)
        pos += n
    return sizes


def max_chunk_len(budget: int, min_chunk: int, max_block: int) -> int:
    """The longest chunk :func:`next_chunk` can return for blocks of at most ``max_block`` tokens.

    Staging buffers are sized by this, so every chunk the rules can legally make fits them. With
    ``B = max(budget, min_chunk)`` the two overshoots are: the tail rule alone (``B + min_chunk - 1``),
    and a swallowed block (fewer than ``min_chunk`` text tokens, the block, then a swallowed tail of
    fewer than ``min_chunk``: ``2 * (min_chunk - 1) + max_block``). ``max_block == 0``: text only.
    """
    if budget < 1 or min_chunk < 1 or max_block < 0:
        raise ValueError(f"bad chunk bounds: budget={budget}, min_chunk={min_chunk}, max_block={max_block}")
    b = max(budget, min_chunk)
    tail = b + min_chunk - 1
    return max(tail, 2 * (min_chunk - 1) + max_block) if max_block else tail
