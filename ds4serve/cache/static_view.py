"""Fixed-shape views of pure-decode forwards, so a decode step can be captured once and replayed.

A ``BatchView`` built by ``build_view`` has shapes that change from step to step: the number of rows,
how many compressed rows the longest sequence sees, how many compressor windows close. A captured
graph (CUDA graphs) needs the same shapes every time, so :func:`static_decode_view` pads a decode view
to a *bucket*:

* rows: to the next batch bucket; a padding row repeats row 0's inputs (a finite, harmless copy);
  its outputs are never read and it writes nothing of its own;
* state writes (sliding ring, compressor rings): padded with copies of entry 0, which write the same
  value to the same row again (idempotent);
* closing windows: one entry per row (a decode token closes at most one window per geometry); padded
  entries pool real ring rows and land in the pool's *scratch page* (``ModelState.scratch_row``),
  which no sequence owns and no query reads;
* key lists: the sliding list to exactly ``window`` columns, compressed lists to the next power of two;
  padded columns are invalid (masked), so the attention result is unchanged up to float summation
  order (fp32 logits within 1e-6 in tests).

Only text decode rows (one token per sequence, no image block) take this path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..model.batch import BatchView, CompressIndex, VisibleRows


def batch_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including ``max_rows``."""
    out = [b for b in (1, 2, 4) if b < max_rows]
    out += list(range(8, max_rows, 8))
    return out + [max_rows]


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding ``n`` rows, or ``None`` when ``n`` exceeds every bucket."""
    return next((b for b in buckets if b >= n), None)


def width_bucket(n: int, minimum: int = 16) -> int:
    """Compressed key columns: the next power of two, at least ``minimum``."""
    width = minimum
    while width < n:
        width *= 2
    return width


def static_decode_view(view: BatchView, bucket: int, window: int, scratch_rows: dict[int, int],
                       n_seqs: int) -> BatchView:
    """Pad a pure-decode ``view`` (``n <= bucket`` rows, one token each) to fixed shapes.

    ``n_seqs`` is the number of sequences the view was built from (known on the host: checking it
    from the view's device tensors would sync every step); ``scratch_rows[ratio]`` is the scratch
    pool row for that compress ratio.
    """
    n = view.num_tokens
    if not 1 <= n <= bucket:
        raise ValueError(f"{n} decode rows do not fit a bucket of {bucket}")
    if view.is_image is not None or view.image_rows is not None:
        raise ValueError("image-block rows never take the fixed-shape decode path")
    # one token per sequence (the plan has distinct slots): every sliding-ring write lands in its own slot
    if n_seqs != n or view.swa_dst.shape[0] != n:
        raise ValueError(f"not a decode view: {n} tokens from {n_seqs} sequences")
    compress = {key: _pad_compress(ci, bucket, scratch_rows[ci.ratio]) for key, ci in view.compress.items()}
    visible = {ratio: _pad_visible(vr, bucket) for ratio, vr in view.visible.items()}
    return BatchView(
        ids=_pad_rows(view.ids, bucket), positions=_pad_rows(view.positions, bucket),
        swa_keys=_pad_rows(_pad_cols(view.swa_keys, window, 0), bucket),
        swa_valid=_pad_rows(_pad_cols(view.swa_valid, window, False), bucket),
        swa_dst=_pad_rows(view.swa_dst, bucket), swa_src=_pad_rows(view.swa_src, bucket),
        compress=compress, visible=visible, rings_after_write=view.rings_after_write,
    )


def _pad_compress(ci: CompressIndex, bucket: int, scratch: int) -> CompressIndex:
    emitted = ci.emit_rows.shape[0]
    if emitted > bucket:
        raise ValueError(f"{emitted} closing windows for {bucket} decode rows")
    extra = bucket - emitted
    dev = ci.emit_rows.device
    return CompressIndex(
        ratio=ci.ratio, overlap=ci.overlap,
        # padded windows pool ring row 0 (finite, real state) and land in the scratch page
        emit_slots=torch.cat((ci.emit_slots, torch.zeros(extra, ci.span, dtype=ci.emit_slots.dtype, device=dev))),
        emit_valid=torch.cat((ci.emit_valid, torch.ones(extra, ci.span, dtype=torch.bool, device=dev))),
        emit_pos=torch.cat((ci.emit_pos, torch.zeros(extra, dtype=ci.emit_pos.dtype, device=dev))),
        emit_rows=torch.cat((ci.emit_rows, torch.full((extra,), scratch, dtype=ci.emit_rows.dtype, device=dev))),
        ring_dst=_pad_rows(ci.ring_dst, bucket), ring_src=_pad_rows(ci.ring_src, bucket),
    )


def _pad_visible(vr: VisibleRows, bucket: int) -> VisibleRows:
    """Compressed key columns to a power of two (padding invalid, pointing at row 0)."""
    width = width_bucket(vr.rows.shape[1])
    return VisibleRows(rows=_pad_rows(_pad_cols(vr.rows, width, 0), bucket),
                       valid=_pad_rows(_pad_cols(vr.valid, width, False), bucket))


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Append copies of row 0 up to ``rows`` rows."""
    extra = rows - t.shape[0]
    if extra <= 0:
        return t
    return torch.cat((t, t[:1].expand(extra, *t.shape[1:])))


def _pad_cols(t: torch.Tensor, cols: int, fill) -> torch.Tensor:
    extra = cols - t.shape[1]
    if extra <= 0:
        return t
    return torch.cat((t, torch.full((t.shape[0], extra), fill, dtype=t.dtype, device=t.device)), dim=1)


def view_key(view: BatchView) -> tuple:
    """Every shape of a view, in a fixed order: two views with one key can share a captured graph."""
    key: list = [tuple(view.ids.shape), tuple(view.swa_keys.shape), view.rings_after_write]
    for k in sorted(view.compress):
        ci = view.compress[k]
        key.append((k, tuple(ci.emit_slots.shape), tuple(ci.ring_dst.shape)))
    for r in sorted(view.visible):
        key.append((r, tuple(view.visible[r].rows.shape)))
    return tuple(key)


def copy_view_into(dst: BatchView, src: BatchView) -> None:
    """Copy every index tensor of ``src`` into the same-shaped tensors of ``dst`` (graph inputs)."""
    for a, b in _tensor_pairs(dst, src):
        a.copy_(b, non_blocking=True)


def clone_view(view: BatchView) -> BatchView:
    """A view whose tensors are fresh buffers with ``view``'s values (a graph's static inputs)."""
    return dataclasses.replace(
        view, **{f: getattr(view, f).clone() for f in _VIEW_FIELDS},
        compress={k: dataclasses.replace(c, **{f: getattr(c, f).clone() for f in _COMPRESS_FIELDS})
                  for k, c in view.compress.items()},
        visible={r: VisibleRows(rows=v.rows.clone(), valid=v.valid.clone()) for r, v in view.visible.items()},
    )


_VIEW_FIELDS = ("ids", "positions", "swa_keys", "swa_valid", "swa_dst", "swa_src")
_COMPRESS_FIELDS = ("emit_slots", "emit_valid", "emit_pos", "emit_rows", "ring_dst", "ring_src")


def _tensor_pairs(a: BatchView, b: BatchView):
    for f in _VIEW_FIELDS:
        yield getattr(a, f), getattr(b, f)
    for k, ca in a.compress.items():
        cb = b.compress[k]
        for f in _COMPRESS_FIELDS:
            yield getattr(ca, f), getattr(cb, f)
    for r, va in a.visible.items():
        yield va.rows, b.visible[r].rows
        yield va.valid, b.visible[r].valid
