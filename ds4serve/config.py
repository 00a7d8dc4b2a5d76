"""Model configuration read from a checkpoint's ``config.json``.

DeepSeek-V4 checkpoints come in two dialects: the Hugging Face form (``layer_types``,
``compress_rates``, ``rope_parameters``, ``mlp_layer_types``) and the official form
(``compress_ratios``, ``rope_scaling``, ``num_hash_layers``). Both are normalised here into one
frozen :class:`ModelConfig`, so nothing downstream ever looks at raw JSON. Every inconsistency is a
:class:`ConfigError` that names the offending field: a wrong config must never load silently.

The engine's knobs are ``settings.py`` (``EngineSettings``); environment variables are read in
``environment.py`` and the CLI only (DESIGN §8.1).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json value is missing, unknown or inconsistent; the message names the field."""


class AttnKind(str, Enum):
    """Which attention a decoder layer runs (spec ds4-text §4)."""

    SLIDING = "sliding_attention"  # raw sliding window only
    CSA = "compressed_sparse_attention"  # window + overlapping ratio-m compressor + lightning indexer
    HCA = "heavily_compressed_attention"  # window + all non-overlapping ratio-m compressed rows


@dataclass(frozen=True)
class RopeParams:
    """One rotary embedding flavour ("main" for sliding layers, "compress" for CSA/HCA layers)."""

    theta: float
    rope_type: str = "default"  # "default" or "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0  # multiplies cos/sin; DS4 forces 1.0 (no YaRN mscale)
    truncate: bool = True  # floor/ceil the YaRN correction range, as the reference does


@dataclass(frozen=True)
class VisionConfig:
    """DS4V vision tower settings (spec ds4-vision §1); ``n_layers == 0`` means text-only."""

    n_layers: int = 0
    dim: int = 1024
    n_heads: int = 16
    inter_dim: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_n_token: int = 384
    min_pixels: int = 147456
    max_wh_ratio: int = 8
    image_token_id: int = 129264
    norm_eps: float = 1e-6

    @property
    def enabled(self) -> bool:
        return self.n_layers > 0


@dataclass(frozen=True)
class ModelConfig:
    """The DeepSeek-V4 text model (plus optional DS4V vision settings), normalised."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    attn_kinds: tuple[AttnKind, ...]
    compress_ratios: tuple[int, ...]  # per layer; 0 for sliding layers
    rope_main: RopeParams
    rope_compress: RopeParams
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    hash_layers: tuple[bool, ...]
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    vision: VisionConfig = field(default_factory=VisionConfig)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived facts -------------------------------------------------------------------------
    @property
    def distinct_ratios(self) -> tuple[int, ...]:
        return tuple(sorted({r for r in self.compress_ratios if r > 0}))

    # ---- loading -------------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"no config.json at {path}") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        return _parse(dict(data))


# --------------------------------------------------------------------------------------------------
# parsing helpers
# --------------------------------------------------------------------------------------------------

_RATIO_DEFAULTS = {AttnKind.CSA: 4, AttnKind.HCA: 128}


def _req_int(d: dict, key: str, default: int | None = None, minimum: int = 1) -> int:
    value = d.get(key, default)
    if value is None:
        raise ConfigError(f"config field '{key}' is required")
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ConfigError(f"config field '{key}' must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"config field '{key}' must be >= {minimum}, got {value}")
    return value


def _req_float(d: dict, key: str, default: float | None = None) -> float:
    value = d.get(key, default)
    if value is None:
        raise ConfigError(f"config field '{key}' is required")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"config field '{key}' must be a number, got {value!r}")
    return float(value)


def _parse_attention_layout(d: dict, n_layers: int,
                            max_positions: int) -> tuple[tuple[AttnKind, ...], tuple[int, ...]]:
    """Per-layer attention kind and compress ratio from either dialect. Every ratio is checked here
    (``_check_ratio``), naming the config key it came from: the native forward and the page layout
    take them as given."""
    if d.get("layer_types") is not None:
        kinds, ratios = _hf_layout(d, n_layers, max_positions)
    elif d.get("compress_ratios") is not None:
        kinds, ratios = _official_layout(d, n_layers, max_positions)
    else:
        # HF default (V4-Pro pattern): 2x HCA, then alternating CSA / HCA.
        kinds = [AttnKind.HCA] * min(n_layers, 2) + [
            AttnKind.CSA if i % 2 else AttnKind.HCA for i in range(max(n_layers - 2, 0))
        ]
        ratios = [_RATIO_DEFAULTS[k] for k in kinds]
        for k in set(kinds):
            _check_ratio(f"compress_rates.{k.value} (not given: the default)", _RATIO_DEFAULTS[k], max_positions)
    if len(kinds) != n_layers:
        field_name = "layer_types" if d.get("layer_types") is not None else "compress_ratios"
        raise ConfigError(f"config field '{field_name}' has {len(kinds)} entries for {n_layers} layers")
    return tuple(kinds), tuple(ratios)


def _hf_layout(d: dict, n_layers: int, max_positions: int) -> tuple[list[AttnKind], list[int]]:
    """HF dialect: ``layer_types`` per layer, one rate per compressed kind (``compress_rates``)."""
    types = d["layer_types"]
    if not isinstance(types, list):
        raise ConfigError("config field 'layer_types' must be a list")
    rates = _hf_rates(d, max_positions)
    kinds = []
    for i, t in enumerate(types[:n_layers]):
        try:
            kinds.append(AttnKind(t))
        except ValueError as exc:
            allowed = [k.value for k in AttnKind]
            raise ConfigError(f"config field 'layer_types[{i}]' = {t!r} is not one of {allowed}") from exc
    return kinds, [0 if k is AttnKind.SLIDING else rates[k] for k in kinds]


def _hf_rates(d: dict, max_positions: int) -> dict[AttnKind, int]:
    """The compress rate of each compressed kind: the defaults, ``compress_rates``, then the legacy
    ``compress_rate_csa`` / ``compress_rate_hca``; each one given is checked (``_check_ratio``)."""
    rates = dict(_RATIO_DEFAULTS)
    for key, value in (d.get("compress_rates") or {}).items():
        try:
            kind = AttnKind(key)
        except ValueError as exc:
            raise ConfigError(f"config field 'compress_rates' has unknown key {key!r}") from exc
        if kind is AttnKind.SLIDING:
            if value != 0 or isinstance(value, bool):
                raise ConfigError(f"config field 'compress_rates.{key}' = {value!r}: sliding layers have no "
                                  "compressor, so their rate must be 0 (or left out)")
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config field 'compress_rates.{key}' must be an integer, got {value!r}")
        _check_ratio(f"compress_rates.{key}", value, max_positions)
        rates[kind] = value
    for legacy, kind in (("compress_rate_csa", AttnKind.CSA), ("compress_rate_hca", AttnKind.HCA)):
        if d.get(legacy) is not None:
            rates[kind] = _req_int(d, legacy, minimum=0)
            _check_ratio(legacy, rates[kind], max_positions)
    return rates


def _official_layout(d: dict, n_layers: int, max_positions: int) -> tuple[list[AttnKind], list[int]]:
    """Official dialect: 0 = sliding, 4 = CSA (overlap + indexer, as in the reference's
    ``overlap = ratio == 4``), any other ratio = HCA. Extra entries are MTP layers."""
    ratios = list(d["compress_ratios"])[:n_layers]
    kinds = []
    for i, r in enumerate(ratios):
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ConfigError(f"config field 'compress_ratios[{i}]' must be a non-negative integer, got {r!r}")
        if r:
            _check_ratio(f"compress_ratios[{i}]", r, max_positions)
        kinds.append(AttnKind.SLIDING if r == 0 else AttnKind.CSA if r == 4 else AttnKind.HCA)
    return kinds, ratios


# A compressed layer's ratio sizes its compressor window (2 x ratio slots for CSA, arrays of the native
# forward) and the page (the LCM of the ratios), so it is refused here rather than trusted: 1 would
# compress nothing, and a ratio past the longest sequence would never emit a row.
MIN_COMPRESS_RATIO = 2


def _check_ratio(key: str, ratio: int, max_positions: int) -> None:
    """A compressed layer's ratio must be in [MIN_COMPRESS_RATIO, max_position_embeddings]."""
    if not MIN_COMPRESS_RATIO <= ratio <= max_positions:
        raise ConfigError(
            f"config field '{key}' = {ratio}: a compressed layer's ratio must be in [{MIN_COMPRESS_RATIO}, "
            f"max_position_embeddings = {max_positions}] (0 = a sliding-only layer; DeepSeek-V4 uses 4 for CSA "
            "and 128 for HCA)")


def _parse_hash_layers(d: dict, n_layers: int) -> tuple[bool, ...]:
    if d.get("mlp_layer_types") is not None:
        types = list(d["mlp_layer_types"])[:n_layers]
        if len(types) != n_layers:
            raise ConfigError(f"config field 'mlp_layer_types' has {len(types)} entries for {n_layers} layers")
        for i, t in enumerate(types):
            if t not in ("hash_moe", "moe"):
                raise ConfigError(f"config field 'mlp_layer_types[{i}]' = {t!r} is not 'hash_moe' or 'moe'")
        return tuple(t == "hash_moe" for t in types)
    n_hash = d.get("num_hash_layers", 3)
    if isinstance(n_hash, bool) or not isinstance(n_hash, int) or n_hash < 0:
        raise ConfigError(f"config field 'num_hash_layers' must be a non-negative integer, got {n_hash!r}")
    return tuple(i < n_hash for i in range(n_layers))


def _rope_from_dict(p: dict, where: str, default_theta: float) -> RopeParams:
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"config field '{where}.rope_type' = {rope_type!r}: only 'default' and 'yarn' are supported")
    theta = float(p.get("rope_theta", default_theta))
    if rope_type == "default":
        return RopeParams(theta=theta)
    for key in ("factor", "original_max_position_embeddings"):
        if p.get(key) is None:
            raise ConfigError(f"config field '{where}.{key}' is required for YaRN rope")
    return RopeParams(
        theta=theta,
        rope_type="yarn",
        factor=float(p["factor"]),
        original_max_position_embeddings=int(p["original_max_position_embeddings"]),
        beta_fast=float(p.get("beta_fast") or 32),
        beta_slow=float(p.get("beta_slow") or 1),
        # DS4 applies no YaRN mscale to cos/sin (HF forces 1.0, vLLM mscale 0)
        attention_factor=float(p.get("attention_factor") if p.get("attention_factor") is not None else 1.0),
        truncate=bool(p.get("truncate", True)),
    )


def _parse_rope(d: dict) -> tuple[RopeParams, RopeParams]:
    theta = _req_float(d, "rope_theta", 10000.0)
    compress_theta = _req_float(d, "compress_rope_theta", 160000.0)
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return (
            _rope_from_dict(rp["main"], "rope_parameters.main", theta),
            _rope_from_dict(rp["compress"], "rope_parameters.compress", compress_theta),
        )
    # Flat scaling dict (HF flat form or official `rope_scaling`): YaRN on compressed layers only.
    scaling = rp if isinstance(rp, dict) else d.get("rope_scaling")
    main = RopeParams(theta=theta)
    if not scaling:
        return main, RopeParams(theta=compress_theta)
    scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
    where = "rope_parameters" if isinstance(rp, dict) else "rope_scaling"
    return main, _rope_from_dict({**scaling, "rope_theta": compress_theta}, where, compress_theta)


def _parse_rope_dim(d: dict, head_dim: int) -> int:
    rope_dim = d.get("qk_rope_head_dim")
    factor = d.get("partial_rotary_factor")
    if rope_dim is None:
        rope_dim = int(head_dim * factor) if factor is not None else 64 * head_dim // 512
    if factor is not None and int(head_dim * factor) != rope_dim:
        raise ConfigError(
            f"config fields 'qk_rope_head_dim' ({rope_dim}) and 'partial_rotary_factor' ({factor}) disagree "
            f"for head_dim {head_dim}"
        )
    if rope_dim <= 0 or rope_dim % 2 or rope_dim > head_dim:
        raise ConfigError(f"config field 'qk_rope_head_dim' must be even and in (0, head_dim], got {rope_dim}")
    return int(rope_dim)


def _parse_vision(d: dict) -> VisionConfig:
    n_layers = d.get("vision_n_layers", 0) or 0
    if not isinstance(n_layers, int) or n_layers < 0:
        raise ConfigError(f"config field 'vision_n_layers' must be a non-negative integer, got {n_layers!r}")
    base = VisionConfig()
    v = VisionConfig(
        n_layers=n_layers,
        dim=int(d.get("vision_dim", base.dim)),
        n_heads=int(d.get("vision_n_heads", base.n_heads)),
        inter_dim=int(d.get("vision_inter_dim", base.inter_dim)),
        patch_size=int(d.get("vision_patch_size", base.patch_size)),
        rope_theta=float(d.get("vision_rope_theta", base.rope_theta)),
        downsample_ratio=int(d.get("vision_downsample_ratio", base.downsample_ratio)),
        max_n_token=int(d.get("vision_max_n_token", base.max_n_token)),
        min_pixels=int(d.get("vision_min_pixels", base.min_pixels)),
        max_wh_ratio=int(d.get("vision_max_wh_ratio", base.max_wh_ratio)),
        image_token_id=int(d.get("image_token_id", base.image_token_id)),
        norm_eps=float(d.get("vision_norm_eps", d.get("rms_norm_eps", base.norm_eps))),
    )
    if v.enabled:
        if v.dim % v.n_heads:
            raise ConfigError(f"config field 'vision_dim' ({v.dim}) must be divisible by 'vision_n_heads' ({v.n_heads})")
        if (v.dim // v.n_heads) % 4:
            raise ConfigError("vision head dim (vision_dim / vision_n_heads) must be a multiple of 4 for 2-D RoPE")
        if v.max_n_token < 16:
            raise ConfigError(f"config field 'vision_max_n_token' must be >= 16, got {v.max_n_token}")
    return v


def _parse_eos(d: dict) -> tuple[int, ...]:
    eos = d.get("eos_token_id", 1)
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    if isinstance(eos, list) and all(isinstance(e, int) for e in eos):
        return tuple(eos)
    raise ConfigError(f"config field 'eos_token_id' must be an int or a list of ints, got {eos!r}")


def _check_model_type(d: dict) -> None:
    model_type = d.get("model_type", "deepseek_v4")
    if model_type not in ("deepseek_v4", "deepseek_v4_vl", "deepseek_v4_vision"):
        raise ConfigError(f"config field 'model_type' = {model_type!r} is not a DeepSeek-V4 model")


def _check_unsupported(d: dict) -> None:
    """Fields that would change the network in ways this implementation does not support."""
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config field 'hidden_act' = {d.get('hidden_act')!r}: only 'silu' is supported")
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise ConfigError("config fields 'attention_bias' / 'mlp_bias' must be false for DeepSeek-V4")
    quant = d.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise ConfigError("config field 'quantization_config' must be an object")


def _check_consistent(d: dict, heads: int, o_groups: int, scoring: str, n_experts: int, top_k: int,
                      kinds: tuple[AttnKind, ...], rope_dim: int, index_head_dim: int) -> None:
    if d.get("num_key_value_heads", 1) != 1:
        raise ConfigError("config field 'num_key_value_heads' must be 1 (DeepSeek-V4 uses one shared K=V head)")
    if heads % o_groups:
        raise ConfigError(f"config field 'o_groups' ({o_groups}) must divide num_attention_heads ({heads})")
    if scoring not in ("sqrtsoftplus", "sigmoid", "softmax"):
        raise ConfigError(f"config field 'scoring_func' = {scoring!r} is not supported")
    if top_k > n_experts:  # routing picks top_k distinct experts: at most all of them
        raise ConfigError(f"config field 'num_experts_per_tok' = {top_k} must be in [1, n_routed_experts = "
                          f"{n_experts}]")
    if any(k is AttnKind.CSA for k in kinds) and rope_dim > index_head_dim:
        raise ConfigError(f"config field 'index_head_dim' ({index_head_dim}) must be >= qk_rope_head_dim ({rope_dim})")


def _parse(d: dict) -> ModelConfig:
    """The field table of ``ModelConfig``: each field read (HF name, default), then the cross-field
    checks (``_check_consistent``)."""
    _check_model_type(d)
    n_layers = _req_int(d, "num_hidden_layers", 43)
    heads = _req_int(d, "num_attention_heads", 64)
    head_dim = _req_int(d, "head_dim", 512)
    o_groups = _req_int(d, "o_groups", 8)
    max_positions = _req_int(d, "max_position_embeddings", 1048576)
    kinds, ratios = _parse_attention_layout(d, n_layers, max_positions)
    main, compress = _parse_rope(d)
    scoring = d.get("scoring_func", "sqrtsoftplus")
    n_experts = _req_int(d, "n_routed_experts", 256)
    top_k = _req_int(d, "num_experts_per_tok", 6)
    index_head_dim = _req_int(d, "index_head_dim", 128)
    rope_dim = _parse_rope_dim(d, head_dim)
    _check_consistent(d, heads, o_groups, scoring, n_experts, top_k, kinds, rope_dim, index_head_dim)
    _check_unsupported(d)
    return ModelConfig(
        vocab_size=_req_int(d, "vocab_size", 129280),
        hidden_size=_req_int(d, "hidden_size", 4096),
        num_layers=n_layers,
        num_heads=heads,
        head_dim=head_dim,
        rope_dim=rope_dim,
        q_lora_rank=_req_int(d, "q_lora_rank", 1024),
        o_groups=o_groups,
        o_lora_rank=_req_int(d, "o_lora_rank", 1024),
        sliding_window=_req_int(d, "sliding_window", 128),
        attn_kinds=kinds,
        compress_ratios=ratios,
        rope_main=main,
        rope_compress=compress,
        index_n_heads=_req_int(d, "index_n_heads", 64),
        index_head_dim=index_head_dim,
        index_topk=_req_int(d, "index_topk", 512),
        n_routed_experts=n_experts,
        n_experts_per_tok=top_k,
        n_shared_experts=_req_int(d, "n_shared_experts", 1, minimum=0),
        moe_intermediate_size=_req_int(d, "moe_intermediate_size", 2048),
        hash_layers=_parse_hash_layers(d, n_layers),
        scoring_func=scoring,
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        routed_scaling_factor=_req_float(d, "routed_scaling_factor", 1.5),
        swiglu_limit=_req_float(d, "swiglu_limit", 10.0),
        hc_mult=_req_int(d, "hc_mult", 4),
        hc_sinkhorn_iters=_req_int(d, "hc_sinkhorn_iters", 20),
        hc_eps=_req_float(d, "hc_eps", 1e-6),
        rms_norm_eps=_req_float(d, "rms_norm_eps", 1e-6),
        max_position_embeddings=max_positions,
        bos_token_id=d.get("bos_token_id", 0),
        eos_token_ids=_parse_eos(d),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        num_nextn_predict_layers=int(d.get("num_nextn_predict_layers", 0) or 0),
        vision=_parse_vision(d),
        raw=d,
    )


def lcm_of(values: tuple[int, ...] | list[int]) -> int:
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out
