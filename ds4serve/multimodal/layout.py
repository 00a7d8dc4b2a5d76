"""Image block layout in the LM token stream (spec ds4-vision §2.4, §3.1, §3.2).

One ``<｜deepseek_image｜>`` placeholder expands to one *image block*::

    [IMAGE_PAD × lead] IMAGE_START  N-layout body  [IMAGE_PAD × pad_last]  IMAGE_END

The block is position dependent: ``lead = 3 - start_pos % 4`` puts IMAGE_START on a position
≡ 3 (mod 4) so that the body starts a ratio-4 compression group, and ``pad_last`` makes IMAGE_END
land on a position ≡ 0 (mod 4). The same image therefore has a different length at a different
prompt offset, which is why everything here takes the absolute ``start_pos``.

The body uses the "N layout": aligner rows are taken two grid rows at a time and, inside a pair,
column by column ``(r0,c), (r1,c)``; each pair ends with the two NEWLINE slots of its rows. An odd
grid gets one extra row made only of IMAGE_PAD (its NEWLINE slot included). ``perm`` says, for each
IMAGE slot in stream order, which row-major aligner row fills it (``emb[slots] = aligner[perm]``).

Everything here is pure and integer-only, so the scheduler, the cache and the embedding merge can
all call it and agree on the layout without sharing state.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

__all__ = [
    "COMPRESS_ALIGN",
    "TokenType",
    "ImageBlock",
    "body_tokens",
    "lead_pads",
    "block_length",
    "image_block",
]

COMPRESS_ALIGN = 4  # the ratio-4 compressor group the padding aligns to (spec §3.2)


class TokenType(IntEnum):
    """The five image-block token types; the reference ids are ``vocab_size + type`` (spec §3.1)."""

    IMAGE_START = 0
    IMAGE_PAD = 1
    IMAGE = 2
    IMAGE_NEW_LINE = 3
    IMAGE_END = 4


_P, _S, _I, _N, _E = (
    TokenType.IMAGE_PAD,
    TokenType.IMAGE_START,
    TokenType.IMAGE,
    TokenType.IMAGE_NEW_LINE,
    TokenType.IMAGE_END,
)


def _check_grid(n_h: int, n_w: int) -> None:
    """Reject empty grids: a zero-sized grid would produce a block with no image rows at all."""
    if n_h < 1 or n_w < 1:
        raise ValueError(f"image grid must be at least 1x1, got n_h={n_h}, n_w={n_w}")


def _check_start(start_pos: int) -> None:
    """Reject negative positions: ``lead`` is defined from the absolute, non-negative position."""
    if start_pos < 0:
        raise ValueError(f"block start position must be >= 0, got {start_pos}")


def _pad_last(n_h: int, n_w: int) -> int:
    """Trailing pads that make (body + pad_last) a multiple of 4, so IMAGE_END lands on ≡ 0 (mod 4)."""
    return 2 if ((n_h + 1) // 2 * (n_w + 1)) % 2 else 0


def body_tokens(n_h: int, n_w: int) -> int:
    """Block tokens excluding lead pads: START, N-layout rows (parity row included), pad_last, END.

    This is the quantity the resize solver budgets against (spec §2.4); lead pads are excluded
    because they depend on the position, and the solver reserves the worst case (3) up front.
    """
    _check_grid(n_h, n_w)
    parity_row = (n_w + 1) if n_h % 2 else 0
    return n_h * (n_w + 1) + 2 + parity_row + _pad_last(n_h, n_w)


def lead_pads(start_pos: int) -> int:
    """Number of IMAGE_PAD tokens before IMAGE_START for a block starting at ``start_pos`` (0..3)."""
    _check_start(start_pos)
    return COMPRESS_ALIGN - 1 - start_pos % COMPRESS_ALIGN


def block_length(n_h: int, n_w: int, start_pos: int) -> int:
    """Whole block length (lead pads included) without materialising the token types.

    Admission and context-length checks need only this number, for every image of a request.
    """
    return lead_pads(start_pos) + body_tokens(n_h, n_w)


@dataclass(frozen=True)
class ImageBlock:
    """One expanded image block at an absolute prompt position.

    ``start`` is the position of the block's first token (the first lead pad, or IMAGE_START when
    there is no lead pad); ``types`` has one :class:`TokenType` per block token; ``perm`` maps each
    IMAGE slot, in stream order, to the row-major aligner row ``r * n_w + c`` that fills it.
    """

    start: int
    n_h: int
    n_w: int
    types: tuple[int, ...]
    perm: tuple[int, ...]

    @property
    def length(self) -> int:
        """Tokens in the block, lead pads included."""
        return len(self.types)

    @property
    def end(self) -> int:
        """First position after the block (half-open), the earliest legal chunk/cache boundary."""
        return self.start + self.length

    @property
    def lead(self) -> int:
        """Lead pads; they belong to the block but attend causally (outside the visible span)."""
        return lead_pads(self.start)

    @property
    def visible_start(self) -> int:
        """Absolute position of IMAGE_START, the first token of the bidirectional span."""
        return self.start + self.lead

    @property
    def visible_end(self) -> int:
        """Absolute position of IMAGE_END, the last token of the bidirectional span (inclusive)."""
        return self.end - 1

    @property
    def image_positions(self) -> tuple[int, ...]:
        """Absolute positions of the IMAGE slots in stream order (``aligner[perm]`` goes here)."""
        return tuple(self.start + i for i, t in enumerate(self.types) if t == _I)

    @property
    def n_image_rows(self) -> int:
        """Aligner rows the block consumes (= IMAGE slots)."""
        return self.n_h * self.n_w


def _pair_body(n_h: int, n_w: int, pair: int) -> tuple[list[TokenType], list[int]]:
    """Types and aligner rows for one row pair: column-major over the pair, then its two NEWLINEs.

    A row index ``>= n_h`` is the parity row of an odd grid; all of its slots are IMAGE_PAD.
    """
    rows = (2 * pair, 2 * pair + 1)
    types: list[TokenType] = []
    perm: list[int] = []
    for c in range(n_w):
        for r in rows:
            if r < n_h:
                types.append(_I)
                perm.append(r * n_w + c)
            else:
                types.append(_P)
    types.extend(_N if r < n_h else _P for r in rows)
    return types, perm


def image_block(n_h: int, n_w: int, start_pos: int) -> ImageBlock:
    """Build the reference image block for an ``n_h × n_w`` LLM grid placed at ``start_pos``.

    Reference vector (spec §3.2): ``image_block(3, 2, 0)`` has types
    ``P P P S I I I I N N I P I P N P E`` and perm ``(0, 2, 1, 3, 4, 5)``.
    """
    _check_grid(n_h, n_w)
    _check_start(start_pos)
    types: list[TokenType] = [_P] * lead_pads(start_pos) + [_S]
    perm: list[int] = []
    for pair in range((n_h + 1) // 2):
        pair_types, pair_perm = _pair_body(n_h, n_w, pair)
        types.extend(pair_types)
        perm.extend(pair_perm)
    types.extend([_P] * _pad_last(n_h, n_w))
    types.append(_E)
    return ImageBlock(start=start_pos, n_h=n_h, n_w=n_w, types=tuple(types), perm=tuple(perm))
