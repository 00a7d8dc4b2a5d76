"""The native forward's C descriptor of a ``BatchView`` (``host_abi._StepView``): the addresses of the
view's index arrays and their sizes.

Built once per view. A view that the engine refills in place step after step (``BatchView.in_place``: the
merged decode forward's, ``cache/native_view.ViewReuse``, a few of them) keeps its descriptor, as the addresses and
sizes of its arrays stay what they were; only the layers' snapshot arenas are set again (a forward in
between may have pointed them elsewhere). Every other view is described afresh: a view whose arrays are
not contiguous is described through copies that live only for its call.
"""

from __future__ import annotations

import ctypes

import torch

from ..config import ModelConfig
from .batch import BatchView, LayerState
from .host_abi import _Capture, _CompView, _Layer, _StepView, _VisView


KEPT = 8  # in-place views whose descriptors are kept (as many as a ``ViewReuse`` holds by default)


class StepViews:
    """Descriptors of the views one ``HostForward`` runs, and the last in-place view's kept."""

    def __init__(self, cfg: ModelConfig, comp_keys: list[tuple[int, bool]], ratios: list[int],
                 layers: "ctypes.Array[_Layer]", states: list[LayerState]):
        self.cfg, self.comp_keys, self.ratios = cfg, comp_keys, ratios
        self._layers, self._states = layers, states
        self._kept: dict[int, tuple[BatchView, _StepView]] = {}  # in-place views' descriptors, by id, oldest first

    def describe(self, view: BatchView, keep: list[torch.Tensor]) -> _StepView:
        """The descriptor of ``view``; ``keep`` holds every tensor a pointer was taken from for the call."""
        kept = self._kept.get(id(view)) if view.in_place else None
        if kept is not None and kept[0] is view:
            sv = kept[1]
            for i, key in enumerate(self.comp_keys):  # the closing windows' count moves within the capacity
                ci, cv = view.compress[key], sv.comp[i]
                cv.E = ci.emit_rows.shape[0]
                if cv.E:  # an empty array has no address: described with none, it may have rows now
                    cv.emit_slots, cv.emit_valid, cv.emit_pos, cv.emit_rows = (
                        _arg(ci.emit_slots, keep), _arg(ci.emit_valid, keep), _arg(ci.emit_pos, keep),
                        _arg(ci.emit_rows, keep))
            self._captures(view, sv, keep)
            return sv
        sv = self._fresh(view, keep)
        if view.in_place:
            self._kept.pop(id(view), None)
            self._kept[id(view)] = (view, sv)
            while len(self._kept) > KEPT:  # more than ``ViewReuse`` holds: the oldest went there too
                del self._kept[next(iter(self._kept))]
        return sv

    def _fresh(self, view: BatchView, keep: list[torch.Tensor]) -> _StepView:
        sv = _StepView(T=view.num_tokens, Kw=view.swa_keys.shape[1], M=view.swa_dst.shape[0],
                       after_write=int(view.rings_after_write), n_comp=len(self.comp_keys), n_vis=len(self.ratios))
        for name in ("ids", "positions", "swa_keys", "swa_dst", "swa_src", "swa_valid"):
            setattr(sv, name, _arg(getattr(view, name), keep))
        if view.is_image is not None:
            sv.is_image = _arg(view.is_image, keep)
        if view.image_rows is not None and view.image_embeds is not None:
            if tuple(view.image_embeds.shape) != (view.image_rows.shape[0], self.cfg.hidden_size):
                raise ValueError(f"image rows of shape {tuple(view.image_embeds.shape)} for {view.image_rows.shape[0]} "
                                 f"IMAGE slots of width {self.cfg.hidden_size}")
            sv.n_image_rows = view.image_rows.shape[0]
            sv.image_rows = _arg(view.image_rows, keep)
            sv.image_embeds = _arg(view.image_embeds.to(torch.float32), keep)
        for i, key in enumerate(self.comp_keys):
            ci = view.compress[key]
            sv.comp[i] = _CompView(ci.ratio, int(ci.overlap), ci.span, ci.emit_rows.shape[0], ci.ring_dst.shape[0],
                                   *(_arg(getattr(ci, f), keep) for f in ("emit_slots", "emit_valid", "emit_pos",
                                                                          "emit_rows", "ring_dst", "ring_src")))
        for i, ratio in enumerate(self.ratios):
            vr = view.visible[ratio]
            sv.vis[i] = _VisView(vr.rows.shape[1], _arg(vr.rows, keep), _arg(vr.valid, keep))
        self._captures(view, sv, keep)
        return sv

    def _captures(self, view: BatchView, sv: _StepView, keep: list[torch.Tensor]) -> None:
        """Prefix-cache snapshots inside this forward: the capture index lists, and the arena rows of
        every layer (read now: the prefix cache attaches its arena to the state after start-up)."""
        caps = view.captures or {}
        sv.n_cap = len(caps)
        for i, (ring_len, cap) in enumerate(sorted(caps.items())):
            sv.cap[i] = _Capture(ring_len, cap.old_dst.shape[0], cap.new_dst.shape[0],
                                 *(_arg(getattr(cap, f), keep) for f in ("old_dst", "old_src", "new_dst", "new_src")))
        for layer, st in zip(self._layers, self._states):
            snap = st.snap if caps else None
            for field, name in (("snap_swa", "swa"), ("snap_comp", "comp_ring"), ("snap_idx", "idx_ring")):
                t = snap.get(name) if snap else None
                setattr(layer, field, _arg(t, keep) if t is not None else None)
                setattr(layer, f"{field}_rows", t.shape[0] if t is not None else 0)


def _arg(t: torch.Tensor, keep: list[torch.Tensor]) -> int:
    """A view tensor's data pointer (int64 or bool, host, contiguous), kept alive for the call."""
    t = t.contiguous()
    keep.append(t)
    return t.data_ptr()
