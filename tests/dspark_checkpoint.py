"""A random DSpark drafter in the release layout, added to a random DS4 checkpoint (config C of
``tests/checkpoints.py``, official names and dialect).

Names, shapes and storage follow spec ds4-speculative §3.2 and the Flash release: the projections
(``wq_a``, ``wq_b``, ``wkv``, ``wo_a``, ``wo_b``, the shared expert, ``main_proj``) FP8 e4m3 with UE8M0
(``float8_e8m0fnu``) block scales; the routed experts MXFP4 (two E2M1 codes per byte, one UE8M0 scale
per 32 inputs); norms, the gate, the Markov and the confidence heads bf16; the mHC mixes, the sinks and
the routing bias fp32. Widths are config C's (D = 64, vocab 300), the Markov rank 16, the FP8 block
32 x 32 (so some blocks are partial). Written independently of ``ds4serve.model.dspark_weights``: the
tensor list is the spec's, and ``reference`` holds each tensor's value as fp32, dequantised here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from checkpoints import CONFIG_C_HF, CONFIG_C_OFFICIAL, build_hf_model, save_hf, write_config, write_official

FP8_BLOCK = 32
MARKOV_RANK = 16
TARGET_LAYERS = [2, 3, 4]
NOISE_ID = 297
BLOCK = 5
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


@dataclass
class DraftTensors:
    stored: dict[str, torch.Tensor]  # as written (FP8 / MXFP4 / bf16 / fp32, with scales)
    reference: dict[str, torch.Tensor]  # the same tensors as fp32 values, by weight name


def build_trunk(root: Path, **overrides) -> Path:
    """Config C's random reference model, re-saved with official names (the trunk under the drafter);
    ``overrides`` change keys both dialects share (``o_groups=2``: a trunk that splits over two ranks)."""
    model = build_hf_model(CONFIG_C_HF | overrides, seed=0, extra_random=True)
    return write_official(save_hf(model, root / "hf"), root / "official", CONFIG_C_OFFICIAL | overrides)


def dspark_config(stages: int = 3, **overrides) -> dict:
    """The trunk's official config plus the DSpark keys; ``num_nextn_predict_layers`` says 1, as on
    0731, whatever the stage count (the loader must count the ``mtp.<s>`` keys instead)."""
    n = CONFIG_C_OFFICIAL["num_hidden_layers"]
    config = dict(CONFIG_C_OFFICIAL)
    config.update({
        "compress_ratios": list(CONFIG_C_OFFICIAL["compress_ratios"][:n]) + [0] * stages,
        "num_nextn_predict_layers": 1, "dspark_block_size": BLOCK, "dspark_noise_token_id": NOISE_ID,
        "dspark_target_layer_ids": list(TARGET_LAYERS), "dspark_markov_rank": MARKOV_RANK,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "weight_block_size": [FP8_BLOCK, FP8_BLOCK]},
    })
    return config | overrides


def stage_layout(config: dict, stage: int, stages: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """{suffix: (shape, storage)} of one stage, from spec §3.2; storage "fp8", "fp4", "bf16" or "fp32"."""
    d, h, hd, hc = config["hidden_size"], config["num_attention_heads"], config["head_dim"], config["hc_mult"]
    ql, og, olr = config["q_lora_rank"], config["o_groups"], config["o_lora_rank"]
    e, inter, v, r = config["n_routed_experts"], config["moe_intermediate_size"], config["vocab_size"], MARKOV_RANK
    mix = (2 + hc) * hc
    out = {
        "attn.attn_sink": ((h,), "fp32"), "attn.wq_a.weight": ((ql, d), "fp8"), "attn.q_norm.weight": ((ql,), "bf16"),
        "attn.wq_b.weight": ((h * hd, ql), "fp8"), "attn.wkv.weight": ((hd, d), "fp8"),
        "attn.kv_norm.weight": ((hd,), "bf16"), "attn.wo_a.weight": ((og * olr, h * hd // og), "fp8"),
        "attn.wo_b.weight": ((d, og * olr), "fp8"), "attn_norm.weight": ((d,), "bf16"),
        "ffn_norm.weight": ((d,), "bf16"),
        "hc_attn_fn": ((mix, hc * d), "fp32"), "hc_attn_base": ((mix,), "fp32"), "hc_attn_scale": ((3,), "fp32"),
        "hc_ffn_fn": ((mix, hc * d), "fp32"), "hc_ffn_base": ((mix,), "fp32"), "hc_ffn_scale": ((3,), "fp32"),
        "ffn.gate.weight": ((e, d), "bf16"), "ffn.gate.bias": ((e,), "fp32"),
        "ffn.shared_experts.w1.weight": ((inter, d), "fp8"), "ffn.shared_experts.w3.weight": ((inter, d), "fp8"),
        "ffn.shared_experts.w2.weight": ((d, inter), "fp8"),
    }
    for j in range(e):
        out |= {f"ffn.experts.{j}.w1.weight": ((inter, d), "fp4"), f"ffn.experts.{j}.w3.weight": ((inter, d), "fp4"),
                f"ffn.experts.{j}.w2.weight": ((d, inter), "fp4")}
    if stage == 0:
        out |= {"main_proj.weight": ((d, len(TARGET_LAYERS) * d), "fp8"), "main_norm.weight": ((d,), "bf16")}
    if stage == stages - 1:
        out |= {"norm.weight": ((d,), "bf16"), "hc_head_fn": ((hc, hc * d), "fp32"), "hc_head_base": ((hc,), "fp32"),
                "hc_head_scale": ((1,), "fp32"), "markov_head.markov_w1.weight": ((v, r), "bf16"),
                "markov_head.markov_w2.weight": ((v, r), "bf16"), "confidence_head.proj.weight": ((1, d + r), "bf16")}
    return out


def _value(suffix: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A random value with a scale that keeps every part of the forward away from saturation."""
    randn = torch.randn(shape, generator=gen)
    if suffix.endswith("norm.weight"):
        return 1.0 + 0.1 * randn
    if suffix.endswith("_scale"):
        return 0.5 + 0.1 * randn
    if suffix.endswith(("_base", "attn_sink", "gate.bias")):
        return 0.5 * randn
    if suffix.startswith("markov_head"):
        return 0.7 * randn
    return randn * shape[-1] ** -0.5


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 codes, UE8M0 block scales, dequantised fp32): per FP8_BLOCK^2 block a power-of-two scale
    that maps the block's absmax to <= 448."""
    rows, cols = w.shape
    nb0, nb1 = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    exps = torch.empty(nb0, nb1)
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    deq = torch.empty(rows, cols)
    for i in range(nb0):
        for j in range(nb1):
            sl = (slice(i * FP8_BLOCK, (i + 1) * FP8_BLOCK), slice(j * FP8_BLOCK, (j + 1) * FP8_BLOCK))
            exp = torch.ceil(torch.log2(w[sl].abs().max().clamp(min=1e-30) / 448.0))
            exps[i, j] = exp
            codes[sl] = (w[sl] / exp.exp2()).to(torch.float8_e4m3fn)
            deq[sl] = codes[sl].float() * exp.exp2()
    return codes, exps.exp2().to(torch.float8_e8m0fnu), deq


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed int8 codes [out, in/2], UE8M0 scales [out, in/32], dequantised fp32): OCP MXFP4, nearest
    E2M1 magnitude, even input in the low nibble."""
    rows, cols = w.shape
    blocks = w.reshape(rows, cols // 32, 32)
    exp = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp(min=2.0**-100) / 6.0)).clamp(-127, 127)
    scaled = blocks / exp.exp2().unsqueeze(-1)
    mag = (scaled.abs().unsqueeze(-1) - E2M1).abs().argmin(-1)
    sign = scaled < 0
    deq = (E2M1[mag] * torch.where(sign, -1.0, 1.0) * exp.exp2().unsqueeze(-1)).reshape(rows, cols)
    codes = (mag + 8 * sign).to(torch.uint8).reshape(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    return packed, exp.exp2().to(torch.float8_e8m0fnu), deq


def drafter_tensors(config: dict, stages: int = 3, seed: int = 0) -> DraftTensors:
    """Every ``mtp.<s>.*`` tensor of a random drafter, as stored and as fp32 reference values."""
    gen = torch.Generator().manual_seed(seed)
    stored, reference = {}, {}
    for s in range(stages):
        for suffix, (shape, kind) in stage_layout(config, s, stages).items():
            name = f"mtp.{s}.{suffix}"
            w = _value(suffix, shape, gen)
            base = name.removesuffix(".weight")
            if kind == "fp8":
                stored[name], stored[base + ".scale"], reference[name] = quantize_fp8(w)
            elif kind == "fp4":
                stored[name], stored[base + ".scale"], reference[name] = quantize_mxfp4(w)
            else:
                stored[name] = w.to(torch.bfloat16 if kind == "bf16" else torch.float32)
                reference[name] = stored[name].float()
    return DraftTensors(stored, reference)


def write_checkpoint(out: Path, trunk: Path, drafter: dict[str, torch.Tensor], config: dict) -> Path:
    """The trunk's tensors plus ``drafter``'s, with ``config`` as config.json, into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(trunk / "model.safetensors")) | drafter
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    write_config(out, config)
    return out
