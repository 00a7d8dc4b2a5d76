"""Build a ``DS4ForCausalLM`` from a checkpoint directory (config.json + safetensors)."""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..config import AttnKind, ModelConfig
from .decoder import DS4ForCausalLM, Linear
from . import triton_experts
from .footprint import footprint
from .packed import PackedExperts
from .rope import inverse_frequencies
from .sharding import ShardPlan, shard_model
from .stored import StoredWeight
from .vision import VisionEncoder, expected_vision_tensors
from .weights import IndexTable, load_state_dict

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}") from None


def fp8_block_size(cfg: ModelConfig) -> tuple[int, int]:
    """Block size of FP8 weight scales (``quantization_config.weight_block_size``; DeepSeek uses 128x128)."""
    quant = cfg.raw.get("quantization_config") or {}
    block = quant.get("weight_block_size") or [128, 128]
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"config field 'quantization_config.weight_block_size' must be two positive ints, got {block!r}")
    return int(block[0]), int(block[1])


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor name the model needs, with shape and (meta) dtype, without allocating."""
    with torch.device("meta"):
        model = DS4ForCausalLM(cfg)
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def index_tables(cfg: ModelConfig) -> dict[str, IndexTable]:
    """The checkpoint tensors whose values are indices, with the range each must lie in: the hash
    layers' ``tid2eid`` (token id -> ``num_experts_per_tok`` routed expert ids)."""
    return {f"model.layers.{i}.mlp.gate.tid2eid": IndexTable(
        cfg.n_routed_experts,
        f"layer {i}'s hash-routing table holds one row per token id (vocab_size = {cfg.vocab_size}) of "
        f"num_experts_per_tok = {cfg.n_experts_per_tok} expert ids, each in [0, n_routed_experts = "
        f"{cfg.n_routed_experts})") for i, is_hash in enumerate(cfg.hash_layers) if is_hash}


_COMPRESSOR = re.compile(r"^model\.layers\.(\d+)\.self_attn\.compressor\.(indexer\.)?")
_WINDOW_TABLE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.compressor\.(indexer\.)?position_bias$")


def layout_notes(cfg: ModelConfig, missing: list[str], unexpected: list[str],
                 misshaped: dict[str, tuple[int, ...]]) -> list[str]:
    """Lines that explain missing, unexpected or mis-shaped compressor tensors by the layer kinds and
    compress ratios of the config (a sliding layer has no compressor, only CSA has an indexer, and a
    compressor's ``position_bias`` has one row per position of its ratio-long window): the usual cause is
    a ``compress_ratios`` / ``layer_types`` that does not belong to this checkpoint. One line per layer."""
    key = "layer_types" if cfg.raw.get("layer_types") is not None else "compress_ratios"
    notes = _window_notes(cfg, key, misshaped) | _presence_notes(cfg, key, missing, unexpected)
    return [notes[i] + ": is this config.json this checkpoint's?" for i in sorted(notes)]


def _presence_notes(cfg: ModelConfig, key: str, missing: list[str], unexpected: list[str]) -> dict[int, str]:
    """layer -> why its compressor or indexer tensors are there although the config gives none, or not."""
    notes: dict[int, str] = {}
    for names, present in ((missing, False), (unexpected, True)):
        for m in filter(None, map(_COMPRESSOR.match, names)):
            layer, indexer = int(m.group(1)), m.group(2) is not None
            if layer < cfg.num_layers:
                part = ("an " if indexer else "a ") if present else "no "
                part += "indexer (only CSA layers have one)" if indexer else "compressor"
                notes[layer] = (f"layer {layer}: the checkpoint has {part}, but config {key}[{layer}] makes it "
                                f"{_kind_words(cfg, layer)}")
    return notes


def _window_notes(cfg: ModelConfig, key: str, misshaped: dict[str, tuple[int, ...]]) -> dict[int, str]:
    """layer -> why its compressor's window table (``position_bias``, one row per position of the window)
    has another length than the layer's compress ratio."""
    notes: dict[int, str] = {}
    for name, got in misshaped.items():
        m = _WINDOW_TABLE.match(name)
        if m is not None and int(m.group(1)) < cfg.num_layers and got:
            layer = int(m.group(1))
            notes[layer] = (f"layer {layer}: the checkpoint's compressor window is {got[0]} positions long (the "
                            f"rows of position_bias), but config {key}[{layer}] makes it {_kind_words(cfg, layer)}")
    return notes


def _kind_words(cfg: ModelConfig, layer: int) -> str:
    """How the config makes ``layer``: its kind and ratio, in the words of the checkpoint notes."""
    kind, ratio = cfg.attn_kinds[layer], cfg.compress_ratios[layer]
    if kind is AttnKind.SLIDING:
        return "sliding-only (compress ratio 0)"
    return f"{'CSA' if kind is AttnKind.CSA else 'HCA'} with compress ratio {ratio}"


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
               progress: bool = True, vision_device: str | torch.device | None = None, packed_experts: bool = False,
               shard: ShardPlan | None = None, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
               vision: bool = True, stored_weights: bool = False) -> tuple[ModelConfig, DS4ForCausalLM]:
    """Load the language model; for a DS4V checkpoint also its vision encoder, attached as
    ``model.vision_encoder`` (a plain attribute, so it may live on another device: ``vision_device``).
    ``packed_experts`` keeps MXFP4 / FP8 routed experts packed (``packed.py``; CPU only for now).
    ``shard``: this tensor-parallel rank's slices only, partial sums added by ``reduce``
    (``sharding.py``); ``vision`` False skips the vision tower (TP workers: rank 0 encodes images).
    ``stored_weights``: FP8 projections and a bf16 embedding / LM head stay at the checkpoint's width
    (``stored.py``; host fp32 models, one process: the native forward reads them as they are)."""
    t0 = time.perf_counter()
    cfg = ModelConfig.from_file(path)
    dt = parse_dtype(dtype)
    device = torch.device(device)
    _check_packed_device(packed_experts, device)
    model, expected = _meta_model(cfg, shard, reduce)
    stored = _stored_names(model) if stored_weights and device.type == "cpu" and shard is None else frozenset()
    sd = load_state_dict(path, expected, dtype=dt, device=device, progress=progress, fp8_block=fp8_block_size(cfg),
                         packed_experts=packed_experts, shard=shard, skip=() if vision else ("vision.", "aligner."),
                         indices=index_tables(cfg), explain=lambda *names: layout_notes(cfg, *names), stored=stored)
    vision_sd = {k: sd.pop(k) for k in list(sd) if k.startswith(("vision.", "aligner."))}
    packed = _assign_weights(model, sd)
    if model.model.embed_tokens.weight.dtype != dt:
        model.compute_dtype = dt  # the embedding table kept narrower: its rows widen to the model dtype
    model.vision_encoder = None
    if cfg.vision.enabled and vision:
        vdev = torch.device(vision_device) if vision_device is not None else device
        model.vision_encoder = _vision_encoder(cfg, vision_sd, vdev)
    model.inv_freq_main = inverse_frequencies(cfg.rope_main, cfg.rope_dim).to(device)
    model.inv_freq_compress = inverse_frequencies(cfg.rope_compress, cfg.rope_dim).to(device)
    model.eval()
    n_params = sum(t.numel() for t in sd.values()) + sum(math.prod(p.shape) for p in packed.values())
    log.info("loaded %s: %.2fM parameters, %d layers, dtype %s, device %s, in %.2f s", path, n_params / 1e6,
             cfg.num_layers, dt, device, time.perf_counter() - t0)
    log.info("%s", footprint(cfg, model).describe())
    return cfg, model


def _check_packed_device(packed_experts: bool, device: torch.device) -> None:
    """Packed experts off the host need Triton's kernels; on CUDA they run unverified on a GPU (a warning)."""
    if packed_experts and device.type != "cpu" and not triton_experts.available(device):
        raise ValueError(f"packed experts on {device} need Triton's kernels (triton comes with CUDA builds of "
                         "torch); load with packed_experts=False")
    if packed_experts and device.type == "cuda":
        log.warning("packed experts on CUDA run through the Triton kernels of model/triton_experts.py, checked "
                    "against the host path under Triton's interpreter, not yet on a GPU")


def _meta_model(cfg: ModelConfig, shard: ShardPlan | None, reduce: Callable[[torch.Tensor], torch.Tensor] | None
                ) -> tuple[DS4ForCausalLM, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """The model on the meta device (no memory) and the tensors the checkpoint must hold, by name: the
    whole model's shapes (vision tower included), taken before ``shard`` cuts this rank's slices."""
    with torch.device("meta"):
        model = DS4ForCausalLM(cfg)
    expected = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    expected.update(expected_vision_tensors(cfg))
    if shard is not None:
        shard_model(model, shard, reduce)  # on meta: the parameters take their local shapes
    return model, expected


def _stored_names(model: DS4ForCausalLM) -> frozenset[str]:
    """The weights that may stay at the checkpoint's width: every ``Linear`` and the embedding table."""
    return frozenset([f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Linear)]
                     + ["model.embed_tokens.weight"])


def _assign_weights(model: DS4ForCausalLM, sd: dict) -> dict[str, PackedExperts | StoredWeight]:
    """Put the loaded tensors in place of the meta parameters; packed expert stacks and weights kept
    at the checkpoint's width become plain attributes (returned by name, and logged)."""
    packed = {k: sd.pop(k) for k in list(sd) if isinstance(sd[k], (PackedExperts, StoredWeight))}
    missing, unexpected = model.load_state_dict(sd, assign=True, strict=False)
    if set(missing) != set(packed) or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {sorted(set(missing) - set(packed))[:5]}, "
                           f"unexpected {unexpected[:5]}")
    for name, stack in packed.items():  # a plain attribute in place of the (meta) parameter
        module, attr = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
        del module._parameters[attr]
        setattr(module, attr, stack)
    stacks = [p for p in packed.values() if isinstance(p, PackedExperts)]
    if stacks:
        log.info("routed experts kept packed: %d stacks, %.1f MiB resident", len(stacks),
                 sum(p.nbytes for p in stacks) / 2**20)
    kept = [p for p in packed.values() if isinstance(p, StoredWeight)]
    if kept:
        log.info("projections kept at the checkpoint's width: %d (%s), %.1f MiB resident", len(kept),
                 ", ".join(sorted({p.fmt for p in kept})), sum(p.nbytes for p in kept) / 2**20)
    return packed


def _vision_encoder(cfg: ModelConfig, vision_sd: dict[str, torch.Tensor], device: torch.device) -> VisionEncoder:
    """The DS4V vision encoder with its loaded weights, on ``device`` (it may differ from the model's)."""
    with torch.device("meta"):
        encoder = VisionEncoder(cfg)
    encoder.load_state_dict({k: v.to(device) for k, v in vision_sd.items()}, assign=True, strict=True)
    return encoder.eval()
