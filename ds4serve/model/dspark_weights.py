"""The DSpark block drafter's config and weights: detected from the checkpoint, validated, loaded.

Spec ds4-speculative §1, §3.2, §12. A DS4 checkpoint carries its drafter under ``mtp.<s>.*``: the
serial MTP block of the Flash preview (``mtp.0.e_proj`` / ``h_proj``), or the three-stage DSpark
drafter of Flash-DSpark / Flash-0731 / Vision-Exp (``mtp.0.main_proj``, ``mtp.<last>.markov_head``).
The stage count comes from the ``mtp.<s>.*`` keys present, never from ``num_nextn_predict_layers``
(1 on 0731 although it ships 3 stages). Everything that does not fit, a missing or mis-shaped tensor, a
tensor in a dtype this loader does not handle, a ``dspark_*`` key that is absent, out of range or
claims a drafter whose tensors are not there, is one :class:`ConfigError` listing every problem by
tensor or key name: peers' silent fallbacks (an uninitialised head, 0 % acceptance) are the failure
this module exists to prevent.

Loading follows the trunk's reader (``weights.py``): FP8 e4m3 with block scales
(``quantization_config.weight_block_size``) and MXFP4 routed experts are dequantised with the same
``quant.py`` helpers, one tensor at a time; bf16 / fp32 / fp16 tensors are converted. Norms, mHC mixes,
sinks, the routing bias and the confidence projection stay fp32 whatever the compute dtype.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ConfigError, ModelConfig
from .checkpoint import Source, checkpoint_files, scale_name, scaled_weight
from .packed import PackedExperts, stack_parts
from .quant import FormatError, dequant_fp8, dequant_mxfp4

# the config keys that declare a DSpark drafter (spec §1); all four are required once any is present
DSPARK_KEYS = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank")

_STAGE_RE = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.+)$")
_FLOAT = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_FP8 = {"F8_E4M3"}
_FP4 = {"I8", "U8", "F4"}
MXFP4_BLOCK = (1, 32)  # one UE8M0 scale per 32 inputs of a row
# what a tensor may be stored as: plain floats, FP8 with a block scale (projections), or also MXFP4 (experts)
_KIND_DTYPES = {"plain": set(_FLOAT), "linear": set(_FLOAT) | _FP8, "expert": set(_FLOAT) | _FP8 | _FP4}
# tensors kept fp32 whatever the compute dtype (statistics, mixes, sinks, selection bias, the score)
_KEEP_FP32 = ("norm.weight", "hc_", "attn_sink", "gate.bias", "confidence_head.")


@dataclass(frozen=True)
class DSparkConfig:
    """The drafter's shape: its own keys plus the trunk's widths (the stages are V4 blocks)."""

    trunk: ModelConfig
    n_stages: int
    block_size: int
    noise_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    n_routed_experts: int
    n_activated_experts: int

    @property
    def window(self) -> int:
        """Rows of each stage's private ring: the trunk's sliding window (128 for DS4, spec §3.4)."""
        return self.trunk.sliding_window


@dataclass
class DSparkWeights:
    """Loaded tensors: ``stages[s]`` maps an official suffix (``attn.wq_a.weight``) to its tensor;
    the routed experts are stacked as ``experts.gate_up [E, 2I, D]`` / ``experts.down [E, D, I]``
    (tensors, or ``PackedExperts`` kept in the checkpoint's MXFP4 / FP8 when loaded packed)."""

    config: DSparkConfig
    stages: list[dict[str, torch.Tensor | PackedExperts]] = field(default_factory=list)


def stage_ids(names) -> list[int]:
    """The stage indices present among checkpoint tensor names (``mtp.<s>.*``), sorted."""
    return sorted({int(m.group(1)) for m in map(_STAGE_RE.match, names) if m})


def detect_drafter(cfg: ModelConfig, names) -> str | None:
    """"dspark", "mtp" or None: which drafter the checkpoint carries. DSpark is claimed by any
    ``dspark_*`` key or by a ``mtp.0.main_proj`` tensor (then the keys are checked at load)."""
    names = list(names)
    suffixes = {m.group(2) for m in map(_STAGE_RE.match, names) if m and m.group(1) == "0"}
    if any(k in cfg.raw for k in DSPARK_KEYS) or "main_proj.weight" in suffixes:
        return "dspark"
    if suffixes:
        return "mtp"
    return None


def parse_dspark_config(cfg: ModelConfig, n_stages: int) -> DSparkConfig:
    """The ``dspark_*`` keys of ``cfg``, validated against the trunk and the ``n_stages`` counted."""
    raw, problems = cfg.raw, []
    missing = [k for k in DSPARK_KEYS if k not in raw]
    if missing:
        raise ConfigError(f"the checkpoint has DSpark drafter tensors (mtp.0.main_proj) but config.json lacks "
                          f"{', '.join(missing)} (spec ds4-speculative §1: DS4 uses block 5, noise id 128799, "
                          "target layers [40, 41, 42], Markov rank 256)")
    block = _int_key(raw, "dspark_block_size", 1, None, problems)
    noise = _int_key(raw, "dspark_noise_token_id", 0, cfg.vocab_size - 1, problems)
    rank = _int_key(raw, "dspark_markov_rank", 1, None, problems)
    layers = raw["dspark_target_layer_ids"]
    if not isinstance(layers, list) or not layers or not all(_is_int(i) for i in layers):
        problems.append(f"config key 'dspark_target_layer_ids' must be a non-empty list of layer indices, "
                        f"got {layers!r}")
        layers = []
    elif any(not 0 <= i < cfg.num_layers for i in layers) or len(set(layers)) != len(layers):
        problems.append(f"config key 'dspark_target_layer_ids' = {layers}: must be distinct target layers in "
                        f"[0, num_hidden_layers = {cfg.num_layers})")
    n_exp = _trunk_default(raw, "dspark_n_routed_experts", cfg.n_routed_experts, problems)
    n_act = _trunk_default(raw, "dspark_n_activated_experts", cfg.n_experts_per_tok, problems)
    if n_act > n_exp:
        problems.append(f"config key 'dspark_n_activated_experts' = {n_act} exceeds the {n_exp} routed experts")
    problems += _stage_count_problems(cfg, n_stages)
    if problems:
        raise ConfigError("DSpark drafter config is invalid:\n  " + "\n  ".join(problems))
    return DSparkConfig(cfg, n_stages, block, noise, tuple(layers), rank, n_exp, n_act)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_key(raw: dict, key: str, lo: int, hi: int | None, problems: list[str]) -> int:
    v = raw[key]
    if not _is_int(v) or v < lo or (hi is not None and v > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        problems.append(f"config key {key!r} must be an integer {bound}, got {v!r}")
        return lo
    return v


def _trunk_default(raw: dict, key: str, trunk: int, problems: list[str]) -> int:
    """Optional expert counts (V4.1 only): absent or 0 means the trunk's value (spec §1)."""
    v = raw.get(key) or 0
    if not _is_int(v) or v < 0:
        problems.append(f"config key {key!r} must be a non-negative integer (0 = the trunk's), got {v!r}")
        return trunk
    return v or trunk


def _stage_count_problems(cfg: ModelConfig, n_stages: int) -> list[str]:
    """``n_mtp_layers`` (inference config) must match the stages counted; official ``compress_ratios``
    entries for the stage layers must be 0 (the stages are sliding-window only, spec §1, §3.6)."""
    raw, out = cfg.raw, []
    if "n_mtp_layers" in raw and raw["n_mtp_layers"] != n_stages:
        out.append(f"config key 'n_mtp_layers' = {raw['n_mtp_layers']!r}, but the checkpoint has {n_stages} "
                   "DSpark stages (mtp.<s>.* tensors)")
    ratios = raw.get("compress_ratios")
    if isinstance(ratios, list):
        extra = ratios[cfg.num_layers:cfg.num_layers + n_stages]
        if any(r != 0 for r in extra):
            out.append(f"config key 'compress_ratios' gives the DSpark stage layers {extra}; they must be 0 "
                       "(the stages are sliding-window only)")
    return out


def expected_stage_tensors(dc: DSparkConfig, stage: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{official suffix: (logical shape, storage kind)}`` of stage ``stage`` (spec §3.2). Kinds:
    "plain" (floats only), "linear" (floats or FP8), "expert" (floats, FP8 or MXFP4)."""
    c = dc.trunk
    d, h, hd, hc = c.hidden_size, c.num_heads, c.head_dim, c.hc_mult
    inter, n_mix = c.moe_intermediate_size, (2 + hc) * hc
    shared = inter * c.n_shared_experts
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "attn.attn_sink": ((h,), "plain"), "attn.wq_a.weight": ((c.q_lora_rank, d), "linear"),
        "attn.q_norm.weight": ((c.q_lora_rank,), "plain"), "attn.wq_b.weight": ((h * hd, c.q_lora_rank), "linear"),
        "attn.wkv.weight": ((hd, d), "linear"), "attn.kv_norm.weight": ((hd,), "plain"),
        "attn.wo_a.weight": ((c.o_groups * c.o_lora_rank, h * hd // c.o_groups), "linear"),
        "attn.wo_b.weight": ((d, c.o_groups * c.o_lora_rank), "linear"),
        "attn_norm.weight": ((d,), "plain"), "ffn_norm.weight": ((d,), "plain"),
        "ffn.gate.weight": ((dc.n_routed_experts, d), "plain"), "ffn.gate.bias": ((dc.n_routed_experts,), "plain"),
    }
    for mix in ("attn", "ffn"):
        out |= {f"hc_{mix}_fn": ((n_mix, hc * d), "plain"), f"hc_{mix}_base": ((n_mix,), "plain"),
                f"hc_{mix}_scale": ((3,), "plain")}
    if c.vision.enabled:  # DS4V: image tokens select experts with their own bias (ds4-vision)
        out["ffn.gate.bias_vl"] = ((dc.n_routed_experts,), "plain")
    if shared:
        out |= {"ffn.shared_experts.w1.weight": ((shared, d), "linear"),
                "ffn.shared_experts.w3.weight": ((shared, d), "linear"),
                "ffn.shared_experts.w2.weight": ((d, shared), "linear")}
    for e in range(dc.n_routed_experts):
        out |= {f"ffn.experts.{e}.w1.weight": ((inter, d), "expert"),
                f"ffn.experts.{e}.w3.weight": ((inter, d), "expert"),
                f"ffn.experts.{e}.w2.weight": ((d, inter), "expert")}
    if stage == 0:
        out |= {"main_proj.weight": ((d, len(dc.target_layer_ids) * d), "linear"), "main_norm.weight": ((d,), "plain")}
    if stage == dc.n_stages - 1:
        out |= {"norm.weight": ((d,), "plain"), "hc_head_fn": ((hc, hc * d), "plain"), "hc_head_base": ((hc,), "plain"),
                "hc_head_scale": ((1,), "plain"),
                "markov_head.markov_w1.weight": ((c.vocab_size, dc.markov_rank), "plain"),
                "markov_head.markov_w2.weight": ((c.vocab_size, dc.markov_rank), "plain"),
                "confidence_head.proj.weight": ((1, d + dc.markov_rank), "plain")}
    return out


def load_dspark(path: str | Path, cfg: ModelConfig | None = None, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", packed_experts: bool = False) -> DSparkWeights:
    """Read the DSpark drafter of the checkpoint at ``path``; ``ConfigError`` naming every problem when
    the checkpoint has none, has the serial MTP block instead, or has one that does not fit its config.
    ``packed_experts``: routed experts stored MXFP4 (or FP8) stay packed (``packed.PackedExperts``, as the
    trunk's loader does; a real drafter's 3 x 256 experts are ~5 GiB packed, ~40 GiB in bf16)."""
    path = Path(path)
    cfg = cfg if cfg is not None else ModelConfig.from_file(path)
    src = Source(checkpoint_files(path))
    names = {m.group(0): m for m in map(_STAGE_RE.match, src.where) if m}
    kind = detect_drafter(cfg, names)
    if kind != "dspark":
        what = "the serial MTP block (mtp.0.e_proj / h_proj)" if kind == "mtp" else "no mtp.* tensors"
        raise ConfigError(f"no DSpark drafter in {path}: the checkpoint has {what} and config.json has none of "
                          f"{', '.join(DSPARK_KEYS)}")
    stages = stage_ids(names)
    if not stages:
        keys = ", ".join(k for k in DSPARK_KEYS if k in cfg.raw)
        raise ConfigError(f"config.json declares a DSpark drafter ({keys}) "
                          f"but the checkpoint {path} has no mtp.<s>.* tensors")
    gaps = sorted(set(range(max(stages) + 1)) - set(stages))
    if gaps:
        raise ConfigError(f"DSpark stages must be numbered 0..{max(stages)}: no tensors for mtp.{gaps[0]}.*")
    dc = parse_dspark_config(cfg, len(stages))
    src.fp8_block = _fp8_block(cfg)
    plan = _plan(src, dc, names)
    weights = DSparkWeights(dc)
    for stage in range(dc.n_stages):
        packed = _packed_stacks(src, plan[stage], dc, dtype, torch.device(device)) if packed_experts else None
        todo = {k: v for k, v in plan[stage].items() if packed is None or ".experts." not in k or "shared" in k}
        loaded = {suffix: _to(_read(src, name), suffix, dtype, device) for suffix, name in todo.items()}
        weights.stages.append(loaded | packed if packed is not None else _stack_experts(loaded, dc))
    return weights


def _packed_stacks(src: Source, plan: dict[str, str], dc: DSparkConfig, dtype: torch.dtype,
                   device: torch.device) -> dict[str, PackedExperts] | None:
    """A stage's routed experts as ``PackedExperts`` (gate and up as two parts, as the trunk stacks
    them), or None when they are not all MXFP4 or all FP8 (then they are dequantised at load)."""
    names = [[plan[f"ffn.experts.{e}.{w}.weight"] for w in ("w1", "w3", "w2")] for e in range(dc.n_routed_experts)]
    kinds = {src.dtype(n) for row in names for n in row}
    fmt = "mxfp4" if kinds <= _FP4 else "fp8" if kinds <= _FP8 else None
    if fmt is None:
        return None

    def part(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return src.get(name), src.get(scale_name(src, name))

    c = dc.trunk
    d, inter, n = c.hidden_size, c.moe_intermediate_size, dc.n_routed_experts
    where = names[0][0].rsplit(".experts.", 1)[0] + ".experts"
    gate_up = PackedExperts(fmt, stack_parts([[part(r[0]), part(r[1])] for r in names], device), (n, 2 * inter, d),
                            dtype, src.fp8_block, where + ".w1/w3")
    down = PackedExperts(fmt, stack_parts([[part(r[2])] for r in names], device), (n, d, inter), dtype,
                         src.fp8_block, where + ".w2")
    return {"experts.gate_up": gate_up, "experts.down": down}


def _fp8_block(cfg: ModelConfig) -> tuple[int, int]:
    block = (cfg.raw.get("quantization_config") or {}).get("weight_block_size") or [128, 128]
    if len(block) != 2 or not all(_is_int(b) and b > 0 for b in block):
        raise ConfigError("config key 'quantization_config.weight_block_size' must be two positive ints, "
                          f"got {block!r}")
    return int(block[0]), int(block[1])


def _plan(src: Source, dc: DSparkConfig, names: dict) -> list[dict[str, str]]:
    """Per stage ``{suffix: checkpoint name}``, after checking that every expected tensor is there with
    its shape and a handled dtype and that nothing else is under ``mtp.*``; one error lists all problems."""
    plan: list[dict[str, str]] = [{} for _ in range(dc.n_stages)]
    by_stage: dict[tuple[int, str], str] = {}
    problems: list[str] = []
    for name, m in names.items():
        if scaled_weight(src, name) is None:
            by_stage[(int(m.group(1)), m.group(2))] = name
    for stage in range(dc.n_stages):
        for suffix, (shape, kind) in expected_stage_tensors(dc, stage).items():
            name = by_stage.pop((stage, suffix), None)
            if name is None:
                problems.append(f"missing tensor mtp.{stage}.{suffix} {list(shape)}")
                continue
            problems += _tensor_problems(src, name, shape, kind)
            plan[stage][suffix] = name
    problems += [f"unexpected tensor {name} (not part of a DSpark stage of this config)"
                 for name in sorted(by_stage.values())]
    if problems:
        raise ConfigError(f"DSpark drafter tensors do not match the config ({len(problems)} problems):\n  "
                          + "\n  ".join(problems[:40]) + ("\n  ..." if len(problems) > 40 else ""))
    return plan


def _tensor_problems(src: Source, name: str, shape: tuple[int, ...], kind: str) -> list[str]:
    dt, scale = src.dtype(name), scale_name(src, name)
    if dt not in _KIND_DTYPES[kind]:
        allowed = ", ".join(sorted(_KIND_DTYPES[kind]))
        return [f"tensor {name}: dtype {dt} is not handled here (expected one of {allowed})"]
    if (dt in _FP8 or dt in _FP4) and scale is None:
        return [f"tensor {name}: {dt} needs a block scale ({name.removesuffix('.weight')}.scale)"]
    got = src.logical_shape(name)
    if got != shape:
        return [f"tensor {name}: shape {list(got)}, expected {list(shape)}"]
    if dt in _FP8 or dt in _FP4:
        (b0, b1), (rows, cols) = (MXFP4_BLOCK if dt in _FP4 else src.fp8_block), shape
        want = (-(-rows // b0), -(-cols // b1))
        if src.shape(scale) != want:
            return [f"tensor {name}: scale {scale} has shape {list(src.shape(scale))}, expected {list(want)} "
                    f"(blocks of {b0} x {b1}; quantization_config.weight_block_size for FP8)"]
    return []


def _read(src: Source, name: str) -> torch.Tensor:
    """One tensor as fp32, dequantised when FP8 / MXFP4 (with the trunk loader's helpers)."""
    t, dt = src.get(name), src.dtype(name)
    try:
        if dt in _FP8:
            return dequant_fp8(t, src.get(scale_name(src, name)), src.fp8_block, name)
        if dt in _FP4:
            return dequant_mxfp4(t, src.get(scale_name(src, name)), name)
    except FormatError as exc:
        raise ConfigError(str(exc)) from exc
    return t.float()


def _to(t: torch.Tensor, suffix: str, dtype: torch.dtype, device) -> torch.Tensor:
    keep = any(marker in suffix for marker in _KEEP_FP32)
    return t.to(device=device, dtype=torch.float32 if keep else dtype).contiguous()


def _stack_experts(loaded: dict[str, torch.Tensor], dc: DSparkConfig) -> dict[str, torch.Tensor]:
    """Per-expert ``w1``/``w3``/``w2`` -> ``experts.gate_up [E, 2I, D]`` and ``experts.down [E, D, I]`` (the
    layout ``moe.run_experts`` takes), the per-expert entries dropped."""
    n = dc.n_routed_experts
    gate_up = torch.stack([torch.cat((loaded.pop(f"ffn.experts.{e}.w1.weight"),
                                      loaded.pop(f"ffn.experts.{e}.w3.weight"))) for e in range(n)])
    down = torch.stack([loaded.pop(f"ffn.experts.{e}.w2.weight") for e in range(n)])
    return loaded | {"experts.gate_up": gate_up, "experts.down": down}
