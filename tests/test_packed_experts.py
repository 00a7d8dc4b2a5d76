"""Routed experts kept packed (issue 16): the same numbers as dequantise-at-load, a fraction of the bytes.

MXFP4 and FP8 checkpoints are made by the quantisers of ``test_weights`` (written independently of the
loader); the packed model must give bit-identical logits and greedy tokens to the dequantised one on
the same checkpoint, hold its experts in < 35% of the bytes (MXFP4), and leave no dequantised copy.
"""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import APPENDIX_A, write_config
from ds4serve.llm import LLM
from ds4serve.model.packed import PackedExperts
from model_helpers import random_ids
from test_weights import _quantize_fp8, _quantize_mxfp4

EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")


def _checkpoint(ckpt_factory, tmp_path, fmt: str):
    _, path = ckpt_factory("A")
    tensors = load_file(str(path / "model.safetensors"))
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [48, 48]}
    for k in [k for k in tensors if EXPERT.search(k)]:
        if fmt == "mxfp4":
            codes, exps = _quantize_mxfp4(tensors[k])
            tensors[k], tensors[k[:-len(".weight")] + ".scale"] = codes.view(torch.int8), exps
        else:
            q, s = _quantize_fp8(tensors[k], 48)  # block 48: FP8 blocks straddle the gate / up boundary
            tensors[k], tensors[k[:-len(".weight")] + ".scale"] = q, s
    d = tmp_path / fmt
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    write_config(d, dict(APPENDIX_A, quantization_config=dict(quant, **({"expert_dtype": "fp4"} if fmt == "mxfp4" else {}))))
    return d


def _stacks(llm: LLM) -> dict[str, object]:
    return {f"{i}.{n}": getattr(layer.mlp.experts, n) for i, layer in enumerate(llm.model.model.layers)
            for n in ("gate_up_proj", "down_proj")}


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_packed_experts_equal_dequantise_at_load(ckpt_factory, tmp_path, fmt):
    d = _checkpoint(ckpt_factory, tmp_path, fmt)
    # both on the torch path (bit for bit): the native forward adds in its own order, and is pinned to the
    # torch path over the same packed stacks in test_host_packed.py
    loaded = LLM(d, max_seqs=4, host_kernels="off")
    packed = LLM(d, max_seqs=4, packed_experts=True, host_kernels="off")
    full, kept = _stacks(loaded), _stacks(packed)
    for name, stack in kept.items():
        assert isinstance(stack, PackedExperts), name
        assert torch.equal(stack.take(torch.arange(stack.n_experts)), full[name]), name  # same values
    ids = random_ids(60, 1000, seed=3)
    assert torch.equal(packed.prompt_logits(ids), loaded.prompt_logits(ids))
    prompts = [random_ids(n, 1000, seed=n) for n in (5, 17, 40, 9)]
    assert packed.generate(prompts, max_tokens=12) == loaded.generate(prompts, max_tokens=12)
    resident = sum(s.nbytes for s in kept.values())
    dequantised = sum(t.numel() * t.element_size() for t in full.values())
    limit = 0.35 if fmt == "mxfp4" else 0.30  # fp32 model: FP4 is 4.25/32, FP8 8.x/32
    assert resident < limit * dequantised, (resident, dequantised)
    if fmt == "mxfp4":  # the capacity plan's packed size is what is resident
        from ds4serve.runtime.capacity import plan_weights

        planned = plan_weights(loaded.cfg, torch.float32, packed_experts=True).by_kind["routed experts"]
        assert abs(planned - resident) <= 0.05 * resident, (planned, resident)
        assert plan_weights(loaded.cfg, torch.float32).by_kind["routed experts"] == dequantised


def test_packed_experts_need_triton_off_the_host_and_skip_unquantised_checkpoints(ckpt_factory):
    _, path = ckpt_factory("A")
    plain = LLM(path, packed_experts=True)  # fp32 experts: nothing to keep packed, loaded as today
    assert all(isinstance(s, torch.Tensor) for s in _stacks(plain).values())
    from ds4serve.model.loader import load_model

    with pytest.raises(ValueError, match="need Triton's kernels"):  # a device that is neither the host nor CUDA
        load_model(path, device="meta", packed_experts=True)


def test_packed_experts_in_bounded_groups_match_within_rounding(ckpt_factory, tmp_path, monkeypatch):
    """A step whose experts exceed the dequantisation bound runs them in groups (here one expert at a
    time): the same answer up to fp32 rounding, never a whole dequantised stack."""
    from ds4serve.model import moe

    d = _checkpoint(ckpt_factory, tmp_path, "mxfp4")
    # both on the torch path (bit for bit): the native forward adds in its own order, and is pinned to the
    # torch path over the same packed stacks in test_host_packed.py
    loaded, packed = LLM(d, max_seqs=4, host_kernels="off"), LLM(d, max_seqs=4, packed_experts=True)
    taken = []
    stack = _stacks(packed)["2.gate_up_proj"]
    one = stack.shape[1] * stack.shape[2] * 4
    monkeypatch.setattr(moe, "PACKED_TILE_BYTES", 2 * one)  # gate_up + down of one expert < 2 gate_ups
    original = PackedExperts.take
    monkeypatch.setattr(PackedExperts, "take", lambda self, e, out=None: taken.append(e.numel()) or original(self, e, out))
    monkeypatch.setattr(moe, "DENSE_WEIGHT_BYTES", 0)  # the grouped path, which groups apply to
    ids = random_ids(60, 1000, seed=4)
    got, want = packed.prompt_logits(ids), loaded.prompt_logits(ids)
    assert max(taken) == 1 and len(taken) > 8
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item()), (got - want).abs().max()


def test_packed_experts_on_an_empty_batch_give_an_empty_result(ckpt_factory, tmp_path):
    from ds4serve.model.moe import run_experts

    d = _checkpoint(ckpt_factory, tmp_path, "mxfp4")
    stack = _stacks(LLM(d, max_seqs=1, packed_experts=True))
    x = torch.zeros(0, stack["1.gate_up_proj"].shape[2])
    out = run_experts(x, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2), stack["1.gate_up_proj"],
                      stack["1.down_proj"], 10.0)
    assert out.shape == x.shape


def test_serve_packs_by_itself_when_only_packed_experts_fit(ckpt_factory, tmp_path, monkeypatch, caplog):
    """``load_core`` (the server's way in) with the default ``auto``: on a device whose memory holds the
    packed model and one sequence but not the dequantised experts, the experts stay packed and the
    log says why; with room for both they are dequantised (the faster prefill)."""
    from ds4serve.config import ModelConfig
    from ds4serve.runtime import capacity
    from ds4serve.runtime.assemble import load_core
    from ds4serve.settings import EngineSettings

    d = _checkpoint(ckpt_factory, tmp_path, "mxfp4")
    # the fit rule is auto's where the native forward does not read the stored formats (host kernels off)
    cfg, settings = ModelConfig.from_file(d), EngineSettings(max_seqs=1, max_model_len=256, host_kernels="off")

    def plan(packed: bool, memory: int = 1 << 40):
        return capacity.plan_capacity(cfg, torch.float32, memory, 256, settings.max_prefill_tokens,
                                      packed_experts=packed, advise=False)

    need = plan(True).weights.total + plan(True).activations + plan(True).per_sequence
    assert not plan(False, need).fits and plan(True, need).fits  # the window this test stands in
    monkeypatch.setattr(capacity, "device_memory", lambda device: need)
    with caplog.at_level("INFO", logger="ds4serve.runtime.assemble"):
        core = load_core(d, settings=settings, packed_experts="auto")
    try:
        stacks = [layer.mlp.experts.gate_up_proj for layer in core.executor.model.model.layers]
        assert all(isinstance(s, PackedExperts) for s in stacks)
        assert "routed experts kept packed: the dequantised experts" in caplog.text
    finally:
        core.close()
    monkeypatch.setattr(capacity, "device_memory", lambda device: 1 << 40)
    core = load_core(d, settings=settings, packed_experts="auto")
    try:
        assert not any(isinstance(layer.mlp.experts.gate_up_proj, PackedExperts) for layer in core.executor.model.model.layers)
    finally:
        core.close()
    # where the native host forward runs, auto keeps every weight as stored, whatever fits
    with caplog.at_level("INFO", logger="ds4serve.runtime.assemble"):
        core = load_core(d, settings=EngineSettings(max_seqs=1, max_model_len=256), packed_experts="auto")
    try:
        assert all(isinstance(layer.mlp.experts.gate_up_proj, PackedExperts) for layer in core.executor.model.model.layers)
        assert "routed experts kept packed: kept as stored (fp4)" in caplog.text
    finally:
        core.close()
