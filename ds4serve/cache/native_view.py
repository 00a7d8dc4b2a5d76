"""The index view of a plain text forward built natively (``csrc/view.c``), for the host forward.

Why: ``build_view`` is ~100 small torch ops per forward, written for clarity and for every case (image
spans, snapshots inside a chunk, query tiles). On a CPU step of the native forward that was 3.8 ms of a
22 ms step at 16 streams in the server. A plain text forward (no image block inside a chunk, no
snapshot captured inside one, no query tiles, host tensors) needs none of that generality: this builds
the same arrays in one C call. ``build_view`` stays the reference (tests/test_native_view.py compares
every array) and the path for everything else; no compiler means it is used always (logged once).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from ctypes import POINTER, c_int, c_int64, c_void_p
from pathlib import Path

import torch

from ..environment import cache_root, native_build
from ..model.batch import BatchView, CompressIndex, VisibleRows
from ..native_build import OnceLibrary, build_library, sanitized
from .layout import StateLayout

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "view.c"
MAX_GEOMETRIES = 4  # fixed arrays in the C descriptor (DS4 has two: CSA and HCA)


class _In(ctypes.Structure):
    _fields_ = ([(n, c_int64) for n in ("S", "T", "W", "n_slots", "page_tokens", "table_width", "n_keys", "n_ratios",
                                        "after")]
                + [(n, c_void_p) for n in ("slot", "start", "n", "tables", "key_ratio", "key_overlap", "ratios")])


class _Out(ctypes.Structure):
    _fields_ = ([(n, c_void_p) for n in ("positions", "swa_keys", "swa_valid", "swa_dst", "swa_src")]
                + [(n, c_void_p * MAX_GEOMETRIES) for n in ("emit_slots", "emit_valid", "emit_pos", "emit_rows",
                                                           "ring_dst", "ring_src", "vis_rows", "vis_valid")]
                + [("Kw", c_int64), ("R", c_int64 * MAX_GEOMETRIES)])


def _load() -> ctypes.CDLL:
    flags = sanitized(["-O2", "-fPIC", "-shared"], native_build().sanitize)
    path = build_library(cache_root() / "native", "view", _SOURCE.read_text(), flags, [])
    lib = ctypes.CDLL(str(path))
    lib.ds4_text_view.argtypes = [POINTER(_In), POINTER(_Out)]
    lib.ds4_text_view.restype = c_int
    return lib


_library = OnceLibrary(_load, log, "native view builder unavailable (%s); views are built with torch ops")


def library() -> ctypes.CDLL | None:
    """The built view library, or ``None`` (``build_view`` is used) when it cannot be built here."""
    return _library.get()


def plain_text(chunks: Sequence, device: torch.device) -> bool:
    """Whether ``text_view`` may build this forward's view: host, no image block inside a chunk, no
    snapshot captured inside one (the chunks are already checked by ``build_view``'s rules)."""
    if device.type != "cpu":
        return False
    for c in chunks:
        end = c.start + len(c)
        if c.image_rows or c.captures or any(c.start < sp.end and sp.start < end for sp in c.spans):
            return False
    return True


def text_view(layout: StateLayout, n_slots: int, chunks: Sequence, ids: torch.Tensor) -> BatchView | None:
    """``build_view(..., tiles=False)`` of a plain text forward (see ``plain_text``), or None when the
    library is not built here. ``ids``: the chunks' token ids, concatenated."""
    lib = library()
    if lib is None:
        return None
    cfg, window = layout.cfg, layout.cfg.sliding_window
    keys = sorted({(ly.ratio, ly.overlap) for ly in layout.layers if ly.ratio})
    ratios = list(cfg.distinct_ratios)
    if len(keys) > MAX_GEOMETRIES or len(ratios) > MAX_GEOMETRIES:
        return None
    starts, ns = [c.start for c in chunks], [len(c) for c in chunks]
    ends = [s + n for s, n in zip(starts, ns)]
    width = max(1, max(len(c.block_table) for c in chunks))
    tables = torch.zeros(len(chunks), width, dtype=torch.int64)
    for i, c in enumerate(chunks):
        if len(c.block_table):
            tables[i, :len(c.block_table)] = torch.as_tensor(list(c.block_table), dtype=torch.int64)
    T, after = sum(ns), all(n == 1 for n in ns)
    keep = [tables, torch.tensor([c.slot for c in chunks]), torch.tensor(starts), torch.tensor(ns),
            torch.tensor([k[0] for k in keys]), torch.tensor([int(k[1]) for k in keys]), torch.tensor(ratios)]
    spec = _In(S=len(chunks), T=T, W=window, n_slots=n_slots, page_tokens=layout.page_tokens, table_width=width,
               n_keys=len(keys), n_ratios=len(ratios), after=int(after), tables=keep[0].data_ptr(),
               slot=keep[1].data_ptr(), start=keep[2].data_ptr(), n=keep[3].data_ptr(),
               key_ratio=keep[4].data_ptr(), key_overlap=keep[5].data_ptr(), ratios=keep[6].data_ptr())
    kw = max(min(window, e) for e in ends)
    out = _Out(Kw=kw)
    i64, b8 = torch.int64, torch.bool

    def new(*shape, dtype=i64) -> torch.Tensor:
        t = torch.empty(*shape, dtype=dtype)
        keep.append(t)
        return t

    positions, swa_keys, swa_valid = new(T), new(T, kw), new(T, kw, dtype=b8)
    m = sum(min(n, window) for n in ns)
    swa_dst, swa_src = new(m), new(m)
    for name, t in (("positions", positions), ("swa_keys", swa_keys), ("swa_valid", swa_valid), ("swa_dst", swa_dst),
                    ("swa_src", swa_src)):
        setattr(out, name, t.data_ptr())
    compress = {}
    for k, (ratio, overlap) in enumerate(keys):
        span = ratio * (2 if overlap else 1)
        e = sum(end // ratio - s // ratio for s, end in zip(starts, ends))
        mk = sum(min(n, span) for n in ns)
        ci = dict(emit_slots=new(e, span), emit_valid=new(e, span, dtype=b8), emit_pos=new(e), emit_rows=new(e),
                  ring_dst=new(mk), ring_src=new(mk))
        for name, t in ci.items():
            getattr(out, name)[k] = t.data_ptr()
        compress[(ratio, overlap)] = CompressIndex(ratio=ratio, overlap=overlap, **ci)
    visible = {}
    for r, ratio in enumerate(ratios):
        width_r = max(e // ratio for e in ends)
        rows, valid = new(T, width_r), new(T, width_r, dtype=b8)
        out.vis_rows[r], out.vis_valid[r], out.R[r] = rows.data_ptr(), valid.data_ptr(), width_r
        visible[ratio] = VisibleRows(rows=rows, valid=valid)
    lib.ds4_text_view(ctypes.byref(spec), ctypes.byref(out))
    return BatchView(ids=ids, positions=positions, swa_keys=swa_keys, swa_valid=swa_valid, swa_dst=swa_dst,
                     swa_src=swa_src, compress=compress, visible=visible, rings_after_write=after)
