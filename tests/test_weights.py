"""Checkpoint loading: name dialects, sharding, FP8 and MXFP4 dequantisation, clear errors."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import APPENDIX_A, official_name, write_config
from ds4serve.llm import LLM
from ds4serve.model.weights import CheckpointError, canonical_name
from model_helpers import random_ids


def _tensors(path):
    return load_file(str(path / "model.safetensors"))


def test_official_names_give_identical_logits(ckpt_factory, llm_factory, tmp_path):
    _, path = ckpt_factory("A")
    off = tmp_path / "official"
    off.mkdir()
    save_file({official_name(k): v for k, v in _tensors(path).items()}, str(off / "model.safetensors"))
    shutil.copy(path / "config.json", off / "config.json")
    assert any(k.startswith("layers.0.attn.wq_a") for k in _tensors(off))
    ids = random_ids(90, 1000, seed=3)
    a = llm_factory("A").prompt_logits(ids)
    b = LLM(off).prompt_logits(ids)
    assert torch.equal(a, b)


def test_hf_module_names_load_too(ckpt_factory, llm_factory, tmp_path):
    """A state dict saved with the module names (no conversion) loads to the same model."""
    hf, _ = ckpt_factory("A")
    d = tmp_path / "modnames"
    d.mkdir()
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    save_file(sd, str(d / "model.safetensors"))
    write_config(d, APPENDIX_A)
    ids = random_ids(40, 1000, seed=4)
    assert torch.equal(LLM(d).prompt_logits(ids), llm_factory("A").prompt_logits(ids))


def test_sharded_checkpoint_with_index(ckpt_factory, llm_factory, tmp_path):
    _, path = ckpt_factory("A")
    tensors = _tensors(path)
    names = sorted(tensors)
    d = tmp_path / "sharded"
    d.mkdir()
    weight_map = {}
    for i in range(3):
        part = {k: tensors[k] for k in names[i::3]}
        fname = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file(part, str(d / fname))
        weight_map.update({k: fname for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(path / "config.json", d / "config.json")
    ids = random_ids(33, 1000, seed=5)
    assert torch.equal(LLM(d).prompt_logits(ids), llm_factory("A").prompt_logits(ids))


def test_missing_tensor_is_named(ckpt_factory, tmp_path):
    _, path = ckpt_factory("A")
    tensors = _tensors(path)
    victim = "model.layers.3.attn.compressor.wgate.weight"
    assert victim in tensors
    del tensors[victim]
    d = tmp_path / "missing"
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    shutil.copy(path / "config.json", d / "config.json")
    with pytest.raises(CheckpointError, match=r"missing tensors \(1\): model\.layers\.3\.self_attn\.compressor\.gate_proj\.weight"):
        LLM(d)


def test_misshaped_and_unexpected_tensors_are_listed(ckpt_factory, tmp_path):
    _, path = ckpt_factory("A")
    tensors = _tensors(path)
    tensors["model.layers.1.attn.wq_a.weight"] = torch.zeros(7, 7)
    tensors["model.layers.1.attn.surprise.weight"] = torch.zeros(2)
    d = tmp_path / "bad"
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    shutil.copy(path / "config.json", d / "config.json")
    with pytest.raises(CheckpointError) as err:
        LLM(d)
    msg = str(err.value)
    assert "model.layers.1.attn.wq_a.weight: shape [7, 7], expected [128, 256]" in msg
    assert "surprise" in msg


def test_mtp_tensors_are_ignored(ckpt_factory, llm_factory, tmp_path):
    _, path = ckpt_factory("A")
    tensors = _tensors(path)
    tensors["mtp.0.e_proj.weight"] = torch.zeros(4, 4)
    d = tmp_path / "mtp"
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    shutil.copy(path / "config.json", d / "config.json")
    ids = random_ids(10, 1000, seed=6)
    assert torch.equal(LLM(d).prompt_logits(ids), llm_factory("A").prompt_logits(ids))


def _quantize_fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block absmax scaling to e4m3 (max 448), written independently of the loader."""
    out_dim, in_dim = w.shape
    nb0, nb1 = -(-out_dim // block), -(-in_dim // block)
    scale = torch.empty(nb0, nb1)
    q = torch.empty(out_dim, in_dim, dtype=torch.float8_e4m3fn)
    for i in range(nb0):
        for j in range(nb1):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            s = blk.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def _dequant_reference(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    out = q.float().clone()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block:(i + 1) * block, j * block:(j + 1) * block] *= scale[i, j]
    return out


@pytest.mark.parametrize("scale_suffix", [".scale", ".weight_scale_inv"])
def test_fp8_block_scaled_checkpoint(ckpt_factory, tmp_path, scale_suffix):
    """FP8 e4m3 weights with block scales (block 48 here, so edge blocks are partial) are dequantised."""
    hf, path = ckpt_factory("A")
    tensors = _tensors(path)
    block = 48
    quantised = [k for k in tensors if k.endswith(("wq_a.weight", "wq_b.weight", "wkv.weight", "wo_b.weight",
                                                   "shared_experts.w1.weight", "experts.3.w2.weight"))]
    assert len(quantised) >= 20
    dequantised = {}
    for k in quantised:
        q, s = _quantize_fp8(tensors[k], block)
        tensors[k] = q
        tensors[k[: -len(".weight")] + scale_suffix] = s
        dequantised[k] = _dequant_reference(q, s, block)
    d = tmp_path / "fp8"
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    config = dict(APPENDIX_A, quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                                   "weight_block_size": [block, block]})
    write_config(d, config)
    ours = LLM(d)

    def overwrite(sd):
        for k, w in dequantised.items():
            mapped = _hf_module_name(k)
            if mapped.endswith("]"):
                base, idx = mapped[:-1].split("[")
                sd[base][int(idx)].copy_(w)
            else:
                sd[mapped].copy_(w)

    _assert_reference_logits(hf, ours, overwrite, seed=8)  # FP8 rounding visible in the logits


def _assert_reference_logits(hf, ours, overwrite, seed: int) -> None:
    """transformers' model with ``overwrite(state_dict)`` applied is the reference: ours matches it
    within 1e-4, and differs from the unquantised original (the weights really changed)."""
    from checkpoints import build_hf_model

    ref = build_hf_model(APPENDIX_A)
    ref.load_state_dict(hf.state_dict())
    with torch.no_grad():
        overwrite(ref.state_dict())
    ids = random_ids(60, 1000, seed=seed)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
        orig = hf(torch.tensor([ids])).logits[0]
    got = ours.prompt_logits(ids)
    assert (got - want).abs().max().item() < 1e-4
    assert (got - orig).abs().max().item() > 1e-4


def _hf_module_name(saved: str) -> str:
    if ".experts." in saved and ".shared_experts." not in saved:
        layer = saved.split(".")[2]
        j = int(saved.split(".experts.")[1].split(".")[0])
        return f"model.layers.{layer}.mlp.experts.down_proj[{j}]"
    return canonical_name(saved)


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _quantize_mxfp4(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MXFP4, written independently of the loader: per 32 inputs a power-of-two scale that
    maps the block's absmax to <= 6, each value rounded to the nearest E2M1 magnitude; codes packed
    two per byte, the even input in the low nibble. Returns (uint8 codes [out, in/2], exponent
    bytes [out, in/32])."""
    out_dim, in_dim = w.shape
    blocks = w.reshape(out_dim, in_dim // block, block)
    exp = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp(min=2.0**-100) / 6.0)).clamp(-127, 127)
    scaled = blocks / exp.exp2().unsqueeze(-1)
    mag = (scaled.abs().unsqueeze(-1) - _E2M1).abs().argmin(-1)
    codes = (mag + 8 * (scaled < 0)).to(torch.uint8).reshape(out_dim, in_dim)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, (exp + 127).to(torch.uint8)


@pytest.mark.parametrize("storage", ["float4+e8m0", "int8+bytes"])
def test_mxfp4_experts_checkpoint(ckpt_factory, tmp_path, storage):
    """Routed experts shipped as MXFP4 (the Flash instruct format) load to what transformers' own
    FP4 dequantisation gives, and the model's logits follow."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    hf, path = ckpt_factory("A")
    tensors = _tensors(path)
    names = [k for k in tensors if re.search(r"\.experts\.\d+\.w[123]\.weight$", k)]
    assert len(names) == 6 * 8 * 3
    reference = Fp8Dequantize(None)
    original = dict(tensors)
    dequantised = {}
    for k in names:
        packed, exps = _quantize_mxfp4(tensors[k])
        if storage == "float4+e8m0":
            weight, scale = packed.view(torch.float4_e2m1fn_x2), (exps.float() - 127).exp2().to(torch.float8_e8m0fnu)
        else:
            weight, scale = packed.view(torch.int8), exps
        tensors[k], tensors[k[: -len(".weight")] + ".scale"] = weight, scale
        dequantised[k] = reference._dequantize_one(weight, scale, output_dtype=torch.float32)
        assert (dequantised[k] - original[k]).abs().max() < 0.2 * original[k].abs().max()
    d = tmp_path / "fp4"
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    write_config(d, dict(APPENDIX_A, quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                                          "weight_block_size": [128, 128], "expert_dtype": "fp4"}))
    ours = LLM(d)
    got_w = ours.model.state_dict()
    for k, w in dequantised.items():
        layer, j, which = re.search(r"layers\.(\d+)\.ffn\.experts\.(\d+)\.(w\d)", k).groups()
        if which == "w2":
            stored = got_w[f"model.layers.{layer}.mlp.experts.down_proj"][int(j)]
        else:
            gate_up = got_w[f"model.layers.{layer}.mlp.experts.gate_up_proj"][int(j)]
            stored = gate_up.chunk(2)[0 if which == "w1" else 1]
        assert torch.equal(stored, w), k

    def overwrite(sd):
        for name in sd:
            if re.match(r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$", name):
                sd[name].copy_(got_w[name])

    _assert_reference_logits(hf, ours, overwrite, seed=9)  # FP4 rounding visible: the experts really changed


def test_mxfp4_without_scale_is_an_error(ckpt_factory, tmp_path):
    _, path = ckpt_factory("A")
    tensors = _tensors(path)
    k = next(k for k in tensors if k.endswith(".experts.0.w1.weight"))
    tensors[k] = _quantize_mxfp4(tensors[k])[0].view(torch.int8)
    d = tmp_path / "fp4bad"
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    shutil.copy(path / "config.json", d / "config.json")
    with pytest.raises(CheckpointError, match="packed FP4"):
        LLM(d)


def test_fp8_without_scale_is_an_error(ckpt_factory, tmp_path):
    _, path = ckpt_factory("A")
    tensors = _tensors(path)
    tensors["model.layers.0.attn.wq_a.weight"] = tensors["model.layers.0.attn.wq_a.weight"].to(torch.float8_e4m3fn)
    d = tmp_path / "fp8bad"
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    shutil.copy(path / "config.json", d / "config.json")
    with pytest.raises(CheckpointError, match="no block scale"):
        LLM(d)


@pytest.mark.parametrize("name,expected", [
    ("layers.4.attn.indexer.compressor.ape", "model.layers.4.self_attn.compressor.indexer.position_bias"),
    ("model.layers.4.attn.norm.weight", "model.layers.4.self_attn.kv_norm.weight"),
    ("layers.2.attn.compressor.norm.weight", "model.layers.2.self_attn.compressor.kv_norm.weight"),
    ("layers.0.ffn.gate.bias", "model.layers.0.mlp.gate.e_score_correction_bias"),
    ("layers.0.hc_ffn_scale", "model.layers.0.ffn_hc.scale"),
    ("hc_head_fn", "model.hc_head.hc_fn"),
    ("head.weight", "lm_head.weight"),
    ("model.layers.3.self_attn.kv_norm.weight", "model.layers.3.self_attn.kv_norm.weight"),
])
def test_name_map(name, expected):
    assert canonical_name(name) == expected
