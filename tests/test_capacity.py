"""``ds4serve plan`` / the start-up capacity check, against the formula and against real allocations.

The Flash numbers are checked against the arithmetic the issue states (43 layers x 256 experts x 3 x
4096 x 2048 weights at 4.25 bits when packed); the small-config numbers against what the engine really
allocates (every tensor of the loaded model, the state, staging and the snapshot arena).
"""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
import torch

from ds4serve.config import ConfigError, ModelConfig
from ds4serve.runtime import capacity
from ds4serve.runtime.capacity import plan_capacity, plan_weights, render_plan
from ds4serve.tiny.random_model import BUNDLED
from test_config import FLASH_OFFICIAL

ROUTED = 43 * 256 * 3 * 4096 * 2048
GiB = 2**30


def _flash() -> ModelConfig:
    return ModelConfig.from_dict(dict(FLASH_OFFICIAL, expert_dtype="fp4"))


def test_flash_routed_experts_match_the_formula_and_mtp_is_apart():
    w = plan_weights(_flash(), torch.bfloat16)
    assert w.routed_params == ROUTED  # the 43 main layers only
    assert abs(w.routed_packed - ROUTED * 4.25 / 8) <= 0.02 * ROUTED * 4.25 / 8
    assert w.by_kind["routed experts"] == ROUTED * 2  # dequantised to bf16 at load, as ds4serve does today
    assert w.mtp_layers == 1


def test_flash_on_one_141_gib_device_does_not_fit_and_says_what_would():
    plan = plan_capacity(_flash(), torch.bfloat16, 141 * GiB, 65536)
    assert not plan.fits and plan.max_seqs == 0
    text = render_plan(plan)
    assert "does not fit" in text and "packed" in text and "MTP" in text
    assert "516.00 GiB" in text  # 277.0e9 routed weights x 2 bytes


def test_more_memory_more_sequences_and_longer_sequences_fewer():
    cfg = ModelConfig.from_file(BUNDLED)
    small = plan_capacity(cfg, torch.float32, 256 * 2**20, 2048)
    big = plan_capacity(cfg, torch.float32, 1024 * 2**20, 2048)
    longer = plan_capacity(cfg, torch.float32, 1024 * 2**20, 8192 // 4)
    assert 0 < small.max_seqs < big.max_seqs
    assert longer.max_seqs <= big.max_seqs
    with pytest.raises(ConfigError):
        plan_capacity(cfg, torch.float32, 0)


def _tensor_bytes(obj) -> int:
    vals = [getattr(obj, f.name) for f in fields(obj)] if hasattr(obj, "__dataclass_fields__") else vars(obj).values()
    return sum(t.numel() * t.element_size() for t in vals if isinstance(t, torch.Tensor))


def test_plan_matches_what_the_engine_allocates():
    from ds4serve.llm import LLM

    seqs, length = 4, 512
    llm = LLM(BUNDLED, max_seqs=seqs, max_model_len=length, warmup=False)
    plan = plan_capacity(llm.cfg, torch.float32, 8 * GiB, length)
    model = llm.core.executor.model
    tensors = {t.data_ptr(): t for t in [*model.state_dict().values(), *model.vision_encoder.state_dict().values()]}
    weights = sum(t.numel() * t.element_size() for t in tensors.values())
    assert abs(plan.weights.total - weights) <= 0.05 * weights, (plan.weights.total, weights)
    cache = llm.core.cache
    state = sum(_tensor_bytes(ly) for ly in cache.state.layers)
    staging = cache.staging.numel() * cache.staging.element_size()
    arena = sum(t.numel() * t.element_size() for ly in cache.prefix.arena.layers for t in ly.values())
    planned = seqs * plan.per_sequence
    real = state + staging + arena
    assert abs(planned - real) <= 0.05 * real, (planned, real, state, staging, arena)


def test_load_core_refuses_a_model_that_cannot_fit_before_loading(monkeypatch):
    from ds4serve.runtime import load_core

    loaded = []
    monkeypatch.setattr(capacity, "device_memory", lambda device: 4 * 2**20)  # 4 MiB: less than the weights
    monkeypatch.setattr("ds4serve.runtime.assemble.load_model", lambda *a, **k: loaded.append(1))
    with pytest.raises(ConfigError, match="does not fit"):
        load_core(BUNDLED)
    assert not loaded


def test_cli_plan_exit_codes(tmp_path, capsys):
    from ds4serve.cli import main

    (tmp_path / "config.json").write_text(json.dumps(dict(FLASH_OFFICIAL, expert_dtype="fp4")))
    assert main(["plan", "--model", str(tmp_path), "--gpu-memory", "141GiB", "--max-model-len", "65536"]) == 3
    assert "max concurrent sequences" in capsys.readouterr().out
    assert main(["plan", "--model", str(BUNDLED), "--gpu-memory", "1GiB", "--dtype", "float32"]) == 0
    capsys.readouterr()
    assert main(["plan", "--model", str(BUNDLED), "--gpu-memory", "lots"]) == 2
    assert "'lots'" in capsys.readouterr().err
    # 400 GiB: dequantised Flash experts (516 GiB) do not fit, packed ones (137 GiB) do: auto packs
    assert main(["plan", "--model", str(tmp_path), "--gpu-memory", "400GiB", "--max-model-len", "65536"]) == 0
    assert "routed experts kept packed (--packed-experts auto)" in capsys.readouterr().out
    assert main(["plan", "--model", str(tmp_path), "--gpu-memory", "400GiB", "--max-model-len", "65536",
                 "--packed-experts", "off"]) == 3


# ---- serve --packed-experts auto: pack only where that turns a refusal into a server ------------------
def test_auto_packs_only_when_the_dequantised_experts_do_not_fit_and_packed_ones_do():
    cpu, cfg = torch.device("cpu"), _flash()
    packed, why = capacity.choose_packed_experts("auto", cfg, torch.bfloat16, cpu, 8192, memory=400 * GiB)
    assert packed and "kept packed (fp4" in why and "516.00 GiB" in why  # 516 GiB dequantised > 400 GiB
    assert plan_capacity(cfg, torch.bfloat16, 400 * GiB, 8192, packed_experts=True).fits
    assert capacity.choose_packed_experts("auto", cfg, torch.bfloat16, cpu, 8192, memory=2048 * GiB) == \
        (False, "the dequantised experts fit")
    packed, why = capacity.choose_packed_experts("auto", cfg, torch.bfloat16, cpu, 8192, memory=64 * GiB)
    assert not packed and "either" in why  # neither fits: check_fits then refuses with the whole plan


def test_auto_keeps_unpacked_formats_and_devices_without_packed_kernels_dequantised(monkeypatch):
    from ds4serve.model import triton_experts

    plain = ModelConfig.from_dict(FLASH_OFFICIAL)  # no expert format: the experts load as stored
    packed, why = capacity.choose_packed_experts("auto", plain, torch.bfloat16, torch.device("cpu"), 8192,
                                                 memory=400 * GiB)
    assert not packed and "not in a packed format (None)" in why
    monkeypatch.setattr(triton_experts, "available", lambda device: False)
    packed, why = capacity.choose_packed_experts("auto", _flash(), torch.bfloat16, torch.device("cuda"), 8192,
                                                 memory=400 * GiB)
    assert not packed and "need Triton" in why
    monkeypatch.setattr(triton_experts, "available", lambda device: True)
    assert capacity.choose_packed_experts("auto", _flash(), torch.bfloat16, torch.device("cuda"), 8192,
                                          memory=400 * GiB)[0]


@pytest.mark.parametrize("mode, expected", [("on", True), ("off", False), (True, True), (False, False)])
def test_explicit_packed_modes_decide_alone(mode, expected):
    cfg = ModelConfig.from_file(BUNDLED)
    assert capacity.choose_packed_experts(mode, cfg, torch.float32, torch.device("cpu"), 2048, memory=1)[0] == expected


def test_unknown_packed_mode_is_refused():
    with pytest.raises(ConfigError, match="auto, on, off"):
        capacity.choose_packed_experts("yes", ModelConfig.from_file(BUNDLED), torch.float32, torch.device("cpu"), 2048)


def test_serve_flag_alone_means_on_and_its_default_is_auto():
    from ds4serve.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["serve"]).packed_weights == "auto"
    assert parse(["serve", "--packed-weights"]).packed_weights == "on"
    assert parse(["serve", "--packed-experts"]).packed_weights == "on"  # the former name of the one setting
    assert parse(["serve", "--packed-experts", "off"]).packed_weights == "off"
