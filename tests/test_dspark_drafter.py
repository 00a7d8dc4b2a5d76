"""The DSpark block drafter (spec ds4-speculative §1, §3-§6, §11): detection and loading with every
refusal named, and oracles written from the spec in plain loops (the ring rows, the non-causal block
attention with ring validity and sinks, the Markov chain, the confidence product), the batched forward
against requests run one by one, draws that follow q, and rejection leaving the rings untouched.

The oracles read the weights from the test helper's own dequantised values (``dspark_checkpoint``),
never from the module under test; fp32 throughout."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dspark_checkpoint import (BLOCK, MARKOV_RANK, NOISE_ID, TARGET_LAYERS, build_trunk, drafter_tensors, dspark_config,
                               write_checkpoint)
from dspark_oracles import attention_ref, chi2, draft_hidden_ref, inverse_cdf_ref, ring_row_ref, rms
from ds4serve.config import ConfigError, ModelConfig
from ds4serve.model import dspark as D
from ds4serve.model.dspark_weights import detect_drafter, expected_stage_tensors, load_dspark, parse_dspark_config
from ds4serve.model.loader import load_model
from ds4serve.model.packed import PackedExperts
from ds4serve.model.rope import inverse_frequencies, rotations


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    """The trunk, a valid drafter checkpoint, its loaded weights and the trunk's shared head."""
    root = tmp_path_factory.mktemp("dspark")
    trunk = build_trunk(root)
    config = dspark_config()
    tensors = drafter_tensors(config)
    path = write_checkpoint(root / "ok", trunk, tensors.stored, config)
    weights = load_dspark(path)
    _, model = load_model(path, progress=False)
    return dict(root=root, trunk=trunk, config=config, tensors=tensors, path=path, weights=weights,
                head=D.SharedHead.from_target(model), model=model)


# ---- detection and loading ---------------------------------------------------------------------------------

def test_stage_count_comes_from_the_keys_not_num_nextn_predict_layers(ck):
    dc = ck["weights"].config
    assert ck["config"]["num_nextn_predict_layers"] == 1
    assert dc.n_stages == 3 and len(ck["weights"].stages) == 3
    assert (dc.block_size, dc.noise_token_id, dc.target_layer_ids, dc.markov_rank) == (
        BLOCK, NOISE_ID, tuple(TARGET_LAYERS), MARKOV_RANK)
    assert dc.window == ck["config"]["sliding_window"]
    assert detect_drafter(ModelConfig.from_dict(ck["config"]), ck["tensors"].stored) == "dspark"


def test_loaded_values_are_the_release_tensors_dequantised(ck):
    """FP8 + UE8M0 block scales, MXFP4 experts, bf16 and fp32 tensors all load to the helper's values."""
    ref, stages = ck["tensors"].reference, ck["weights"].stages
    n_exp = ck["config"]["n_routed_experts"]
    for name, want in ref.items():
        _, s, suffix = name.split(".", 2)
        st = stages[int(s)]
        if ".experts." in suffix and "shared" not in suffix:
            e, part = int(suffix.split(".")[2]), suffix.split(".")[3]
            inter = ck["config"]["moe_intermediate_size"]
            got = st["experts.down"][e] if part == "w2" else \
                st["experts.gate_up"][e][:inter] if part == "w1" else st["experts.gate_up"][e][inter:]
        else:
            got = st[suffix]
        assert got.dtype == torch.float32 and torch.equal(got, want), name
    assert stages[0]["experts.gate_up"].shape[0] == n_exp


def test_a_two_stage_drafter_loads_and_drafts(ck, tmp_path):
    config = dspark_config(stages=2)
    path = write_checkpoint(tmp_path / "two", ck["trunk"], drafter_tensors(config, stages=2, seed=3).stored, config)
    weights = load_dspark(path)
    assert weights.config.n_stages == 2
    rings = D.DSparkRings(weights.config, 1)
    state = rings.new_state()
    D.commit(weights, [state], torch.arange(4), torch.randn(4, 3, 64), torch.zeros(4, dtype=torch.long))
    out = D.draft(weights, [state], torch.tensor([7]), torch.tensor([4]), ck["head"])
    assert out.tokens.shape == (1, BLOCK) and out.q.shape == (1, BLOCK, ck["config"]["vocab_size"])


def test_packed_experts_draft_like_dequantised_ones(ck):
    """MXFP4 experts kept packed (as the trunk keeps its own) give the drafts of the dequantised stacks."""
    packed = load_dspark(ck["path"], packed_experts=True)
    assert all(isinstance(st["experts.gate_up"], PackedExperts) and st["experts.gate_up"].fmt == "mxfp4"
               for st in packed.stages)
    rings, states = _history(ck["weights"], 2, [6, 11])
    runs = [D.draft(w, states, torch.tensor([3, 90]), torch.tensor([6, 11]), ck["head"], temperature=torch.tensor(
        [0.0, 1.0]), generator=torch.Generator().manual_seed(8)) for w in (ck["weights"], packed)]
    assert torch.equal(runs[0].tokens, runs[1].tokens)
    torch.testing.assert_close(runs[0].logits, runs[1].logits, atol=1e-5, rtol=1e-5)


def test_ds4v_stages_carry_bias_vl():
    """On a DS4V trunk each stage's gate has its image-token selection bias (spec §1, Vision-Exp)."""
    from ds4serve.tiny.random_model import random_config

    raw = random_config(512, vision=True) | {"dspark_block_size": 5, "dspark_noise_token_id": 500,
                                               "dspark_target_layer_ids": [3, 4, 5], "dspark_markov_rank": 8}
    dc = parse_dspark_config(ModelConfig.from_dict(raw), 3)
    for stage in range(3):
        assert expected_stage_tensors(dc, stage)["ffn.gate.bias_vl"] == ((8,), "plain")
    assert "ffn.gate.bias_vl" not in expected_stage_tensors(parse_dspark_config(ModelConfig.from_dict(
        raw | {"vision_n_layers": 0}), 3), 0)


def _drop(prefix):
    return lambda t, c: {k: v for k, v in t.items() if not k.startswith(prefix)}


def _put(name, value):
    return lambda t, c: t | {name: value}


def _cfg(**kw):
    def edit(t, c):
        c.update(kw)
        return t
    return edit


def _nokey(key):
    def edit(t, c):
        c.pop(key)
        return t
    return edit


BROKEN = {
    "missing tensor": (_drop("mtp.1.attn.wkv."), ["missing tensor mtp.1.attn.wkv.weight"]),
    "wrong shape": (_put("mtp.2.markov_head.markov_w1.weight", torch.zeros(300, 8, dtype=torch.bfloat16)),
                    ["mtp.2.markov_head.markov_w1.weight: shape [300, 8], expected [300, 16]"]),
    "integer dtype": (_put("mtp.2.confidence_head.proj.weight", torch.zeros(1, 80, dtype=torch.int32)),
                      ["mtp.2.confidence_head.proj.weight: dtype I32 is not handled"]),
    "fp8 where only floats are handled": (
        lambda t, c: t | {"mtp.2.markov_head.markov_w2.weight": torch.zeros(300, 16).to(torch.float8_e4m3fn),
                          "mtp.2.markov_head.markov_w2.scale": torch.ones(10, 1)},
        ["mtp.2.markov_head.markov_w2.weight: dtype F8_E4M3 is not handled"]),
    "fp8 without its scale": (lambda t, c: {k: v for k, v in t.items() if k != "mtp.0.attn.wq_a.scale"},
                              ["mtp.0.attn.wq_a.weight: F8_E4M3 needs a block scale"]),
    "scale that does not fit": (_put("mtp.0.main_proj.scale", torch.ones(3, 3).to(torch.float8_e8m0fnu)),
                                ["mtp.0.main_proj.weight: scale mtp.0.main_proj.scale has shape [3, 3], "
                                 "expected [2, 6]"]),
    "expert scale that does not fit": (
        _put("mtp.0.ffn.experts.1.w2.scale", torch.ones(64, 2).to(torch.float8_e8m0fnu)),
        ["mtp.0.ffn.experts.1.w2.weight: scale mtp.0.ffn.experts.1.w2.scale has shape [64, 2], expected [64, 1]"]),
    "config claims DSpark, no tensors": (_drop("mtp."), ["declares a DSpark drafter", "dspark_block_size",
                                                         "no mtp.<s>.* tensors"]),
    "tensors without the config keys": (_nokey("dspark_markov_rank"), ["lacks dspark_markov_rank"]),
    "hash routing in a stage": (_put("mtp.1.ffn.gate.tid2eid", torch.zeros(300, 1, dtype=torch.int32)),
                                ["unexpected tensor mtp.1.ffn.gate.tid2eid"]),
    "a stage missing in the middle": (_drop("mtp.1."), ["no tensors for mtp.1.*"]),
    "noise id past the vocabulary": (_cfg(dspark_noise_token_id=300), ["'dspark_noise_token_id'", "[0, 299]"]),
    "target layer past the trunk": (_cfg(dspark_target_layer_ids=[2, 3, 5]), ["'dspark_target_layer_ids'"]),
    "n_mtp_layers disagrees": (_cfg(n_mtp_layers=2), ["'n_mtp_layers' = 2", "3 DSpark stages"]),
    "a compressed stage layer": (_cfg(compress_ratios=[0, 4, 32, 4, 0, 0, 4, 0]), ["'compress_ratios'"]),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_drafters_are_refused_by_name(ck, tmp_path, case):
    edit, phrases = BROKEN[case]
    config = dict(ck["config"])
    tensors = edit(dict(ck["tensors"].stored), config)
    path = write_checkpoint(tmp_path / "bad", ck["trunk"], tensors, config)
    with pytest.raises(ConfigError) as err:
        load_dspark(path)
    for phrase in phrases:
        assert phrase in str(err.value), (phrase, str(err.value))


def test_a_serial_mtp_checkpoint_is_not_taken_for_dspark(ck, tmp_path):
    config = {k: v for k, v in ck["config"].items() if not k.startswith("dspark_")}
    path = write_checkpoint(tmp_path / "mtp", ck["trunk"], {"mtp.0.e_proj.weight": torch.zeros(64, 64)}, config)
    assert detect_drafter(ModelConfig.from_dict(config), ["mtp.0.e_proj.weight"]) == "mtp"
    with pytest.raises(ConfigError, match=r"serial MTP block \(mtp.0.e_proj"):
        load_dspark(path)
    assert detect_drafter(ModelConfig.from_dict(config), ["embed.weight"]) is None


# ---- against the oracles written from the spec (dspark_oracles.py) ------------------------------------------

@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_commit_writes_the_last_window_of_rows(ck, order):
    """A prefill of 13 rows into an 8-row ring (rows given in either order: 0..4 share slots with 8..12):
    each slot holds the row of the latest position, equal to §3.4's formula; other slots untouched."""
    ref, c, weights = ck["tensors"].reference, ck["config"], ck["weights"]
    w, n = c["sliding_window"], 13
    rings = D.DSparkRings(weights.config, 2)
    state = rings.new_state()
    hidden = torch.randn(n, 3, 64, generator=torch.Generator().manual_seed(1))
    order_idx = torch.arange(n) if order == "ascending" else torch.arange(n - 1, -1, -1)
    D.commit(weights, [state], order_idx, hidden[order_idx], torch.zeros(n, dtype=torch.long))
    kv, pos = state.snapshot()
    for p in range(n):
        slot = p % w
        if p < n - w:
            assert int(pos[slot]) != p
            continue
        assert int(pos[slot]) == p
        for s in range(3):
            torch.testing.assert_close(kv[slot, s], ring_row_ref(ref, c, s, hidden[p], p), atol=1e-5, rtol=1e-5)
    assert torch.equal(rings.pos[1], torch.full((w,), -1)) and not rings.kv[1].any()  # other slots untouched


def test_block_attention_matches_the_loop_oracle(ck):
    """Three requests: a short history (p < W - 1), a full ring, and a ring with stale rows past p and
    rows older than p - W: each query sees exactly the spec's keys, the whole block included."""
    ref, c, weights = ck["tensors"].reference, ck["config"], ck["weights"]
    w, hd, b = c["sliding_window"], c["head_dim"], BLOCK
    gen = torch.Generator().manual_seed(2)
    ring = torch.randn(3, w, hd, generator=gen)
    ring_pos = torch.tensor([[0, 1, 2, -1, -1, -1, -1, -1], [8, 9, 10, 11, 12, 13, 14, 15],
                             [16, 17, 18, 3, 4, 13, 6, 7]])
    last = torch.tensor([2, 15, 12])  # request 2: 16-18 are past p, 3 and 4 older than p - W
    positions = (last + 1).unsqueeze(1) + torch.arange(b)
    x = torch.randn(3 * b, c["hidden_size"], generator=gen)
    rot = rotations(positions.reshape(-1), inverse_frequencies(weights.config.trunk.rope_main, c["qk_rope_head_dim"]))
    for s in range(3):
        got = D.stage_attention(weights.config, weights.stages[s], x, ring, D.ring_valid(ring_pos, last, w), rot)
        for r in range(3):
            want = attention_ref(ref, c, s, x[r * b:(r + 1) * b], ring[r], ring_pos[r].tolist(), int(last[r]),
                                  positions[r].tolist())
            torch.testing.assert_close(got[r * b:(r + 1) * b], want, atol=2e-5, rtol=1e-4)


def test_whole_block_matches_the_loop_oracle(ck):
    """Stages chained on the block's streams, each with its own ring, mHC and MoE, then the last stage's
    hc_head and the shared norm-then-head: the pre-norm hidden and the base logits of a greedy draft."""
    ref, c, weights, head = ck["tensors"].reference, ck["config"], ck["weights"], ck["head"]
    rings, states = _history(weights, 1, [10])
    kv, pos = states[0].snapshot()
    out = D.draft(weights, states, torch.tensor([21]), torch.tensor([10]), head)
    embed = ck["model"].model.embed_tokens.weight
    want = draft_hidden_ref(ref, c, embed, 21, 9, [kv[:, s] for s in range(3)], pos.tolist())
    torch.testing.assert_close(out.hidden[0], want, atol=1e-4, rtol=1e-4)
    logits = torch.stack([ck["model"].lm_head.weight @ rms(h, ref["mtp.2.norm.weight"]) for h in want])
    torch.testing.assert_close(out.base_logits[0], logits, atol=1e-4, rtol=1e-4)


def _history(weights, n_req, lengths, seed=5):
    rings = D.DSparkRings(weights.config, n_req)
    states = [rings.new_state() for _ in range(n_req)]
    gen = torch.Generator().manual_seed(seed)
    pos = torch.cat([torch.arange(n) for n in lengths])
    owners = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    D.commit(weights, states, pos, torch.randn(pos.shape[0], 3, 64, generator=gen), owners)
    return rings, states


def test_markov_chain_and_confidence_match_the_loop_oracle(ck):
    """§3.7 per request and slot: m = w1[prev], logits = U + w2 m, q = softmax(logits / T), the token
    drawn from q (argmax when greedy) with the request's uniforms, prev = that token; c = sigmoid(w [h; m]),
    survival = running product. U is the shared head on the last stage's normed hc_head output."""
    ref, weights, head = ck["tensors"].reference, ck["weights"], ck["head"]
    rings, states = _history(weights, 3, [9, 4, 12])
    temps = [0.0, 1.0, 0.7]
    seeds = [11, 12, 13]
    out = D.draft(weights, states, torch.tensor([5, 77, 200]), torch.tensor([9, 4, 12]), head,
                  temperature=torch.tensor(temps), generator=[torch.Generator().manual_seed(s) for s in seeds])
    w1, w2 = ref["mtp.2.markov_head.markov_w1.weight"], ref["mtp.2.markov_head.markov_w2.weight"]
    wc, norm = ref["mtp.2.confidence_head.proj.weight"][0], ref["mtp.2.norm.weight"]
    lm_head = ck["model"].lm_head.weight
    for r, anchor in enumerate([5, 77, 200]):
        u = torch.rand(BLOCK, generator=torch.Generator().manual_seed(seeds[r]))
        prev, alive = anchor, 1.0
        for i in range(BLOCK):
            hid = out.hidden[r, i]
            torch.testing.assert_close(out.base_logits[r, i], lm_head @ rms(hid, norm), atol=1e-5, rtol=1e-5)
            m = w1[prev]
            logits = out.base_logits[r, i] + w2 @ m
            greedy = temps[r] == 0
            q = F.one_hot(logits.argmax(), logits.shape[0]).float() if greedy else torch.softmax(logits / temps[r], 0)
            tok = int(logits.argmax()) if greedy else inverse_cdf_ref(q, float(u[i]))
            conf = 1 / (1 + math.exp(-float(torch.dot(wc, torch.cat((hid, m))))))
            alive *= conf
            torch.testing.assert_close(out.q[r, i], q, atol=1e-6, rtol=1e-5)
            assert int(out.tokens[r, i]) == tok, (r, i)
            assert abs(float(out.confidence[r, i]) - conf) < 1e-5 and abs(float(out.survival[r, i]) - alive) < 1e-5
            prev = tok


def test_the_chain_follows_the_tokens_the_sampler_draws(ck):
    """An engine-supplied sampler (here one forcing token 7 at every slot): slot i+1's Markov bias and
    confidence use the token drawn at slot i, not the argmax; q is the sampler's."""
    ref, weights = ck["tensors"].reference, ck["weights"]
    rings, states = _history(weights, 2, [7, 9])
    vocab = ck["config"]["vocab_size"]

    def forced(logits, i):
        tok = torch.full((logits.shape[0],), 7)
        return tok, F.one_hot(tok, vocab).float()

    out = D.draft(weights, states, torch.tensor([30, 31]), torch.tensor([7, 9]), ck["head"], sampler=forced)
    w1, w2 = ref["mtp.2.markov_head.markov_w1.weight"], ref["mtp.2.markov_head.markov_w2.weight"]
    wc = ref["mtp.2.confidence_head.proj.weight"][0]
    assert out.tokens.eq(7).all() and out.q[..., 7].eq(1).all()
    for r, anchor in enumerate([30, 31]):
        for i in range(BLOCK):
            m = w1[anchor if i == 0 else 7]
            torch.testing.assert_close(out.logits[r, i], out.base_logits[r, i] + w2 @ m, atol=1e-5, rtol=1e-5)
            conf = torch.sigmoid(torch.dot(wc, torch.cat((out.hidden[r, i], m))))
            torch.testing.assert_close(out.confidence[r, i], conf, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="either sampler or temperature"):
        D.draft(weights, states, torch.tensor([30, 31]), torch.tensor([7, 9]), ck["head"], temperature=1.0,
                sampler=forced)


def test_sampled_drafts_follow_q(ck):
    """Drafted tokens are really drawn from the q returned with them: 4000 copies of one request in one
    batch, per slot the token counts against the summed q rows (the later slots' q depend on the earlier
    draws); a fixed bound of dof + 6 sqrt(2 dof). Greedy tokens scored the same way fail it (the test bites)."""
    weights, head = ck["weights"], ck["head"]
    rings, states = _history(weights, 1, [10])
    n = 4000
    out = D.draft(weights, states * n, torch.full((n,), 42), torch.full((n,), 10), head, temperature=1.5,
                  generator=torch.Generator().manual_seed(0))
    greedy = D.draft(weights, states, torch.tensor([42]), torch.tensor([10]), head)
    for i in range(BLOCK):
        counts = torch.bincount(out.tokens[:, i], minlength=out.q.shape[-1]).double()
        stat, dof = chi2(counts, out.q[:, i].double().sum(0))
        assert dof > 10 and stat < dof + 6 * math.sqrt(2 * dof), (i, stat, dof)
    counts = torch.zeros(out.q.shape[-1], dtype=torch.float64)
    counts[int(greedy.tokens[0, 0])] = n
    stat, dof = chi2(counts, out.q[:, 0].double().sum(0))
    assert stat > dof + 6 * math.sqrt(2 * dof)


def test_batched_draft_equals_requests_one_by_one(ck):
    """Different histories (short, exactly W, wrapped), anchors and temperatures in one batch give each
    request what it gets alone, with its own generator; and batched commits equal one-by-one commits."""
    weights, head = ck["weights"], ck["head"]
    lengths, anchors, temps, seeds = [3, 8, 13, 20], [4, 50, 150, 299], [0.0, 0.8, 1.0, 0.0], [1, 2, 3, 4]
    rings, states = _history(weights, 4, lengths)
    batched = D.draft(weights, states, torch.tensor(anchors), torch.tensor(lengths), head,
                      temperature=torch.tensor(temps), generator=[torch.Generator().manual_seed(s) for s in seeds])
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(sum(lengths), 3, 64, generator=gen)
    start = 0
    for r, n in enumerate(lengths):
        solo_rings = D.DSparkRings(weights.config, 1)
        solo = solo_rings.new_state()
        D.commit(weights, [solo], torch.arange(n), hidden[start:start + n], torch.zeros(n, dtype=torch.long))
        start += n
        # torch's matmul may round a row differently by batch size (an Intel Xeon with AVX-512 and AMX
        # differed by 1.3e-6 in one of 1,536 values, 4e-6 relative): a tolerance, not bit equality
        torch.testing.assert_close(solo_rings.kv[0], rings.kv[r], atol=1e-5, rtol=1e-5)
        assert torch.equal(solo_rings.pos[0], rings.pos[r])
        alone = D.draft(weights, [solo], torch.tensor([anchors[r]]), torch.tensor([n]), head,
                        temperature=temps[r], generator=[torch.Generator().manual_seed(seeds[r])])
        assert torch.equal(alone.tokens[0], batched.tokens[r]), r
        torch.testing.assert_close(alone.q[0], batched.q[r], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(alone.confidence[0], batched.confidence[r], atol=1e-6, rtol=1e-5)


def _commit_rows(weights, state, positions, hidden):
    D.commit(weights, [state], positions, hidden, torch.zeros(positions.shape[0], dtype=torch.long))


@pytest.mark.parametrize("accepted", [0, 2, BLOCK])
def test_rejected_drafts_leave_the_rings_as_if_never_drafted(ck, accepted):
    """A round: draft, verify accepts ``accepted`` drafts, commit the anchor and the accepted rows. The
    rings then equal, bit for bit, a run that committed the same rows without ever drafting, and the next
    drafts are identical: the rings only ever see committed positions."""
    weights, head = ck["weights"], ck["head"]
    gen = torch.Generator().manual_seed(9)
    prompt, tail = torch.randn(11, 3, 64, generator=gen), torch.randn(accepted + 1, 3, 64, generator=gen)
    pools = []
    for drafted in (True, False):
        rings = D.DSparkRings(weights.config, 1)
        state = rings.new_state()
        _commit_rows(weights, state, torch.arange(11), prompt)
        if drafted:
            before = state.snapshot()
            D.draft(weights, [state], torch.tensor([33]), torch.tensor([11]), head, temperature=1.0,
                    generator=torch.Generator().manual_seed(1))
            after = state.snapshot()
            assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])  # drafting writes nothing
        _commit_rows(weights, state, 11 + torch.arange(accepted + 1), tail)
        nxt = D.draft(weights, [state], torch.tensor([61]), torch.tensor([12 + accepted]), head, temperature=1.0,
                      generator=torch.Generator().manual_seed(2))
        pools.append((rings, nxt))
    (a, next_a), (b, next_b) = pools
    assert torch.equal(a.kv, b.kv) and torch.equal(a.pos, b.pos)
    assert torch.equal(next_a.tokens, next_b.tokens) and torch.equal(next_a.q, next_b.q)


def test_ring_validity_hides_rows_past_the_anchor(ck):
    """Rows of positions after p (a ring restored from a longer history) are invisible: a ring that held
    0..11 drafts at p = 9 exactly like one that only ever held the rows still visible (4..9)."""
    weights, head = ck["weights"], ck["head"]
    hidden = torch.randn(12, 3, 64, generator=torch.Generator().manual_seed(4))
    longer, only = D.DSparkRings(weights.config, 1), D.DSparkRings(weights.config, 1)
    s_long, s_only = longer.new_state(), only.new_state()
    _commit_rows(weights, s_long, torch.arange(12), hidden)
    _commit_rows(weights, s_only, torch.arange(4, 10), hidden[4:10])
    a = D.draft(weights, [s_long], torch.tensor([8]), torch.tensor([10]), head)
    b = D.draft(weights, [s_only], torch.tensor([8]), torch.tensor([10]), head)
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(a.q, b.q, atol=0, rtol=0)
    torch.testing.assert_close(a.base_logits, b.base_logits, atol=1e-6, rtol=1e-6)
    assert not bool(longer.complete([s_long], torch.tensor([9])))  # rows 2, 3 were overwritten by 10, 11
    assert bool(longer.complete([s_long], torch.tensor([11])))


def test_commit_never_replaces_a_later_row(ck):
    weights = ck["weights"]
    hidden = torch.randn(14, 3, 64, generator=torch.Generator().manual_seed(6))
    rings = D.DSparkRings(weights.config, 1)
    state = rings.new_state()
    _commit_rows(weights, state, torch.arange(12), hidden[:12])
    snap = state.snapshot()
    _commit_rows(weights, state, torch.tensor([3]), hidden[12:13])  # older than the row in its slot (11)
    assert torch.equal(state.snapshot()[0], snap[0]) and torch.equal(state.snapshot()[1], snap[1])
    _commit_rows(weights, state, torch.tensor([11]), hidden[11:12])  # the same position again: rewritten
    kv, pos = state.snapshot()
    assert torch.equal(pos, snap[1])  # (alone, not in a batch of 12: equal up to GEMM rounding)
    torch.testing.assert_close(kv, snap[0], atol=1e-6, rtol=1e-6)


def test_bf16_drafting_stays_close_to_fp32(ck):
    """A bf16 drafter (rings bf16; norms, mixes, sinks and the confidence kept fp32) beside a bf16 trunk
    head: ring rows within bf16 rounding of fp32's; drafts run with fp32 q (no end-to-end tolerance: a
    top-1 route of a random 4-expert gate may flip under bf16 rounding)."""
    weights16 = load_dspark(ck["path"], dtype=torch.bfloat16)
    assert weights16.stages[0]["attn.wq_a.weight"].dtype == torch.bfloat16
    assert weights16.stages[0]["hc_attn_fn"].dtype == torch.float32
    assert weights16.stages[2]["confidence_head.proj.weight"].dtype == torch.float32
    _, model16 = load_model(ck["path"], progress=False, dtype="bfloat16")
    hidden = torch.randn(12, 3, 64, generator=torch.Generator().manual_seed(12))
    runs, rows = [], []
    head16 = D.SharedHead.from_target(model16)
    assert head16.dtype == torch.bfloat16
    for w, head, dt in ((ck["weights"], ck["head"], torch.float32), (weights16, head16, torch.bfloat16),
                        (weights16, head16, torch.float32)):  # a bf16 drafter may keep fp32 rings
        rings = D.DSparkRings(w.config, 1, dtype=dt)
        state = rings.new_state()
        _commit_rows(w, state, torch.arange(12), hidden)
        rows.append(rings.kv[0].float())
        runs.append(D.draft(w, [state], torch.tensor([17]), torch.tensor([12]), head))
    for run, row in zip(runs[1:], rows[1:]):
        torch.testing.assert_close(row, rows[0], atol=0.03, rtol=0.02)
        assert run.hidden.dtype == torch.bfloat16 and run.q.dtype == torch.float32
        assert torch.isfinite(run.logits).all() and torch.allclose(run.q.sum(-1), torch.ones(1, BLOCK))


def test_commit_refuses_captures_of_the_wrong_width(ck):
    weights = ck["weights"]
    state = D.DSparkRings(weights.config, 1).new_state()
    with pytest.raises(ValueError, match=r"captured must be \[N = 2, 3, 64\]"):
        D.commit(weights, [state], torch.arange(2), torch.randn(2, 2, 64), torch.zeros(2, dtype=torch.long))


def test_a_snapshot_restored_into_another_slot_drafts_the_same(ck):
    """What a prefix-cache entry would keep: one request's rings and positions, restored into a fresh
    slot, give the same block bit for bit; a fresh slot starts empty."""
    weights, head = ck["weights"], ck["head"]
    rings, states = _history(weights, 2, [13, 5])
    other = D.DSparkRings(weights.config, 1).new_state()
    assert other.rings.pos[0].eq(-1).all() and not bool(other.rings.complete([other], torch.tensor([0])))
    other.restore(states[0].snapshot())
    a = D.draft(weights, [states[0]], torch.tensor([19]), torch.tensor([13]), head)
    b = D.draft(weights, [other], torch.tensor([19]), torch.tensor([13]), head)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logits, b.logits)


def test_capture_slices_end_after_every_target_layer():
    assert D.capture_slices([40, 41, 42], 43) == [(0, 41), (41, 42), (42, 43)]
    assert D.capture_slices([2, 4], 6) == [(0, 3), (3, 5), (5, 6)]


def test_confident_length_and_capture_mean():
    survival = torch.tensor([[0.9, 0.8, 0.5, 0.4, 0.1], [0.5, 0.4, 0.3, 0.2, 0.1], [1.0, 1.0, 1.0, 0.9, 0.9]])
    assert D.confident_length(survival, 0.6).tolist() == [2, 0, 5]
    streams = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
    assert torch.equal(D.capture_mean(streams), torch.stack([streams[t].sum(0) / 3 for t in range(2)]))
