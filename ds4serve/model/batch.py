"""The model's view of one forward: index metadata and per-layer state tensors.

The model is stateless about users. The engine (through ``cache/``) hands it a :class:`BatchView`
per forward: a *flattened* batch of tokens from many sequences, each token with its absolute
position, plus index lists that say which stored rows every query sees and where new state is
written. All of it is built once per step (not per layer) and reused by every layer, and by every
layer slice of a pass. No padding token ever enters the model; index lists are padded with a
validity mask instead.

Row addressing: a *ring* holds fixed per-slot state, flattened to ``[n_slots * ring_len, width]``
and addressed ``slot * ring_len + pos % ring_len``. Gathers read from ``cat(ring, new_rows)``: an
index ``< ring rows`` reads stored state, an index ``>= ring rows`` reads a token of this forward.
A *pool* holds compressed rows of all sequences, paged; its flat row index comes from the
sequence's block table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class CompressIndex:
    """Metadata shared by every layer with one compressor geometry ``(ratio, overlap)``."""

    ratio: int
    overlap: bool  # CSA: windows overlap (2 * ratio slots per row); HCA: ratio slots
    emit_slots: torch.Tensor  # [E, span] rows of cat(ring, new states) for each closing window
    emit_valid: torch.Tensor  # [E, span] False for slots before position 0
    emit_pos: torch.Tensor  # [E] window start position (RoPE position of the row)
    emit_rows: torch.Tensor  # [E] flat pool row that receives the compressed row
    ring_dst: torch.Tensor  # [M] ring rows overwritten with this forward's token states
    ring_src: torch.Tensor  # [M] token index (into this forward) of each written state

    @property
    def span(self) -> int:
        return self.ratio * (2 if self.overlap else 1)


@dataclass(frozen=True)
class VisibleRows:
    """For one ratio: the compressed rows each query may see (``r < (pos + 1) // ratio``)."""

    rows: torch.Tensor  # [T, R] flat pool rows (padding points at row 0)
    valid: torch.Tensor  # [T, R] bool


@dataclass(frozen=True)
class QueryTile:
    """Queries ``[start, stop)`` of one prefill chunk attending to shared key blocks.

    Sliding keys: ``ring[ring_rows]`` (positions before the chunk, read before this forward writes the
    ring) then this forward's rows ``[new_start, new_stop)``; ``swa_mask [t, K]`` keeps each query's own
    window. Compressed keys per ratio: pool rows ``comp_rows[ratio] [R]`` with ``comp_mask[ratio] [t, R]``.
    """

    start: int
    stop: int
    ring_rows: torch.Tensor
    new_start: int
    new_stop: int
    swa_mask: torch.Tensor
    comp_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    comp_mask: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class RingCapture:
    """Rings as they stood at a position inside this forward, copied into snapshot rows.

    For a snapshot at ``H`` strictly inside a chunk, every ring row holds the latest position
    ``p < H`` of its residue: from this forward's new rows when ``p`` is in the chunk (``new_*``),
    else from the ring as it was before this forward's writes (``old_*``). Keyed in the view by ring
    length (the index math depends on nothing else)."""

    old_dst: torch.Tensor  # snapshot rows filled from the live ring
    old_src: torch.Tensor  # live ring rows (read before this forward writes the ring)
    new_dst: torch.Tensor  # snapshot rows filled from this forward's new rows
    new_src: torch.Tensor  # token index of each


def capture_ring(cap: RingCapture | None, snap: torch.Tensor | None, ring: torch.Tensor, new: torch.Tensor) -> None:
    """Copy the ring as it stood at each capture point into ``snap`` (call before the ring write)."""
    if cap is None or snap is None:
        return
    if cap.old_dst.numel():
        snap.index_copy_(0, cap.old_dst, ring.index_select(0, cap.old_src))
    if cap.new_dst.numel():
        snap.index_copy_(0, cap.new_dst, new.index_select(0, cap.new_src).to(snap.dtype))


@dataclass(frozen=True)
class BatchView:
    """Everything a forward needs besides weights and state tensors."""

    ids: torch.Tensor  # [T] token ids (image-block sentinels >= vocab_size are allowed)
    positions: torch.Tensor  # [T] absolute positions
    swa_keys: torch.Tensor  # [T, Kw] rows of cat(sliding ring, new kv) each query sees
    swa_valid: torch.Tensor  # [T, Kw]
    swa_dst: torch.Tensor  # [M] sliding-ring rows written by this forward
    swa_src: torch.Tensor  # [M] token index of each written row
    compress: dict[tuple[int, bool], CompressIndex] = field(default_factory=dict)
    visible: dict[int, VisibleRows] = field(default_factory=dict)
    is_image: torch.Tensor | None = None  # [T] bool: token belongs to an image block
    image_embeds: torch.Tensor | None = None  # [N, D] rows that replace the embedding of image slots
    image_rows: torch.Tensor | None = None  # [N] token index of each row of image_embeds
    tiles: tuple[QueryTile, ...] = ()  # long prefill chunks: shared key blocks (see cache/view.py)
    gather_tokens: torch.Tensor | None = None  # [G] tokens outside tiles (None: none, or no tiles)
    # True for a pure-decode forward (one token per sequence): swa_keys and emit_slots then index the
    # rings themselves, read after this forward's writes; else they index cat(ring, new rows)
    rings_after_write: bool = False
    captures: dict[int, RingCapture] | None = None  # prefix-cache snapshots inside this forward, by ring length
    # refilled in place step after step (``cache/native_view.ViewReuse``): the same object with new contents,
    # its arrays' addresses and sizes unchanged; a consumer may keep what it derived from them (the native
    # forward's descriptor), and must not keep the view past the next one
    in_place: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])


@dataclass
class LayerState:
    """The state tensors of one decoder layer (all slots). Written in place by the model."""

    swa: torch.Tensor  # [n_slots * window, head_dim] raw K=V ring
    comp_ring: torch.Tensor | None = None  # [n_slots * span, 2 * c * head_dim] fp32 [C | Z+ape]
    comp_pool: torch.Tensor | None = None  # [pool_rows, head_dim] compressed rows
    idx_ring: torch.Tensor | None = None  # [n_slots * span, 4 * index_head_dim] fp32 (CSA indexer)
    idx_pool: torch.Tensor | None = None  # [pool_rows, index_head_dim] indexer key rows
    # the prefix cache's snapshot arena rows of this layer's rings ("swa", "comp_ring", "idx_ring"),
    # filled by ``capture_ring`` when a view asks for snapshots inside a forward; None: no cache
    snap: dict[str, torch.Tensor] | None = None
