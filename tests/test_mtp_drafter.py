"""The serial MTP drafter (``model/mtp.py``, ``model/mtp_weights.py``; spec ds4-speculative §2, §6).

Detection and every loader error (message checked); the loaded FP8 / MXFP4 weights against an
independent dequantisation; one MTP step and its ring rows against a plain-loop oracle written from the
spec; batched requests against one-by-one; and the rollback oracle: drafting, rejecting and committing
the true tokens leaves the state (and the next draft) bit-identical to a run that never drafted.
"""

from __future__ import annotations

import math

import pytest
import torch
from mtp_checkpoint import FP8_BLOCK, MTP_CONFIG, write_mtp_checkpoint

from ds4serve.config import ConfigError
from ds4serve.model.loader import load_model
from ds4serve.model.mtp import MTPState
from ds4serve.model.mtp_weights import find_mtp, load_mtp

EPS = 1e-6


@pytest.fixture(scope="module")
def base(ckpt_factory):
    return ckpt_factory("C")[1]


@pytest.fixture(scope="module")
def mtp_path(base, tmp_path_factory):
    return write_mtp_checkpoint(base, tmp_path_factory.mktemp("mtp") / "ckpt")


@pytest.fixture(scope="module")
def loaded(mtp_path):
    cfg, target = load_model(mtp_path, progress=False)
    return cfg, target, load_mtp(mtp_path, target)


# ---- detection and loader errors --------------------------------------------------------------------
def test_detects_the_block_and_nothing_without_it(mtp_path, base, loaded):
    layout = find_mtp(mtp_path)
    assert layout is not None and layout.layer == MTP_CONFIG["num_hidden_layers"] == 5
    n_exp = MTP_CONFIG["n_routed_experts"]
    assert sum(".ffn.experts." in n for n in layout.names) == n_exp * 3 * 2  # weights and scales
    assert find_mtp(base) is None and load_mtp(base, loaded[1]) is None
    drafter = loaded[2]
    assert drafter.target is loaded[1] and drafter.block.block.self_attn.compressor is None  # SWA only
    mlp = drafter.block.block.mlp
    assert not mlp.is_hash and mlp.gate.e_score_correction_bias.shape == (n_exp,)  # learned routing


def _drop(*names):
    def edit(t):
        for n in names:
            del t[n]
    return edit


def _set(name, value):
    def edit(t):
        t[name] = value
    return edit


def _no_mtp(t):
    for n in [n for n in t if n.startswith("mtp.")]:
        del t[n]


def _cfg(**kv):
    return lambda c: c.update(kv)


LOADER_ERRORS = {
    "missing projection": (_drop("mtp.0.h_proj.weight", "mtp.0.h_proj.scale"), None,
                           "missing tensor mtp.0.h_proj.weight"),
    "missing block tensor": (_drop("mtp.0.attn.attn_sink"), None, "missing tensor mtp.0.attn.attn_sink"),
    "missing mix": (_drop("mtp.0.hc_ffn_base"), None, "missing tensor mtp.0.hc_ffn_base"),
    "missing expert": (_drop("mtp.0.ffn.experts.3.w2.weight", "mtp.0.ffn.experts.3.w2.scale"), None,
                       "missing tensor mtp.0.ffn.experts.3.w2.weight"),
    "wrong shape": (_set("mtp.0.attn.wkv.weight", torch.zeros(32, 64)), None,
                    "tensor mtp.0.attn.wkv.weight: shape [32, 64], expected [64, 64]"),
    "wrong expert shape": (_set("mtp.0.ffn.experts.1.w3.weight", torch.zeros(16, 64)), None,
                           "tensor mtp.0.ffn.experts.1.w3.weight: shape [16, 64], expected [32, 64]"),
    "compressor tensor": (_set("mtp.0.attn.compressor.ape", torch.zeros(4, 64)), None,
                          "unexpected tensor mtp.0.attn.compressor.ape"),
    "unknown tensor": (_set("mtp.0.emb.tok_emb.weight", torch.zeros(300, 64)), None,
                       "unexpected tensor mtp.0.emb.tok_emb.weight"),
    "extra expert": (_set("mtp.0.ffn.experts.4.w1.weight", torch.zeros(32, 64)), None,
                     "unexpected tensor mtp.0.ffn.experts.4.w1.weight (n_routed_experts = 4)"),
    "integer dtype": (_set("mtp.0.attn.attn_sink", torch.zeros(2, dtype=torch.int64)), None,
                      "tensor mtp.0.attn.attn_sink: dtype I64 is not handled"),
    "fp8 without scale": (_drop("mtp.0.e_proj.scale"), None,
                          "tensor mtp.0.e_proj.weight: F8_E4M3 without its block scale"),
    "fp4 without scale": (_drop("mtp.0.ffn.experts.0.w1.scale"), None,
                          "tensor mtp.0.ffn.experts.0.w1.weight: I8 without its block scale"),
    "claims without tensors": (_no_mtp, None,
                               "config field 'num_nextn_predict_layers' = 1 claims an MTP block, but the "
                               "checkpoint has no mtp.0.* tensors"),
    "tensors with explicit 0": (None, _cfg(num_nextn_predict_layers=0),
                                "config field 'num_nextn_predict_layers' = 0, but the checkpoint has"),
    "two layers": (None, _cfg(num_nextn_predict_layers=2), "config field 'num_nextn_predict_layers' = 2"),
    "dspark tensors": (_set("mtp.0.main_proj.weight", torch.zeros(64, 192)), None,
                       "carries the DSpark drafter (mtp.0.main_proj.weight)"),
    "dspark keys": (None, _cfg(dspark_block_size=5), "carries the DSpark drafter (dspark_block_size)"),
    "compressed block": (None, _cfg(compress_ratios=[0, 4, 32, 4, 0, 4]), "config field 'compress_ratios[5]' = 4"),
    "hash-routed block": (None, _cfg(num_hash_layers=6), "config field 'num_hash_layers' = 6"),
}


@pytest.mark.parametrize("case", sorted(LOADER_ERRORS))
def test_loader_errors_name_what_to_fix(case, base, loaded, tmp_path):
    edit, config_edit, message = LOADER_ERRORS[case]
    path = write_mtp_checkpoint(base, tmp_path / "bad", edit=edit, config_edit=config_edit)
    with pytest.raises(ConfigError) as err:
        load_mtp(path, loaded[1])
    assert message in str(err.value)


# ---- weights as loaded ------------------------------------------------------------------------------
_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_fp8_and_mxfp4_weights_dequantise_like_the_format_says(mtp_path, loaded):
    from safetensors.torch import load_file

    raw = load_file(str(mtp_path / "model.safetensors"))
    block = loaded[2].block
    codes, scale = raw["mtp.0.e_proj.weight"].float(), raw["mtp.0.e_proj.scale"]
    want = torch.empty_like(codes)
    for r in range(codes.shape[0]):
        for c in range(codes.shape[1]):
            want[r, c] = codes[r, c] * scale[r // FP8_BLOCK, c // FP8_BLOCK]
    assert torch.equal(block.e_proj.weight, want)
    packed = raw["mtp.0.ffn.experts.2.w3.weight"].view(torch.uint8)
    exps = raw["mtp.0.ffn.experts.2.w3.scale"].view(torch.uint8)
    inter = MTP_CONFIG["moe_intermediate_size"]
    got = block.block.mlp.experts.gate_up_proj[2, inter:]
    for r in range(0, packed.shape[0], 7):
        for c in range(0, 2 * packed.shape[1], 5):
            byte = int(packed[r, c // 2])
            code = byte & 0xF if c % 2 == 0 else byte >> 4
            value = (-1 if code & 8 else 1) * _E2M1[code & 7] * 2.0 ** (int(exps[r, c // 32]) - 127)
            assert float(got[r, c]) == value


# ---- the plain-loop oracle (spec §2.2, ds4-text §3-§8) ------------------------------------------------
def _rms(x, w=None):
    y = x / torch.sqrt((x * x).mean() + EPS)
    return y if w is None else y * w


def _rope(x, pos, cfg):
    """Interleaved pairs of the last rope_dim channels, theta = rope_main (no YaRN), by ``pos``."""
    out, rd = x.clone(), cfg.rope_dim
    base = x.shape[-1] - rd
    for i in range(rd // 2):
        ang = pos * cfg.rope_main.theta ** (-2 * i / rd)
        a, b = x[base + 2 * i], x[base + 2 * i + 1]
        c, s = math.cos(ang), math.sin(ang)
        out[base + 2 * i], out[base + 2 * i + 1] = a * c - b * s, b * c + a * s
    return out


def _hc_pre(streams, hc_mod, cfg):
    hc = cfg.hc_mult
    fn, base, scale = (t.double() for t in (hc_mod.fn, hc_mod.base, hc_mod.scale))
    z = fn @ _rms(streams.flatten())
    pre = [torch.sigmoid(z[i] * scale[0] + base[i]) + cfg.hc_eps for i in range(hc)]
    post = [2 * torch.sigmoid(z[hc + i] * scale[1] + base[hc + i]) for i in range(hc)]
    raw = torch.stack([z[2 * hc + i * hc:2 * hc + (i + 1) * hc] * scale[2] + base[2 * hc + i * hc:2 * hc + (i + 1) * hc]
                       for i in range(hc)])
    comb = torch.softmax(raw, dim=-1) + cfg.hc_eps
    for it in range(cfg.hc_sinkhorn_iters):
        if it:
            comb = comb / (comb.sum(1, keepdim=True) + cfg.hc_eps)  # rows
        comb = comb / (comb.sum(0, keepdim=True) + cfg.hc_eps)  # columns
    return sum(pre[i] * streams[i] for i in range(hc)), post, comb


def _hc_post(y, streams, post, comb):
    hc = streams.shape[0]
    return torch.stack([post[j] * y + sum(comb[i, j] * streams[i] for i in range(hc)) for j in range(hc)])


def _kv(layer, a, pos, cfg):
    at = layer.self_attn
    return _rope(_rms(at.kv_proj.weight.double() @ a, at.kv_norm.weight.double()), pos, cfg)


def _attention(layer, a, pos, keys, cfg):
    """``keys``: the K=V rows this query sees (its own included)."""
    at, heads, hd = layer.self_attn, cfg.num_heads, cfg.head_dim
    qa = _rms(at.q_a_proj.weight.double() @ a, at.q_a_norm.weight.double())
    qf = (at.q_b_proj.weight.double() @ qa).view(heads, hd)
    outs = []
    for h in range(heads):
        q = _rope(_rms(qf[h]), pos, cfg)
        logits = [float(q @ k) * hd**-0.5 for k in keys] + [float(at.sinks[h])]
        p = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
        o = sum(p[i] * keys[i] for i in range(len(keys)))
        outs.append(_rope(o, -pos, cfg))
    per = heads // cfg.o_groups
    wa = at.o_a_proj.weight.double()
    grouped = [wa[g * cfg.o_lora_rank:(g + 1) * cfg.o_lora_rank] @ torch.cat(outs[g * per:(g + 1) * per])
               for g in range(cfg.o_groups)]
    return at.o_b_proj.weight.double() @ torch.cat(grouped)


def _swiglu(w1, w3, w2, x, limit):
    g, u = w1 @ x, w3 @ x
    return w2 @ (torch.nn.functional.silu(g.clamp(max=limit)) * u.clamp(-limit, limit))


def _moe(layer, a, cfg):
    m = layer.mlp
    scores = torch.sqrt(torch.nn.functional.softplus(m.gate.weight.double() @ a))
    sel = scores + m.gate.e_score_correction_bias.double()
    top = sorted(range(cfg.n_routed_experts), key=lambda e: -float(sel[e]))[:cfg.n_experts_per_tok]
    total = sum(scores[e] for e in top)
    inter, out = cfg.moe_intermediate_size, 0
    gu, dn = m.experts.gate_up_proj.double(), m.experts.down_proj.double()
    for e in top:
        out = out + scores[e] / total * cfg.routed_scaling_factor * _swiglu(gu[e, :inter], gu[e, inter:], dn[e], a,
                                                                            cfg.swiglu_limit)
    s = m.shared_experts
    return out + _swiglu(s.gate_proj.weight.double(), s.up_proj.weight.double(), s.down_proj.weight.double(), a,
                         cfg.swiglu_limit)


class Oracle:
    """One request's MTP history, position by position: every row's K=V, then full steps on top."""

    def __init__(self, drafter, cfg):
        self.d, self.cfg, self.b = drafter, cfg, drafter.block
        self.rows: dict[int, torch.Tensor] = {}

    def mixed(self, hidden, token):
        b = self.b
        e = _rms(self.d.target.model.embed_tokens.weight[token].double(), b.enorm.weight.double())
        return torch.stack([b.h_proj.weight.double() @ _rms(hidden[i].double(), b.hnorm.weight.double())
                            + b.e_proj.weight.double() @ e for i in range(self.cfg.hc_mult)])

    def row(self, hidden, token, pos):
        layer = self.b.block
        a, _, _ = _hc_pre(self.mixed(hidden, token), layer.attn_hc, self.cfg)
        return _kv(layer, _rms(a, layer.input_layernorm.weight.double()), pos, self.cfg)

    def step(self, hidden, token, pos, first_row):
        """(block output [hc, D], logits [V]) of the pair at ``pos``; its row joins the history."""
        cfg, layer = self.cfg, self.b.block
        x = self.mixed(hidden, token)
        a, post, comb = _hc_pre(x, layer.attn_hc, cfg)
        a = _rms(a, layer.input_layernorm.weight.double())
        self.rows[pos] = _kv(layer, a, pos, cfg)
        keys = [self.rows[s] for s in range(max(first_row, pos - cfg.sliding_window + 1), pos + 1)]
        x = _hc_post(_attention(layer, a, pos, keys, cfg), x, post, comb)
        a, post, comb = _hc_pre(x, layer.ffn_hc, cfg)
        x = _hc_post(_moe(layer, _rms(a, layer.post_attention_layernorm.weight.double()), cfg), x, post, comb)
        hh = self.b.hc_head
        fn, base, scale = hh.hc_fn.double(), hh.hc_base.double(), hh.hc_scale.double()
        pre = torch.sigmoid((fn @ _rms(x.flatten())) * scale + base) + cfg.hc_eps
        h = sum(pre[i] * x[i] for i in range(cfg.hc_mult))
        return x, self.d.target.lm_head.weight.double() @ _rms(h, self.b.norm.weight.double())


def _prompt(cfg, n, seed):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, cfg.vocab_size, (n,), generator=g)
    return toks, torch.randn(n, cfg.hc_mult, cfg.hidden_size, generator=g)


@pytest.mark.parametrize("chunks", [(6, 7), (13,), (1, 12)])
def test_rows_and_chained_steps_match_the_plain_loop_oracle(loaded, chunks):
    cfg, _, drafter = loaded
    n, w = 13, cfg.sliding_window  # past one ring wrap (W = 8); one chunk longer than W
    toks, hid = _prompt(cfg, n, seed=3)
    st = MTPState.new(drafter)
    at = 0
    for c in chunks:
        drafter.commit([st], [at], [toks[at:at + c]], [hid[at:at + c]])
        at += c
    assert (st.next_pos, st.first_row) == (n, 1) and torch.equal(st.prev_hidden, hid[-1])
    oracle = Oracle(drafter, cfg)
    for t in range(1, n):
        oracle.rows[t] = oracle.row(hid[t - 1], int(toks[t]), t)
    for t in range(n - w, n):
        torch.testing.assert_close(st.ring[t % w].double(), oracle.rows[t], rtol=1e-5, atol=1e-5)
    anchor, temp = 17, 0.7
    out = drafter.draft([st], torch.tensor([anchor]), 3, generator=torch.Generator().manual_seed(5), greedy=False,
                        temperature=temp)
    x, tok = hid[-1], anchor
    for i in range(3):
        x, logits = oracle.step(x, tok, n + i, first_row=1)
        probs = torch.softmax(logits, 0)
        torch.testing.assert_close(out.q[0, i].double(), torch.softmax(logits / temp, 0), rtol=1e-4, atol=1e-6)
        assert abs(float(out.confidence[0, i]) - float(probs.max())) < 1e-5
        tok = int(out.tokens[0, i])
    greedy = drafter.draft([st], torch.tensor([anchor]), 1)
    _, logits = oracle.step(hid[-1], anchor, n, first_row=1)
    assert int(greedy.tokens[0, 0]) == int(logits.argmax())
    assert torch.equal(greedy.q[0, 0], torch.nn.functional.one_hot(greedy.tokens[0, 0], cfg.vocab_size).float())


def test_sampled_drafts_are_drawn_from_the_returned_q(loaded):
    cfg, _, drafter = loaded
    states = [MTPState.new(drafter) for _ in range(3)]
    for i, st in enumerate(states):
        toks, hid = _prompt(cfg, 5 + 3 * i, seed=10 + i)
        drafter.commit([st], [0], [toks], [hid])
    out = drafter.draft(states, torch.tensor([3, 4, 5]), 4, generator=torch.Generator().manual_seed(9),
                        greedy=False, temperature=1.3)
    g = torch.Generator().manual_seed(9)
    for i in range(4):
        assert torch.equal(torch.multinomial(out.q[:, i], 1, generator=g).squeeze(1), out.tokens[:, i])


# ---- batching, rollback ----------------------------------------------------------------------------
def _run(drafter, cfg, lengths, starts, batched):
    states = [MTPState.new(drafter, start=s) for s in starts]
    data = [_prompt(cfg, n, seed=20 + i) for i, n in enumerate(lengths)]
    groups = [list(range(len(states)))] if batched else [[i] for i in range(len(states))]
    for chunk in ((0, 4), (4, None)):
        for grp in groups:
            sel = [i for i in grp if data[i][0][slice(*chunk)].shape[0]]
            drafter.commit([states[i] for i in sel], [states[i].next_pos for i in sel],
                           [data[i][0][slice(*chunk)] for i in sel], [data[i][1][slice(*chunk)] for i in sel])
    anchors = torch.tensor([7, 8, 9])
    drafts = [drafter.draft([states[i] for i in grp], anchors[grp], 3,
                            generator=[torch.Generator().manual_seed(40 + i) for i in grp],
                            greedy=[i != 1 for i in grp], temperature=[0.9] * len(grp)) for grp in groups]
    cat = lambda f: torch.cat([getattr(d, f) for d in drafts])  # noqa: E731
    return states, cat("tokens"), cat("q"), cat("confidence")


def test_batched_requests_equal_one_by_one(loaded):
    cfg, _, drafter = loaded
    lengths, starts = [11, 3, 7], [0, 5, 30]
    b_states, b_tok, b_q, b_c = _run(drafter, cfg, lengths, starts, batched=True)
    s_states, s_tok, s_q, s_c = _run(drafter, cfg, lengths, starts, batched=False)
    for a, b in zip(b_states, s_states):
        assert (a.next_pos, a.first_row) == (b.next_pos, b.first_row)
        torch.testing.assert_close(a.ring, b.ring, rtol=1e-5, atol=1e-6)
    assert torch.equal(b_tok, s_tok)
    torch.testing.assert_close(b_q, s_q, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(b_c, s_c, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("accepted", [0, 1, 3])
def test_rejected_drafts_leave_no_trace(loaded, accepted):
    """Draft k, accept j, commit the anchor and the j accepted tokens with the target's rows: the state and
    the next draft are bit-identical to a run that committed the same rows and never drafted."""
    cfg, _, drafter = loaded
    toks, hid = _prompt(cfg, 10, seed=50)
    runs = []
    for drafted in (True, False):
        st = MTPState.new(drafter)
        drafter.commit([st], [0], [toks], [hid])
        ring0 = st.ring.clone()
        gen = torch.Generator().manual_seed(60)
        if drafted:
            out = drafter.draft([st], torch.tensor([11]), 3, generator=gen, greedy=False, temperature=1.0)
            assert torch.equal(st.ring, ring0) and st.next_pos == 10  # a draft never writes the state
            kept = [11] + out.tokens[0, :accepted].tolist()
        else:
            kept = [11] + runs[0][1][1:]
        _, verified = _prompt(cfg, len(kept), seed=70)  # the target's rows of anchor + accepted drafts
        drafter.commit([st], [10], [torch.tensor(kept)], [verified])
        nxt = drafter.draft([st], torch.tensor([99]), 4, generator=torch.Generator().manual_seed(80), greedy=False,
                            temperature=0.8)
        runs.append((st, kept, nxt))
    (a, _, da), (b, _, db) = runs
    assert torch.equal(a.ring, b.ring) and torch.equal(a.prev_hidden, b.prev_hidden)
    assert (a.next_pos, a.first_row) == (b.next_pos, b.first_row) == (11 + accepted, 1)
    assert torch.equal(da.tokens, db.tokens) and torch.equal(da.q, db.q) and torch.equal(da.confidence, db.confidence)


def test_caller_mistakes_are_errors(loaded):
    cfg, _, drafter = loaded
    st = MTPState.new(drafter)
    with pytest.raises(ValueError, match="call commit first"):
        drafter.draft([st], torch.tensor([1]), 2)
    toks, hid = _prompt(cfg, 4, seed=1)
    drafter.commit([st], [0], [toks], [hid])
    with pytest.raises(ValueError, match="continue from 4 without gaps"):
        drafter.commit([st], [5], [toks[:1]], [hid[:1]])
    with pytest.raises(ValueError, match="hidden must be"):
        drafter.commit([st], [4], [toks[:2]], [hid[:2, 0]])
    with pytest.raises(ValueError, match="temperature > 0"):
        drafter.draft([st], torch.tensor([1]), 1, greedy=False, temperature=0.0)


def test_an_engine_sampler_decides_the_chain(loaded):
    """``sampler`` (the engine's counter-seeded draw) picks each step's token and q, and the chain feeds
    its token on: an argmax sampler reproduces the greedy draft; k = 0 drafts nothing."""
    cfg, _, drafter = loaded
    states = [MTPState.new(drafter) for _ in range(2)]
    for i, st in enumerate(states):
        toks, hid = _prompt(cfg, 6 + i, seed=90 + i)
        drafter.commit([st], [0], [toks], [hid])
    seen = []

    def argmax_sampler(step, logits):
        seen.append(step)
        best = logits.argmax(-1)
        return best, torch.nn.functional.one_hot(best, logits.shape[-1]).float()

    hooked = drafter.draft(states, torch.tensor([1, 2]), 3, sampler=argmax_sampler)
    greedy = drafter.draft(states, torch.tensor([1, 2]), 3)
    assert seen == [0, 1, 2] and torch.equal(hooked.tokens, greedy.tokens) and torch.equal(hooked.q, greedy.q)
    none = drafter.draft(states, torch.tensor([1, 2]), 0)
    assert none.tokens.shape == (2, 0) and none.q.shape == (2, 0, cfg.vocab_size)
