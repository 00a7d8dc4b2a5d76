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
import dataclasses
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


def _geometry(layout: StateLayout) -> tuple[tuple[tuple[int, bool], ...], tuple[int, ...]] | None:
    """The compressor geometries ``(ratio, overlap)`` and the distinct ratios of ``layout`` (None: more
    than the C descriptor holds)."""
    keys = tuple(sorted({(ly.ratio, ly.overlap) for ly in layout.layers if ly.ratio}))
    ratios = tuple(layout.cfg.distinct_ratios)
    return None if len(keys) > MAX_GEOMETRIES or len(ratios) > MAX_GEOMETRIES else (keys, ratios)


class ViewReuse:
    """A caller's buffers for views of a few capacities, each filled again in place when its capacity comes
    again (the merged forward of a decode step: the same sequences one token on, step after step, a verify
    step's rows varying with its drafts). A view returned before is then the same object, its arrays
    rewritten: a caller passes a ``ViewReuse`` only for views it does not keep past the next one (a
    layer-sliced pass keeps its view across steps: it passes none).

    Why: assembling the view's arrays (a split into ~20 tensors, their dataclasses) and the native
    forward's descriptor of them cost ~45 + ~25 us of a ~500 us one-stream step of the bundled model, the C
    fill 2 us. The capacity is what varies step to step without changing the forward's work: a view made
    here holds room for every compressor window its chunks could close (their count changes with the
    positions: 0 or 1 for a decode row of a ratio-4 layer, 1 or 2 for a 5-row verify) and its visible
    compressed rows are padded to a multiple of ``VIS_QUANTUM`` with invalid entries (which every reader
    skips, as it skips a shorter sequence's in a batch). Only a sequence joining or leaving, a chunk's
    length or the sliding window's width changing, or the visible rows outgrowing their padding make new
    buffers (before the padding, a verify step's view was rebuilt almost every step, a decode step's every
    other)."""

    def __init__(self, shapes: int = 8) -> None:
        self.shapes = shapes  # views of this many capacities are held (a verify step's rows vary with its drafts)
        self.held: dict[tuple, _Held] = {}  # by capacity, the oldest first
        self.reused = 0  # views served from the buffers (for tests and logs)

    def hold(self, shape: tuple, held: "_Held") -> None:
        self.held.pop(shape, None)
        self.held[shape] = held
        while len(self.held) > self.shapes:
            del self.held[next(iter(self.held))]


@dataclasses.dataclass
class _Held:
    """One capacity's view and C descriptor, the closing windows its compress arrays hold now, per geometry
    its emit arrays at capacity and its index cut to each count met so far."""

    view: BatchView
    out: "_Out"
    emits: tuple[int, ...]
    full: list[tuple[torch.Tensor, ...]]
    cuts: list[dict[int, CompressIndex]]


VIS_QUANTUM = 16  # visible compressed rows of a reused view: padded to a multiple of this


def _emit_arrays(full: tuple[torch.Tensor, ...], e: int, span: int) -> tuple[torch.Tensor, ...]:
    """The first ``e`` windows of a geometry's emit arrays held at capacity: slots, valid, positions, rows."""
    slots, valid, pos, rows = full
    return slots[:e * span].view(e, span), valid[:e * span].view(e, span), pos[:e], rows[:e]


def _refill(lib, spec: "_In", held: _Held, ids: torch.Tensor, spans, keys) -> BatchView:
    """A held view, its arrays rewritten for these chunks; the compress arrays re-cut where the number of
    closing windows changed."""
    held.view.ids.copy_(ids)
    lib.ds4_text_view(ctypes.byref(spec), ctypes.byref(held.out))
    emits = tuple(e for _, e in spans)
    if emits != held.emits:
        for k, ((span, e), key) in enumerate(zip(spans, keys)):
            cut = held.cuts[k].get(e)
            if cut is None:
                es, ev, ep, er = _emit_arrays(held.full[k], e, span)
                cut = held.cuts[k][e] = dataclasses.replace(held.view.compress[key], emit_slots=es, emit_valid=ev,
                                                            emit_pos=ep, emit_rows=er)
            held.view.compress[key] = cut
        held.emits = emits
    return held.view


def text_view(layout: StateLayout, n_slots: int, chunks: Sequence, ids: torch.Tensor,
              reuse: ViewReuse | None = None) -> BatchView | None:
    """``build_view(..., tiles=False)`` of a plain text forward (see ``plain_text``), or None when the
    library is not built here. ``ids``: the chunks' token ids, concatenated. ``reuse``: the caller's
    buffers (``ViewReuse``), refilled when this view has their shape.

    Every step builds one, so the Python around the C call is kept to a few allocations: the inputs go
    in one int64 tensor, the outputs come out of one int64 and one bool buffer, sliced into the
    ``BatchView``'s arrays (views of disjoint ranges)."""
    lib = library()
    geometry = _geometry(layout) if lib is not None else None
    if geometry is None:
        return None
    keys, ratios = geometry
    T, after, kw, longs, bools, spans, widths = _sizes(layout, chunks, keys, ratios, capacity=reuse is not None)
    spec, inputs = _inputs(layout, n_slots, chunks, keys, ratios, T, after)
    shape = (after, kw, tuple(longs), tuple(bools))
    held = reuse.held.get(shape) if reuse is not None else None
    if held is not None:
        reuse.reused += 1
        return _refill(lib, spec, held, ids, spans, keys)
    i64, b8 = torch.empty(sum(longs), dtype=torch.int64), torch.empty(sum(bools), dtype=torch.bool)
    lp = _pointers(i64.data_ptr(), longs, 8)
    bp = _pointers(b8.data_ptr(), bools, 1)
    li, bi = torch.split(i64, longs), torch.split(b8, bools)
    out = _Out(lp[0], lp[1], bp[0], lp[2], lp[3], Kw=kw)
    compress, full = {}, []
    for k, ((span, e), key) in enumerate(zip(spans, keys)):
        j = 4 + 5 * k
        out.emit_slots[k], out.emit_valid[k], out.emit_pos[k], out.emit_rows[k] = lp[j], bp[1 + k], lp[j + 1], lp[j + 2]
        out.ring_dst[k], out.ring_src[k] = lp[j + 3], lp[j + 4]
        full.append((li[j], bi[1 + k], li[j + 1], li[j + 2]))
        es, ev, ep, er = _emit_arrays(full[-1], e, span)
        compress[key] = CompressIndex(ratio=key[0], overlap=key[1], emit_slots=es, emit_valid=ev, emit_pos=ep,
                                      emit_rows=er, ring_dst=li[j + 3], ring_src=li[j + 4])
    visible = {}
    for r, (ratio, w) in enumerate(zip(ratios, widths)):
        j, jb = 4 + 5 * len(keys) + r, 1 + len(keys) + r
        out.vis_rows[r], out.vis_valid[r], out.R[r] = lp[j], bp[jb], w
        visible[ratio] = VisibleRows(rows=li[j].view(T, w), valid=bi[jb].view(T, w))
    lib.ds4_text_view(ctypes.byref(spec), ctypes.byref(out))
    view = BatchView(ids=ids, positions=li[0], swa_keys=li[1].view(T, kw), swa_valid=bi[0].view(T, kw),
                     swa_dst=li[2], swa_src=li[3], compress=compress, visible=visible, rings_after_write=after,
                     in_place=reuse is not None)
    if reuse is not None:  # its buffers now hold this view: ``ids`` is the caller's fresh tensor, kept with it
        reuse.hold(shape, _Held(view, out, tuple(e for _, e in spans), full,
                                [{e: compress[key]} for (_, e), key in zip(spans, keys)]))
    return view


def _sizes(layout: StateLayout, chunks: Sequence, keys, ratios, capacity: bool = False):
    """``(T, after, Kw, longs, bools, spans, widths)`` of the view of ``chunks``: its rows, whether it reads
    the rings after its writes, its sliding keys a row, the sizes of its int64 and bool arrays in the order
    ``text_view`` assembles them, ``(span, emitted rows)`` per compressor geometry and the visible rows a
    query per ratio. ``capacity``: the arrays sized for a reused view (``ViewReuse``): room for every window
    the chunks' lengths could close, the visible rows padded to ``VIS_QUANTUM``."""
    window = layout.cfg.sliding_window
    starts, ns = [c.start for c in chunks], [len(c) for c in chunks]
    ends = [s + n for s, n in zip(starts, ns)]
    T, after = sum(ns), all(n == 1 for n in ns)
    kw = max(min(window, e) for e in ends)
    m = sum(min(n, window) for n in ns)
    longs, bools = [T, T * kw, m, m], [T * kw]
    spans = []
    for ratio, overlap in keys:
        span = ratio * (2 if overlap else 1)
        e = sum(end // ratio - s // ratio for s, end in zip(starts, ends))
        room = sum(n // ratio + 1 for n in ns) if capacity else e
        mk = sum(min(n, span) for n in ns)
        spans.append((span, e))
        longs += [room * span, room, room, mk, mk]
        bools.append(room * span)
    widths = [max(e // ratio for e in ends) for ratio in ratios]
    if capacity:
        widths = [-(-w // VIS_QUANTUM) * VIS_QUANTUM for w in widths]
    longs += [T * w for w in widths]
    bools += [T * w for w in widths]
    return T, after, kw, longs, bools, spans, widths


def _inputs(layout: StateLayout, n_slots: int, chunks: Sequence, keys, ratios, T: int,
            after: bool) -> tuple[_In, torch.Tensor]:
    """The C descriptor of the chunks, its arrays in one int64 tensor (returned: it must outlive the call):
    the block tables (0-padded), slots, starts, lengths, the geometries' ratios and overlaps, the ratios."""
    S, width = len(chunks), max(1, max(len(c.block_table) for c in chunks))
    flat: list[int] = []
    for c in chunks:
        flat += c.block_table
        flat += [0] * (width - len(c.block_table))
    flat += ([c.slot for c in chunks] + [c.start for c in chunks] + [len(c) for c in chunks]
             + [k[0] for k in keys] + [int(k[1]) for k in keys] + list(ratios))
    inputs = torch.tensor(flat, dtype=torch.int64)
    at = inputs.data_ptr() + 8 * S * width  # past the tables
    spec = _In(S, T, layout.cfg.sliding_window, n_slots, layout.page_tokens, width, len(keys), len(ratios), int(after),
               at, at + 8 * S, at + 16 * S, inputs.data_ptr(), at + 24 * S, at + 8 * (3 * S + len(keys)),
               at + 8 * (3 * S + 2 * len(keys)))
    return spec, inputs


def _pointers(base: int, sizes: Sequence[int], itemsize: int) -> list[int]:
    """The address of each of ``sizes``' consecutive arrays in a buffer at ``base``."""
    out, at = [], base
    for n in sizes:
        out.append(at)
        at += n * itemsize
    return out
