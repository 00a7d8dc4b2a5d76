"""The DeepSeek-V4 network as modules that hold weights only (parameter names = HF names).

The forward is a function of ``(hidden streams, layer range, BatchView, per-layer state)``: the
engine can run all layers at once, or a pass a few layers at a time (layer slicing), on a flattened
batch of many sequences at different positions. State lives in ``LayerState`` tensors owned by the
engine's cache; the model only reads and writes them through the view's index lists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import AttnKind, ModelConfig
from .attention import block_sink_attention, gather_rows, sink_attention
from .batch import BatchView, LayerState, QueryTile, capture_ring
from .compressor import (block_indexer_scores, finish_rows, indexer_scores, pool_windows, select_top_rows,
                         token_states)
from .mhc import hc_head, hc_post, hc_pre
from .moe import route, run_experts, run_local_experts, swiglu
from .norms import rms_norm, rms_norm_unweighted
from .rope import apply_rope, inverse_frequencies, rotations
from .stored import StoredWeight, dense_weight


def _param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Norm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = _param(dim)


class Linear(nn.Module):
    """Bias-free projection; only holds ``weight [out, in]`` (a parameter, or a ``StoredWeight`` kept at
    the checkpoint's width)."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = _param(d_out, d_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, StoredWeight):
            return self.weight.linear(x)
        return F.linear(x, self.weight)


class HyperConnection(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = (2 + cfg.hc_mult) * cfg.hc_mult
        self.fn = _param(n, cfg.hc_mult * cfg.hidden_size)
        self.base = _param(n)
        self.scale = _param(3)


@dataclass(frozen=True)
class RopeTables:
    """Complex rotations computed once per forward and shared by all layers of that forward."""

    main: torch.Tensor
    compress: torch.Tensor
    emit: dict[tuple[int, bool], torch.Tensor]


class Scorer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weights_proj = Linear(cfg.hidden_size, cfg.index_n_heads)


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer: its own overlapping compressor (width index_head_dim)."""

    def __init__(self, cfg: ModelConfig, ratio: int):
        super().__init__()
        d = cfg.index_head_dim
        self.kv_proj = Linear(cfg.hidden_size, 2 * d)
        self.gate_proj = Linear(cfg.hidden_size, 2 * d)
        self.position_bias = _param(ratio, 2 * d)
        self.kv_norm = Norm(d)
        self.q_b_proj = Linear(cfg.q_lora_rank, cfg.index_n_heads * d)
        self.scorer = Scorer(cfg)


class Compressor(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg = cfg
        self.ratio = cfg.compress_ratios[layer]
        self.overlap = cfg.attn_kinds[layer] is AttnKind.CSA
        width = cfg.head_dim * (2 if self.overlap else 1)
        self.kv_proj = Linear(cfg.hidden_size, width)
        self.gate_proj = Linear(cfg.hidden_size, width)
        self.position_bias = _param(self.ratio, width)
        self.kv_norm = Norm(cfg.head_dim)
        self.indexer = Indexer(cfg, self.ratio) if self.overlap else None

    def emit(self, x, qr, view: BatchView, st: LayerState, rope: RopeTables):
        """Emit closing windows into the pools (and the indexer's); returns the indexer's per-token
        inputs ``(q_idx [T, H, d], head weights [T, H])``, or ``None`` without an indexer."""
        key = (self.ratio, self.overlap)
        snaps = st.snap or {}
        self._emit(x, view, rope, key, self.kv_proj, self.gate_proj, self.position_bias, self.kv_norm,
                   st.comp_ring, st.comp_pool, snaps.get("comp_ring"))
        if self.indexer is None:
            return None
        ix = self.indexer
        self._emit(x, view, rope, key, ix.kv_proj, ix.gate_proj, ix.position_bias, ix.kv_norm,
                   st.idx_ring, st.idx_pool, snaps.get("idx_ring"))
        n_tok = x.shape[0]
        q_idx = apply_rope(ix.q_b_proj(qr).view(n_tok, self.cfg.index_n_heads, -1), rope.compress)
        head_w = ix.scorer.weights_proj(x).float() * (self.cfg.index_n_heads**-0.5)
        return q_idx, head_w

    def gathered(self, rows: torch.Tensor, valid: torch.Tensor, st: LayerState, index_in):
        """Compressed keys per query (``rows``/``valid [G, R]``: its visible pool rows), gathered."""
        if self.indexer is None:
            return gather_rows(st.comp_pool, rows), valid
        q_idx, head_w = index_in
        scores = indexer_scores(q_idx, gather_rows(st.idx_pool, rows), head_w, valid)
        cols, ok = select_top_rows(scores, self.cfg.index_topk)
        return gather_rows(st.comp_pool, rows.gather(1, cols)), ok

    def tile_keys(self, tile: QueryTile, st: LayerState, index_in):
        """A tile's compressed keys: ``(block [R, d], mask [t, R])`` for HCA, where every query sees a
        prefix of the same rows; ``(per-query top-k rows [t, k, d], valid [t, k])`` for CSA, whose
        indexer picks different rows per query (scored against the shared block of indexer rows)."""
        rows, mask = tile.comp_rows[self.ratio], tile.comp_mask[self.ratio]
        if self.indexer is None:
            return st.comp_pool.index_select(0, rows), mask
        q_idx, head_w = index_in
        a, b = tile.start, tile.stop
        scores = block_indexer_scores(q_idx[a:b], st.idx_pool.index_select(0, rows), head_w[a:b], mask)
        cols, ok = select_top_rows(scores, self.cfg.index_topk)
        return gather_rows(st.comp_pool, rows[cols]), ok

    def _emit(self, x, view, rope, key, wkv, wgate, ape, norm, ring, pool, snap=None) -> None:
        ci = view.compress[key]
        states = token_states(x, dense_weight(wkv.weight), dense_weight(wgate.weight), ape, view.positions)
        after = view.rings_after_write
        if after:  # one token per sequence: the ring then holds each closing window whole
            ring.index_copy_(0, ci.ring_dst, states.index_select(0, ci.ring_src))
        if ci.emit_rows.shape[0]:
            slots = gather_rows(ring if after else torch.cat((ring, states)), ci.emit_slots)
            pooled = pool_windows(slots, ci.emit_valid, self.overlap, self.ratio, norm.weight, self.cfg.rms_norm_eps)
            pool.index_copy_(0, ci.emit_rows, finish_rows(pooled, rope.emit[key], pool.dtype))
        if not after:
            if view.captures:
                capture_ring(view.captures.get(self.ratio * (2 if self.overlap else 1)), snap, ring, states)
            ring.index_copy_(0, ci.ring_dst, states.index_select(0, ci.ring_src))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg = cfg
        self.sliding = cfg.attn_kinds[layer] is AttnKind.SLIDING
        h, hd = cfg.num_heads, cfg.head_dim
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_a_norm = Norm(cfg.q_lora_rank)
        self.q_b_proj = Linear(cfg.q_lora_rank, h * hd)
        self.kv_proj = Linear(cfg.hidden_size, hd)
        self.kv_norm = Norm(hd)
        self.o_a_proj = Linear(h * hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.o_b_proj = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size)
        self.sinks = _param(h)
        self.compressor = None if self.sliding else Compressor(cfg, layer)
        # this process's share under tensor parallel (``sharding.py``): heads, output groups, and the
        # sum of the partial outputs over ranks (None: one process holds every head)
        self.n_heads, self.o_groups = h, cfg.o_groups
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, view: BatchView, st: LayerState, rope: RopeTables) -> torch.Tensor:
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        n_tok = x.shape[0]
        rot = rope.main if self.sliding else rope.compress
        qr = rms_norm(self.q_a_proj(x), self.q_a_norm.weight, eps)
        q = rms_norm_unweighted(self.q_b_proj(qr).view(n_tok, self.n_heads, cfg.head_dim), eps)
        q = apply_rope(q, rot)
        kv = apply_rope(rms_norm(self.kv_proj(x), self.kv_norm.weight, eps), rot)
        tiles, g = view.tiles, view.gather_tokens
        # every read of the sliding ring happens before this forward's writes to it
        blocks = [torch.cat((st.swa.index_select(0, t.ring_rows), kv[t.new_start:t.new_stop])) for t in tiles]
        keys = valid = keys_idx = None
        if not tiles or g is not None:
            keys_idx = view.swa_keys if g is None else view.swa_keys.index_select(0, g)
            valid = view.swa_valid if g is None else view.swa_valid.index_select(0, g)
            if not view.rings_after_write:
                keys = gather_rows(torch.cat((st.swa, kv)), keys_idx)
        if view.captures and st.snap:
            capture_ring(view.captures.get(cfg.sliding_window), st.snap.get("swa"), st.swa, kv)
        st.swa.index_copy_(0, view.swa_dst, kv.index_select(0, view.swa_src))
        if keys_idx is not None and keys is None:  # decode rows: the ring now holds exactly their windows
            keys = gather_rows(st.swa, keys_idx)
        index_in = self.compressor.emit(x, qr, view, st, rope) if self.compressor is not None else None
        if not tiles:
            out = self._gathered(q, keys, valid, view, st, index_in, None)
        else:
            out = q.new_empty(q.shape)
            if g is not None:
                out.index_copy_(0, g, self._gathered(q.index_select(0, g), keys, valid, view, st, index_in, g))
            for t, block in zip(tiles, blocks):
                out[t.start:t.stop] = self._tile(q[t.start:t.stop], t, block, st, index_in)
        out = apply_rope(out, rot, inverse=True)
        out = self.o_b_proj(self._grouped_out(out))
        return out if self.reduce is None else self.reduce(out)

    def _gathered(self, q, keys, valid, view: BatchView, st: LayerState, index_in, tokens):
        """Attention of queries (``tokens``, or all) over their own gathered key lists."""
        if self.compressor is not None:
            vis = view.visible[self.compressor.ratio]
            rows, vvalid = (vis.rows, vis.valid) if tokens is None else \
                (vis.rows.index_select(0, tokens), vis.valid.index_select(0, tokens))
            sub = index_in if index_in is None or tokens is None else \
                (index_in[0].index_select(0, tokens), index_in[1].index_select(0, tokens))
            ckeys, cvalid = self.compressor.gathered(rows, vvalid, st, sub)
            return sink_attention(q, keys, valid, self.sinks, self.cfg.head_dim**-0.5, ckeys, cvalid)
        return sink_attention(q, keys, valid, self.sinks, self.cfg.head_dim**-0.5)

    def _tile(self, q, tile: QueryTile, block: torch.Tensor, st: LayerState, index_in):
        """Attention of one tile's queries over its shared sliding block (and compressed rows)."""
        mask, extra, extra_valid = tile.swa_mask, None, None
        if self.compressor is not None:
            ckeys, cvalid = self.compressor.tile_keys(tile, st, index_in)
            if self.compressor.indexer is None:  # shared rows: one block
                block, mask = torch.cat((block, ckeys)), torch.cat((mask, cvalid), dim=1)
            else:
                extra, extra_valid = ckeys, cvalid
        return block_sink_attention(q, block, mask, self.sinks, self.cfg.head_dim**-0.5, extra, extra_valid)

    def _grouped_out(self, out: torch.Tensor) -> torch.Tensor:
        """Block-diagonal ``o_a``: each group of heads is projected by its own slice."""
        g = self.o_groups
        grouped = out.reshape(out.shape[0], g, -1).transpose(0, 1)  # [G, T, H/G * hd]
        w = dense_weight(self.o_a_proj.weight).view(g, self.cfg.o_lora_rank, -1)  # [G, o_lora, H/G * hd]
        return torch.bmm(grouped, w.transpose(1, 2)).transpose(0, 1).reshape(out.shape[0], -1)


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, is_hash: bool):
        super().__init__()
        self.weight = _param(cfg.n_routed_experts, cfg.hidden_size)
        if is_hash:
            self.register_buffer("tid2eid", torch.empty(cfg.vocab_size, cfg.n_experts_per_tok, dtype=torch.long))
        else:
            self.e_score_correction_bias = _param(cfg.n_routed_experts)
        if cfg.vision.enabled:
            self.bias_vl = _param(cfg.n_routed_experts)


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, i, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = _param(e, 2 * i, d)
        self.down_proj = _param(e, d, i)


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        width = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.gate_proj = Linear(cfg.hidden_size, width)
        self.up_proj = Linear(cfg.hidden_size, width)
        self.down_proj = Linear(width, cfg.hidden_size)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg = cfg
        self.is_hash = cfg.hash_layers[layer]
        self.gate = Gate(cfg, self.is_hash)
        self.experts = Experts(cfg)
        self.shared_experts = SharedExpert(cfg) if cfg.n_shared_experts else None
        # under expert parallel this process holds experts [lo, hi) only; ``reduce`` sums the ranks'
        # partial outputs (``sharding.py``)
        self.expert_range: tuple[int, int] | None = None
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, view: BatchView) -> torch.Tensor:
        cfg, g = self.cfg, self.gate
        weights, idx = route(
            x, g.weight, top_k=cfg.n_experts_per_tok, scoring_func=cfg.scoring_func,
            scaling=cfg.routed_scaling_factor, normalize=cfg.norm_topk_prob,
            bias=None if self.is_hash else g.e_score_correction_bias,
            tid2eid=g.tid2eid if self.is_hash else None, ids=view.ids,
            is_image=view.is_image, bias_vl=getattr(g, "bias_vl", None),
        )
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        if self.expert_range is None:
            out = run_experts(x, idx, weights, gate_up, down, cfg.swiglu_limit)
        else:
            out = run_local_experts(x, idx, weights, gate_up, down, cfg.swiglu_limit, self.expert_range)
        if self.shared_experts is not None:
            s = self.shared_experts
            out = out + s.down_proj(swiglu(s.gate_proj(x), s.up_proj(x), cfg.swiglu_limit))
        return out if self.reduce is None else self.reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg = cfg
        self.self_attn = Attention(cfg, layer)
        self.mlp = MoE(cfg, layer)
        self.input_layernorm = Norm(cfg.hidden_size)
        self.post_attention_layernorm = Norm(cfg.hidden_size)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    def forward(self, streams: torch.Tensor, view: BatchView, st: LayerState, rope: RopeTables) -> torch.Tensor:
        cfg = self.cfg
        hc_args = (cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        hc = self.attn_hc
        x, post, comb = hc_pre(streams, hc.fn, hc.base, hc.scale, *hc_args)
        y = self.self_attn(rms_norm(x, self.input_layernorm.weight, cfg.rms_norm_eps), view, st, rope)
        streams = hc_post(y, streams, post, comb)
        hc = self.ffn_hc
        x, post, comb = hc_pre(streams, hc.fn, hc.base, hc.scale, *hc_args)
        y = self.mlp(rms_norm(x, self.post_attention_layernorm.weight, cfg.rms_norm_eps), view)
        return hc_post(y, streams, post, comb)


class HyperHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.hc_fn = _param(cfg.hc_mult, cfg.hc_mult * cfg.hidden_size)
        self.hc_base = _param(cfg.hc_mult)
        self.hc_scale = _param(1)


class Backbone(nn.Module):
    """HF's ``model.`` prefix: embeddings, layers, hc_head and the final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # given its (uninitialised) weight, nn.Embedding skips its random init: that init, run on the meta
        # device while the model is built, imports torch._dynamo (~1 s and ~100 MB resident for nothing)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = Norm(cfg.hidden_size)
        self.hc_head = HyperHead(cfg)


class DS4ForCausalLM(nn.Module):
    """DeepSeek-V4 text model; vision parts attach in ``model/vision.py``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        # the activations' dtype when the embedding table is stored narrower (set by the loader)
        self.compute_dtype: torch.dtype | None = None
        if cfg.vision.enabled:
            # the four learned sentinel vectors of image blocks (spec ds4-vision §3.3), kept in fp32
            for name in ("image_start", "image_pad", "image_newline", "image_end"):
                setattr(self, name, _param(cfg.hidden_size))
        self.register_buffer("inv_freq_main", inverse_frequencies(cfg.rope_main, cfg.rope_dim), persistent=False)
        self.register_buffer("inv_freq_compress", inverse_frequencies(cfg.rope_compress, cfg.rope_dim),
                             persistent=False)

    # ---- the three stages of a forward ---------------------------------------------------------
    def embed(self, view: BatchView) -> torch.Tensor:
        """Token embeddings expanded to ``hc_mult`` streams: ``[T, hc, D]``.

        Image-block tokens carry sentinel ids ``vocab_size + type``: they take the learned sentinel
        vector of their type, and IMAGE slots then receive the aligner rows (spec ds4-vision §3.3).
        """
        ids = view.ids
        widen = (lambda t: t.to(self.compute_dtype)) if self.compute_dtype is not None else (lambda t: t)
        if view.is_image is None:  # a table kept at the checkpoint's width (bf16) has its rows widened
            x = widen(self.model.embed_tokens(ids))
        else:
            x = widen(self.model.embed_tokens(torch.where(view.is_image, torch.zeros_like(ids), ids)))
            kinds = (ids - self.cfg.vocab_size).clamp(0, 4)
            table = torch.stack([self.image_start, self.image_pad, torch.zeros_like(self.image_pad),
                                 self.image_newline, self.image_end]).to(x.dtype)
            x = torch.where(view.is_image.unsqueeze(-1), table.index_select(0, kinds), x)
        if view.image_rows is not None and view.image_embeds is not None:
            x = x.index_copy(0, view.image_rows, view.image_embeds.to(x.dtype))
        return x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()

    def rope_tables(self, view: BatchView) -> RopeTables:
        main = rotations(view.positions, self.inv_freq_main, self.cfg.rope_main.attention_factor)
        af = self.cfg.rope_compress.attention_factor
        comp = rotations(view.positions, self.inv_freq_compress, af)
        emit = {key: rotations(ci.emit_pos, self.inv_freq_compress, af) for key, ci in view.compress.items()}
        return RopeTables(main=main, compress=comp, emit=emit)

    def forward_layers(self, streams: torch.Tensor, view: BatchView, states: Sequence[LayerState],
                       start: int = 0, stop: int | None = None, rope: RopeTables | None = None) -> torch.Tensor:
        """Run layers ``[start, stop)`` on ``streams [T, hc, D]``; state is updated in place."""
        stop = self.cfg.num_layers if stop is None else stop
        rope = rope if rope is not None else self.rope_tables(view)
        for i in range(start, stop):
            streams = self.model.layers[i](streams, view, states[i], rope)
        return streams

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        """fp32 logits for every row of ``streams [N, hc, D]``."""
        cfg, m = self.cfg, self.model
        h = hc_head(streams, m.hc_head.hc_fn, m.hc_head.hc_base, m.hc_head.hc_scale, cfg.hc_eps, cfg.rms_norm_eps)
        h = rms_norm(h, m.norm.weight, cfg.rms_norm_eps)
        return self.lm_head(h).float()
