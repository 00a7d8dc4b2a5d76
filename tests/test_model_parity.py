"""ds4serve's DeepSeek-V4 network against transformers' DeepseekV4ForCausalLM (fp32, 1e-4).

Three tiny configs (the spec's Appendix A and two of our own), weights saved by transformers and
loaded by ds4serve: prompt logits, 100 incremental decode steps, chunked prefill with odd chunk
sizes, and prompt lengths around every ratio / window / top-k boundary.
"""

from __future__ import annotations

import pytest
import torch

from checkpoints import CONFIGS, boundary_lengths, hf_incremental, hf_logits
from model_helpers import ours_incremental, random_ids

TOL = 1e-4


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    assert diff <= TOL, f"{what}: max |dlogit| {diff:.3g} > {TOL}"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prompt_logits_match_reference(name, ckpt_factory, llm_factory):
    hf, _ = ckpt_factory(name)
    llm = llm_factory(name)
    ids = random_ids(300, hf.config.vocab_size, seed=11)
    _close(llm.prompt_logits(ids), hf_logits(hf, ids), f"{name}: 300-token prompt logits")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hundred_decode_steps_match_reference(name, ckpt_factory, llm_factory):
    hf, _ = ckpt_factory(name)
    llm = llm_factory(name)
    prompt = random_ids(70, hf.config.vocab_size, seed=12)
    ref_p, ref_d, ref_toks = hf_incremental(hf, prompt, 100)
    got_p, got_d, got_toks = ours_incremental(llm, prompt, 100, forced=ref_toks)
    _close(got_p, ref_p, f"{name}: prefill")
    _close(got_d, ref_d, f"{name}: 100 decode steps")
    greedy = ours_incremental(llm, prompt, 100)[2]
    assert greedy == ref_toks, f"{name}: greedy tokens differ from the reference"


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("chunks", [[37, 64, 1, 59, 39], [3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 32], [128, 72]])
def test_chunked_prefill_matches_reference(name, chunks, ckpt_factory, llm_factory):
    hf, _ = ckpt_factory(name)
    llm = llm_factory(name)
    prompt = random_ids(200, hf.config.vocab_size, seed=13)
    ref_p, ref_d, ref_toks = hf_incremental(hf, prompt, 20)
    got_p, got_d, got_toks = ours_incremental(llm, prompt, 20, chunks=chunks, forced=ref_toks)
    _close(got_p, ref_p, f"{name}: chunked prefill {chunks}")
    _close(got_d, ref_d, f"{name}: decode after chunked prefill {chunks}")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prompt_lengths_around_boundaries(name, ckpt_factory, llm_factory):
    hf, _ = ckpt_factory(name)
    llm = llm_factory(name)
    cfg = CONFIGS[name]
    lengths = boundary_lengths(cfg)
    rates = cfg["compress_rates"]
    for b in (rates["compressed_sparse_attention"], rates["heavily_compressed_attention"], cfg["sliding_window"]):
        assert {b - 1, b, b + 1} <= set(lengths)
    assert max(lengths) > cfg["index_topk"] * rates["compressed_sparse_attention"]
    for n in lengths:
        prompt = random_ids(n, hf.config.vocab_size, seed=100 + n)
        ref_p, ref_d, ref_toks = hf_incremental(hf, prompt, 4)
        got_p, got_d, got_toks = ours_incremental(llm, prompt, 4)
        _close(got_p, ref_p, f"{name}: prompt of {n} tokens")
        _close(got_d, ref_d, f"{name}: decode after {n} tokens")
        assert got_toks == ref_toks, f"{name}: greedy tokens after a {n}-token prompt"
