"""A small random-weight DS4 checkpoint, generated deterministically on first use.

Until the trained tiny DS4V model is bundled in ``models/``, ``ds4serve serve`` with no arguments
serves this: the real architecture with seeded random weights and a byte-level tokenizer. It says
so in its log line and in ``/v1/models``: its answers are noise.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import ModelConfig
from ..environment import cache_root
from ..model.loader import expected_tensors
from ..model.vision import expected_vision_tensors
from .byte_tokenizer import SPECIAL_ORDER, build_byte_tokenizer

log = logging.getLogger(__name__)

VERSION = "random-ds4v-tiny-v2"
REPO_MODELS = Path(__file__).resolve().parent.parent.parent / "models"
BUNDLED = REPO_MODELS / "ds4v-tiny"


VISION = {
    # a small ViT and a 64-token image cap: images cost tens of tokens, not hundreds
    "vision_n_layers": 2, "vision_dim": 64, "vision_n_heads": 4, "vision_inter_dim": 128, "vision_patch_size": 14,
    "vision_rope_theta": 10000.0, "vision_downsample_ratio": 3, "vision_max_n_token": 64,
    "vision_min_pixels": 112 * 112, "vision_max_wh_ratio": 8,
}


def random_config(vocab_size: int, vision: bool = True) -> dict:
    extra = VISION if vision else {}
    return extra | {
        "model_type": "deepseek_v4", "vocab_size": vocab_size, "hidden_size": 256, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "qk_rope_head_dim": 16,
        "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 64, "sliding_window": 32,
        "compress_ratios": [0, 0, 4, 16, 4, 16], "num_hash_layers": 1, "compress_rope_theta": 160000.0,
        "rope_theta": 10000.0, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                                                "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 4096, "index_n_heads": 16, "index_head_dim": 32, "index_topk": 8,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 128,
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1,
        "image_token_id": SPECIAL_ORDER.index("<｜deepseek_image｜>"), "ds4serve_checkpoint": VERSION,
    }


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    names = expected_tensors(cfg) | expected_vision_tensors(cfg)
    for name, (shape, dtype) in sorted(names.items()):
        if name.endswith("tid2eid"):
            t = torch.stack([torch.randperm(cfg.n_routed_experts, generator=gen)[: shape[1]] for _ in range(shape[0])])
        elif name.endswith(("norm.weight", "layernorm.weight", "hc_scale", ".scale")):
            t = torch.ones(shape)
        elif name.endswith(("e_score_correction_bias", ".base", "hc_base")):
            t = torch.zeros(shape)
        elif name.endswith(("sinks", "position_bias", "bias_vl")):
            t = torch.randn(shape, generator=gen) * 0.5
        else:
            t = torch.randn(shape, generator=gen) * 0.02
        out[name] = t.to(dtype if not dtype.is_floating_point else torch.float32).contiguous()
    return out


def cache_dir() -> Path:
    return cache_root() / VERSION


def ensure_random_checkpoint(path: Path | None = None, vision: bool = True) -> Path:
    """Create (once) and return the random placeholder checkpoint directory (DS4V unless ``vision``
    is False)."""
    path = Path(path) if path else cache_dir()
    marker = path / "RANDOM_WEIGHTS"
    if marker.exists() and marker.read_text().strip() == VERSION:
        return path
    path.mkdir(parents=True, exist_ok=True)
    tok = build_byte_tokenizer()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    config = random_config(vocab_size=vocab + (-vocab) % 8, vision=vision)
    cfg = ModelConfig.from_dict(config)
    tmp = path / "model.safetensors.tmp"
    save_file(random_weights(cfg), str(tmp))
    tmp.replace(path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config, indent=1))
    tok.save(str(path / "tokenizer.json"))
    marker.write_text(VERSION + "\n")
    log.info("generated the random placeholder checkpoint at %s", path)
    return path


def default_model() -> tuple[Path, bool]:
    """(model dir, is_random): the bundled tiny model if present, else the random placeholder."""
    if (BUNDLED / "model.safetensors").exists():
        return BUNDLED, False
    return ensure_random_checkpoint(), True
