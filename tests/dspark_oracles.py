"""Plain-loop oracles of the DSpark drafter, written from spec ds4-speculative §3-§5 and ds4-text §2,
§7, §8, independently of ``ds4serve.model.dspark``: one request, one row, one head at a time, from the
test helper's fp32 weights (``dspark_checkpoint``'s ``reference``) and the config dict."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dspark_checkpoint import BLOCK, NOISE_ID

EPS = 1e-6


def rms(x, w=None):
    y = x / torch.sqrt((x * x).mean() + EPS)
    return y if w is None else y * w


def rope(x, pos, c, inverse=False):
    """Interleaved partial RoPE of the last qk_rope_head_dim channels, θ = rope_theta (no YaRN)."""
    rd, hd, theta = c["qk_rope_head_dim"], c["head_dim"], c["rope_theta"]
    out = x.clone()
    for j in range(rd // 2):
        angle = pos * theta ** (-(2 * j) / rd) * (-1 if inverse else 1)
        i = hd - rd + 2 * j
        x0, x1 = float(x[i]), float(x[i + 1])
        out[i], out[i + 1] = x0 * math.cos(angle) - x1 * math.sin(angle), x0 * math.sin(angle) + x1 * math.cos(angle)
    return out


def ring_row_ref(ref, c, s, hidden, pos):
    """§3.4: kv_s = rope(kv_norm_s(wkv_s(main_norm(main_proj(concat hidden))))) at the target position."""
    main_x = rms(ref["mtp.0.main_proj.weight"] @ hidden.reshape(-1), ref["mtp.0.main_norm.weight"])
    return rope(rms(ref[f"mtp.{s}.attn.wkv.weight"] @ main_x, ref[f"mtp.{s}.attn.kv_norm.weight"]), pos, c)


def attention_ref(ref, c, s, x, ring, ring_pos, p, positions):
    """§3.6 for one request, in loops: keys = valid ring rows (written, p - W < pos <= p) then every block
    row (no causal mask); per-head sink in the denominator; scale head_dim^-0.5; inverse RoPE; wo_a in
    o_groups groups, then wo_b."""
    h, hd, w = c["num_attention_heads"], c["head_dim"], c["sliding_window"]
    g, olr = c["o_groups"], c["o_lora_rank"]
    pre = f"mtp.{s}.attn."
    keys = [ring[j] for j in range(w) if ring_pos[j] >= 0 and p - w < ring_pos[j] <= p]
    keys += [rope(rms(ref[pre + "wkv.weight"] @ x[i], ref[pre + "kv_norm.weight"]), positions[i], c)
             for i in range(x.shape[0])]
    rows = []
    for i in range(x.shape[0]):
        qf = ref[pre + "wq_b.weight"] @ rms(ref[pre + "wq_a.weight"] @ x[i], ref[pre + "q_norm.weight"])
        heads = []
        for head in range(h):
            qh = rope(rms(qf[head * hd:(head + 1) * hd]), positions[i], c)
            scores = [float(qh @ k) * hd**-0.5 for k in keys]
            sink = float(ref[pre + "attn_sink"][head])
            top = max(scores + [sink])
            den = sum(math.exp(v - top) for v in scores) + math.exp(sink - top)
            o = sum(math.exp(v - top) / den * k for v, k in zip(scores, keys))
            heads.append(rope(o, positions[i], c, inverse=True))
        flat, per = torch.cat(heads), h * hd // g
        low = torch.cat([ref[pre + "wo_a.weight"][j * olr:(j + 1) * olr] @ flat[j * per:(j + 1) * per]
                         for j in range(g)])
        rows.append(ref[pre + "wo_b.weight"] @ low)
    return torch.stack(rows)


def hc_weights(xs, fn, base, scale, c):
    """ds4-text §7: pre, post and the Sinkhorn-projected comb of one row's streams ``xs [hc, D]``."""
    hc, eps = c["hc_mult"], c["hc_eps"]
    flat = xs.flatten()
    mix = (fn @ flat) / torch.sqrt((flat * flat).mean() + EPS)
    pre = torch.sigmoid(mix[:hc] * scale[0] + base[:hc]) + eps
    if scale.shape[0] == 1:  # hc_head: no post, no comb
        return pre, None, None
    post = 2 * torch.sigmoid(mix[hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = torch.softmax((mix[2 * hc:] * scale[2] + base[2 * hc:]).view(hc, hc), dim=1) + eps
    comb = comb / (comb.sum(0, keepdim=True) + eps)
    for _ in range(c["hc_sinkhorn_iters"] - 1):
        comb = comb / (comb.sum(1, keepdim=True) + eps)
        comb = comb / (comb.sum(0, keepdim=True) + eps)
    return pre, post, comb


def swiglu_ref(x, w1, w3, w2, limit):
    return w2 @ (F.silu((w1 @ x).clamp(max=limit)) * (w3 @ x).clamp(-limit, limit))


def moe_ref(ref, c, s, x):
    """ds4-text §8 for one row, learned routing: bias for selection only, weights renormalised x scale."""
    pre = f"mtp.{s}.ffn."
    score = torch.sqrt(F.softplus(ref[pre + "gate.weight"] @ x))
    idx = torch.topk(score + ref[pre + "gate.bias"], c["num_experts_per_tok"]).indices.tolist()
    total = sum(float(score[e]) for e in idx)
    out = swiglu_ref(x, *(ref[pre + f"shared_experts.{w}.weight"] for w in ("w1", "w3", "w2")), c["swiglu_limit"])
    for e in idx:
        wts = float(score[e]) / total * c["routed_scaling_factor"]
        out = out + wts * swiglu_ref(x, *(ref[pre + f"experts.{e}.{w}.weight"] for w in ("w1", "w3", "w2")),
                                      c["swiglu_limit"])
    return out


def draft_hidden_ref(ref, c, embed, anchor, p, ring_kv, ring_pos):
    """The whole block for one request (spec §3.5-§3.7, ds4-text §2): ``[anchor, noise x (B-1)]`` at
    positions p+1.., streams = 4 copies of the embedding, per stage the two mHC sub-blocks around
    DSparkAttention and the MoE, then hc_head. Returns the pre-norm hidden ``[B, D]``."""
    ids = [anchor] + [NOISE_ID] * (BLOCK - 1)
    positions = [p + 1 + i for i in range(BLOCK)]
    streams = [embed[t].unsqueeze(0).repeat(c["hc_mult"], 1) for t in ids]
    for s in range(len(ring_kv)):
        pre = f"mtp.{s}."
        mixes = [hc_weights(xs, ref[pre + "hc_attn_fn"], ref[pre + "hc_attn_base"], ref[pre + "hc_attn_scale"], c)
                 for xs in streams]
        x = torch.stack([rms(pr @ xs, ref[pre + "attn_norm.weight"]) for (pr, _, _), xs in zip(mixes, streams)])
        y = attention_ref(ref, c, s, x, ring_kv[s], ring_pos, p, positions)
        streams = [post[:, None] * y[i][None, :] + comb.T @ xs for i, ((_, post, comb), xs) in
                   enumerate(zip(mixes, streams))]
        out = []
        for xs in streams:
            pr, post, comb = hc_weights(xs, ref[pre + "hc_ffn_fn"], ref[pre + "hc_ffn_base"],
                                         ref[pre + "hc_ffn_scale"], c)
            y = moe_ref(ref, c, s, rms(pr @ xs, ref[pre + "ffn_norm.weight"]))
            out.append(post[:, None] * y[None, :] + comb.T @ xs)
        streams = out
    last = f"mtp.{len(ring_kv) - 1}."
    return torch.stack([hc_weights(xs, ref[last + "hc_head_fn"], ref[last + "hc_head_base"],
                                    ref[last + "hc_head_scale"], c)[0] @ xs for xs in streams])


def inverse_cdf_ref(q, u):
    total, acc = float(q.double().sum()), 0.0
    for k, v in enumerate(q.double().tolist()):
        acc += v
        if acc > u * total:
            return k
    return q.shape[0] - 1


def chi2(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic with bins of expected count < 5 merged into one."""
    big = expected >= 5
    obs = torch.cat((counts[big], counts[~big].sum().view(1)))
    exp = torch.cat((expected[big], expected[~big].sum().view(1)))
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1
