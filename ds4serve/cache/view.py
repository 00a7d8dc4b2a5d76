"""Build the model's ``BatchView`` for one forward from per-sequence chunks.

Everything is derived with vectorised integer arithmetic on small host tensors (no Python loop
over tokens), once per forward, and moved to the model's device in one go. The index rules:

* sliding window: a query at position ``p`` sees raw rows ``[lo, hi]`` (text: ``[p-W+1, p]``);
  rows before the chunk start come from the slot's ring, the rest from this forward's tokens;
* a compressor window ``w`` closes at ``w*m + m - 1``; it pools positions
  ``[w*m + m - span, w*m + m)`` and lands in pool row ``w`` of the sequence;
* a query sees compressed rows ``r < (p + 1) // m`` (complete windows only);
* DS4V image blocks: a query inside a visible span ``[s, e]`` (IMAGE_START..IMAGE_END) sees raw rows
  ``[min(p-W+1, s), p + min(e-p, M)]``, future span tokens included (spec ds4-vision §4.1); lead pads,
  text and compressed rows stay causal. A block must lie wholly inside one chunk: a chunk that would
  split one is refused here, loudly, never computed with the wrong mask.

Queries of one prefill chunk share almost all their keys, so long chunks are cut into *query
tiles* (``QueryTile``): each tile gets one sliding key block (positions ``[min lo, max hi]`` of its
queries: ring rows before the chunk, then a contiguous run of this forward's rows) and a mask that
keeps, for every query, exactly the rows of its own ``[lo, hi]`` list; and, per compress ratio, the
visible rows of its last query with the per-query validity as mask. The per-query lists stay in
the view for the other tokens (``gather_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..model.batch import BatchView, CompressIndex, QueryTile, RingCapture, VisibleRows
from ..multimodal.records import ImageRows, ImageSpan
from .layout import StateLayout
from .native_view import ViewReuse, plain_text, text_view

# Prefill chunks of at least TILE_MIN tokens attend to shared key blocks in query tiles of at most
# TILE tokens (memory O(TILE x (window + TILE)) per tile); shorter chunks and decode rows gather a
# private key list per query, which is cheaper for them.
TILE_MIN = 16
TILE = 128


class ViewError(RuntimeError):
    """A forward was planned that the state cannot serve (unreserved pages, duplicate slot...)."""


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's part of a forward: ``len(ids)`` new tokens starting at absolute ``start``."""

    slot: int
    start: int
    ids: Sequence[int] | torch.Tensor
    block_table: Sequence[int] = field(default_factory=list)
    spans: tuple[ImageSpan, ...] = ()  # every image block of the sequence
    # for blocks inside this chunk: (absolute positions of IMAGE slots in stream order, rows [n, D]
    # already in stream order, i.e. aligner rows permuted by the block's perm)
    image_rows: tuple[ImageRows, ...] = ()
    # prefix-cache snapshots strictly inside this chunk: (position H, snapshot arena entry); the
    # forward copies the rings as they stood at H into that entry (see ``RingCapture``)
    captures: tuple[tuple[int, int], ...] = ()

    def __len__(self) -> int:
        return len(self.ids)


_I64 = torch.int64


def _segments(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For segment sizes ``counts [S]``: (segment id, index within segment) of every element."""
    seg = torch.repeat_interleave(torch.arange(counts.numel(), dtype=_I64), counts)
    offsets = torch.cumsum(counts, 0) - counts
    return seg, torch.arange(int(counts.sum()), dtype=_I64) - offsets[seg]


def build_view(layout: StateLayout, n_slots: int, chunks: Sequence[SeqChunk], device: torch.device,
               max_image_tokens: int = 384, tiles: bool = True, reuse: ViewReuse | None = None) -> BatchView:
    """The view of one forward over ``chunks``. ``tiles`` False: no query tiles (a consumer that reads the
    per-query key lists, like the native host forward, needs none; the torch path then gathers).
    ``reuse``: buffers a plain text view may be refilled in (``native_view.ViewReuse``: only for a view
    the caller drops before asking for the next one)."""
    _check_chunks(layout, n_slots, chunks)
    if not tiles and plain_text(chunks, torch.device(device)):  # the same arrays, in one native call
        ids = torch.cat([torch.as_tensor(c.ids, dtype=_I64).reshape(-1) for c in chunks])
        fast = text_view(layout, n_slots, chunks, ids, reuse)
        if fast is not None:
            return fast
    g = _Geometry.of(layout, chunks)
    window = layout.cfg.sliding_window
    # a pure-decode forward (one token per sequence) reads the rings after its own writes, which then
    # hold exactly each query's window and each closing compressor window (no copy of the whole ring)
    after = all(len(c) == 1 for c in chunks)
    tensors: dict[str, torch.Tensor] = {}
    tensors["ids"] = torch.cat([torch.as_tensor(c.ids, dtype=_I64).reshape(-1) for c in chunks])
    tensors["positions"] = g.pos
    lo = (g.pos - (window - 1)).clamp(min=0)
    hi = g.pos.clone()
    _widen_spans(g, chunks, lo, hi, window, max_image_tokens)
    keys, valid = _ring_gather(g, lo, hi, ring_len=window, n_ring=n_slots * window, after_write=after)
    tensors.update(swa_keys=keys, swa_valid=valid)
    dst, src = _ring_writes(g, window)
    tensors.update(swa_dst=dst, swa_src=src)

    compress = {}
    for ratio, overlap in sorted({(ly.ratio, ly.overlap) for ly in layout.layers if ly.ratio}):
        compress[(ratio, overlap)] = _compress_index(layout, g, ratio, overlap, n_slots, after)
    visible = {ratio: _visible(layout, g, ratio) for ratio in layout.cfg.distinct_ratios}

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    tiles, gather = _query_tiles(g, lo, hi, visible, window, n_slots * window) if tiles else ([], None)

    is_image = tensors["ids"] >= layout.cfg.vocab_size
    has_images = bool(is_image.any())
    rows_idx, rows = _image_rows(g, chunks)
    return BatchView(
        is_image=dev(is_image) if has_images else None,
        image_rows=dev(rows_idx) if rows is not None else None,
        image_embeds=rows.to(device) if rows is not None else None,
        ids=dev(tensors["ids"]), positions=dev(g.pos),
        swa_keys=dev(tensors["swa_keys"]), swa_valid=dev(tensors["swa_valid"]),
        swa_dst=dev(tensors["swa_dst"]), swa_src=dev(tensors["swa_src"]),
        compress={k: CompressIndex(**{f: dev(v) if isinstance(v, torch.Tensor) else v for f, v in ci.items()})
                  for k, ci in compress.items()},
        visible={k: VisibleRows(rows=dev(r), valid=dev(v)) for k, (r, v) in visible.items()},
        tiles=tuple(QueryTile(start=t.start, stop=t.stop, ring_rows=dev(t.ring_rows), new_start=t.new_start,
                              new_stop=t.new_stop, swa_mask=dev(t.swa_mask),
                              comp_rows={k: dev(v) for k, v in t.comp_rows.items()},
                              comp_mask={k: dev(v) for k, v in t.comp_mask.items()}) for t in tiles),
        gather_tokens=dev(gather) if tiles and gather is not None and gather.numel() else None,
        rings_after_write=after,
        captures=_captures(layout, g, chunks, device) if any(c.captures for c in chunks) else None,
    )


def _check_chunks(layout: StateLayout, n_slots: int, chunks: Sequence[SeqChunk]) -> None:
    """Raise ``ViewError`` for a forward the state cannot serve (before any index is built)."""
    if not chunks:
        raise ViewError("a forward needs at least one sequence")
    slots = [c.slot for c in chunks]
    if len(set(slots)) != len(slots):
        raise ViewError(f"a slot appears twice in one forward: {slots}")
    for c in chunks:
        if not 0 <= c.slot < n_slots:
            raise ViewError(f"slot {c.slot} out of range [0, {n_slots})")
        if len(c) < 1 or c.start < 0:
            raise ViewError(f"slot {c.slot}: empty chunk or negative start ({c.start})")
    _check_pages(layout, chunks)
    _check_spans(chunks)


def _query_tiles(g: "_Geometry", lo: torch.Tensor, hi: torch.Tensor, visible: dict, window: int,
                 n_ring: int) -> tuple[list[QueryTile], torch.Tensor]:
    """Tiles for every chunk of at least ``TILE_MIN`` tokens, and the tokens left to the gather path."""
    tiles: list[QueryTile] = []
    tiled = torch.zeros(g.n_tokens, dtype=torch.bool)
    for i in range(int(g.n.numel())):
        n, off, c0 = int(g.n[i]), int(g.offset[i]), int(g.start[i])
        if n < TILE_MIN:
            continue
        tiled[off:off + n] = True
        for a in range(off, off + n, TILE):
            tiles.append(_tile(g, i, a, min(a + TILE, off + n), lo, hi, visible, window, c0))
    return tiles, torch.nonzero(~tiled).flatten()


def _tile(g: "_Geometry", seq: int, a: int, b: int, lo: torch.Tensor, hi: torch.Tensor, visible: dict,
          window: int, c0: int) -> QueryTile:
    k_lo, k_hi = int(lo[a:b].min()), int(hi[a:b].max())
    kp = torch.arange(k_lo, k_hi + 1, dtype=_I64)
    mask = (kp >= lo[a:b].unsqueeze(1)) & (kp <= hi[a:b].unsqueeze(1))
    before = kp[kp < c0]  # positions still in the slot's ring (read before this forward's writes)
    off = int(g.offset[seq])
    first_new = max(k_lo, c0)
    comp_rows, comp_mask = {}, {}
    for ratio, (rows, valid) in visible.items():
        width = int(valid[b - 1].sum())  # the last query sees the most rows (positions grow)
        comp_rows[ratio] = rows[b - 1, :width]
        comp_mask[ratio] = valid[a:b, :width]
    return QueryTile(start=a, stop=b, ring_rows=int(g.slot[seq]) * window + before.remainder(window),
                     new_start=off + first_new - c0, new_stop=off + k_hi + 1 - c0, swa_mask=mask,
                     comp_rows=comp_rows, comp_mask=comp_mask)


def _check_spans(chunks: Sequence[SeqChunk]) -> None:
    """Refuse a chunk that would split an image block (its span needs one forward)."""
    for c in chunks:
        end = c.start + len(c)
        for sp in c.spans:
            overlaps = sp.start < end and c.start < sp.end
            if overlaps and not (c.start <= sp.start and sp.end <= end):
                raise ViewError(f"slot {c.slot}: prefill chunk [{c.start}, {end}) would split the image block "
                                f"[{sp.start}, {sp.end}); image blocks must be prefilled whole")


def _widen_spans(g: "_Geometry", chunks: Sequence[SeqChunk], lo: torch.Tensor, hi: torch.Tensor, window: int,
                 max_tokens: int) -> None:
    """Bidirectional raw window inside each visible span of this forward (spec ds4-vision §4.1)."""
    for i, c in enumerate(chunks):
        end = c.start + len(c)
        base = int(g.offset[i]) - c.start
        for sp in c.spans:
            if not (c.start <= sp.start and sp.end <= end):
                continue
            p = torch.arange(sp.visible_start, sp.visible_end + 1, dtype=_I64)
            left = (p - sp.visible_start).clamp(max=max_tokens - 1)
            right = (sp.visible_end - p).clamp(max=max_tokens)
            new_lo = (p - (window - 1) - (left - (window - 1)).clamp(min=0)).clamp(min=0)
            new_hi = torch.minimum(p + right, new_lo + window + max_tokens - 1)
            idx = p + base
            lo[idx] = new_lo
            hi[idx] = new_hi


def _image_rows(g: "_Geometry", chunks: Sequence[SeqChunk]):
    """Token indices (in this forward) of IMAGE slots and the rows that fill them."""
    idx, rows = [], []
    for i, c in enumerate(chunks):
        base = int(g.offset[i]) - c.start
        for positions, r in c.image_rows:
            pos = torch.as_tensor(list(positions), dtype=_I64)
            if pos.numel() != r.shape[0]:
                raise ViewError(f"slot {c.slot}: {pos.numel()} image slots but {r.shape[0]} rows")
            if pos.numel() and (int(pos.min()) < c.start or int(pos.max()) >= c.start + len(c)):
                raise ViewError(f"slot {c.slot}: image rows outside the chunk [{c.start}, {c.start + len(c)})")
            idx.append(pos + base)
            rows.append(r)
    if not rows:
        return None, None
    return torch.cat(idx), torch.cat([r.to(rows[0].device) for r in rows])


def _check_pages(layout: StateLayout, chunks: Sequence[SeqChunk]) -> None:
    ratios = layout.cfg.distinct_ratios
    for c in chunks:
        end = c.start + len(c)
        need_tokens = max(((end // m) * m for m in ratios), default=0)
        need = layout.pages_for(need_tokens)
        if need > len(c.block_table):
            raise ViewError(
                f"slot {c.slot}: positions up to {end} need {need} pages but only {len(c.block_table)} are reserved"
            )


@dataclass(frozen=True)
class _Geometry:
    """Per-token and per-sequence integers shared by every index rule."""

    n: torch.Tensor  # [S] new tokens per sequence
    start: torch.Tensor  # [S]
    slot: torch.Tensor  # [S]
    offset: torch.Tensor  # [S] first token index of each sequence in this forward
    seq: torch.Tensor  # [T] sequence of each token
    pos: torch.Tensor  # [T]
    tables: torch.Tensor  # [S, max_pages] block tables (0-padded)
    n_tokens: int

    @classmethod
    def of(cls, layout: StateLayout, chunks: Sequence[SeqChunk]) -> "_Geometry":
        n = torch.tensor([len(c) for c in chunks], dtype=_I64)
        start = torch.tensor([c.start for c in chunks], dtype=_I64)
        seq, within = _segments(n)
        width = max(1, max(len(c.block_table) for c in chunks))
        tables = torch.zeros(len(chunks), width, dtype=_I64)
        for i, c in enumerate(chunks):
            if len(c.block_table):
                tables[i, : len(c.block_table)] = torch.as_tensor(list(c.block_table), dtype=_I64)
        return cls(n=n, start=start, slot=torch.tensor([c.slot for c in chunks], dtype=_I64),
                   offset=torch.cumsum(n, 0) - n, seq=seq, pos=start[seq] + within, tables=tables,
                   n_tokens=int(n.sum()))


def _ring_gather(g: _Geometry, lo: torch.Tensor, hi: torch.Tensor, ring_len: int, n_ring: int,
                 seq: torch.Tensor | None = None, after_write: bool = False):
    """Rows of ``cat(ring, new)`` for positions ``[lo, hi]`` per query; ``(index, valid)``. With
    ``after_write`` (one token per sequence), rows of the ring itself as it is after the writes."""
    seq = g.seq if seq is None else seq
    width = max(1, int((hi - lo).max()) + 1) if lo.numel() else 1
    kp = lo.unsqueeze(1) + torch.arange(width, dtype=_I64)
    valid = (kp <= hi.unsqueeze(1)) & (kp >= 0)
    c0 = g.start[seq].unsqueeze(1)
    from_ring = kp < c0
    ring_idx = g.slot[seq].unsqueeze(1) * ring_len + kp.remainder(ring_len)
    new_idx = n_ring + g.offset[seq].unsqueeze(1) + (kp - c0)
    idx = ring_idx if after_write else torch.where(from_ring, ring_idx, new_idx)
    return torch.where(valid, idx, torch.zeros_like(idx)), valid


def _captures(layout: StateLayout, g: _Geometry, chunks: Sequence[SeqChunk],
               device: torch.device) -> dict[int, RingCapture]:
    """Per ring length ``R``: for each capture (``H`` inside a chunk starting at ``a``, arena entry
    ``i``), ring row ``r`` of the snapshot is the latest position ``p < H`` with ``p % R == r``: a new
    row of this forward when ``p >= a``, else the slot's ring row as it was before the forward."""
    lengths = {layout.cfg.sliding_window} | {ly.span for ly in layout.layers if ly.ratio}
    out = {}
    for R in sorted(lengths):
        parts: list[list[torch.Tensor]] = [[], [], [], []]
        r = torch.arange(R, dtype=_I64)
        for k, c in enumerate(chunks):
            a, off, slot = c.start, int(g.offset[k]), c.slot
            for h, entry in c.captures:
                if not a < h < a + len(c):
                    raise ViewError(f"snapshot at {h} is not strictly inside the chunk [{a}, {a + len(c)})")
                p = h - 1 - (h - 1 - r).remainder(R)
                new = p >= a
                parts[0].append(entry * R + r[~new])
                parts[1].append(slot * R + r[~new])
                parts[2].append(entry * R + r[new])
                parts[3].append(off + p[new] - a)
        old_dst, old_src, new_dst, new_src = (torch.cat(t).to(device) for t in parts)
        out[R] = RingCapture(old_dst=old_dst, old_src=old_src, new_dst=new_dst, new_src=new_src)
    return out


def _ring_writes(g: _Geometry, ring_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's last ``min(n, ring_len)`` tokens go to ``slot * ring_len + pos % ring_len``."""
    count = g.n.clamp(max=ring_len)
    seq, j = _segments(count)
    src = g.offset[seq] + g.n[seq] - count[seq] + j
    dst = g.slot[seq] * ring_len + g.pos[src].remainder(ring_len)
    return dst, src


def _pool_rows(layout: StateLayout, g: _Geometry, seq: torch.Tensor, rows: torch.Tensor, ratio: int) -> torch.Tensor:
    rpp = layout.rows_per_page(ratio)
    page_i = (rows * ratio // layout.page_tokens).clamp(max=g.tables.shape[1] - 1)
    if rows.dim() == 2:
        pages = torch.gather(g.tables[seq], 1, page_i)
    else:
        pages = g.tables[seq, page_i]
    return pages * rpp + rows.remainder(rpp)


def _compress_index(layout: StateLayout, g: _Geometry, ratio: int, overlap: bool, n_slots: int,
                    after_write: bool) -> dict:
    span = ratio * (2 if overlap else 1)
    counts = (g.start + g.n) // ratio - g.start // ratio
    seq_e, j = _segments(counts)
    w = g.start[seq_e] // ratio + j
    first = w * ratio + ratio - span
    slots, valid = _ring_gather(g, first, first + span - 1, ring_len=span, n_ring=n_slots * span, seq=seq_e,
                                after_write=after_write)
    if slots.shape[1] != span:  # no windows close in this forward
        slots = torch.zeros(0, span, dtype=_I64)
        valid = torch.zeros(0, span, dtype=torch.bool)
    dst, src = _ring_writes(g, span)
    return dict(ratio=ratio, overlap=overlap, emit_slots=slots, emit_valid=valid, emit_pos=w * ratio,
                emit_rows=_pool_rows(layout, g, seq_e, w, ratio), ring_dst=dst, ring_src=src)


def _visible(layout: StateLayout, g: _Geometry, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    n_vis = (g.pos + 1) // ratio
    width = int(n_vis.max()) if n_vis.numel() else 0
    r = torch.arange(width, dtype=_I64).unsqueeze(0).expand(g.n_tokens, width)
    valid = r < n_vis.unsqueeze(1)
    rows = _pool_rows(layout, g, g.seq, r, ratio)
    return torch.where(valid, rows, torch.zeros_like(rows)), valid
