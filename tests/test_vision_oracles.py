"""DS4V reference oracles (issue 11, item 4): bias_vl routing, image-span attention, sentinel merge.

Every oracle below is written from ``shared/spec/ds4-vision.md`` (§3.2, §3.3, §4.1, §5.1) and the
text spec (§3, §8) in plain Python loops (per token, per key, per expert), not from the engine's
vectorised code, and compared with the engine on three random configs that mix sliding, CSA and HCA
layers, 1-3 hash layers, ``hc_mult`` 1/2/4 and windows 8/12/16. Each config builds three sequences
in one view: two images in one sequence, a block at position 0 (three lead pads) whose visible span
is wider than the sliding window, and a sequence whose image chunk follows an earlier text chunk
(keys from the ring). Image-block rows and text rows are mixed in every forward.

* ``test_sentinel_merge``: ``embed`` equals, per position, the token row (text), the learned vector
  of the sentinel type (START/PAD/NEWLINE/END), or the encoder row of that IMAGE slot in N-layout
  stream order, copied to all ``hc_mult`` streams.
* ``test_routing_oracle``: each layer's MoE output equals an oracle that routes image tokens (all five
  block types) by ``topk(scores + bias_vl)`` on every layer, hash layers included (no ``tid2eid``),
  text by ``tid2eid`` / ``topk(scores + bias)``, with weights from the unbiased scores. bias_vl and
  the text bias are random and non-zero, and the test asserts they pick different experts.
* ``test_attention_window_oracle``: each layer's attention output equals a sink softmax over the
  raw keys of spec §4.1 (START..END bidirectional, lead pads and text causal), plus for CSA/HCA
  layers the compressed keys the engine gathered, whose counts must stay causal.
* ``test_span_dependencies``: through the whole stack, perturbing an IMAGE row changes earlier
  tokens of its span but nothing before IMAGE_START (lead pads included) nor other sequences, and
  the text after IMAGE_END never reaches back into the span.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F

from ds4serve.cache import ImageSpan, ModelState, SeqChunk, StateLayout, build_view
from ds4serve.cache import view as view_module
from ds4serve.config import ModelConfig
from ds4serve.model.decoder import DS4ForCausalLM
from ds4serve.model.norms import rms_norm, rms_norm_unweighted
from ds4serve.model.rope import apply_rope, rotations
from ds4serve.multimodal.layout import image_block
from ds4serve.tiny.random_model import random_weights

START, PAD, IMAGE, NEWLINE, END = 0, 1, 2, 3, 4  # spec §3.1 block token types (id = vocab + type)
VOCAB = 200
N_SLOTS = 3
BASE = {
    "model_type": "deepseek_v4", "vocab_size": VOCAB, "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 32, "qk_rope_head_dim": 8, "q_lora_rank": 32, "o_groups": 2,
    "o_lora_rank": 16, "compress_rope_theta": 160000.0, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 4096, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 4,
    "n_shared_experts": 1, "moe_intermediate_size": 32, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1,
    "vision_n_layers": 1, "vision_dim": 32, "vision_n_heads": 2, "vision_inter_dim": 48,
}
CONFIGS = {
    "A": dict(compress_ratios=[0, 4, 8], num_hash_layers=2, sliding_window=8, hc_mult=2,
              n_routed_experts=8, num_experts_per_tok=2, vision_max_n_token=48),
    "B": dict(compress_ratios=[4, 0, 16, 0], num_hash_layers=3, sliding_window=16, hc_mult=4,
              n_routed_experts=16, num_experts_per_tok=3, vision_max_n_token=64),
    "C": dict(compress_ratios=[0, 8, 0, 4, 4], num_hash_layers=1, sliding_window=12, hc_mult=1,
              n_routed_experts=12, num_experts_per_tok=4, vision_max_n_token=40),
}


# ---- spec oracles ---------------------------------------------------------------------------------

def spec_block(n_h: int, n_w: int, start: int) -> tuple[list[int], list[int]]:
    """Spec §3.2 block: (types, aligner row of each IMAGE slot in stream order)."""
    types = [PAD] * (3 - start % 4) + [START]
    rows_of_slots: list[int] = []
    rows, row_len = n_h + n_h % 2, n_w + 1
    for pair in range(rows // 2):
        rr = (2 * pair, 2 * pair + 1)
        for c in range(n_w):
            for r in rr:
                if r < n_h:
                    types.append(IMAGE)
                    rows_of_slots.append(r * n_w + c)
                else:
                    types.append(PAD)
        types += [NEWLINE if r < n_h else PAD for r in rr]
    types += [PAD] * (2 if (rows // 2 * row_len) % 2 else 0)
    return types + [END], rows_of_slots


def oracle_raw_keys(p: int, spans: list[tuple[int, int]], window: int, max_tok: int, seqlen: int) -> list[int]:
    """Spec §4.1: the raw (sliding) key positions a query at ``p`` sees."""
    left = right = 0
    for s, e in spans:
        if s <= p <= e:
            left, right = min(p - s, max_tok - 1), min(e - p, max_tok)
    win_start = max(0, p - (window - 1) - max(0, left - (window - 1)))
    last = min(p + right, win_start + min(seqlen, window + max_tok) - 1)
    keys = list(range(win_start, last + 1))
    # the prose of §4.1: the causal window always; inside a span also the whole span, future included
    assert set(range(max(0, p - window + 1), p + 1)) <= set(keys)
    assert all(set(range(s, e + 1)) <= set(keys) for s, e in spans if s <= p <= e and e - s < max_tok)
    return keys


def oracle_route(gate, is_hash: bool, cfg: ModelConfig, x: torch.Tensor, tok: int) -> tuple[list[int], list[float]]:
    """Spec ds4-vision §5.1 for one token: (experts, weights)."""
    n_exp, k = cfg.n_routed_experts, cfg.n_experts_per_tok
    scores = [float(torch.sqrt(F.softplus(gate.weight[e].double() @ x.double()))) for e in range(n_exp)]

    def top(bias: torch.Tensor) -> list[int]:
        return sorted(range(n_exp), key=lambda e: -(scores[e] + float(bias[e])))[:k]

    if tok >= cfg.vocab_size:  # any image-block token, lead pads included
        experts = top(gate.bias_vl)
    elif is_hash:
        experts = [int(e) for e in gate.tid2eid[tok]]
    else:
        experts = top(gate.e_score_correction_bias)
    total = sum(scores[e] for e in experts)
    return experts, [scores[e] / total * cfg.routed_scaling_factor for e in experts]


def oracle_swiglu(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, x: torch.Tensor,
                  limit: float) -> torch.Tensor:
    """Text spec §8: W2(silu(min(W1 x, limit)) * clamp(W3 x, -limit, limit))."""
    g, u = w_gate @ x, w_up @ x
    return w_down @ (F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit))


# ---- random cases ---------------------------------------------------------------------------------

@dataclass
class Block:
    start: int
    types: list[int]
    rows_of_slots: list[int]
    aligner: torch.Tensor  # [n_h * n_w, D] row-major encoder output

    @property
    def lead(self) -> int:
        return self.types.index(START)

    @property
    def visible(self) -> tuple[int, int]:
        return self.start + self.lead, self.start + len(self.types) - 1

    @property
    def image_positions(self) -> list[int]:
        return [self.start + i for i, t in enumerate(self.types) if t == IMAGE]


@dataclass
class Seq:
    ids: list[int]
    blocks: list[Block]
    prior: int  # tokens prefilled by an earlier forward (0: the whole sequence in one forward)

    def spans(self) -> list[tuple[int, int]]:
        return [b.visible for b in self.blocks]


@dataclass
class Case:
    name: str
    cfg: ModelConfig
    model: DS4ForCausalLM
    seqs: list[Seq]
    layout: StateLayout
    pages: int  # per slot

    @property
    def max_tok(self) -> int:
        return self.cfg.vision.max_n_token

    def chunks(self, split: bool) -> list[list[SeqChunk]]:
        """Forwards: ``split`` prefills each sequence's prior text first, then the rest together."""
        first, second = [], []
        for slot, s in enumerate(self.seqs):
            table = list(range(slot * self.pages, (slot + 1) * self.pages))
            spans = tuple(ImageSpan(b.start, b.start + len(b.types), *b.visible) for b in s.blocks)
            cut = s.prior if split else 0
            if cut:
                first.append(SeqChunk(slot, 0, s.ids[:cut], table, spans=spans))
            rows = tuple((b.image_positions, b.aligner[b.rows_of_slots]) for b in s.blocks if b.start >= cut)
            second.append(SeqChunk(slot, cut, s.ids[cut:], table, spans=spans, image_rows=rows))
        return [f for f in (first, second) if f]

    def view(self, chunks: list[SeqChunk]):
        return build_view(self.layout, N_SLOTS, chunks, torch.device("cpu"), max_image_tokens=self.max_tok)

    def state(self) -> ModelState:
        return ModelState(self.layout, N_SLOTS, N_SLOTS * self.pages, "cpu")


def _build_model(cfg: ModelConfig, seed: int) -> DS4ForCausalLM:
    sd = {k: v for k, v in random_weights(cfg, seed).items() if not k.startswith(("vision.", "aligner."))}
    gen = torch.Generator().manual_seed(seed + 1)
    for k, v in sd.items():  # routing that depends on scores AND biases; biases random and non-zero
        if k.endswith(("gate.bias_vl", "gate.e_score_correction_bias")):
            sd[k] = torch.randn(v.shape, generator=gen) * 0.5
        elif k.endswith("mlp.gate.weight"):
            sd[k] = torch.randn(v.shape, generator=gen) / cfg.hidden_size**0.5
    model = DS4ForCausalLM(cfg)
    model.load_state_dict(sd, strict=True)
    return model.eval()


def _add_block(ids: list[int], blocks: list[Block], n_h: int, n_w: int, dim: int, gen: torch.Generator) -> None:
    types, rows_of_slots = spec_block(n_h, n_w, len(ids))
    ref = image_block(n_h, n_w, len(ids))  # the engine's layout must agree with the spec's
    assert list(ref.types) == types and list(ref.perm) == rows_of_slots
    blocks.append(Block(len(ids), types, rows_of_slots, torch.randn(n_h * n_w, dim, generator=gen) * 0.05))
    ids.extend(VOCAB + t for t in types)


def _wide_grid(rng: random.Random, window: int, max_tok: int) -> tuple[int, int]:
    """A grid whose visible span is wider than the window (and whose block fits max_tok)."""
    n_h = rng.randint(2, 4)
    fits = [w for w in range(1, 40) if window + 2 < len(spec_block(n_h, w, 0)[0]) - 3 <= max_tok - 3]
    return n_h, rng.choice(fits[:3])


def make_case(name: str, seed: int) -> Case:
    cfg = ModelConfig.from_dict(BASE | CONFIGS[name] | {"num_hidden_layers": len(CONFIGS[name]["compress_ratios"])})
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    d = cfg.hidden_size

    def text(ids: list[int], n: int) -> None:
        ids.extend(rng.randrange(2, VOCAB) for _ in range(n))

    seqs = []
    ids, blocks = [], []  # two images between text
    for _ in range(2):
        text(ids, rng.randint(1, 6))
        _add_block(ids, blocks, rng.randint(1, 3), rng.randint(1, 3), d, gen)
    text(ids, rng.randint(1, 5))
    seqs.append(Seq(ids, blocks, 0))
    ids, blocks = [], []  # a block at position 0 (three lead pads), wider than the window
    _add_block(ids, blocks, *_wide_grid(rng, cfg.sliding_window, cfg.vision.max_n_token), d, gen)
    text(ids, rng.randint(1, 4))
    seqs.append(Seq(ids, blocks, 0))
    ids, blocks = [], []  # text, then in a later forward more text and an image
    text(ids, rng.randint(cfg.sliding_window // 2, cfg.sliding_window + 4))
    prior = len(ids)
    text(ids, rng.randint(0, 3))
    _add_block(ids, blocks, rng.randint(2, 3), rng.randint(2, 4), d, gen)
    text(ids, rng.randint(1, 3))
    seqs.append(Seq(ids, blocks, prior))
    layout = StateLayout.build(cfg, torch.float32)
    pages = layout.pages_for(max(len(s.ids) for s in seqs)) + 1
    return Case(name, cfg, _build_model(cfg, seed), seqs, layout, pages)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request: pytest.FixtureRequest) -> Case:
    torch.manual_seed(0)
    return make_case(request.param, seed=1000 + ord(request.param))


# ---- sentinel-embedding merge ---------------------------------------------------------------------

def test_sentinel_merge(case: Case) -> None:
    model, cfg = case.model, case.cfg
    chunks = case.chunks(split=True)[-1]
    with torch.no_grad():
        got = model.embed(case.view(chunks))
    learned = {START: model.image_start, PAD: model.image_pad, NEWLINE: model.image_newline,
               END: model.image_end}
    want, kinds = [], set()
    for c, s in zip(chunks, case.seqs):
        rows = {}
        for b in s.blocks:
            for k, pos in enumerate(b.image_positions):
                rows[pos] = b.aligner[b.rows_of_slots[k]]
        for pos in range(c.start, len(s.ids)):
            tok = s.ids[pos]
            kind = tok - cfg.vocab_size
            kinds.add(kind if kind >= 0 else "text")
            if kind < 0:
                want.append(model.model.embed_tokens.weight[tok])
            elif kind == IMAGE:
                want.append(rows[pos])
            else:
                want.append(learned[kind])
    assert kinds == {"text", START, PAD, IMAGE, NEWLINE, END}
    assert got.shape == (len(want), cfg.hc_mult, cfg.hidden_size)
    want_t = torch.stack(want)
    for h in range(cfg.hc_mult):
        bad = (got[:, h] != want_t).any(-1)  # a merge copies rows: exact
        assert not bad.any(), f"stream {h}: wrong embedding at tokens {bad.nonzero().flatten().tolist()}"


# ---- bias_vl routing ------------------------------------------------------------------------------

def _oracle_moe(mlp, cfg: ModelConfig, x: torch.Tensor, ids: list[int]) -> tuple[torch.Tensor, list[list[int]]]:
    ex, n_i, lim = mlp.experts, cfg.moe_intermediate_size, cfg.swiglu_limit
    out, chosen = torch.zeros_like(x), []
    for t, tok in enumerate(ids):
        experts, weights = oracle_route(mlp.gate, mlp.is_hash, cfg, x[t], tok)
        chosen.append(experts)
        for e, w in zip(experts, weights):
            gu = ex.gate_up_proj[e]
            out[t] += w * oracle_swiglu(gu[:n_i], gu[n_i:], ex.down_proj[e], x[t], lim)
        sh = mlp.shared_experts
        out[t] += oracle_swiglu(sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight, x[t], lim)
    return out, chosen


def test_routing_oracle(case: Case) -> None:
    cfg, model = case.cfg, case.model
    chunks = case.chunks(split=False)[0]
    view = case.view(chunks)
    ids = [t for c in chunks for t in c.ids]
    is_img = [t >= cfg.vocab_size for t in ids]
    assert any(is_img) and not all(is_img)
    x = torch.randn(len(ids), cfg.hidden_size, generator=torch.Generator().manual_seed(7))
    for layer, dec in enumerate(model.model.layers):
        mlp = dec.mlp
        assert mlp.is_hash == (layer < CONFIGS[case.name]["num_hash_layers"])
        with torch.no_grad():
            got = mlp(x, view)
        want, chosen = _oracle_moe(mlp, cfg, x, ids)
        tol = 3e-5 * float(want.abs().max())  # fp32 rounding only (observed ~1e-6 relative)
        bad = [(t, ids[t] - cfg.vocab_size) for t in range(len(ids)) if (got[t] - want[t]).abs().max() > tol]
        assert not bad, f"layer {layer} (hash={mlp.is_hash}): wrong MoE output at (token, type) {bad[:8]}"
        # the test can tell bias_vl from the text bias and (hash layers) from the hash table
        k = cfg.n_experts_per_tok
        img_rows = [t for t in range(len(ids)) if is_img[t]]
        scores = torch.sqrt(F.softplus(x[img_rows] @ mlp.gate.weight.T))
        alt = torch.topk(scores + (0 if mlp.is_hash else mlp.gate.e_score_correction_bias), k).indices
        assert any(set(chosen[t]) != set(alt[i].tolist()) for i, t in enumerate(img_rows))
        if mlp.is_hash:
            assert any(set(chosen[t]) != set(mlp.gate.tid2eid[0].tolist()) for t in img_rows)


# ---- image-span attention window ------------------------------------------------------------------

def _oracle_attention(case: Case, attn, x: torch.Tensor, seq: Seq, first: int,
                      comp: list[torch.Tensor] | None) -> torch.Tensor:
    """Spec text §3 + vision §4.1 for queries ``first..`` of one sequence (``x`` = all its rows)."""
    cfg, model = case.cfg, case.model
    eps, n_h, hd, n = cfg.rms_norm_eps, cfg.num_heads, cfg.head_dim, x.shape[0]
    inv, af = ((model.inv_freq_main, 1.0) if attn.compressor is None
               else (model.inv_freq_compress, cfg.rope_compress.attention_factor))
    rot = rotations(torch.arange(n), inv, af)
    q = rms_norm_unweighted(attn.q_b_proj(rms_norm(attn.q_a_proj(x), attn.q_a_norm.weight, eps)).view(n, n_h, hd), eps)
    q = apply_rope(q, rot)
    kv = apply_rope(rms_norm(attn.kv_proj(x), attn.kv_norm.weight, eps), rot)
    outs = []
    for p in range(first, n):
        keys = [kv[j] for j in oracle_raw_keys(p, seq.spans(), cfg.sliding_window, case.max_tok, n)]
        if comp is not None:
            keys += list(comp[p - first])
        keys_t = torch.stack(keys)
        o = torch.zeros(n_h, hd)
        for h in range(n_h):
            logits = torch.cat([keys_t @ q[p, h] * hd**-0.5, attn.sinks[h].view(1)])
            probs = torch.softmax(logits, 0)[:-1]
            o[h] = (probs.unsqueeze(1) * keys_t).sum(0)
        outs.append(o)
    o = apply_rope(torch.stack(outs), rot[first:], inverse=True)
    g, r = cfg.o_groups, cfg.o_lora_rank
    per_group = o.reshape(o.shape[0], g, -1)
    z = torch.cat([per_group[:, i] @ attn.o_a_proj.weight[i * r:(i + 1) * r].T for i in range(g)], dim=-1)
    return attn.o_b_proj(z)


def _engine_attention(case: Case, layer: int, xs: list[torch.Tensor], spy_on: bool = True
                      ) -> tuple[torch.Tensor, list[torch.Tensor] | None, list[SeqChunk]]:
    """Run one attention layer over the split forwards; (last output, compressed keys per token).

    Call with the per-query gather path forced (see ``test_attention_window_oracle``): the spy reads
    the compressed keys each query was given."""
    attn, state = case.model.model.layers[layer].self_attn, case.state()
    captured = []
    spy_on = spy_on and attn.compressor is not None
    if spy_on:
        inner = attn.compressor.gathered

        def spy(*a, **kw):
            captured.append(inner(*a, **kw))
            return captured[-1]

        attn.compressor.gathered = spy
    try:
        for chunks in case.chunks(split=True):
            x = torch.cat([xs[c.slot][c.start:c.start + len(c)] for c in chunks])
            view = case.view(chunks)
            out = attn(x, view, state.layers[layer], case.model.rope_tables(view))
    finally:
        if spy_on:
            del attn.compressor.gathered
    comp = None
    if captured:
        keys, valid = captured[-1]
        ratio, top = attn.compressor.ratio, case.cfg.index_topk if attn.compressor.overlap else 10**9
        want = torch.clamp((view.positions + 1) // ratio, max=top)  # causal compressed rows only
        assert torch.equal(valid.sum(1), want), f"layer {layer}: compressed rows not causal"
        comp = [keys[t][valid[t]] for t in range(keys.shape[0])]
    return out, comp, chunks


def test_attention_window_oracle(case: Case, monkeypatch) -> None:
    """The per-query gather path against the oracle; then the tiled path (shared key blocks, used for
    long prefill chunks) must give the same outputs."""
    widths = [e - s + 1 for q in case.seqs for s, e in q.spans()]
    assert max(widths) > case.cfg.sliding_window and max(len(q.blocks) for q in case.seqs) > 1
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(len(s.ids), case.cfg.hidden_size, generator=gen) for s in case.seqs]
    tiles_used = False
    for layer in range(case.cfg.num_layers):
        with torch.no_grad():
            tiled, _, _ = _engine_attention(case, layer, xs, spy_on=False)
            tiles_used |= bool(case.view(case.chunks(split=True)[-1]).tiles)
            monkeypatch.setattr(view_module, "TILE_MIN", 10**9)
            got, comp, chunks = _engine_attention(case, layer, xs)
            monkeypatch.undo()
            torch.testing.assert_close(tiled, got, rtol=0, atol=3e-5 * float(got.abs().max()))
            off = 0
            for c in chunks:
                s, n = case.seqs[c.slot], len(c)
                attn = case.model.model.layers[layer].self_attn
                extra = None if comp is None else comp[off:off + n]
                want = _oracle_attention(case, attn, xs[c.slot], s, c.start, extra)
                err = (got[off:off + n] - want).abs().amax(-1)
                tol = 3e-5 * float(want.abs().max())  # fp32 rounding only (observed ~3e-7 relative)
                bad = [(c.start + i, s.ids[c.start + i] - VOCAB) for i in range(n) if err[i] > tol]
                assert not bad, f"layer {layer} seq {c.slot}: wrong attention at (pos, type) {bad[:8]}"
                off += n
    assert tiles_used, "no chunk of this config was long enough to use query tiles"


# ---- whole-stack dependencies ---------------------------------------------------------------------

def _streams(case: Case, chunks: list[SeqChunk]) -> torch.Tensor:
    view, state = case.view(chunks), case.state()
    with torch.no_grad():
        return case.model.forward_layers(case.model.embed(view), view, state.layers)


def test_span_dependencies(case: Case) -> None:
    """Spec §4.1 through every layer: span tokens see future span tokens, nothing else looks ahead."""
    chunks = case.chunks(split=False)[0]
    base = _streams(case, chunks)
    seq, blk = case.seqs[0], case.seqs[0].blocks[0]
    s, e = blk.visible
    last_img = blk.image_positions[-1]
    # 1) a new encoder row for the last IMAGE slot of block 0 of sequence 0
    rows = list(chunks[0].image_rows)
    stream_rows = rows[0][1].clone()
    stream_rows[-1] = torch.randn(stream_rows.shape[1], generator=torch.Generator().manual_seed(3)) * 0.05
    rows[0] = (rows[0][0], stream_rows)
    alt = [replace(chunks[0], image_rows=tuple(rows))] + chunks[1:]
    diff = (_streams(case, alt) - base).abs().flatten(1).amax(-1)
    assert diff[:s].max() < 1e-6, "tokens before IMAGE_START (lead pads, text) saw a later image row"
    assert diff[len(seq.ids):].max() < 1e-6, "another sequence changed"
    assert diff[s:last_img].min() > 1e-4, "earlier span tokens did not see a later IMAGE row"
    # 2) a new id for the text token right after IMAGE_END: nothing up to END may change
    ids = list(seq.ids)
    ids[e + 1] = 2 + (ids[e + 1] - 1) % (VOCAB - 2)
    alt = [replace(chunks[0], ids=ids)] + chunks[1:]
    diff = (_streams(case, alt) - base).abs().flatten(1).amax(-1)
    assert diff[:e + 1].max() < 1e-6, "a span token saw the text after IMAGE_END"
    assert diff[e + 1] > 1e-4
