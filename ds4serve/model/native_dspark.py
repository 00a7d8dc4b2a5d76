"""The DSpark drafter's forward in C (``csrc/host_dspark.c``), for a target on the host forward.

Why: the torch drafter (``dspark.py``) is ~300 dispatched ops a block, 2.3-3.3 ms on two cores for the
bundled model, against a ~0.7 ms target step: it cost more than the drafts saved. The C forward runs
the same network (commit's ring rows; the block's stages, ``hc_head``, norm and the shared LM head; the
greedy Markov and confidence heads) as one call, each request on its own in a fixed order, so a
request's drafts do not depend on its batch. Rings stay the torch drafter's ``DSparkRings`` (fp32), so
readiness, snapshots and restores are shared with it.

Where it applies (``unsupported`` says why not, and the torch drafter runs): fp32 host tensors for every
drafter weight (no packed experts), the shared embedding and LM head, the bounds of the C file's stack
arrays. Sampled blocks take the C forward's base logits and hidden states through the torch
``markov_sample`` with the engine's own draws (the Markov loop is B small steps); greedy blocks stay in
C end to end.
"""

from __future__ import annotations

import ctypes
import logging
from ctypes import POINTER, Structure, c_float, c_int, c_int64, c_void_p
from pathlib import Path

import torch

from ..environment import cache_root, native_build
from ..native_build import OnceLibrary, build_library, cpu_key, sanitized
from .dspark import DSparkRings, _rope_freqs
from .dspark_weights import DSparkWeights
from .host_forward import _BASE_FLAGS, _attempts, library as host_library

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SCORING = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}
# host_dspark.c's stack arrays (ds_draft refuses beyond): ring rows, hc streams, experts, block rows x top_k
MAX_WINDOW, MAX_HC, MAX_EXPERTS, MAX_ROUTES = 4096, 16, 512, 1024

_DIMS = ("D", "hc", "H", "hd", "rd", "q_lora", "o_groups", "o_lora", "n_exp", "top_k", "inter", "sh_inter", "V",
         "iters", "scoring", "norm_topk", "W", "S", "B", "rank", "L", "noise", "lm_kn", "capacity")
_STAGE = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale", "attn_norm.weight",
          "ffn_norm.weight", "attn.wq_a.weight", "attn.q_norm.weight", "attn.wq_b.weight", "attn.wkv.weight",
          "attn.kv_norm.weight", "attn.attn_sink", "attn.wo_a.weight", "attn.wo_b.weight", "ffn.gate.weight",
          "ffn.gate.bias", "experts.gate_up", "experts.down", "ffn.shared_experts.w1.weight",
          "ffn.shared_experts.w3.weight", "ffn.shared_experts.w2.weight")
_HEADS = ("main_proj", "main_norm", "norm", "head_fn", "head_base", "head_scale", "w1", "w2", "wc", "embed", "lm_head",
          "inv_freq")
# the linears host_dspark.c's ds_linear_rows reads transposed ([in, out] contiguous; stacked ones per expert)
_KN_STAGE = frozenset({"attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_b.weight",
                       "experts.gate_up", "experts.down", "ffn.shared_experts.w1.weight",
                       "ffn.shared_experts.w3.weight", "ffn.shared_experts.w2.weight"})
_KN_HEADS = frozenset({0, 7})  # main_proj, markov w2


class _Dims(Structure):
    _fields_ = [(n, c_int64) for n in _DIMS] + [(n, c_float) for n in ("eps", "hc_eps", "limit", "rscale")]


class _Stage(Structure):
    _fields_ = [(f"t{i}", c_void_p) for i in range(len(_STAGE))]


class _Model(Structure):
    _fields_ = [("d", _Dims), ("stages", POINTER(_Stage))] + [(n, c_void_p) for n in _HEADS]


class _Job(Structure):  # host_dspark.c DSJob
    _fields_ = [("m", c_void_p), ("n_rows", c_int64), ("rows", c_void_p), ("row_pos", c_void_p),
                ("row_slots", c_void_p), ("R", c_int64), ("anchors", c_void_p), ("anchor_pos", c_void_p),
                ("slots", c_void_p), ("ring_kv", c_void_p), ("ring_pos", c_void_p), ("ready", c_void_p),
                ("tokens", c_void_p), ("survival", c_void_p), ("rc", c_int64), ("commit_ns", c_int64),
                ("propose_ns", c_int64)]


def _load() -> ctypes.CDLL:
    build = native_build()
    extra = sanitized(["-DDS4_CHECK"] if build.check else [], build.sanitize)
    source = (_CSRC / "host_dspark.c").read_text()
    key = cpu_key() + (_CSRC / "host.h").read_text()
    errors = []
    for march in _attempts(build):
        try:
            path = build_library(cache_root() / "native", "dspark_unit", source,
                                 _BASE_FLAGS + [f"-I{_CSRC}"] + march + extra, ["-lm"], key=key)
            lib = ctypes.CDLL(str(path))
        except (OSError, RuntimeError) as exc:
            errors.append(f"{' '.join(march) or 'baseline'}: {exc}")
            continue
        lib.ds_commit.argtypes = [POINTER(_Model), c_int64, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p]
        lib.ds_commit.restype = c_int
        lib.ds_draft.argtypes = [POINTER(_Model), c_int64] + [c_void_p] * 5 + [c_int64] + [c_void_p] * 4
        lib.ds_draft.restype = c_int
        lib.ds_commit_rows.argtypes = [POINTER(_Model), c_int64] + [c_void_p] * 5
        lib.ds_commit_rows.restype = c_int
        lib.ds_propose_greedy.argtypes = [POINTER(_Model), c_int64] + [c_void_p] * 8
        lib.ds_propose_greedy.restype = c_int
        lib.ds_ready.argtypes = [POINTER(_Model), c_int64] + [c_void_p] * 4
        lib.ds_ready.restype = None
        lib.ds_job_run.argtypes = [c_void_p]
        lib.ds_job_run.restype = None
        return lib
    raise RuntimeError("; ".join(errors))


_library = OnceLibrary(_load, log, "native DSpark drafter unavailable (%s); the torch drafter runs")


def library() -> ctypes.CDLL | None:
    return _library.get()


def _fp32(t) -> torch.Tensor | None:
    """A host fp32 tensor as the C forward reads it (contiguous), or None when it is not one."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dtype != torch.float32:
        return None
    return t.contiguous()


def unsupported(weights: DSparkWeights, target) -> str | None:
    """Why the C forward cannot run this drafter beside this target (None: it can)."""
    cfg = weights.config
    if library() is None:
        return "the native library could not be built"
    for s, st in enumerate(weights.stages):
        for name in _STAGE:
            if name in st and _fp32(st[name]) is None:
                return f"stage {s} tensor {name} is not an fp32 host tensor ({type(st[name]).__name__})"
    for t in (target.model.embed_tokens.weight, target.lm_head.weight):
        if t.device.type != "cpu" or t.dtype != torch.float32:
            return "the shared embedding / LM head is not fp32 on the host"
    if cfg.trunk.scoring_func not in _SCORING:
        return f"scoring function {cfg.trunk.scoring_func!r}"
    if (cfg.window > MAX_WINDOW or cfg.trunk.hc_mult > MAX_HC or cfg.n_routed_experts > MAX_EXPERTS
            or cfg.block_size * cfg.n_activated_experts > MAX_ROUTES):
        return "a width beyond host_dspark.c's stack arrays"
    return None


def _kn(name: str, t: torch.Tensor | None, groups: int) -> torch.Tensor | None:
    """Stage tensor ``name`` as host_dspark.c reads it: a linear of ``_KN_STAGE`` transposed (``[.., in,
    out]``, made contiguous by ``_ptr``: a copy the size of the drafter's linears, the torch drafter keeps
    the stored one), ``attn.wo_a`` per output group (``[G, in / G, o_lora]``), anything else as stored."""
    if t is None or t.dim() < 2:
        return t
    if name == "attn.wo_a.weight":
        return t.reshape(groups, t.shape[0] // groups, t.shape[1]).transpose(1, 2)
    return t.transpose(-1, -2) if name in _KN_STAGE else t


class NativeDSpark:
    """The C drafter bound to one drafter's weights, the target's shared embedding and head, and one
    ``DSparkRings`` pool (whose tensors the C calls read and write in place)."""

    def __init__(self, weights: DSparkWeights, target, rings: DSparkRings):
        why = unsupported(weights, target)
        if why is not None:
            raise RuntimeError(f"native DSpark drafter: {why}")
        self.lib, self.weights, self.rings = library(), weights, rings
        cfg, tc = weights.config, weights.config.trunk
        last = weights.stages[-1]
        lm = target.lm_head.weight
        lm_kn = lm.dim() == 2 and lm.stride() == (1, lm.shape[0])  # stored [D, V] (host_forward's in-place transpose)
        self._keep: list[torch.Tensor] = []  # every tensor a pointer below points into
        self._stages = (_Stage * len(weights.stages))(*[
            _Stage(*[self._ptr(_kn(name, st.get(name), tc.o_groups)) for name in _STAGE]) for st in weights.stages])
        st0 = weights.stages[0]
        shared = st0.get("ffn.shared_experts.w1.weight")
        dims = dict(D=tc.hidden_size, hc=tc.hc_mult, H=tc.num_heads, hd=tc.head_dim, rd=tc.rope_dim,
                    q_lora=tc.q_lora_rank, o_groups=tc.o_groups, o_lora=tc.o_lora_rank, n_exp=cfg.n_routed_experts,
                    top_k=cfg.n_activated_experts, inter=st0["experts.gate_up"].shape[1] // 2,
                    sh_inter=0 if shared is None else shared.shape[0], V=lm.shape[0], iters=tc.hc_sinkhorn_iters,
                    scoring=_SCORING[tc.scoring_func], norm_topk=int(tc.norm_topk_prob), W=cfg.window,
                    S=cfg.n_stages, B=cfg.block_size, rank=cfg.markov_rank, L=len(cfg.target_layer_ids),
                    noise=cfg.noise_token_id, lm_kn=int(lm_kn), capacity=rings.capacity)
        d = _Dims(*[dims[n] for n in _DIMS], tc.rms_norm_eps, tc.hc_eps, tc.swiglu_limit, tc.routed_scaling_factor)
        heads = [st0["main_proj.weight"], st0["main_norm.weight"], last["norm.weight"], last["hc_head_fn"],
                 last["hc_head_base"], last["hc_head_scale"], last["markov_head.markov_w1.weight"],
                 last["markov_head.markov_w2.weight"], last["confidence_head.proj.weight"],
                 target.model.embed_tokens.weight, lm, _rope_freqs(cfg, "cpu")]
        heads = [t.t() if i in _KN_HEADS else t for i, t in enumerate(heads)]
        self.model = _Model(d, self._stages, *[self._ptr(t, raw=(i == 10 and lm_kn)) for i, t in enumerate(heads)])
        self.vocab, self.block, self.hidden = dims["V"], cfg.block_size, tc.hidden_size
        self._arrays: _JobArrays | None = None  # ``start``'s, made on its first job
        self._job_fn: int | None = None  # the address of ``ds_job_run``

    def _ptr(self, t: torch.Tensor | None, raw: bool = False) -> int | None:
        if t is None:
            return None
        t = t if raw else _fp32(t)
        self._keep.append(t)
        return t.data_ptr()

    def commit(self, slots: torch.Tensor, positions: torch.Tensor, captured: torch.Tensor) -> None:
        """Ring rows of ``captured [N, L * D]`` at ``positions [N]`` for pool ``slots [N]`` (dspark.commit)."""
        captured = captured.reshape(captured.shape[0], -1).float().contiguous()
        positions, slots = positions.contiguous(), slots.contiguous()
        if self.lib.ds_commit(ctypes.byref(self.model), positions.shape[0], captured.data_ptr(), positions.data_ptr(),
                              slots.data_ptr(), self.rings.kv.data_ptr(), self.rings.pos.data_ptr()) != 0:
            raise MemoryError("native DSpark commit: out of memory")

    def commit_rows(self, rows: list[int], positions: list[int], slots: list[int]) -> None:
        """``commit`` of captured rows given as addresses (``rows[i]``: L * D contiguous fp32 values, kept
        alive by the caller), with plain lists for the rest: the engine's path, no tensor built per call."""
        n = len(rows)
        if n == 0:
            return
        if self.lib.ds_commit_rows(ctypes.byref(self.model), n, (c_void_p * n)(*rows), (c_int64 * n)(*positions),
                                   (c_int64 * n)(*slots), self.rings.kv.data_ptr(), self.rings.pos.data_ptr()) != 0:
            raise MemoryError("native DSpark commit: out of memory")

    def start(self, rows: list[int], positions: list[int], row_slots: list[int], slots: list[int],
              anchors: list[int], anchor_positions: list[int], threads: int, keep: list | None = None) -> DSparkJob:
        """``commit_rows(rows, positions, row_slots)`` then ``propose_greedy(slots, anchors, anchor_positions)``
        as one job on the host pool's worker (``DSparkJob.wait`` for its results; one job at a time); where
        the pool cannot take it (one thread, the pool busy, no host unit) it has run by the time this
        returns. ``keep``: the tensors ``rows`` point into, held until the wait."""
        a = self._arrays
        if a is None or len(rows) > a.n_cap or len(slots) > a.r_cap:
            a = self._arrays = _JobArrays(self, max(len(rows), 256), max(len(slots), self.rings.capacity))
        a.fill(rows, positions, row_slots, slots, anchors, anchor_positions)
        host = host_library()
        if host is None:
            self.lib.ds_job_run(a.address)
            return DSparkJob(a, self.block, False, keep or [])
        if self._job_fn is None:
            self._job_fn = ctypes.cast(self.lib.ds_job_run, c_void_p).value
        return DSparkJob(a, self.block, host.ds4_pool_submit(self._job_fn, a.address, threads) == 1, keep or [])

    def ready(self, slots: list[int], last: list[int]) -> list[bool]:
        """Whether each ring holds every row a block after committed position ``last[i]`` may see: its
        window ``[max(0, last - window + 1), last]`` whole (``DSparkRings.complete``, by the rings'
        addressing: ring row ``q`` only ever holds a position ``= q (mod window)`` or -1)."""
        n = len(slots)
        out = (c_int64 * n)()
        self.lib.ds_ready(ctypes.byref(self.model), n, (c_int64 * n)(*slots), (c_int64 * n)(*last),
                          self.rings.pos.data_ptr(), out)
        return [bool(r) for r in out]

    def propose_greedy(self, slots: list[int], anchors: list[int], anchor_positions: list[int]
                       ) -> tuple[list[bool], list[list[int]], list[list[float]]]:
        """``(ready, tokens, survival)`` per request: whether its ring is whole for the block (``ready``
        of the engine's adapter), and where it is, the greedy block's tokens and the running product of
        its confidences (``draft`` with ``greedy`` and a ``torch.cumprod``, in one call and plain lists)."""
        n, b = len(slots), self.block
        ready, tokens, survival = (c_int64 * n)(), (c_int64 * (n * b))(), (c_float * (n * b))()
        rc = self.lib.ds_propose_greedy(ctypes.byref(self.model), n, (c_int64 * n)(*anchors),
                                        (c_int64 * n)(*anchor_positions), (c_int64 * n)(*slots),
                                        self.rings.kv.data_ptr(), self.rings.pos.data_ptr(), ready, tokens, survival)
        if rc != 0:
            raise MemoryError("native DSpark draft: out of memory")
        toks, surv = tokens[:], survival[:]
        return ([bool(r) for r in ready], [toks[i * b:(i + 1) * b] for i in range(n)],
                [surv[i * b:(i + 1) * b] for i in range(n)])

    def draft(self, slots: torch.Tensor, anchors: torch.Tensor, anchor_positions: torch.Tensor, greedy: bool):
        """``(base [R, B, V], hidden [R, B, D], tokens [R, B] | None, confidence [R, B] | None)``: the
        block's head logits and ``hc_head`` output per request, and, when ``greedy``, its argmax Markov
        tokens and confidences."""
        n = anchors.shape[0]
        base = torch.empty(n, self.block, self.vocab)
        hidden = torch.empty(n, self.block, self.hidden)
        tokens = torch.empty(n, self.block, dtype=torch.long) if greedy else None
        conf = torch.empty(n, self.block) if greedy else None
        anchors, anchor_positions, slots = anchors.contiguous(), anchor_positions.contiguous(), slots.contiguous()
        rc = self.lib.ds_draft(ctypes.byref(self.model), n, anchors.data_ptr(), anchor_positions.data_ptr(),
                               slots.data_ptr(), self.rings.kv.data_ptr(), self.rings.pos.data_ptr(), int(greedy),
                               base.data_ptr(), hidden.data_ptr(), None if tokens is None else tokens.data_ptr(),
                               None if conf is None else conf.data_ptr())
        if rc != 0:
            raise MemoryError("native DSpark draft: out of memory")  # the limits were checked in unsupported
        return base, hidden, tokens, conf


class _JobArrays:
    """The arrays of ``NativeDSpark``'s one job at a time, kept from job to job (built for each job they
    cost ~30 us of Python a step of the bundled model) and grown when a job needs more rows."""

    def __init__(self, native: "NativeDSpark", rows: int, requests: int):
        b = native.block
        self.n_cap, self.r_cap = rows, requests
        self.rows, self.row_pos, self.row_slots = (c_void_p * rows)(), (c_int64 * rows)(), (c_int64 * rows)()
        self.anchors, self.anchor_pos, self.slots = (c_int64 * requests)(), (c_int64 * requests)(), (c_int64 * requests)()
        self.ready, self.tokens, self.survival = (c_int64 * requests)(), (c_int64 * (requests * b))(), (c_float * (requests * b))()
        at = ctypes.addressof
        self.job = _Job(at(native.model), 0, at(self.rows), at(self.row_pos), at(self.row_slots), 0, at(self.anchors),
                        at(self.anchor_pos), at(self.slots), native.rings.kv.data_ptr(), native.rings.pos.data_ptr(),
                        at(self.ready), at(self.tokens), at(self.survival), 0, 0, 0)
        self.address = at(self.job)

    def fill(self, rows: list[int], positions: list[int], row_slots: list[int], slots: list[int], anchors: list[int],
             anchor_positions: list[int]) -> None:
        n, R = len(rows), len(slots)
        self.rows[:n], self.row_pos[:n], self.row_slots[:n] = rows, positions, row_slots
        self.anchors[:R], self.anchor_pos[:R], self.slots[:R] = anchors, anchor_positions, slots
        self.job.n_rows, self.job.R, self.job.rc = n, R, 0


class DSparkJob:
    """A commit and a greedy proposal started on the host pool's worker (``NativeDSpark.start``), until
    ``wait``: its arrays (``_JobArrays``) and the rows its addresses point into are not touched before."""

    def __init__(self, arrays: _JobArrays, block: int, pooled: bool, keep: list):
        self._arrays, self.R, self.block, self.pooled, self.keep = arrays, arrays.job.R, block, pooled, keep
        self.on_worker: bool | None = None

    def wait(self) -> tuple[list[bool], list[list[int]], list[list[float]]]:
        """``propose_greedy``'s ``(ready, tokens, survival)``, once the job is done (joined here)."""
        a = self._arrays
        if self.pooled:
            self.on_worker = host_library().ds4_pool_join() == 1
            self.pooled = False
        if a.job.rc != 0:
            raise MemoryError("native DSpark drafter: out of memory")
        R, b = self.R, self.block
        toks, surv = a.tokens[:R * b], a.survival[:R * b]
        return ([bool(r) for r in a.ready[:R]], [toks[i * b:(i + 1) * b] for i in range(R)],
                [surv[i * b:(i + 1) * b] for i in range(R)])

    @property
    def seconds(self) -> tuple[float, float]:
        """The job's own ``(commit, propose)`` seconds (not what the caller waited for them)."""
        return self._arrays.job.commit_ns * 1e-9, self._arrays.job.propose_ns * 1e-9
