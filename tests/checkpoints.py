"""Tiny DeepSeek-V4 checkpoints built with transformers' reference model, for parity tests.

Three configs: the spec's Appendix A, and two of our own that move every knob the engine must get
right (layer order, ratios, window, top-k, hash layers, experts, hc_mult, RoPE/YaRN). Config "C" is
written in the official dialect (``compress_ratios``, ``rope_scaling``, ``num_hash_layers``) with
official tensor names, so loading it exercises both name maps.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

APPENDIX_A = {
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "compress_rope_theta": 160000.0, "eos_token_id": None, "hc_eps": 1e-06, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "head_dim": 64, "hidden_act": "silu", "hidden_size": 256,
    "index_head_dim": 32, "index_n_heads": 16, "index_topk": 8, "initializer_range": 0.02,
    "layer_types": ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    "max_position_embeddings": 2048, "mlp_bias": False,
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe", "moe", "moe"],
    "model_type": "deepseek_v4", "moe_intermediate_size": 128, "n_routed_experts": 8, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 6,
    "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 2, "o_lora_rank": 64,
    "output_router_logits": False, "pad_token_id": 0, "partial_rotary_factor": 0.25, "q_lora_rank": 128,
    "qk_rope_head_dim": 16, "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "compress": {"attention_factor": 1.0, "beta_fast": 32, "beta_slow": 1, "factor": 4.0,
                     "original_max_position_embeddings": 512, "partial_rotary_factor": 0.25,
                     "rope_theta": 160000.0, "rope_type": "yarn"},
        "main": {"partial_rotary_factor": 0.25, "rope_theta": 10000.0, "rope_type": "default"},
    },
    "rope_theta": 10000.0, "routed_scaling_factor": 1.5, "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0, "scoring_func": "sqrtsoftplus", "sliding_window": 32, "swiglu_limit": 10.0,
    "tie_word_embeddings": False, "transformers_version": "5.23.0", "use_cache": True, "vocab_size": 1000,
}


def build_hf_model(config: dict, seed: int = 0, extra_random: bool = False):
    """The reference model with Appendix A's initialisation (plus more randomised params if asked)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config.from_dict(dict(config))
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                for tok in range(buf.shape[0]):
                    buf[tok] = torch.randperm(cfg.n_routed_experts, generator=gen)[: buf.shape[1]]
        for name, p in model.named_parameters():
            if name.endswith("sinks") or name.endswith("position_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        if extra_random:
            for name, p in model.named_parameters():
                if name.endswith((".base", "hc_base")):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
                elif name.endswith((".scale", "hc_scale")):
                    p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.2)
                elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                    p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.1)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return model


def save_hf(model, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_incremental(model, prompt: list[int], steps: int, chunks: list[int] | None = None):
    """Reference: (chunked) prefill with a cache, then greedy single-token decode.

    Returns ``(prompt_logits [len, V], decode_logits [steps, V], tokens [steps])``.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    chunks = chunks or [len(prompt)]
    assert sum(chunks) == len(prompt)
    outs, pos = [], 0
    with torch.no_grad():
        for n in chunks:
            ids = torch.tensor([prompt[pos:pos + n]])
            out = model(ids, past_key_values=cache, use_cache=True,
                        position_ids=torch.arange(pos, pos + n).unsqueeze(0))
            outs.append(out.logits[0].float())
            pos += n
        prompt_logits = torch.cat(outs)
        tok = int(prompt_logits[-1].argmax())
        dec, toks = [], []
        for _ in range(steps):
            toks.append(tok)
            out = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True,
                        position_ids=torch.tensor([[pos]]))
            pos += 1
            logits = out.logits[0, -1].float()
            dec.append(logits)
            tok = int(logits.argmax())
    return prompt_logits, torch.stack(dec) if dec else torch.empty(0), toks


def write_config(path: Path, config: dict) -> None:
    (path / "config.json").write_text(json.dumps(config, indent=1))


CONFIG_B = {
    "model_type": "deepseek_v4", "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 7,
    "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 32, "qk_rope_head_dim": 8,
    "partial_rotary_factor": 0.25, "q_lora_rank": 64, "o_groups": 4, "o_lora_rank": 32, "sliding_window": 16,
    "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention",
                    "compressed_sparse_attention", "sliding_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe", "moe", "moe"],
    "index_n_heads": 16, "index_head_dim": 16, "index_topk": 4, "n_routed_experts": 6, "num_experts_per_tok": 3,
    "n_shared_experts": 1, "moe_intermediate_size": 64, "routed_scaling_factor": 2.0, "swiglu_limit": 3.0,
    "hc_mult": 3, "hc_sinkhorn_iters": 7, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "max_position_embeddings": 1024,
    "rope_theta": 5000.0, "compress_rope_theta": 40000.0,
    "rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.25},
        "compress": {"rope_type": "yarn", "rope_theta": 40000.0, "factor": 2.0, "original_max_position_embeddings": 128,
                     "beta_fast": 32, "beta_slow": 1, "attention_factor": 1.0, "partial_rotary_factor": 0.25},
    },
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
}

# Config C for the reference (HF dialect) ...
CONFIG_C_HF = {
    "model_type": "deepseek_v4", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 5,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "qk_rope_head_dim": 32,
    "partial_rotary_factor": 0.5, "q_lora_rank": 32, "o_groups": 1, "o_lora_rank": 48, "sliding_window": 8,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention", "sliding_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe", "moe"],
    "index_n_heads": 16, "index_head_dim": 48, "index_topk": 16, "n_routed_experts": 4, "num_experts_per_tok": 1,
    "n_shared_experts": 1, "moe_intermediate_size": 32, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "hc_mult": 2, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "max_position_embeddings": 1024,
    "rope_theta": 10000.0, "compress_rope_theta": 80000.0,
    "rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "compress": {"rope_type": "yarn", "rope_theta": 80000.0, "factor": 8.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1, "attention_factor": 1.0, "partial_rotary_factor": 0.5},
    },
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
}

# ... and the same model as ds4serve reads it (official dialect).
CONFIG_C_OFFICIAL = {
    k: v for k, v in CONFIG_C_HF.items()
    if k not in ("layer_types", "compress_rates", "mlp_layer_types", "rope_parameters", "partial_rotary_factor")
} | {
    "compress_ratios": [0, 4, 32, 4, 0, 0],  # the trailing entry is an MTP layer and is ignored
    "num_hash_layers": 1,
    "rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1},
}

CONFIGS = {"A": APPENDIX_A, "B": CONFIG_B, "C": CONFIG_C_HF}


def official_name(hf_saved: str) -> str:
    """transformers-saved name (official names under ``model.``) -> the official checkpoint name."""
    special = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
               "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
               "model.hc_head.hc_scale": "hc_head_scale"}
    if hf_saved in special:
        return special[hf_saved]
    return hf_saved[len("model."):] if hf_saved.startswith("model.") else hf_saved


def write_official(saved_dir: Path, out_dir: Path, config: dict) -> Path:
    """Re-save a transformers checkpoint with official tensor names and an official config.json."""
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(saved_dir / "model.safetensors"))
    save_file({official_name(k): v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"))
    write_config(out_dir, config)
    return out_dir


def make_checkpoint(name: str, root: Path):
    """(reference model, ds4serve checkpoint dir) for config ``name``."""
    model = build_hf_model(CONFIGS[name], seed=0, extra_random=name != "A")
    saved = save_hf(model, root / "hf")
    if name == "C":
        return model, write_official(saved, root / "official", CONFIG_C_OFFICIAL)
    return model, saved


def boundary_lengths(config: dict) -> list[int]:
    """Prompt lengths around every ratio, the window, and past index_topk x csa ratio."""
    rates = config.get("compress_rates", {})
    csa, hca = rates.get("compressed_sparse_attention", 4), rates.get("heavily_compressed_attention", 128)
    w, topk = config["sliding_window"], config["index_topk"]
    points = {csa, hca, w, topk * csa + 1, 2 * hca}
    out = sorted({n for p in points for n in (p - 1, p, p + 1) if n >= 1})
    return out
