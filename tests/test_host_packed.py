"""The native forward over experts kept packed in MXFP4 (model/csrc/host_packed.c) computes what the
torch path computes over the same packed experts (which equals dequantise-at-load bit for bit,
``test_packed_experts``), reads the codes where they were loaded, and keeps rows batch-invariant."""

from __future__ import annotations

import pytest
import torch

from ds4serve.llm import LLM
from ds4serve.model import host_decode
from ds4serve.model.packed import PackedExperts
from model_helpers import random_ids
from test_host_decode import _decode_steps, _run_both
from test_packed_experts import _checkpoint


@pytest.fixture(scope="module")
def mxfp4_dir(ckpt_factory, tmp_path_factory):
    return _checkpoint(ckpt_factory, tmp_path_factory.mktemp("packed"), "mxfp4")


def test_native_packed_experts_equal_the_torch_path(mxfp4_dir):
    fast = LLM(mxfp4_dir, max_seqs=4, packed_experts=True, host_kernels="on")
    slow = LLM(mxfp4_dir, max_seqs=4, packed_experts=True, host_kernels="off")
    assert fast.core.engine.host is not None and slow.core.engine.host is None
    cfg = fast.cfg
    w = cfg.sliding_window
    prompts = [random_ids(n, cfg.vocab_size, seed=90 + n) for n in (w + 3, 2 * w + 11, 37)]
    steps = [[(0, 0, prompts[0][:5], ()), (1, 0, prompts[1][:w - 1], ())],
             [(0, 5, prompts[0][5:], ()), (1, w - 1, prompts[1][w - 1:], ()), (2, 0, prompts[2], ())]]
    _run_both(fast, slow, steps + _decode_steps(prompts, 2 * max(cfg.distinct_ratios) + 3, cfg.vocab_size))
    ps = [random_ids(n, 1000, seed=n) for n in (5, 17, 40, 9)]
    assert fast.generate(ps, max_tokens=16, ignore_eos=True) == slow.generate(ps, max_tokens=16, ignore_eos=True)


def test_packed_rows_are_batch_invariant_bit_for_bit(mxfp4_dir):
    llm = LLM(mxfp4_dir, max_seqs=4, packed_experts=True, host_kernels="on")
    prompts = [random_ids(n, 1000, seed=30 + n) for n in (7, 45, 70)]
    solo = [llm.generate_with_logprobs([p], max_tokens=10, ignore_eos=True, logprobs=3)[0] for p in prompts]
    together = llm.generate_with_logprobs(prompts, max_tokens=10, ignore_eos=True, logprobs=3)
    assert all(len(lps) == 10 for _, lps in solo)  # the float logprobs are compared, not only the tokens
    assert together == solo


def test_the_codes_are_read_where_they_were_loaded(mxfp4_dir):
    """No dequantised or repacked copy: the native forward points at the stacks' own codes and scales,
    and holds no fp32 tensor the size of an expert stack."""
    llm = LLM(mxfp4_dir, max_seqs=4, packed_experts=True, host_kernels="on")
    host = llm.core.engine.host
    stacks = [getattr(ly.mlp.experts, n) for ly in llm.model.model.layers for n in ("gate_up_proj", "down_proj")]
    assert all(isinstance(s, PackedExperts) for s in stacks)
    kept = {t.data_ptr() for t in host._keep}
    assert all(p.codes.data_ptr() in kept and p.scales.data_ptr() in kept for s in stacks for p in s.parts)
    expert_sizes = {s.n_experts * s.shape[1] * s.shape[2] for s in stacks}
    assert not [t for t in host._keep if t.is_floating_point() and t.numel() in expert_sizes]


def test_fp8_experts_keep_the_torch_path(ckpt_factory, tmp_path):
    d = _checkpoint(ckpt_factory, tmp_path, "fp8")
    llm = LLM(d, max_seqs=2, packed_experts=True)
    assert llm.core.engine.host is None
    why = host_decode.unsupported(llm.cfg, llm.model, llm.core.cache.state.layers)
    assert why == "packed fp8 experts (the native forward reads MXFP4)"
    assert llm.generate([[5, 6, 7]], max_tokens=3, ignore_eos=True)
