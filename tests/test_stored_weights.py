"""Weights kept at the checkpoint's width (issue 26): FP8 projections and a bf16 embedding / LM head.

The native products over stored weights (``csrc/host_stored.c``) decode each weight in registers and add
in the fp32 kernels' order, so they must equal the same kernels over the dequantised values bit for bit
(every M, partial scale blocks, K tails), rows must not depend on the batch, the torch path over a
stored model must equal dequantise-at-load bit for bit, and the native forward must match the torch
path. The FP8 checkpoints are made by ``test_weights``' quantiser (written independently of the loader).
"""

from __future__ import annotations

import ctypes
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import APPENDIX_A, write_config
from ds4serve.llm import LLM
from ds4serve.model import host_forward
from ds4serve.model.footprint import footprint
from ds4serve.model.stored import StoredWeight
from model_helpers import random_ids
from test_host_forward import _decode_steps, _run_both
from test_weights import _quantize_fp8, _quantize_mxfp4

FP8 = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])\.weight$")
EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
BLOCK = 32


def _lib():
    lib = host_forward.library()
    if lib is None:
        pytest.skip("the native host forward could not be built here")
    return lib


def _run(lib, x: torch.Tensor, w, n: int) -> torch.Tensor:
    y = torch.full((x.shape[0], n), float("nan"))
    assert lib.ds4_linear(x.data_ptr(), x.shape[0], x.shape[1], ctypes.byref(w), n, y.data_ptr(), n, 2) == 0
    return y


def _fp8_weight(n: int, k: int, block: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, s = _quantize_fp8(torch.randn(n, k, generator=g) * 0.05, block)
    dense = q.float() * s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return q.view(torch.uint8), s, dense


@pytest.mark.parametrize("n,k,block", [(96, 200, 48), (256, 512, 128), (128, 1030, 16), (16512, 70, 16),
                                       (96, 600, 48)])
def test_fp8_products_equal_the_fp32_kernels_over_dequantised_weights(n, k, block):
    """Stored [K, N] FP8 vs the fp32 [K, N] kernels over the dequantised weights: the same
    bits for 1-3 rows (streamed rows), more rows (decoded blocks under the register tiles), partial scale
    blocks (200 = 4 x 48 + 8) and K tails; and close to a plain matmul (the values are right). Past 8 rows
    the streamed kernels go over K in chunks of 256 weight rows, each group of rows in turn (600 = 2
    chunks + 88: a chunk edge inside a block of 48 scales), in groups as even as may be (17 = 6 + 6 + 5)."""
    lib = _lib()
    codes, s, dense = _fp8_weight(n, k, block, seed=n + k)
    kn_codes, muls, dense_kn = codes.t().contiguous(), s.contiguous(), dense.t().contiguous()
    stored = host_forward._Weight(None, n, 1, 1, kn_codes.data_ptr(), muls.data_ptr(), block, block, muls.shape[1],
                                 muls.shape[0])
    fp32 = host_forward._Weight(dense_kn.data_ptr(), n, 1)
    g = torch.Generator().manual_seed(k)
    for m in (1, 2, 3, 4, 7, 9, 13, 17, 20, 40, 41):  # streamed rows up to 40 (groups of <= 8), decoded blocks past
        x = torch.randn(m, k, generator=g)
        got = _run(lib, x, stored, n)
        assert torch.equal(got, _run(lib, x, fp32, n)), m
        assert (got - x @ dense.t()).abs().max() < 1e-3
        assert torch.equal(_run(lib, x[-1:], stored, n)[0], got[-1]), m  # a row alone = the row in a batch


def _ue8m0_weight(n: int, k: int, block: int, seed: int):
    """Power-of-two block scales, as DS4 stores them (the kernels fold these into the activations), with
    subnormal codes and zeros of both signs in the first row."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    nb0, nb1 = -(-n // block), -(-k // block)
    pad = torch.zeros(nb0 * block, nb1 * block)
    pad[:n, :k] = w
    s = torch.exp2(torch.ceil(torch.log2(pad.view(nb0, block, nb1, block).abs().amax(dim=(1, 3)) / 448.0)))
    full = s.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    codes = (w / full).to(torch.float8_e4m3fn).view(torch.uint8)
    codes[:, :8] = torch.tensor([0, 0x80, 1, 0x81, 7, 0x87, 8, 0x88], dtype=torch.uint8)
    return codes, s, codes.view(torch.float8_e4m3fn).float() * full


@pytest.mark.parametrize("n,k,block", [(256, 512, 128), (2048, 256, 128), (160, 96, 32)])
def test_fp8_products_with_power_of_two_scales_equal_the_fp32_kernels(n, k, block):
    """UE8M0 scales take the fold (the scale moves to the activations, no multiply per weight) where every
    product stays exact, and the multiply where an activation times a scale would leave the normal floats
    (1e30, 1e-30) or is not finite: the same bits as the fp32 kernels either way, for 1-2 rows (f8_rows),
    3-8 (f8_many), past 8 (groups of <= 8, K in chunks) and past 40 (decoded blocks), alone or in a batch."""
    lib = _lib()
    codes, s, dense = _ue8m0_weight(n, k, block, seed=n + k)
    kn_codes, muls, dense_kn = codes.t().contiguous(), s.contiguous(), dense.t().contiguous()
    stored = host_forward._Weight(None, n, 1, 1, kn_codes.data_ptr(), muls.data_ptr(), block, block, muls.shape[1],
                                 muls.shape[0])
    fp32 = host_forward._Weight(dense_kn.data_ptr(), n, 1)
    g = torch.Generator().manual_seed(k)
    for scale in (1.0, 1e30, 1e-30, float("inf")):
        for m in (1, 2, 3, 8, 9, 16, 17, 41):
            x = torch.randn(m, k, generator=g) * scale
            x[0, :4] = torch.tensor([0.0, -0.0, 1e-40, -3e-39])  # zeros of both signs, subnormal activations
            got = _run(lib, x, stored, n)
            ref = _run(lib, x, fp32, n)
            if scale == float("inf"):  # inf x 0 codes: NaN in both, at the same outputs
                assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.nan_to_num(), ref.nan_to_num()), m
                continue
            assert torch.equal(got, ref), (scale, m)
            assert torch.equal(_run(lib, x[-1:], stored, n)[0], got[-1]), (scale, m)
            if scale == 1.0:
                assert (got - x @ dense.t()).abs().max() < 1e-3


@pytest.mark.parametrize("n,k", [(96, 200), (130, 64), (257, 4100)])
def test_bf16_products_equal_the_fp32_kernels_over_widened_weights(n, k):
    """The bf16 [N, K] head's tiles (up to 8 rows x 3 outputs on AVX-512, 6 x 2 on AVX2, with a prefetch
    that runs past the last row) add like the fp32 nk_tile: the same bits for every row count (groups as
    even as may be: 11 = 6 + 5, 17 = 6 + 6 + 5), short output blocks (130, 257) and K tails (200, 4100)."""
    lib = _lib()
    g = torch.Generator().manual_seed(n)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    wide = w.float().contiguous()
    stored = host_forward._Weight(None, k, 0, 2, w.data_ptr(), None, 0, 0, 0, 0)
    fp32 = host_forward._Weight(wide.data_ptr(), k, 0)
    for m in (1, 2, 3, 4, 5, 8, 9, 11, 17):
        x = torch.randn(m, k, generator=g)
        got = _run(lib, x, stored, n)
        assert torch.equal(got, _run(lib, x, fp32, n)), m
        assert (got - x @ wide.t()).abs().max() < 1e-3
        assert torch.equal(_run(lib, x[-1:], stored, n)[0], got[-1]), m


def _flash_like(ckpt_factory, tmp_path):
    """Checkpoint A stored as DS4-Flash stores its weights: FP8 projections (block 32), bf16 embedding
    and head, MXFP4 experts."""
    _, path = ckpt_factory("A")
    tensors = load_file(str(path / "model.safetensors"))
    for k in list(tensors):
        if FP8.search(k):
            q, s = _quantize_fp8(tensors[k], BLOCK)
            tensors[k], tensors[k[:-len(".weight")] + ".scale"] = q, s
        elif EXPERT.search(k):
            codes, exps = _quantize_mxfp4(tensors[k])
            tensors[k], tensors[k[:-len(".weight")] + ".scale"] = codes.view(torch.int8), exps
        elif k in ("embed.weight", "model.embed_tokens.weight", "head.weight"):
            tensors[k] = tensors[k].to(torch.bfloat16)
    assert sum(bool(FP8.search(k)) for k in tensors) >= 30
    d = tmp_path / "flash-like"
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    write_config(d, dict(APPENDIX_A, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "expert_dtype": "fp4",
                                                          "weight_block_size": [BLOCK, BLOCK]}))
    return d


@pytest.fixture(scope="module")
def flash_dir(ckpt_factory, tmp_path_factory):
    return _flash_like(ckpt_factory, tmp_path_factory.mktemp("stored"))


def test_stored_weights_hold_the_checkpoint_width(flash_dir):
    stored = LLM(flash_dir, max_seqs=2, packed_experts=True, stored_weights=True, host_kernels="on")
    loaded = LLM(flash_dir, max_seqs=2, host_kernels="on")
    a = stored.model.model.layers[0].self_attn
    assert isinstance(a.q_b_proj.weight, StoredWeight) and a.q_b_proj.weight.fmt == "fp8"
    assert isinstance(stored.model.lm_head.weight, StoredWeight) and stored.model.lm_head.weight.fmt == "bf16"
    assert stored.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert not isinstance(loaded.model.lm_head.weight, StoredWeight)
    host = stored.core.executor.host
    assert host is not None
    kept = {t.data_ptr() for t in host._keep}
    assert a.q_b_proj.weight.data.data_ptr() in kept  # read where loaded, no fp32 copy
    values = a.q_b_proj.weight.dense()
    assert not [t for t in host._keep if t.dtype == torch.float32 and any(
        t.shape == v.shape and torch.equal(t, v) for v in (values, values.t()))]
    small, big = footprint(stored.cfg, stored.model), footprint(loaded.cfg, loaded.model)
    assert small.held["attention"] * 3 < big.held["attention"]
    assert small.held["LM head"] * 2 == big.held["LM head"]
    assert small.per_token_total * 2 < big.per_token_total
    assert "fp8" in small.formats["attention"] and "bf16" in small.formats["LM head"]


def test_the_torch_path_over_stored_weights_equals_dequantise_at_load(flash_dir):
    stored = LLM(flash_dir, max_seqs=2, stored_weights=True, host_kernels="off")
    loaded = LLM(flash_dir, max_seqs=2, host_kernels="off")
    ids = random_ids(50, 1000, seed=5)
    assert torch.equal(stored.prompt_logits(ids), loaded.prompt_logits(ids))


def test_native_forward_over_stored_weights_equals_the_torch_path(flash_dir):
    """Experts, head and FP8 projections on fp32 activations: the int8 experts, the bf16-pair head and the
    FP8 bf16-pair projections (the defaults where they apply, test_host_q8, test_host_pairs and
    test_host_f8pairs) are close, not equal."""
    fast = LLM(flash_dir, max_seqs=4, packed_experts=True, stored_weights=True, host_kernels="on",
               moe_activations="fp32", head_activations="fp32", fp8_activations="fp32")
    slow = LLM(flash_dir, max_seqs=4, packed_experts=True, stored_weights=True, host_kernels="off")
    assert fast.core.executor.host is not None and slow.core.executor.host is None
    cfg = fast.cfg
    w = cfg.sliding_window
    prompts = [random_ids(n, cfg.vocab_size, seed=70 + n) for n in (w + 3, 2 * w + 11, 37)]
    steps = [[(0, 0, prompts[0][:5], ()), (1, 0, prompts[1][:w - 1], ())],
             [(0, 5, prompts[0][5:], ()), (1, w - 1, prompts[1][w - 1:], ()), (2, 0, prompts[2], ())]]
    _run_both(fast, slow, steps + _decode_steps(prompts, 2 * max(cfg.distinct_ratios) + 3, cfg.vocab_size))


def test_stored_rows_are_batch_invariant_and_prefix_hits_exact(flash_dir):
    llm = LLM(flash_dir, max_seqs=4, packed_experts=True, stored_weights=True, host_kernels="on")
    prompts = [random_ids(n, 1000, seed=40 + n) for n in (7, 45, 70)]
    solo = [llm.generate_with_logprobs([p], max_tokens=8, ignore_eos=True, logprobs=3)[0] for p in prompts]
    together = llm.generate_with_logprobs(prompts, max_tokens=8, ignore_eos=True, logprobs=3)
    assert all(len(lps) == 8 for _, lps in solo)
    assert together == solo
    again = llm.generate_with_logprobs(prompts, max_tokens=8, ignore_eos=True, logprobs=3)  # prefix-cache hits
    assert again == solo


def test_nan_fp8_codes_are_refused_at_load(flash_dir, tmp_path):
    from ds4serve.model.weights import CheckpointError

    tensors = load_file(str(flash_dir / "model.safetensors"))
    name = next(k for k in tensors if FP8.search(k))
    codes = tensors[name].view(torch.uint8).clone()
    codes[0, 0] = 0x7F
    tensors[name] = codes.view(torch.float8_e4m3fn)
    d = tmp_path / "nan"
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text((flash_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match="NaN codes"):
        LLM(d, stored_weights=True)


@pytest.mark.parametrize("n,k,block", [(96, 200, 48), (130, 64, 16), (256, 384, 128)])
def test_native_fp8_dequantisation_equals_the_torch_form(n, k, block, monkeypatch):
    """``StoredWeight.dense`` by the C loop on torch's threads, for weights as loaded ([out, in]) and as
    the native forward stores them ([in, out] underneath), equals ``quant.dequant_fp8`` bit for bit."""
    from ds4serve.model import native
    from ds4serve.model.quant import dequant_fp8

    codes, s, _ = _fp8_weight(n, k, block, seed=k)
    ref = dequant_fp8(codes.view(torch.float8_e4m3fn), s, (block, block))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)  # row ranges cut on block edges
    for layout in (codes, codes.t().contiguous().t()):
        got = native.fp8_native(layout, s, (block, block))
        if got is None:
            pytest.skip("native kernels unavailable")
        assert got.shape == ref.shape and torch.equal(got, ref)
        assert torch.equal(StoredWeight("fp8", layout, s, (block, block)).dense(), ref)


def test_the_capacity_plan_counts_stored_weights_at_their_width(flash_dir, caplog):
    """``serve``'s fit check counts what it will hold: FP8 codes (and their fp32 block scales) and bf16
    tables at their stored bytes, read from the headers before any weight is loaded."""
    from ds4serve.config import ModelConfig
    from ds4serve.model.weights import stored_bytes
    from ds4serve.runtime import capacity
    from ds4serve.runtime.capacity import plan_weights
    from ds4serve.runtime.assemble import load_core
    from ds4serve.settings import EngineSettings

    cfg = ModelConfig.from_file(flash_dir)
    sizes = stored_bytes(flash_dir, (BLOCK, BLOCK))
    q_b = "model.layers.0.self_attn.q_b_proj.weight"
    assert sizes[q_b] == 256 * 128 + 4 * (256 // BLOCK) * (128 // BLOCK)
    assert sizes["lm_head.weight"] == 2 * 1000 * 256 and sizes["model.embed_tokens.weight"] == 2 * 1000 * 256
    dense, held = plan_weights(cfg, torch.float32), plan_weights(cfg, torch.float32, stored=sizes)
    assert held.by_kind["embeddings + LM head"] * 2 == dense.by_kind["embeddings + LM head"]
    assert held.total < dense.total
    with caplog.at_level("INFO", logger="ds4serve.runtime.capacity"):
        core = load_core(flash_dir, settings=EngineSettings(max_seqs=1, max_model_len=256), packed_experts="auto")
    try:
        planned = held.total - held.by_kind["routed experts"] + plan_weights(
            cfg, torch.float32, packed_experts=True).by_kind["routed experts"]
        assert f"capacity: weights {capacity._gib(planned)}," in caplog.text
    finally:
        core.close()
