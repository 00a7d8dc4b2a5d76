"""Finding and loading the serial MTP block (``mtp.0.*``) of a DS4 checkpoint (spec ds4-speculative §1,
§2.1, §10, §12.1).

``weights.py`` skips every ``mtp.*`` tensor when it loads the target, so the drafter has its own small
planner here, built on the same readers: ``checkpoint.Source`` (lazy shards, block-scale lookup),
``quant`` (FP8 e4m3 with block scales, MXFP4 experts) and ``weights.canonical_name`` (the official
layer names: ``attn.wq_a`` -> ``self_attn.q_a_proj`` ...). Everything is dequantised at load into the
target's dtype (no packed or stored-width variant yet), precision-critical tensors kept in fp32 as the
target keeps them (``weights.loaded_dtype``).

Every problem is a ``ConfigError`` naming the tensor or the config key, all of them in one message:
peers' MTP loaders that fell back silently gave "exactly 0 % acceptance with no load-time error" (§2.1,
§10), so nothing here is guessed. Refused: a config that claims MTP (``num_nextn_predict_layers >= 1``)
without ``mtp.0.*`` tensors or the reverse (an explicit 0); a DSpark checkpoint (``mtp.0.main_proj``,
``mtp.1.*``, ``dspark_*`` keys: that drafter is ``dspark.py``'s); more than one serial layer; a config
that would make the block compressed or hash-routed (``compress_ratios[L]``, ``layer_types[L]``,
``mlp_layer_types[L]``, ``num_hash_layers``); missing, unexpected or mis-shaped tensors; dtypes this
loader does not read, and FP8 / FP4 tensors without their block scale.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError, ModelConfig
from .checkpoint import Source, checkpoint_files, scale_name, scaled_weight
from .decoder import DS4ForCausalLM
from .loader import fp8_block_size
from .mtp import MTPBlock, MTPDrafter
from .quant import FormatError, dequant_fp8, dequant_mxfp4
from .weights import canonical_name, loaded_dtype

log = logging.getLogger(__name__)

PREFIX = "mtp.0."
_TOP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "e_proj.weight": "e_proj.weight",
        "h_proj.weight": "h_proj.weight", "norm.weight": "norm.weight", "hc_head_fn": "hc_head.hc_fn",
        "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}
_FP32 = ("enorm.weight", "hnorm.weight", "norm.weight")  # norms: fp32 as the target's (HF keeps them fp32)
_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_DSPARK_NAMES = ("mtp.0.main_proj", "mtp.0.main_norm", "mtp.0.markov_head", "mtp.0.confidence_head", "mtp.1.")
_DSPARK_KEYS = ("dspark_block_size", "dspark_target_layer_ids", "dspark_noise_token_id", "dspark_markov_rank")
_FLOATS = {"F32", "BF16", "F16"}
_FP8 = {"F8_E4M3", "F8_E5M2"}
_FP4 = {"I8", "U8", "F4"}  # packed E2M1 codes (with a block scale)


@dataclass(frozen=True)
class MTPLayout:
    """A serial MTP block found in a checkpoint: its layer index and its tensors' names (scales included)."""

    layer: int
    names: tuple[str, ...]


def _bare(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def detect_mtp(cfg: ModelConfig, names: Iterable[str]) -> MTPLayout | None:
    """The serial MTP block of a checkpoint with tensor ``names`` and config ``cfg``, None when neither
    claims one; any contradiction between the two is a ``ConfigError`` naming the key or tensor."""
    bare = {_bare(n): n for n in names}
    dspark = sorted(n for n in bare if n.startswith(_DSPARK_NAMES))
    keys = [k for k in _DSPARK_KEYS if k in cfg.raw]
    if dspark or keys:
        raise ConfigError(f"this checkpoint carries the DSpark drafter ({', '.join((keys + dspark)[:3])}), not the "
                          "serial MTP block: load it as DSpark (model/dspark.py), not as MTP")
    ours = tuple(sorted(bare[n] for n in bare if n.startswith(PREFIX)))
    claimed = cfg.num_nextn_predict_layers
    if not ours:
        if claimed >= 1:
            raise ConfigError(f"config field 'num_nextn_predict_layers' = {claimed} claims an MTP block, but the "
                              f"checkpoint has no {PREFIX}* tensors (is the MTP shard missing?)")
        return None
    if "num_nextn_predict_layers" in cfg.raw and claimed == 0:
        raise ConfigError(f"config field 'num_nextn_predict_layers' = 0, but the checkpoint has {len(ours)} "
                          f"{PREFIX}* tensors (e.g. {ours[0]}): set it to 1, or drop the tensors")
    if claimed > 1:
        raise ConfigError(f"config field 'num_nextn_predict_layers' = {claimed}: the serial MTP drafter has one "
                          f"block ({PREFIX}*); DeepSeek-V4-Flash ships 1")
    _check_block_keys(cfg)
    return MTPLayout(layer=cfg.num_layers, names=ours)


def _check_block_keys(cfg: ModelConfig) -> None:
    """The config's entries for layer L (the MTP block) must make it sliding-only with learned routing."""
    d, layer = cfg.raw, cfg.num_layers
    ratios, types, mlp = d.get("compress_ratios"), d.get("layer_types"), d.get("mlp_layer_types")
    if isinstance(ratios, list) and len(ratios) > layer and ratios[layer] != 0:
        raise ConfigError(f"config field 'compress_ratios[{layer}]' = {ratios[layer]!r}: the MTP block is "
                          "sliding-only, so its entry must be 0")
    if isinstance(types, list) and len(types) > layer and types[layer] != "sliding_attention":
        raise ConfigError(f"config field 'layer_types[{layer}]' = {types[layer]!r}: the MTP block is "
                          "'sliding_attention'")
    if isinstance(mlp, list) and len(mlp) > layer and mlp[layer] != "moe":
        raise ConfigError(f"config field 'mlp_layer_types[{layer}]' = {mlp[layer]!r}: the MTP block routes "
                          "by score ('moe', with gate.bias), not by hash")
    if isinstance(d.get("num_hash_layers"), int) and d["num_hash_layers"] > layer:
        raise ConfigError(f"config field 'num_hash_layers' = {d['num_hash_layers']} would make the MTP block "
                          f"(layer {layer}) hash-routed; it routes by score")
    if cfg.vision.enabled:
        raise ConfigError("config field 'vision_n_layers' > 0: the serial MTP drafter is text-only (the "
                          "checkpoint that ships it, DeepSeek-V4-Flash, has no vision tower)")


def find_mtp(path: str | Path) -> MTPLayout | None:
    """``detect_mtp`` for a checkpoint directory (config.json and safetensors headers only)."""
    path = Path(path)
    return detect_mtp(ModelConfig.from_file(path), Source(checkpoint_files(path)).where)


def expected_mtp_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Module name -> shape of every MTP block tensor, without allocating."""
    with torch.device("meta"):
        block = MTPBlock(cfg)
    return {k: tuple(v.shape) for k, v in block.state_dict().items()}


@dataclass
class _Plan:
    direct: dict[str, str]  # module name -> checkpoint name
    experts: dict[tuple[int, str], str]  # (expert, w1|w2|w3) -> checkpoint name
    problems: list[str]


def _plan(src: Source, layout: MTPLayout) -> _Plan:
    """Sort the block's checkpoint names into module tensors and expert pieces; unknown ones are problems."""
    plan = _Plan({}, {}, [])
    for name in layout.names:
        if scaled_weight(src, name) is not None:
            continue
        rest = _bare(name)[len(PREFIX):]
        m = _EXPERT.match(rest)
        if m:
            plan.experts[(int(m.group(1)), m.group(2))] = name
            continue
        module = _TOP.get(rest) or _block_name(rest, layout.layer)
        if module is None or module in plan.direct:
            plan.problems.append(f"unexpected tensor {name}")
        else:
            plan.direct[module] = name
    return plan


def _block_name(rest: str, layer: int) -> str | None:
    """``attn.wq_a.weight`` -> ``block.self_attn.q_a_proj.weight`` (the target's official-name map)."""
    full = canonical_name(f"layers.{layer}.{rest}")
    head = f"model.layers.{layer}."
    return "block." + full[len(head):] if full.startswith(head) else None


def _dtype_problem(src: Source, name: str) -> str | None:
    kind = src.dtype(name)
    if kind in _FLOATS:
        return None
    if kind in _FP8 | _FP4:
        if scale_name(src, name) is None:
            return f"tensor {name}: {kind} without its block scale (.scale / .weight_scale_inv)"
        return None
    return (f"tensor {name}: dtype {kind} is not handled (F32, BF16, F16; F8_E4M3 or packed FP4 with a block "
            "scale)")


def _check(src: Source, plan: _Plan, cfg: ModelConfig) -> list[str]:
    """Every missing, unexpected, mis-shaped or unreadable tensor of the block, one line each."""
    expected = expected_mtp_tensors(cfg)
    problems = list(plan.problems)
    stacks = {"block.mlp.experts.gate_up_proj", "block.mlp.experts.down_proj"}
    for module in sorted(set(expected) - set(plan.direct) - stacks):
        problems.append(f"missing tensor {PREFIX}{_official(module, cfg.num_layers)}")
    for module, name in sorted(plan.direct.items()):
        if module not in expected:
            problems.append(f"unexpected tensor {name}")
        elif src.logical_shape(name) != expected[module]:
            problems.append(f"tensor {name}: shape {list(src.logical_shape(name))}, expected {list(expected[module])}")
    n_exp, inter, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for j in range(n_exp):
        for w in ("w1", "w2", "w3"):
            if (j, w) not in plan.experts:
                problems.append(f"missing tensor {PREFIX}ffn.experts.{j}.{w}.weight")
    for (j, w), name in sorted(plan.experts.items()):
        want = (d, inter) if w == "w2" else (inter, d)
        if j >= n_exp:
            problems.append(f"unexpected tensor {name} (n_routed_experts = {n_exp})")
        elif src.logical_shape(name) != want:
            problems.append(f"tensor {name}: shape {list(src.logical_shape(name))}, expected {list(want)}")
    names = list(plan.direct.values()) + list(plan.experts.values())
    problems += [p for p in (_dtype_problem(src, n) for n in names) if p is not None]
    return problems


# the block's release names (spec §2.1), for naming what is missing; canonical_name maps them to modules
_BLOCK_NAMES = ([f"attn.{w}.weight" for w in ("wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b")]
                + ["attn.attn_sink", "attn_norm.weight", "ffn_norm.weight", "ffn.gate.weight", "ffn.gate.bias"]
                + [f"hc_{part}_{p}" for part in ("attn", "ffn") for p in ("fn", "base", "scale")]
                + [f"ffn.shared_experts.w{k}.weight" for k in (1, 2, 3)])


def _official(module: str, layer: int) -> str:
    """The release name of a module tensor (for 'missing' lines)."""
    names = {v: k for k, v in _TOP.items()} | {_block_name(n, layer): n for n in _BLOCK_NAMES}
    return names.get(module, module)


def _read(src: Source, name: str, block: tuple[int, int]) -> torch.Tensor:
    """A tensor as fp32 (FP8 / MXFP4 dequantised with their block scales) or its float dtype."""
    kind, t = src.dtype(name), src.get(name)
    try:
        if kind in _FP8:
            return dequant_fp8(t, src.get(scale_name(src, name)), block, name)
        if kind in _FP4:
            return dequant_mxfp4(t, src.get(scale_name(src, name)), name)
    except FormatError as exc:
        raise ConfigError(str(exc)) from exc
    return t


def load_mtp(path: str | Path, target: DS4ForCausalLM) -> MTPDrafter | None:
    """The serial MTP drafter of the checkpoint at ``path`` bound to its loaded ``target`` (shared
    embedding and head), on the target's device and in its dtype; None when the checkpoint has none."""
    path, cfg = Path(path), target.cfg
    src = Source(checkpoint_files(path))
    layout = detect_mtp(_same_model(ModelConfig.from_file(path), cfg), src.where)
    if layout is None:
        return None
    plan = _plan(src, layout)
    problems = _check(src, plan, cfg)
    if problems:
        raise ConfigError(f"the MTP block ({PREFIX}*) of {path} does not match the config:\n  "
                          + "\n  ".join(problems))
    block_size = fp8_block_size(cfg)
    embed = target.model.embed_tokens.weight
    dtype, device = target.compute_dtype or embed.dtype, embed.device
    sd = {}
    for module, name in plan.direct.items():
        want = torch.float32 if module in _FP32 else loaded_dtype(module, torch.float32, dtype)
        sd[module] = _read(src, name, block_size).to(device=device, dtype=want, copy=True)
    sd.update(_stacked(src, plan, cfg, block_size, dtype, device))
    with torch.device("meta"):
        block = MTPBlock(cfg)
    block.load_state_dict(sd, assign=True, strict=True)
    log.info("loaded the MTP drafter: %d tensors (%s) from %s", len(layout.names), PREFIX + "*", path)
    return MTPDrafter(target, block.eval())


def _same_model(found: ModelConfig, target: ModelConfig) -> ModelConfig:
    """The checkpoint's config (its keys decide what is claimed), checked to be the target's model."""
    fields = ("vocab_size", "hidden_size", "num_layers", "hc_mult", "head_dim", "sliding_window")
    differ = [f for f in fields if getattr(found, f) != getattr(target, f)]
    if differ:
        raise ConfigError(f"the target model was not loaded from this checkpoint: config fields {differ} differ")
    return found


def _stacked(src: Source, plan: _Plan, cfg: ModelConfig, block: tuple[int, int], dtype: torch.dtype,
             device: torch.device) -> dict[str, torch.Tensor]:
    """Per-expert ``w1``/``w3`` -> ``gate_up_proj [E, 2I, D]`` and ``w2`` -> ``down_proj [E, D, I]`` (the
    target's layout), filled expert by expert into tensors allocated once."""
    e, i, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    gate_up = torch.empty(e, 2 * i, d, dtype=dtype, device=device)
    down = torch.empty(e, d, i, dtype=dtype, device=device)
    for j in range(e):
        gate_up[j, :i].copy_(_read(src, plan.experts[(j, "w1")], block))
        gate_up[j, i:].copy_(_read(src, plan.experts[(j, "w3")], block))
        down[j].copy_(_read(src, plan.experts[(j, "w2")], block))
    return {"block.mlp.experts.gate_up_proj": gate_up, "block.mlp.experts.down_proj": down}
