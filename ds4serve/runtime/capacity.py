"""Capacity plan: what a checkpoint needs on one device, worked out from ``config.json`` alone.

A user with a real DS4-Flash should learn *before* minutes of loading (and an out-of-memory crash
in the middle) whether it fits, what takes the memory, and what would fit instead. The plan counts:

* **weights**, by kind (routed experts of the main layers, shared experts, attention and the rest of
  the layers, embeddings + LM head, the vision tower), at the dtype ds4serve loads them with: every
  floating tensor in the model dtype except the few kept in fp32 (``weights.loaded_dtype``), integer
  buffers as they are. Routed experts are dequantised at load by default, so a checkpoint's MXFP4
  experts (4.25 bits each) take 16 bits in bf16; with ``packed_experts`` (``serve --packed-experts``)
  they stay at their packed size.
  MTP layers are listed apart: ds4serve does not load them.
* **state**: each sequence slot's fixed rings (``StateLayout.bytes_per_slot``), its pass staging
  (``staging_rows x hc x D``), and its pages for ``max_model_len`` tokens (compressed + indexer
  rows); the prefix cache's default budget; a step's transient activations (an estimate: the
  largest prefill chunk's streams, a few times over, and its logits).

From those, the most sequences of ``max_model_len`` tokens the memory holds. ``serve`` logs the same
plan at start-up and refuses, before allocating anything, a model whose weights and one sequence do
not fit the device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..cache import StateLayout
from ..config import ConfigError, ModelConfig
from ..model.loader import expected_tensors
from ..model.vision import expected_vision_tensors
from ..model.sharding import ShardPlan
from ..model.weights import loaded_dtype
from ..multimodal.chunking import max_chunk_len
from ..settings import PACKED_MODES

GiB = 2**30
# bits per routed-expert weight as the checkpoint stores it: MXFP4 = 4-bit codes + one 8-bit scale
# per 32; FP8 = 1 byte + one fp32 scale per 128 x 128 block
PACKED_BITS = {"fp4": 4 + 8 / 32, "mxfp4": 4 + 8 / 32, "fp8": 8 + 32 / (128 * 128)}
ACTIVATION_COPIES = 8  # live [rows, hc, D] tensors at a layer's peak (streams, residual, q/kv, MoE), with margin


def weight_kind(name: str) -> str:
    """The plan's line for one tensor name (transformers' names, as ``expected_tensors`` gives them)."""
    if name.startswith(("vision.", "aligner.")):
        return "vision tower"
    if ".mlp.experts." in name:
        return "routed experts"
    if ".mlp.shared_experts." in name:
        return "shared experts"
    if "embed_tokens" in name or name.startswith("lm_head") or name.startswith("image_"):
        return "embeddings + LM head"
    return "attention, norms, routers, mHC"


def _loaded_bytes(name: str, shape: tuple[int, ...], meta_dtype: torch.dtype, dtype: torch.dtype) -> int:
    return math.prod(shape) * loaded_dtype(name, meta_dtype, dtype).itemsize


@dataclass(frozen=True)
class WeightPlan:
    by_kind: dict[str, int]
    routed_params: int  # routed-expert parameters of the main layers
    packed_format: str | None  # the checkpoint's expert format when known ("fp4", "fp8")
    mtp_layers: int
    packed: bool = False  # routed experts kept packed (``serve --packed-experts``)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    @property
    def routed_packed(self) -> int | None:
        bits = PACKED_BITS.get(self.packed_format or "")
        return None if bits is None else int(self.routed_params * bits / 8)


def plan_weights(cfg: ModelConfig, dtype: torch.dtype, packed_experts: bool = False,
                 shard: ShardPlan | None = None, stored: Mapping[str, int] | None = None) -> WeightPlan:
    """Bytes of every tensor ds4serve instantiates, by kind, without allocating (meta tensors); with
    ``packed_experts`` and a known expert format, routed experts at their packed size. ``shard``: what
    that tensor-parallel rank holds (rank 0 also holds the vision tower; the others do not). ``stored``:
    {name: bytes} of the tensors kept at the checkpoint's width (``weights.stored_bytes``)."""
    tensors = dict(expected_tensors(cfg))
    if cfg.vision.enabled and (shard is None or shard.rank == 0):
        tensors.update(expected_vision_tensors(cfg))
    by_kind: dict[str, int] = {}
    routed = 0
    for name, (shape, meta_dtype) in tensors.items():
        shape = shard.local_shape(name, shape) if shard is not None else shape
        kind = weight_kind(name)
        held = stored[name] if stored and name in stored else _loaded_bytes(name, shape, meta_dtype, dtype)
        by_kind[kind] = by_kind.get(kind, 0) + held
        if kind == "routed experts":
            routed += math.prod(shape)
    raw = cfg.raw
    quant = raw.get("quantization_config") or {}
    fmt = raw.get("expert_dtype") or quant.get("expert_dtype") or quant.get("quant_method")
    plan = WeightPlan(by_kind, routed, str(fmt).lower() if fmt else None, int(raw.get("num_nextn_predict_layers") or 0),
                      packed_experts and PACKED_BITS.get(str(fmt).lower() if fmt else "") is not None)
    if plan.packed:
        by_kind["routed experts"] = plan.routed_packed
    return plan


@dataclass(frozen=True)
class CapacityPlan:
    cfg: ModelConfig
    dtype: torch.dtype
    memory: int  # bytes the plan may use on the device
    max_model_len: int
    weights: WeightPlan
    per_slot_fixed: int  # rings of one slot
    per_slot_staging: int  # pass staging of one slot
    per_token: float  # paged state growth per token
    per_seq_pages: int  # bytes of the pages one max_model_len sequence needs
    page_bytes: int
    activations: int  # a step's transient peak (estimate)
    notes: list[str] = field(default_factory=list)
    tensor_parallel: int = 1  # the plan is per rank (rank 0: the largest, it also holds the vision tower)
    expert_parallel: bool = False

    @property
    def per_sequence_prefix(self) -> int:
        """The prefix cache's default snapshot arena, per sequence (``sizing._prefix_bytes``): a quarter
        of its pages, at least two snapshots (rings + one page each)."""
        return max(self.per_seq_pages // 4, 2 * (self.per_slot_fixed + self.page_bytes))

    @property
    def per_sequence(self) -> int:
        return self.per_slot_fixed + self.per_slot_staging + self.per_seq_pages + self.per_sequence_prefix

    @property
    def free_for_state(self) -> int:
        return self.memory - self.weights.total - self.activations

    @property
    def max_seqs(self) -> int:
        """Sequences of ``max_model_len`` tokens that fit, each with its share of the prefix cache."""
        return max(0, self.free_for_state // self.per_sequence)

    @property
    def fits(self) -> bool:
        return self.max_seqs >= 1


def plan_capacity(cfg: ModelConfig, dtype: torch.dtype, memory: int, max_model_len: int | None = None,
                  max_prefill_tokens: int = 1024, min_prefill_tokens: int = 16,
                  packed_experts: bool = False, tensor_parallel: int = 1,
                  expert_parallel: bool = False, advise: bool = True,
                  stored: Mapping[str, int] | None = None) -> CapacityPlan:
    """The plan for one device with ``memory`` bytes, or for each of ``tensor_parallel`` such devices
    (rank 0's share; sequence state is replicated on every rank, see ``model.sharding``)."""
    if memory <= 0:
        raise ConfigError(f"memory must be positive, got {memory}")
    max_len = min(max_model_len or 8192, cfg.max_position_embeddings)
    layout = StateLayout.build(cfg, dtype)
    shard = ShardPlan(0, tensor_parallel, expert_parallel) if tensor_parallel > 1 else None
    problems = shard.problems(cfg) if shard is not None else []
    if problems:
        raise ConfigError("cannot split this model: " + "; ".join(problems))
    weights = plan_weights(cfg, dtype, packed_experts, shard, stored)
    elem = dtype.itemsize
    rows = max_chunk_len(max_prefill_tokens, min_prefill_tokens, cfg.vision.max_n_token if cfg.vision.enabled else 0)
    stream = cfg.hc_mult * cfg.hidden_size * elem
    activations = rows * stream * ACTIVATION_COPIES + rows * cfg.vocab_size * 4 // 16  # logits of sampled rows
    plan = CapacityPlan(cfg, dtype, memory, max_len, weights, layout.bytes_per_slot(), rows * stream,
                        layout.bytes_per_token(), layout.pages_for(max_len) * layout.bytes_per_page(),
                        layout.bytes_per_page(), activations, tensor_parallel=tensor_parallel,
                        expert_parallel=expert_parallel)
    if advise:
        plan.notes.extend(_advice(plan, max_prefill_tokens, min_prefill_tokens))
    return plan


def smallest_fit(p: CapacityPlan, max_prefill_tokens: int, min_prefill_tokens: int) -> tuple[int, bool] | None:
    """The fewest devices of ``p.memory`` each (and whether expert parallel) that hold the model."""
    for n in (2, 4, 8, 16, 32):
        for ep in (False, True):
            try:
                q = plan_capacity(p.cfg, p.dtype, p.memory, p.max_model_len, max_prefill_tokens, min_prefill_tokens,
                                  p.weights.packed, n, ep, advise=False)
            except ConfigError:  # not divisible that many ways
                continue
            if q.fits:
                return n, ep
    return None


def _advice(p: CapacityPlan, max_prefill_tokens: int, min_prefill_tokens: int) -> list[str]:
    out = []
    w = p.weights
    packed = w.routed_packed
    if w.packed:
        out.append(f"routed experts kept packed ({w.packed_format}, --packed-experts): {_gib(packed)}; "
                   "dequantised only for the experts a step uses (on CUDA inside Triton GEMMs, not yet run on a GPU)")
    elif packed is not None:
        loaded = w.by_kind.get("routed experts", 0)
        out.append(f"routed experts are dequantised at load ({_gib(loaded)}); kept packed as the checkpoint "
                   f"stores them ({w.packed_format}, serve --packed-experts) they take "
                   f"{_gib(packed)}")
    if w.mtp_layers:
        out.append(f"{w.mtp_layers} MTP layer(s) in the checkpoint are not loaded (no speculative decoding yet)")
    if not p.fits:
        need = w.total + p.activations + p.per_sequence
        where = "one device" if p.tensor_parallel == 1 else f"each of {p.tensor_parallel} devices"
        out.append(f"does not fit: one sequence of {p.max_model_len} tokens needs {_gib(need)} on {where}, "
                   f"{_gib(p.memory)} given")
        if packed is not None and not w.packed:
            need_packed = need - w.by_kind.get("routed experts", 0) + packed
            out.append(f"with --packed-experts it needs {_gib(need_packed)}")
        fit = smallest_fit(p, max_prefill_tokens, min_prefill_tokens)
        if fit is not None:
            out.append(f"needs --tensor-parallel-size >= {fit[0]}{' --enable-expert-parallel' if fit[1] else ''} "
                       f"on devices of this size")
    return out


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 100 else f"{n / 2**20:.2f} MiB"


def render_plan(p: CapacityPlan) -> str:
    w = p.weights
    where = "one device" if p.tensor_parallel == 1 else (
        f"per rank of {p.tensor_parallel} (rank 0, which also holds the vision tower; expert parallel "
        f"{'on' if p.expert_parallel else 'off'})")
    lines = [f"capacity plan: {where}, {_gib(p.memory)}, weights in {str(p.dtype).removeprefix('torch.')}, "
             f"max_model_len {p.max_model_len}", "", "| what | bytes |", "|---|---:|"]
    lines += [f"| weights: {kind} | {_gib(n)} |" for kind, n in sorted(w.by_kind.items(), key=lambda kv: -kv[1])]
    lines += [f"| **weights total** | **{_gib(w.total)}** |",
              f"| activations of one step (estimate) | {_gib(p.activations)} |",
              f"| per sequence: fixed rings | {_gib(p.per_slot_fixed)} |",
              f"| per sequence: pass staging | {_gib(p.per_slot_staging)} |",
              f"| per sequence: pages for {p.max_model_len} tokens ({p.per_token:.0f} B/token) | {_gib(p.per_seq_pages)} |",
              f"| per sequence: prefix-cache snapshots (default budget) | {_gib(p.per_sequence_prefix)} |",
              f"| **max concurrent sequences of {p.max_model_len} tokens** | **{p.max_seqs}** |"]
    return "\n".join(lines + [""] + [f"- {n}" for n in p.notes])




def device_memory(device: torch.device) -> int:
    """What one device can hold at most: a GPU's free memory now (before ds4serve allocates), or the
    host's physical memory (free memory would count the page cache as used)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import os

    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # cannot tell: do not refuse


def _packed_mode(mode: str | bool, what: str) -> str:
    """``--packed-weights``' value as "auto" / "on" / "off" (a bool means on or off)."""
    if isinstance(mode, bool):
        return "on" if mode else "off"
    if mode not in PACKED_MODES:
        raise ConfigError(f"{what} must be one of {', '.join(PACKED_MODES)}, got {mode!r}")
    return mode


def choose_stored_weights(mode: str | bool, dtype: torch.dtype, device: torch.device, host_kernels: str = "auto",
                          tensor_parallel: int = 1) -> tuple[bool, str]:
    """Whether projections, embedding and LM head stay at the checkpoint's width (FP8 / bf16;
    ``model/stored.py``), and why. ``auto`` keeps them where the native host forward reads them as they
    are (a CPU, fp32 compute, one process, the kernels built): it decodes them in registers as fast as it
    reads fp32, and a step then reads 2-4x fewer bytes. Elsewhere they are dequantised at load."""
    mode = _packed_mode(mode, "packed weights")
    if mode != "auto":
        return mode == "on", f"--packed-weights {mode}"
    if device.type != "cpu" or dtype != torch.float32 or tensor_parallel > 1 or host_kernels == "off":
        return False, "the torch path computes on dequantised weights (GPU, non-fp32, tensor parallel or host kernels off)"
    from ..model import host_forward

    if host_forward.library() is None:
        return False, "the native host forward is not available here"
    return True, "the native host forward reads FP8, bf16 and MXFP4 weights as the checkpoint stores them"


def choose_packed_experts(mode: str | bool, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | None,
                          max_model_len: int | None, max_prefill_tokens: int = 1024, tensor_parallel: int = 1,
                          expert_parallel: bool = False, memory: int | None = None,
                          stored: bool = False) -> tuple[bool, str]:
    """Whether to keep the routed experts packed, and why. ``on`` / ``off`` (or a bool) decide alone.
    ``auto`` packs only where that turns a refusal into a server: the checkpoint stores its experts in a
    packed format this device can run packed, the dequantised weights leave no room for one sequence and
    the packed ones do; with ``stored`` (``choose_stored_weights`` keeps the other weights as the
    checkpoint stores them: the native host forward reads them so) the experts are kept packed too.
    ``device`` None (``plan``: the hardware is not here) decides on fit alone; ``memory`` is then required."""
    mode = _packed_mode(mode, "packed experts")
    if mode != "auto":
        return mode == "on", f"--packed-experts {mode}"
    if memory is None:
        if device is None:
            raise ValueError("choose_packed_experts: give the memory when there is no device")
        memory = device_memory(device)

    def plan(packed: bool) -> CapacityPlan:
        return plan_capacity(cfg, dtype, memory, max_model_len, max_prefill_tokens, packed_experts=packed,
                             tensor_parallel=tensor_parallel, expert_parallel=expert_parallel, advise=False)

    dense = plan(False)
    if stored and dense.weights.routed_packed is not None:
        return True, f"kept as stored ({dense.weights.packed_format}) with the other weights"
    if dense.fits:
        return False, "the dequantised experts fit"
    if dense.weights.routed_packed is None:
        return False, f"the checkpoint's experts are not in a packed format ({dense.weights.packed_format})"
    if device is not None and device.type != "cpu":
        from ..model import triton_experts

        if not triton_experts.available(device):
            return False, f"packed experts on {device} need Triton"
    packed = plan(True)
    if not packed.fits:
        return False, "the model does not fit with packed experts either"
    return True, (f"the dequantised experts ({_gib(dense.weights.by_kind['routed experts'])}) leave no room for a "
                  f"sequence on {device or 'this device'}; kept packed ({packed.weights.packed_format}, "
                  f"{_gib(packed.weights.routed_packed)}) they do")


def check_fits(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_model_len: int | None,
               max_prefill_tokens: int = 1024, packed_experts: bool = False, tensor_parallel: int = 1,
               expert_parallel: bool = False, stored: Mapping[str, int] | None = None) -> CapacityPlan:
    """The start-up check: log the plan, refuse (``ConfigError`` with the plan) before loading anything
    when the weights and one sequence cannot fit on ``device`` (on each rank's device under TP).
    ``stored``: the bytes of the tensors kept at their stored width (``weights.stored_bytes``)."""
    import logging

    plan = plan_capacity(cfg, dtype, device_memory(device), max_model_len, max_prefill_tokens,
                         packed_experts=packed_experts, tensor_parallel=tensor_parallel,
                         expert_parallel=expert_parallel, stored=stored)
    log = logging.getLogger(__name__)
    if not plan.fits:
        raise ConfigError(f"the model does not fit on {device}:\n{render_plan(plan)}")
    log.info("capacity: weights %s, %s per sequence of %d tokens; at most %d such sequences fit on %s",
             _gib(plan.weights.total), _gib(plan.per_sequence), plan.max_model_len, plan.max_seqs, device)
    for note in plan.notes:
        log.info("capacity: %s", note)
    return plan


__all__ = ["CapacityPlan", "WeightPlan", "check_fits", "choose_packed_experts", "choose_stored_weights", "device_memory", "plan_capacity",
           "plan_weights", "render_plan", "weight_kind"]
