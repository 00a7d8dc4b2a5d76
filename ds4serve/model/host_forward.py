"""The model's forward on the host as one native call per step (``csrc/host_*.c``).

Why: a decode step of the torch path on a CPU is ~1,700 dispatched ops, most of its time in Python and
dispatch rather than arithmetic, and the BLAS under it is slow for the 1-32-row products of decode
(MKL takes a generic path on AMD CPUs: a 1,024 x 512 product of one row runs at ~4 GFLOP/s there).
``HostForward`` runs the same network in C for every view the engine builds (decode rows, prefill
chunks, image blocks, layer slices of a pass): products by kernels written for these shapes, everything
else as plain loops, split across threads by a work-claiming pool (``csrc/host_pool.c``: a late thread
never stalls a step); and the LM head the same way. The torch path stays the reference and the
fallback: the engine checks this one against it at start-up, and tests pin them together (fp32).

Where it applies: host tensors, fp32 weights and state, one process (no tensor parallel), experts
dequantised at load. Anything else keeps the torch path, with the reason logged once.

Weights the native products read as ``[in, out]`` are stored that way once, in place: the parameter
becomes a transposed view of the same memory (no copy is kept), which torch's own products take as
readily, so both paths share one copy.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from ctypes import POINTER, byref, c_int, c_int64, c_void_p
from pathlib import Path

import torch
from torch import nn

from ..config import AttnKind, ModelConfig
from ..environment import NativeBuild, cache_root, native_build
from ..native_build import OnceLibrary, build_library, cpu_key, sanitized
from . import host_f8pairs, host_pairs, host_q8
from .host_views import StepViews
from .host_support import kn_store, kn_stored, packed_unsupported as _packed_unsupported, \
    stored_unsupported as _stored_unsupported
from .batch import BatchView, LayerState
from .host_abi import MAX_CAPTURES, _Arena, _Dims, _Layer, _Model, _StepView, _Weight, abi
from .packed import PackedExperts
from .stored import StoredWeight

log = logging.getLogger(__name__)

# one translation unit: csrc/host.c includes host.h and the parts (the map is in host.h)
_CSRC = Path(__file__).with_name("csrc")
# -ffp-contract=off: the compiler never fuses a * b + c on its own; the source says where a multiply-add
# is fused (vfma / sfma in csrc/host.h), so every path that promises the same bits rounds the same way on
# every instruction set (with GCC's default contraction, rows of one batch differed on an AVX2 CPU)
_BASE_FLAGS = ["-O3", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-fast-math"]
SMALL_OUT = 64  # projections with fewer outputs get a padded [in, out] copy (see HostForward._weight)
# ---- building and loading the library ----------------------------------------------------------

def _attempts(build: NativeBuild) -> list[list[str]]:
    """The ``-march`` flags to try: ``native`` falls back to the compiler's baseline where the compiler
    cannot tune for this CPU; a named target does not fall back (a test that asks for it must get it)."""
    if build.target == "native":
        return [["-march=native"], []]
    return [[]] if build.target == "baseline" else [[f"-march={build.target}"]]


def _load() -> ctypes.CDLL:
    """Built for the target ``environment.native_build()`` names (each failed attempt's error kept)."""
    build = native_build()
    extra = sanitized(["-DDS4_CHECK"] if build.check else [], build.sanitize)
    source = (_CSRC / "host.c").read_text()
    included = "".join(p.read_text() for p in sorted(_CSRC.glob("host*")))  # any edit to a part rebuilds
    errors = []
    for march in _attempts(build):
        try:
            # the unit's name must not be a part's: the compiler would find the unit itself for that #include
            path = build_library(cache_root() / "native", "host_unit", source,
                                 _BASE_FLAGS + [f"-I{_CSRC}"] + march + extra, ["-lm"], key=cpu_key() + included)
            lib = _bind(ctypes.CDLL(str(path)))
        except (OSError, RuntimeError) as exc:
            errors.append(f"{' '.join(march) or 'baseline'}: {exc}")
            continue
        lib.ds4_description = (f"{' '.join(march) or 'the compiler baseline'}{' + checks' if build.check else ''}"
                               f"{' + sanitizers' if build.sanitize else ''} ({lib.ds4_build_info().decode()})")
        if errors:
            log.info("host forward built without -march=native (%s)", errors[-1])
        log.info("host forward built for %s", lib.ds4_description)
        return lib
    raise RuntimeError("; ".join(errors))


_library = OnceLibrary(_load, log, "host decode kernels unavailable (%s); decode runs on the torch path")


def library() -> ctypes.CDLL | None:
    """The built decode library, or ``None`` (the torch path is used) when it cannot be built here."""
    return _library.get()


def description() -> str | None:
    """What the library was built for (target, vector width, FMA), or None when it was not built."""
    lib = _library.get()
    return getattr(lib, "ds4_description", None) if lib is not None else None


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.ds4_vector_width.restype = c_int
    lib.ds4_build_info.restype = ctypes.c_char_p
    host_q8.bind(lib)
    host_pairs.bind(lib)
    host_f8pairs.bind(lib)
    lib.ds4_abi_names.restype = ctypes.c_char_p
    lib.ds4_abi.argtypes = [POINTER(c_int64), c_int64]
    lib.ds4_abi.restype = c_int64
    lib.ds4_limits = abi(lib)
    lib.ds4_forward.argtypes = [POINTER(_Model), POINTER(_StepView), c_void_p, c_int64, c_int64, POINTER(_Arena),
                                c_int]
    lib.ds4_forward.restype = c_int
    lib.ds4_forward_captured.argtypes = [POINTER(_Model), POINTER(_StepView), c_void_p, c_int64, c_int64,
                                         POINTER(_Arena), c_int, c_void_p, c_int64, c_int, c_void_p]
    lib.ds4_forward_captured.restype = c_int
    lib.ds4_logits.argtypes = [POINTER(_Model), c_void_p, c_int64, c_void_p, POINTER(_Arena), c_int]
    lib.ds4_logits.restype = c_int
    lib.ds4_linear.argtypes = [c_void_p, c_int64, c_int64, POINTER(_Weight), c_int64, c_void_p, c_int64, c_int]
    lib.ds4_linear.restype = c_int
    lib.ds4_arena_free.argtypes = [POINTER(_Arena)]
    lib.ds4_pool_check.argtypes = [c_int64, c_int64, c_int]
    lib.ds4_pool_check.restype = c_int64
    lib.ds4_pool_job_check.argtypes = [c_int64, c_int64, c_int]
    lib.ds4_pool_job_check.restype = c_int64
    lib.ds4_pool_submit.argtypes = [c_void_p, c_void_p, c_int]
    lib.ds4_pool_submit.restype = c_int
    lib.ds4_pool_join.argtypes = []
    lib.ds4_pool_join.restype = c_int
    return lib


# ---- the decoder ---------------------------------------------------------------------------------

def unsupported(cfg: ModelConfig, model: nn.Module, states: list[LayerState],
                limits: dict[str, int] | None = None) -> str | None:
    """Why this model and state cannot take the native decode (None: it can); ``limits``: the library's
    fixed sizes (``ds4_abi``; by default the built library's)."""
    if limits is None:
        lib = library()
        if lib is None:
            return f"the kernels could not be built ({_library.failure})"
        limits = lib.ds4_limits
    params = list(model.parameters()) + [t for st in states for t in (st.swa, st.comp_ring, st.comp_pool,
                                                                      st.idx_ring, st.idx_pool) if t is not None]
    if any(p.device.type != "cpu" for p in params):
        return "not on the host"
    embed = model.model.embed_tokens.weight
    if any(p.is_floating_point() and p.dtype != torch.float32 and p is not embed for p in params) \
            or embed.dtype not in (torch.float32, torch.bfloat16):
        return "weights or state not in float32"
    for name, module in model.named_modules():
        why = _stored_unsupported(getattr(module, "weight", None), name)
        if why:
            return why
    layers = model.model.layers
    if any(ly.self_attn.reduce is not None or ly.mlp.reduce is not None or ly.mlp.expert_range is not None
           for ly in layers):
        return "tensor / expert parallel"
    for ly in layers:
        why = _packed_unsupported(ly.mlp.experts.gate_up_proj, 2) or _packed_unsupported(ly.mlp.experts.down_proj, 1)
        if why:
            return why
    n_keys = len({(r, k) for r, k in zip(cfg.compress_ratios, cfg.attn_kinds) if r})
    if cfg.n_routed_experts > limits["MAX_EXPERTS"] or cfg.hc_mult > limits["MAX_HC"] \
            or 2 * max(cfg.compress_ratios) > limits["MAX_SPAN"] or n_keys > limits["MAX_RATIOS"]:
        return (f"more than {limits['MAX_EXPERTS']} experts, {limits['MAX_HC']} hyper-connection streams, "
                f"{limits['MAX_RATIOS']} kinds of compressed layer or a compress span over {limits['MAX_SPAN']}")
    return None


class HostForward:
    """The native decode forward and LM head of one model over one ``ModelState``'s tensors."""

    def __init__(self, cfg: ModelConfig, model: nn.Module, states: list[LayerState], lib: ctypes.CDLL,
                 moe_activations: str = "fp32",  # "int8": packed experts interleaved for host_q8.c
                 head_activations: str = "fp32",  # "bf16": a bf16 head on bf16-rounded rows (host_pairs.c)
                 fp8_activations: str = "fp32"):  # "bf16": FP8 projections on bf16-rounded rows (host_f8pairs.c)
        self.cfg, self.lib, self.moe_activations = cfg, lib, moe_activations
        self.head_activations, self.fp8_activations = head_activations, fp8_activations
        self.fp8_pairs: list[StoredWeight] = []  # FP8 weights on the pair product (f8p_disagrees probes one)
        self.fp8_kept: list[str] = []  # FP8 weights left on fp32 rows with bf16 asked for, and why
        self.vw = lib.ds4_vector_width()
        self._keep: list[torch.Tensor] = []  # every tensor a pointer was taken from
        self._q8_stacks: list[PackedExperts] = []  # stacks the int8 product reads, in layer order
        self.comp_keys = sorted({(r, cfg.attn_kinds[i] is AttnKind.CSA) for i, r in enumerate(cfg.compress_ratios) if r})
        self.ratios = list(cfg.distinct_ratios)
        self._states = states
        self._bf16_head = host_pairs.bf16_head(model)  # what p16_disagrees probes
        self._layers = (_Layer * cfg.num_layers)(*[self._layer(i, ly, st) for i, (ly, st)
                                                   in enumerate(zip(model.model.layers, states))])
        m = model.model
        table = m.embed_tokens.weight
        bf16 = table.dtype == torch.bfloat16
        self.model = _Model(
            embed=None if bf16 else self._ptr(table), embed_bf16=self._ptr(table) if bf16 else None, **{name: self._ptr(getattr(model, name, None)) for name in (
                "image_start", "image_pad", "image_newline", "image_end")},
            inv_freq_main=self._ptr(model.inv_freq_main),
            inv_freq_comp=self._ptr(model.inv_freq_compress), af_main=cfg.rope_main.attention_factor,
            af_comp=cfg.rope_compress.attention_factor, head_fn=self._weight(m.hc_head.hc_fn),
            head_base=self._ptr(m.hc_head.hc_base), head_scale=self._ptr(m.hc_head.hc_scale),
            final_norm=self._ptr(m.norm.weight), lm_head=self._head(model.lm_head.weight), n_layers=cfg.num_layers,
            layers=self._layers, d=self._dims(cfg))
        self._arena, self._head_arena = _Arena(), _Arena()
        self._views = StepViews(cfg, self.comp_keys, self.ratios, self._layers, states)
        self._layer_ids: dict[tuple[int, ...], torch.Tensor] = {}  # a drafter's captured layers, as passed to C

    @classmethod
    def create(cls, cfg: ModelConfig, model: nn.Module, states: list[LayerState],
               moe_activations: str = "auto", head_activations: str = "auto",
               fp8_activations: str = "auto") -> tuple["HostForward | None", str]:
        """The decoder, or ``(None, why not)``; the activations' modes: ``choose_*_activations`` in
        ``host_q8`` (moe), ``host_pairs`` (head) and ``host_f8pairs`` (fp8)."""
        lib = library()
        if lib is None:
            return None, f"the kernels could not be built ({_library.failure})"
        why = unsupported(cfg, model, states, lib.ds4_limits)
        if why is not None:
            return None, why
        mode = host_q8.choose_moe_activations(model, moe_activations, lib.ds4_limits)
        head = host_pairs.choose_head_activations(model, head_activations, lib)
        return cls(cfg, model, states, lib, mode, head, host_f8pairs.choose_fp8_activations(model, fp8_activations, lib)), ""

    def q8_disagrees(self) -> str | None:  # the int8 product on the first layer's stacks (host_q8)
        return host_q8.q8_disagrees(self.lib, self._q8_stacks[:2])

    def p16_disagrees(self) -> str | None:  # the bf16-pair head product against its definition (host_pairs)
        head = self._bf16_head
        return None if self.head_activations != "bf16" or head is None else host_pairs.p16_disagrees(self.lib, head)

    def f8p_disagrees(self) -> str | None:  # the FP8 bf16-pair product against its definition (host_f8pairs)
        return host_f8pairs.f8p_disagrees(self.lib, self.fp8_pairs[0]) if self.fp8_pairs else None

    def _head(self, w: torch.Tensor | StoredWeight) -> _Weight:
        """The LM head's descriptor: ``_weight``'s, on bf16-rounded rows where ``head_activations`` says."""
        desc = self._weight(w)
        if self.head_activations == "bf16" and desc.fmt == 2:
            desc.fmt = host_pairs.FMT_PAIRS
        return desc

    def close(self) -> None:
        for arena in (self._arena, self._head_arena):
            self.lib.ds4_arena_free(byref(arena))

    def __del__(self):  # the arenas are C memory
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ---- per step ----------------------------------------------------------------------------
    @staticmethod
    def takes(view: BatchView) -> bool:
        """Whether ``forward`` runs this view (every view the engine builds, up to ``MAX_CAPTURES``
        prefix-cache snapshots inside one forward)."""
        return len(view.captures or {}) <= MAX_CAPTURES

    def forward(self, view: BatchView, start: int = 0, stop: int | None = None,
                streams: torch.Tensor | None = None) -> torch.Tensor:
        """Layers ``[start, stop)`` of ``view`` (decode rows, prefill chunks, image blocks): from the
        embedding when ``start`` is 0, else from ``streams [T, hc, D]`` (updated in place and returned).
        State tensors (rings, pools, snapshot rows) are written in place, exactly where the torch path
        writes them."""
        return self.forward_captured(view, (), True, start, stop, streams)[0]

    def forward_captured(self, view: BatchView, layers: tuple[int, ...], mean_hc: bool, start: int = 0,
                         stop: int | None = None, streams: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` that also returns the outputs of ``layers`` (ascending, inside ``[start, stop)``)
        for a model drafter, ``[T, len(layers) * W]`` in that order: W = D with ``mean_hc`` (the mean over
        the hc copies), else hc * D (every copy). One native call: a forward split at each captured
        layer costs a call, a step view and a scratch plan per piece."""
        if not self.takes(view):
            raise ValueError(f"the native forward takes at most {MAX_CAPTURES} prefix snapshots per forward")
        stop = self.cfg.num_layers if stop is None else stop
        if list(layers) != sorted(set(layers)) or any(not start <= layer < min(stop, self.cfg.num_layers) for layer in layers):
            raise ValueError(f"captured layers {layers} must be distinct, ascending and inside [{start}, {stop})")
        T, hc, D = view.num_tokens, self.cfg.hc_mult, self.cfg.hidden_size
        keep: list[torch.Tensor] = []
        sv = self._views.describe(view, keep)
        if start == 0:
            streams = torch.empty(T, hc, D)
        elif streams is None or streams.dtype != torch.float32 or not streams.is_contiguous() \
                or tuple(streams.shape) != (T, hc, D):
            raise ValueError("a forward from a middle layer needs its input streams [T, hc, D] (contiguous fp32)")
        captured = torch.empty(T, len(layers) * (D if mean_hc else hc * D))
        ids = self._layer_ids.get(key := tuple(layers))
        if ids is None:
            ids = self._layer_ids[key] = torch.tensor(key, dtype=torch.int64)
        rc = self.lib.ds4_forward_captured(byref(self.model), byref(sv), streams.data_ptr(), start, stop,
                                           byref(self._arena), torch.get_num_threads(), ids.data_ptr(), len(layers),
                                           int(mean_hc), captured.data_ptr() if layers else None)
        _check(rc)
        return streams, captured

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        """``DS4ForCausalLM.logits`` natively: fp32 logits ``[N, vocab]`` of streams ``[N, hc, D]``."""
        streams = streams.contiguous()
        if streams.dtype != torch.float32 or streams.device.type != "cpu":
            raise ValueError("the native LM head takes host float32 streams")
        out = torch.empty(streams.shape[0], self.cfg.vocab_size)
        rc = self.lib.ds4_logits(byref(self.model), streams.data_ptr(), streams.shape[0], out.data_ptr(),
                                 byref(self._head_arena), torch.get_num_threads())
        _check(rc)
        return out

    # ---- descriptors (once) ------------------------------------------------------------------
    def _ptr(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        if not t.is_contiguous():
            raise ValueError("a tensor the native decode reads is not contiguous")
        self._keep.append(t)
        return t.data_ptr()

    def _stored(self, w: StoredWeight, kn: bool, group: int) -> _Weight:
        """A weight kept at the checkpoint's width: bf16 read ``[out, in]`` as loaded; FP8 codes stored
        ``[in, out]`` (once, rows padded: ``kn_stride``; the torch path reads the transposed view) with
        the block scales (``csrc/host_stored.c``), or, with ``out`` not whole vectors (or o_a's ``group``
        of outputs not whole scale blocks), dequantised."""
        n_out, n_in = w.shape
        if w.fmt == "bf16":
            self._keep.append(w.data)
            return _Weight(None, n_in, 0, 2, w.data.data_ptr(), None, 0, 0, 0, 0)
        if n_out % self.vw or (group and group % w.block[0]):  # o_a's groups must start on a block
            return self._weight(nn.Parameter(w.dense(), requires_grad=False), kn)  # a copy the C alone reads
        if not kn_stored(w.data):
            w.data = kn_store(w.data)
        scales = w.scales.contiguous()
        self._keep += [w.data, scales]
        fmt = host_f8pairs.fmt_for(w, self.fp8_activations, self.fp8_pairs, self.fp8_kept)  # 1 or 4 (pairs)
        return _Weight(None, w.data.stride(1), 1, fmt, w.data.data_ptr(), scales.data_ptr(), *w.block, *scales.shape[::-1])

    def _weight(self, param: torch.Tensor | StoredWeight, kn: bool = True, group: int = 0) -> _Weight:
        """A projection weight ``[out, in]`` as the kernels read it best: stored ``[in, out]`` (rows padded
        off 4 KiB multiples: ``host_support.kn_stride``) when ``out`` is whole vectors; a small ``out``
        (mHC mixes, router, indexer head weights: 4-24 columns) as a separate ``[in, out]`` copy padded
        with zero columns to whole vectors (a few KB); else as it is (dot products along ``in``). Stored
        weights: ``_stored``."""
        if isinstance(param, StoredWeight):
            return self._stored(param, kn, group)
        n_out, n_in = param.shape
        data = param.data
        if kn and n_out % self.vw == 0:
            if not kn_stored(data):  # not yet stored transposed (rows padded: kn_stride): do it once
                param.data = kn_store(data)
            self._keep.append(param.data)
            return _Weight(param.data.data_ptr(), param.data.stride(1), 1)
        if kn and n_out < SMALL_OUT:
            width = -(-n_out // self.vw) * self.vw
            copy = torch.zeros(n_in, width)
            copy[:, :n_out] = data.t()
            self._keep.append(copy)
            return _Weight(copy.data_ptr(), width, 1)
        if not data.is_contiguous():
            param.data = data.contiguous()
        self._keep.append(param.data)
        return _Weight(param.data.data_ptr(), n_in, 0)

    def _layer(self, i: int, ly: nn.Module, st: LayerState) -> _Layer:
        cfg, a, f = self.cfg, ly.self_attn, ly.mlp
        kind = {AttnKind.SLIDING: 0, AttnKind.CSA: 1, AttnKind.HCA: 2}[cfg.attn_kinds[i]]
        out = _Layer(kind=kind, ratio=cfg.compress_ratios[i], tid2eid_rows=cfg.vocab_size,
                     has_shared=int(f.shared_experts is not None))
        if kind:
            out.comp_key = self.comp_keys.index((cfg.compress_ratios[i], kind == 1))
            out.vis_key = self.ratios.index(cfg.compress_ratios[i])
        for name, hc in (("hc_attn", ly.attn_hc), ("hc_ffn", ly.ffn_hc)):
            setattr(out, f"{name}_fn", self._weight(hc.fn))
            setattr(out, f"{name}_base", self._ptr(hc.base))
            setattr(out, f"{name}_scale", self._ptr(hc.scale))
        out.attn_norm, out.ffn_norm = self._ptr(ly.input_layernorm.weight), self._ptr(ly.post_attention_layernorm.weight)
        out.q_a, out.q_b, out.kv = self._weight(a.q_a_proj.weight), self._weight(a.q_b_proj.weight), \
            self._weight(a.kv_proj.weight)
        out.o_a = self._weight(a.o_a_proj.weight, kn=cfg.o_lora_rank % self.vw == 0, group=cfg.o_lora_rank)
        out.o_b = self._weight(a.o_b_proj.weight)
        out.q_a_norm, out.kv_norm, out.sinks = self._ptr(a.q_a_norm.weight), self._ptr(a.kv_norm.weight), \
            self._ptr(a.sinks)
        if a.compressor is not None:
            c = a.compressor
            out.c_kv, out.c_gate = self._weight(c.kv_proj.weight), self._weight(c.gate_proj.weight)
            out.c_ape, out.c_norm = self._ptr(c.position_bias), self._ptr(c.kv_norm.weight)
            if c.indexer is not None:
                ix = c.indexer
                out.i_kv, out.i_gate = self._weight(ix.kv_proj.weight), self._weight(ix.gate_proj.weight)
                out.i_q_b, out.i_w = self._weight(ix.q_b_proj.weight), self._weight(ix.scorer.weights_proj.weight)
                out.i_ape, out.i_norm = self._ptr(ix.position_bias), self._ptr(ix.kv_norm.weight)
        self._moe(out, f)
        for name in ("swa", "comp_ring", "comp_pool", "idx_ring", "idx_pool"):
            setattr(out, name, self._ptr(getattr(st, name)))
        out.swa_rows = st.swa.shape[0]
        out.comp_ring_rows = st.comp_ring.shape[0] if st.comp_ring is not None else 0
        out.idx_ring_rows = st.idx_ring.shape[0] if st.idx_ring is not None else 0
        out.comp_pool_rows = st.comp_pool.shape[0] if st.comp_pool is not None else 0
        out.idx_pool_rows = st.idx_pool.shape[0] if st.idx_pool is not None else 0
        return out

    def _moe(self, out: _Layer, f: nn.Module) -> None:
        out.gate = self._weight(f.gate.weight)
        out.bias_vl = self._ptr(getattr(f.gate, "bias_vl", None))
        if f.is_hash:
            out.tid2eid = self._ptr(f.gate.tid2eid)
        else:
            out.gate_bias = self._ptr(f.gate.e_score_correction_bias)
        gate_up, down = f.experts.gate_up_proj, f.experts.down_proj
        if isinstance(gate_up, PackedExperts):
            self._packed(out, gate_up, down)
        else:
            self._dense_experts(out, gate_up, down)
        if f.shared_experts is not None:
            s = f.shared_experts
            out.sh_gate, out.sh_up, out.sh_down = self._weight(s.gate_proj.weight), self._weight(s.up_proj.weight), \
                self._weight(s.down_proj.weight)

    def _packed(self, out: _Layer, gate_up: PackedExperts, down: PackedExperts) -> None:
        """MXFP4 stacks read where they are (codes and scales as loaded, or rewritten in place into the
        int8 product's layout; nothing is copied)."""
        q8 = self.moe_activations == "int8"
        for stack in (gate_up, down):
            stack.interleave(q8, functools.partial(host_q8.interleave_part, self.lib))
        self._q8_stacks += [gate_up, down] if q8 else []
        out.exp_packed, out.exp_q8, out.qgu_parts = 1, int(q8), len(gate_up.parts)
        for i, p in enumerate(gate_up.parts):
            out.qgu_codes[i], out.qgu_scales[i] = self._ptr(p.codes), self._ptr(p.scales)
            out.qgu_rows[i] = p.codes.shape[1]
        out.qdn_codes, out.qdn_scales = self._ptr(down.parts[0].codes), self._ptr(down.parts[0].scales)

    def _dense_experts(self, out: _Layer, gate_up: torch.nn.Parameter, down: torch.nn.Parameter) -> None:
        # per expert [in, out] (in place: the parameters become transposed views, which torch's grouped
        # products take as they are) when both outputs are whole vectors, else as the checkpoint has them
        out.exp_kn = int(gate_up.shape[1] % self.vw == 0 and down.shape[1] % self.vw == 0)
        for p in (gate_up, down):
            stored = p.data.transpose(1, 2)
            if out.exp_kn and not stored.is_contiguous():
                p.data = stored.contiguous().transpose(1, 2)
            elif not out.exp_kn and not p.data.is_contiguous():
                p.data = p.data.contiguous()
            self._keep.append(p.data)
        out.exp_gate_up, out.exp_down = gate_up.data.data_ptr(), down.data.data_ptr()

    @staticmethod
    def _dims(cfg: ModelConfig) -> _Dims:
        scoring = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}[cfg.scoring_func]
        return _Dims(hidden=cfg.hidden_size, hc=cfg.hc_mult, n_heads=cfg.num_heads, head_dim=cfg.head_dim,
                     rope_dim=cfg.rope_dim, q_lora=cfg.q_lora_rank, o_groups=cfg.o_groups, o_lora=cfg.o_lora_rank,
                     idx_heads=cfg.index_n_heads, idx_dim=cfg.index_head_dim, idx_topk=cfg.index_topk,
                     n_experts=cfg.n_routed_experts, top_k=cfg.n_experts_per_tok, moe_inter=cfg.moe_intermediate_size,
                     shared_inter=cfg.moe_intermediate_size * cfg.n_shared_experts, vocab=cfg.vocab_size,
                     sinkhorn_iters=cfg.hc_sinkhorn_iters, scoring=scoring, norm_topk=int(cfg.norm_topk_prob),
                     window=cfg.sliding_window,
                     rms_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, swiglu_limit=cfg.swiglu_limit,
                     routed_scale=cfg.routed_scaling_factor)


def _check(rc: int) -> None:
    if rc == -1:
        raise MemoryError("the native decode could not allocate its scratch memory")
    if rc == -2:
        raise ValueError("a token id is outside the vocabulary (or an image row outside the forward)")
    if rc == -3:
        raise ValueError("a view beyond the native forward's fixed limits (compressor keys, ratios or captures)")
    if rc != 0:
        raise RuntimeError(f"the native decode failed ({rc})")
