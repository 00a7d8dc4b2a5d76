"""Bytes held per weight class and bytes one decoded token reads (model/footprint.py), written from the
model's definition: a decode step of one stream reads every weight it multiplies once, one embedding
row, and top_k / n_routed_experts of each layer's routed experts on average; never the vision tower."""

from __future__ import annotations

import logging

from ds4serve.bench.engine_bench import Row, render_roofline
from ds4serve.llm import LLM
from ds4serve.model.footprint import footprint, weight_class
from test_packed_experts import _checkpoint


def _by_hand(model, packed_bytes: int = 0):
    """Total bytes, embedding bytes and routed-expert bytes, from the named tensors directly."""
    total = embed = routed = vision = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        n = t.numel() * t.element_size()
        total += n
        embed += n if name == "model.embed_tokens.weight" else 0
        routed += n if ".mlp.experts." in name else 0
        vision += n if name.startswith(("vision_encoder.", "image_")) else 0
    return total + packed_bytes, embed, routed + packed_bytes, vision


def test_held_and_per_token_bytes_of_a_dense_checkpoint(ckpt_factory):
    _, path = ckpt_factory("A")
    llm = LLM(path, max_seqs=1, warmup=False)
    cfg, fp = llm.cfg, footprint(llm.cfg, llm.model)
    total, embed, routed, vision = _by_hand(llm.model)
    assert fp.held_total == total
    assert fp.held["embedding"] == embed and fp.held["routed experts"] == routed
    expected = (total - embed - routed - vision - fp.held.get("other", 0) + cfg.hidden_size * 4
                + routed * cfg.n_experts_per_tok // cfg.n_routed_experts)
    assert fp.per_token_total == expected
    assert fp.per_token["LM head"] == cfg.vocab_size * cfg.hidden_size * 4
    assert fp.formats["attention"] == "float32"


def test_packed_experts_count_their_codes_and_scales(ckpt_factory, tmp_path, caplog):
    d = _checkpoint(ckpt_factory, tmp_path, "mxfp4")
    with caplog.at_level(logging.INFO, logger="ds4serve.model.loader"):
        llm = LLM(d, max_seqs=1, warmup=False, packed_experts=True)
    stacks = [ly.mlp.experts.gate_up_proj for ly in llm.model.model.layers] + \
             [ly.mlp.experts.down_proj for ly in llm.model.model.layers]
    packed = sum(sum(t.numel() * t.element_size() for p in s.parts for t in (p.codes, p.scales)) for s in stacks)
    fp = footprint(llm.cfg, llm.model)
    assert fp.held["routed experts"] == packed and fp.formats["routed experts"] == "mxfp4 packed"
    assert "routed experts" in caplog.text and "one decoded token reads" in caplog.text


def test_classes_by_name():
    assert weight_class("model.layers.3.self_attn.compressor.indexer.q_b_proj.weight") == "compressor + indexer"
    assert weight_class("model.layers.0.self_attn.q_b_proj.weight") == "attention"
    assert weight_class("model.layers.1.attn_hc.fn") == "mHC" and weight_class("model.hc_head.hc_fn") == "mHC"
    assert weight_class("model.layers.1.mlp.gate.tid2eid") == "router"
    assert weight_class("lm_head.weight") == "LM head" and weight_class("image_pad") == "vision"


def test_the_roofline_line():
    line = render_roofline(10 * 2**20, 20e9, [Row(1, 100.0, 10.0, None, None)])
    roof = 20e9 / (10 * 2**20)
    assert f"roofline {roof:.0f} tok/s" in line and "measured 100 tok/s" in line and f"({100 / roof:.0%})" in line
