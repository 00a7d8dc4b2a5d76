"""``tiny train-drafter`` (issue 28): the DSpark drafter trained on the bundled model's own outputs.

* a few seeded steps on a small corpus lower the held-fixed batch's loss;
* the training forward is the serving forward: after ``dspark.commit`` of the same captured rows,
  ``dspark.draft`` gives the logits and confidence the trainer scored (slot 0, and the base logits of
  every slot);
* the written tensors load with ``load_dspark`` and drive ``LLM(..., speculative=dspark)`` with greedy
  outputs identical to plain decoding, the drafter really drafting;
* when the bundled model ships its drafter, its greedy acceptance length on fixed prompts stays above
  a floor (deterministic: greedy drafts, greedy verification).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ds4serve.llm import LLM
from ds4serve.model.dspark import DSparkRings, SharedHead, commit, draft
from ds4serve.model.dspark_weights import load_dspark
from ds4serve.model.loader import load_model
from ds4serve.tiny.train_drafter import (DrafterSettings, bench_shape_prompts, build_corpus, dspark_config, fit,
                                         forward, init_params, loss_terms, release_tensors, sample_batch,
                                         write_drafter)

BUNDLED = Path(__file__).resolve().parents[1] / "models" / "ds4v-tiny"
# the shipped drafter (12000 steps, 1 stage, 768 bench-shaped + 256 task prompts) measured 2.40 on this test's
# prompts (3.25 on bench spec's); the one before it (5000 steps, 192 + 64 prompts) 2.28 (2.92)
ACCEPTANCE_FLOOR = 2.3


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A one-stage drafter after 40 seeded steps on four bench-shaped sequences, and what it needs."""
    torch.manual_seed(0)
    s = DrafterSettings(model=BUNDLED, out=tmp_path_factory.mktemp("drafter"), steps=40, batch=16, lr=3e-3,
                        log_every=0)
    dc = dspark_config(BUNDLED, s)
    cfg, lm = load_model(BUNDLED, vision=False, progress=False)
    for p in lm.parameters():
        p.requires_grad_(False)
    seqs = [(q, 80) for q in bench_shape_prompts(4, cfg.vocab_size, seed=3, length=120)]
    corpus = build_corpus(lm, cfg, seqs, s.target_layers)
    head = SharedHead.from_target(lm)
    params = init_params(dc, seed=0)
    fixed = sample_batch(corpus, [(i % 4, 70 + 7 * i) for i in range(6)], dc)
    with torch.no_grad():
        before = float(loss_terms(*forward(params, dc, head, fixed), fixed.p)["loss"])
    fit(params, dc, head, corpus, s, [0, 1, 2, 3], t_start=0.0)
    with torch.no_grad():
        after = float(loss_terms(*forward(params, dc, head, fixed), fixed.p)["loss"])
    write_drafter(s.out, BUNDLED, params, dc, s, {"test": True})
    return {"s": s, "dc": dc, "head": head, "params": params, "corpus": corpus, "before": before, "after": after}


def test_a_few_steps_lower_the_loss(trained):
    assert trained["after"] < trained["before"] - 0.05, (trained["before"], trained["after"])


def test_saved_tensors_load_as_trained(trained):
    weights = load_dspark(trained["s"].out)
    assert weights.config.n_stages == 1 and weights.config.target_layer_ids == (1, 2, 3)
    for suffix, t in trained["params"][0].items():
        assert torch.equal(weights.stages[0][suffix], t.detach()), suffix
    names = release_tensors(trained["params"], trained["dc"])
    assert "mtp.0.ffn.experts.1.w3.weight" in names and "mtp.0.main_proj.weight" in names


def test_training_forward_is_the_serving_forward(trained):
    """The ring filled by ``commit`` from the captured rows and a greedy ``draft`` at anchor ``a`` give
    what the trainer computed for the same example (window 64 < a, so the ring has wrapped)."""
    dc, corpus, head = trained["dc"], trained["corpus"], trained["head"]
    weights = load_dspark(trained["s"].out)
    off, _, _ = corpus.spans[1]
    a = 100
    rings = DSparkRings(dc, capacity=1)
    state = rings.new_state()
    with torch.no_grad():
        commit(weights, [state], torch.arange(a), corpus.captured[off:off + a], torch.zeros(a, dtype=torch.long))
        got = draft(weights, [state], corpus.tokens[off + a].view(1), torch.tensor([a]), head)
        batch = sample_batch(corpus, [(1, a)], dc)
        logits, conf = forward(weights.stages, dc, head, batch)
    last = weights.stages[-1]
    markov = F.linear(last["markov_head.markov_w1.weight"][batch.prev], last["markov_head.markov_w2.weight"])
    torch.testing.assert_close(got.base_logits, logits - markov, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.logits[:, 0], logits[:, 0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.confidence[:, 0], torch.sigmoid(conf[:, 0]), atol=1e-5, rtol=1e-5)


def _prompts(vocab: int) -> list[list[int]]:
    return bench_shape_prompts(3, vocab, seed=11, length=100)


def test_saved_drafter_decodes_exactly_through_the_engine(trained):
    path = trained["s"].out
    plain = LLM(path, max_seqs=3, warmup=False)
    drafted = LLM(path, max_seqs=3, warmup=False, speculative=json.dumps({"method": "dspark"}))
    prompts = _prompts(plain.core.cfg.vocab_size)
    want = plain.generate(prompts, max_tokens=24, temperature=0.0, ignore_eos=True)
    got = drafted.generate(prompts, max_tokens=24, temperature=0.0, ignore_eos=True)
    assert got == want
    assert drafted.core.stats.speculation.get("drafted_tokens", 0) > 0


def test_bundled_drafter_acceptance_stays_above_the_floor():
    """The drafter shipped in models/ds4v-tiny (``ds4serve tiny train-drafter``, 12000 steps): greedy outputs
    equal plain decoding, and its mean acceptance length stays above the floor it was measured at."""
    assert (BUNDLED / "drafter.safetensors").exists()
    llm = LLM(BUNDLED, max_seqs=4, warmup=False, speculative=json.dumps({"method": "dspark"}))
    plain = LLM(BUNDLED, max_seqs=4, warmup=False)
    prompts = bench_shape_prompts(4, llm.core.cfg.vocab_size, seed=5)
    got = llm.generate(prompts, max_tokens=64, temperature=0.0, ignore_eos=True)
    assert got == plain.generate(prompts, max_tokens=64, temperature=0.0, ignore_eos=True)
    figures = llm.core.stats.speculation
    length = 1 + figures["accepted_tokens"] / figures["verify_steps"]
    assert length >= ACCEPTANCE_FLOOR, dict(figures)
