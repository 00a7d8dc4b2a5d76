"""A random serial MTP block (``mtp.0.*``, release names, shapes and dtypes: spec ds4-speculative §2.1)
added to a random DS4 checkpoint in the official layout (``tests/checkpoints.py``'s config C).

Release dtypes: projections FP8 e4m3 with fp32 block scales (e_proj, h_proj, attention, shared expert),
routed experts MXFP4 (two E2M1 codes a byte, one UE8M0 exponent byte per 32 inputs), norms and the gate
bf16, mHC mixes, sinks and the gate bias fp32. The FP8 block is 32 x 32 here (``weight_block_size`` in
the config) so the small widths still have several blocks. ``quantized=False`` writes everything fp32.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from checkpoints import CONFIG_C_OFFICIAL

FP8_BLOCK = 32
MTP_CONFIG = dict(CONFIG_C_OFFICIAL, num_nextn_predict_layers=1, quantization_config={"weight_block_size": [32, 32]})


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 32 x 32 block absmax / 448 scaling to e4m3 (codes, fp32 scales)."""
    rows, cols = w.shape
    nb0, nb1 = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    scale = torch.empty(nb0, nb1)
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(nb0):
        for j in range(nb1):
            r, c = slice(i * FP8_BLOCK, (i + 1) * FP8_BLOCK), slice(j * FP8_BLOCK, (j + 1) * FP8_BLOCK)
            scale[i, j] = w[r, c].abs().max().clamp(min=1e-8) / 448.0
            codes[r, c] = (w[r, c] / scale[i, j]).to(torch.float8_e4m3fn)
    return codes, scale


def _mxfp4(rows: int, cols: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed E2M1 codes ``[rows, cols / 2]`` (int8, as the release stores them) and UE8M0
    exponent bytes ``[rows, cols / 32]`` around 2^-4 (values up to 6 x 2^-3)."""
    codes = torch.randint(0, 256, (rows, cols // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    exps = (127 + torch.randint(-6, -2, (rows, cols // 32), generator=gen)).to(torch.uint8)
    return codes.view(torch.int8), exps.view(torch.float8_e8m0fnu)


def mtp_tensors(config: dict, seed: int = 0, quantized: bool = True) -> dict[str, torch.Tensor]:
    """``mtp.0.*`` for ``config`` (official dialect), seeded."""
    gen = torch.Generator().manual_seed(1000 + seed)
    d, hc, heads, hd = config["hidden_size"], config["hc_mult"], config["num_attention_heads"], config["head_dim"]
    q_lora, groups, o_lora = config["q_lora_rank"], config["o_groups"], config["o_lora_rank"]
    n_exp, inter = config["n_routed_experts"], config["moe_intermediate_size"] * config["n_shared_experts"]
    out: dict[str, torch.Tensor] = {}
    p = "mtp.0."

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def linear(name: str, rows: int, cols: int) -> None:
        w = randn(rows, cols, std=cols**-0.5)
        if quantized:
            out[p + name + ".weight"], out[p + name + ".scale"] = _fp8(w)
        else:
            out[p + name + ".weight"] = w

    def norm(name: str, dim: int) -> None:
        w = 1.0 + randn(dim, std=0.1)
        out[p + name] = w.to(torch.bfloat16) if quantized else w

    for name in ("enorm.weight", "hnorm.weight", "norm.weight", "attn_norm.weight", "ffn_norm.weight"):
        norm(name, d)
    norm("attn.q_norm.weight", q_lora)
    norm("attn.kv_norm.weight", hd)
    linear("e_proj", d, d)
    linear("h_proj", d, d)
    linear("attn.wq_a", q_lora, d)
    linear("attn.wq_b", heads * hd, q_lora)
    linear("attn.wkv", hd, d)
    linear("attn.wo_a", groups * o_lora, heads * hd // groups)
    linear("attn.wo_b", d, groups * o_lora)
    out[p + "attn.attn_sink"] = randn(heads, std=0.5)
    mix = (2 + hc) * hc
    for part in ("attn", "ffn"):
        out[p + f"hc_{part}_fn"] = randn(mix, hc * d, std=0.05)
        out[p + f"hc_{part}_base"] = randn(mix, std=0.5)
        out[p + f"hc_{part}_scale"] = 1.0 + randn(3, std=0.2)
    out[p + "hc_head_fn"] = randn(hc, hc * d, std=0.05)
    out[p + "hc_head_base"] = randn(hc, std=0.5)
    out[p + "hc_head_scale"] = 1.0 + randn(1, std=0.2)
    gate = randn(n_exp, d, std=d**-0.5)
    out[p + "ffn.gate.weight"] = gate.to(torch.bfloat16) if quantized else gate
    out[p + "ffn.gate.bias"] = randn(n_exp, std=0.1)
    linear("ffn.shared_experts.w1", inter, d)
    linear("ffn.shared_experts.w3", inter, d)
    linear("ffn.shared_experts.w2", d, inter)
    _experts(out, p, n_exp, config["moe_intermediate_size"], d, gen, quantized)
    return out


def _experts(out: dict, p: str, n_exp: int, inter: int, d: int, gen: torch.Generator, quantized: bool) -> None:
    for j in range(n_exp):
        for w, (rows, cols) in (("w1", (inter, d)), ("w3", (inter, d)), ("w2", (d, inter))):
            name = f"{p}ffn.experts.{j}.{w}"
            if quantized:
                out[name + ".weight"], out[name + ".scale"] = _mxfp4(rows, cols, gen)
            else:
                out[name + ".weight"] = torch.randn(rows, cols, generator=gen) * cols**-0.5


def write_mtp_checkpoint(base: Path, out: Path, seed: int = 0, quantized: bool = True,
                         edit: Callable[[dict], None] | None = None,
                         config_edit: Callable[[dict], None] | None = None, **overrides) -> Path:
    """``base`` (an official-layout config C checkpoint) plus ``mtp.0.*`` into ``out``; ``edit`` /
    ``config_edit`` change the tensors / config before they are written (the loader's error tests);
    ``overrides``: the config keys ``base`` was built with (``build_trunk``'s), for the block too."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(base / "model.safetensors"))
    tensors.update(mtp_tensors(MTP_CONFIG | overrides, seed, quantized))
    config = json.loads(json.dumps(MTP_CONFIG | overrides))
    if edit is not None:
        edit(tensors)
    if config_edit is not None:
        config_edit(config)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def write_byte_tokenizer(ckpt: Path) -> Path:
    """A byte tokenizer (``ds4serve.tiny.byte_tokenizer``) padded with placeholder tokens up to the
    checkpoint's vocabulary, into ``ckpt``: a server then decodes every id the random model writes."""
    from tokenizers import AddedToken

    from ds4serve.tiny.byte_tokenizer import build_byte_tokenizer

    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    tok = build_byte_tokenizer()
    tok.add_tokens([AddedToken(f"<id{i}>", normalized=False) for i in range(tok.get_vocab_size(), vocab)])
    tok.save(str(ckpt / "tokenizer.json"))
    return ckpt
