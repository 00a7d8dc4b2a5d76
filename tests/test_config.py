"""config.json in both dialects, and clear errors that name the field."""

from __future__ import annotations

import pytest

from checkpoints import APPENDIX_A, CONFIG_C_HF, CONFIG_C_OFFICIAL
from ds4serve.config import AttnKind, ConfigError, ModelConfig

FLASH_OFFICIAL = {
    "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8,
    "o_lora_rank": 1024, "sliding_window": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "compress_rope_theta": 160000, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 2048,
    "num_hash_layers": 3, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1,
    "vision_n_layers": 32, "vision_dim": 1024, "vision_n_heads": 16, "vision_inter_dim": 2816,
}


def test_appendix_a_hf_dialect():
    cfg = ModelConfig.from_dict(APPENDIX_A)
    assert cfg.attn_kinds == (AttnKind.SLIDING, AttnKind.SLIDING, AttnKind.CSA, AttnKind.HCA, AttnKind.CSA,
                              AttnKind.HCA)
    assert cfg.compress_ratios == (0, 0, 4, 16, 4, 16)
    assert cfg.hash_layers == (True, False, False, False, False, False)
    assert cfg.rope_dim == 16
    assert cfg.rope_compress.rope_type == "yarn" and cfg.rope_compress.factor == 4.0
    assert cfg.rope_main.rope_type == "default" and cfg.rope_main.theta == 10000.0
    assert cfg.eos_token_ids == ()
    assert not cfg.vision.enabled


def test_flash_official_dialect():
    cfg = ModelConfig.from_dict(FLASH_OFFICIAL)
    assert cfg.num_layers == 43
    assert cfg.attn_kinds.count(AttnKind.SLIDING) == 2
    assert cfg.attn_kinds.count(AttnKind.CSA) == 21
    assert cfg.attn_kinds.count(AttnKind.HCA) == 20
    assert cfg.attn_kinds[42] is AttnKind.CSA
    assert cfg.hash_layers[:4] == (True, True, True, False)
    assert cfg.rope_compress.theta == 160000 and cfg.rope_compress.factor == 16
    assert cfg.rope_compress.original_max_position_embeddings == 65536
    assert cfg.rope_main.rope_type == "default"
    assert cfg.vision.enabled and cfg.vision.n_layers == 32 and cfg.vision.max_n_token == 384


def test_both_dialects_of_one_model_agree():
    a, b = ModelConfig.from_dict(CONFIG_C_HF), ModelConfig.from_dict(CONFIG_C_OFFICIAL)
    for field in ("attn_kinds", "compress_ratios", "hash_layers", "rope_main", "rope_compress", "rope_dim"):
        assert getattr(a, field) == getattr(b, field), field


@pytest.mark.parametrize("patch,field", [
    ({"layer_types": ["sliding_attention", "bogus"] + ["sliding_attention"] * 4}, "layer_types[1]"),
    ({"layer_types": ["sliding_attention"] * 5}, "layer_types"),
    ({"mlp_layer_types": ["moe"] * 6 + ["moe"] * 0 + []}, None),
    ({"mlp_layer_types": ["moe", "dense", "moe", "moe", "moe", "moe"]}, "mlp_layer_types[1]"),
    ({"num_key_value_heads": 4}, "num_key_value_heads"),
    ({"o_groups": 3}, "o_groups"),
    ({"hidden_size": "256"}, "hidden_size"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"scoring_func": "relu"}, "scoring_func"),
    ({"qk_rope_head_dim": 12}, "qk_rope_head_dim"),
    ({"rope_parameters": {"main": {"rope_type": "default"}, "compress": {"rope_type": "linear"}}}, "rope_type"),
    ({"rope_parameters": {"main": {"rope_type": "default"}, "compress": {"rope_type": "yarn"}}}, "factor"),
    ({"model_type": "llama"}, "model_type"),
    ({"compress_rates": {"weird": 3}}, "compress_rates"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_bad_values_name_the_field(patch, field):
    data = dict(APPENDIX_A, **patch)
    if field is None:
        ModelConfig.from_dict(data)  # a valid variant
        return
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        ModelConfig.from_dict(data)


def test_official_bad_ratio_names_the_index():
    data = dict(FLASH_OFFICIAL, compress_ratios=[0, 0, -4] + [4] * 41)
    with pytest.raises(ConfigError, match=r"compress_ratios\[2\]"):
        ModelConfig.from_dict(data)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_file(tmp_path)


def _spin_probe(code: str, **env: str) -> str:
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    out = subprocess.run([sys.executable, "-c", code], env=dict(clean, **env), capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.strip()


def test_openmp_spin_is_shortened_when_ds4serve_comes_first_and_advice_is_given_when_it_does_not():
    report = "import os; from ds4serve.environment import openmp_spin_advice as a; print(os.environ['GOMP_SPINCOUNT'], a())"
    assert _spin_probe("import ds4serve, torch; " + report) == "10000 None"
    late = _spin_probe("import torch, ds4serve; " + report)
    assert late.startswith("10000 torch was imported before ds4serve") and "GOMP_SPINCOUNT=10000" in late
    assert _spin_probe("import torch, ds4serve; " + report, GOMP_SPINCOUNT="500") == "500 None"  # the user's choice
