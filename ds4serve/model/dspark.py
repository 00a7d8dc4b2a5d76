"""The DSpark block drafter's forward, batched over requests (spec ds4-speculative §3-§6).

A drafter (``dspark_weights.DSparkWeights``) keeps no state of its own past blocks: per request it
keeps one private K=V ring per stage (``window`` rows, 128 for DS4), each row a pure function of the
target's hidden at one committed position (§3.4, §6). Two calls:

* ``commit(weights, states, positions, captured, owners)``: the target's captured hidden states of
  committed positions -> ``main_x = main_norm(main_proj(concat))`` -> per stage
  ``rope(kv_norm(wkv(main_x)))`` at the target position, written at ring slot ``pos % window``. Rows are
  written for committed positions only, so rejecting drafts needs no undo of the rings (§4.6, §6).
* ``draft(weights, states, anchors, anchor_positions, head, ...)``: the block ``[anchor, noise x (B-1)]``
  at positions ``p+1 .. p+B`` through every stage in one parallel pass (non-causal inside the block,
  keys = the valid ring rows then the block's own rows, per-head sinks), the last stage's ``hc_head``,
  the trunk's norm-then-head (shared, passed in), then the sequential Markov head and the confidence
  head: ``B`` draft tokens, their draft distributions ``q`` and confidences. Nothing is written.

Batched over requests: every layer runs once on the flattened ``R * B`` rows; only the Markov head
loops, over the ``B`` block slots (each needs the token drawn at the previous slot), never over
requests. The rings of all requests live in one ``DSparkRings`` pool (a request's ``DSparkState`` is a
slot of it), so a batched read is one gather and a commit one scatter, with no host sync.

What the engine must capture
----------------------------
* **Which layers**: the target layers ``config.target_layer_ids`` (``dspark_target_layer_ids``; 0-based
  indices into ``model.model.layers``; DS4: 40, 41, 42), in that order (it is the column order of
  ``main_proj``).
* **Which tensor, where**: the *output* of each such ``DecoderLayer`` (its return value: the 4-stream
  residual ``[T, hc, D]`` after the FFN sub-block's ``hc_post``), averaged over the ``hc`` copies:
  ``streams.float().mean(dim=1)`` -> ``[T, D]`` (``capture_mean``). A plain mean, not ``hc_head``
  (§3.3); the output, not the input (V4.1 captures inputs; DS4-0731 outputs). The native host forward
  runs all layers in one call, so it captures by running the pass as layer slices (``capture_slices``)
  or by a capture added inside it; under tensor parallel the streams are whole on every rank.
* **Stacked**: ``captured [T, L, D]`` with ``L = len(target_layer_ids)`` (or ``[T, L * D]``).
* **For which positions**: row ``t`` is the hidden of the forward row that processed the token at
  position ``t`` (the row whose logits predict position ``t+1``); pass each committed row once, with its
  position and request. Prefill (every chunk): every prompt row (only the last ``window`` per request
  matter; ``commit`` keeps those). A verify pass over ``[anchor, d_1..d_L]`` at ``p+1 .. p+L+1`` that
  accepts ``j`` drafts: rows ``p+1 .. p+1+j`` (the anchor's and the accepted drafts'), never a rejected
  row; a plain decode step (L = 0): its one row. Then ``p`` becomes ``p+1+j`` and the bonus token, at
  ``p+2+j``, is the next anchor. A prefix-cache hit skips the trunk for the cached rows, so their ring
  rows must come from the cache (``DSparkState.snapshot`` / ``restore``) or drafting must wait until
  ``DSparkRings.complete`` (§6).

Decisions where the spec is UNCERTAIN (each one constant or function here)
----------------------------------------------------------------------------
* ``CAPTURE_POINT`` = layer outputs (§3.3/§13: four independent ports agree for 0731; V4.1 differs).
* ``Q_HEAD_NORM`` = True: the per-head weightless RMS norm of q, as the trunk's attention and the
  Tenstorrent V4 port do (§3.6; absent only in the V4.1 reference, a different model).
* ``store_kv``: no FP8 round trip of the K=V rows (§3.4's ``act_quant``): the trunk's sliding ring in
  ``attention.py`` keeps rows in the model dtype too, so drafter and target share one convention.
* ``calibrate_confidence``: no STS temperatures are applied (§3.7: not known to ship in the checkpoint).
* ``ring_valid``: a ring row is visible to the block at anchor position ``p+1`` when it was written and
  its position lies in ``(p - window, p]``. For a contiguously committed history this is exactly the
  reference's ``slot <= min(p, window-1)`` (§11); it also hides stale rows (a reused or half-restored
  ring) instead of trusting them (§6 prefix-cache rule). ``DSparkRings.complete`` tells the engine
  whether all ``min(window, p+1)`` rows are there, to skip drafting until they are.
* Stage routing is learned (``gate.bias`` for selection, §3.7); a stage with ``tid2eid`` is refused at
  load. ``bias_vl`` (DS4V) is loaded but unused: block tokens are text (no drafting in image blocks).
* Sampling draws one uniform per (request, slot) and inverts the CDF of ``q``: an exact draw from ``q``
  (the reference's Gumbel-max is another exact draw). The uniforms come from the caller's generator(s):
  one per request makes a request's drafts independent of its batch (``draft_uniforms``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import sink_attention
from .dspark_weights import DSparkConfig, DSparkWeights
from .mhc import hc_head, hc_post, hc_pre
from .moe import route, run_experts, swiglu
from .norms import rms_norm, rms_norm_unweighted
from .packed import PackedExperts
from .rope import apply_rope, inverse_frequencies, rotations

CAPTURE_POINT = "layer_output"
Q_HEAD_NORM = True
STS_TEMPERATURES: tuple[float, ...] | None = None

# (Markov-corrected logits [R, V] of block slot i, i) -> (tokens [R] drawn from q, q [R, V])
Sampler = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def capture_mean(streams: torch.Tensor) -> torch.Tensor:
    """The captured hidden of one target layer: the plain mean of its output ``[T, hc, D]`` over the
    ``hc`` copies, in fp32 (§3.3)."""
    return streams.float().mean(dim=1)


def capture_slices(target_layer_ids: Sequence[int], num_layers: int) -> list[tuple[int, int]]:
    """Layer ranges ``[start, stop)`` that cover ``0 .. num_layers`` and end right after every target
    layer: run a forward pass as these slices (``DS4ForCausalLM.forward_layers``, or the native forward's
    layer slices) and capture ``capture_mean`` of the streams at the end of each slice whose last layer is
    a target. DS4 (targets 40-42 of 43): ``[(0, 41), (41, 42), (42, 43)]``."""
    cuts = sorted({layer + 1 for layer in target_layer_ids} | {num_layers})
    return list(zip([0] + cuts[:-1], cuts))


def store_kv(kv: torch.Tensor) -> torch.Tensor:
    """The K=V row as stored in a ring and used by the block: unchanged (no FP8 round trip; see above)."""
    return kv


def calibrate_confidence(logit: torch.Tensor, slot: int) -> torch.Tensor:
    """The confidence logit of block slot ``slot`` after calibration: unchanged (no STS shipped)."""
    return logit if STS_TEMPERATURES is None else logit / STS_TEMPERATURES[slot]


@dataclass(frozen=True)
class SharedHead:
    """The trunk's embedding and LM head, which the drafter shares (§2.1, §3.1): ``embed(ids [N]) ->
    [N, D]`` and ``lm_head([N, D]) -> [N, V]``; ``dtype``: what ``lm_head`` takes (None: the drafter's)."""

    embed: Callable[[torch.Tensor], torch.Tensor]
    lm_head: Callable[[torch.Tensor], torch.Tensor]
    dtype: torch.dtype | None = None

    @classmethod
    def from_target(cls, model) -> "SharedHead":
        """The ``DS4ForCausalLM``'s own ``embed_tokens`` and ``lm_head`` (no copies), in its compute dtype."""
        dtype = model.compute_dtype if model.compute_dtype is not None else model.model.embed_tokens.weight.dtype
        return cls(model.model.embed_tokens, model.lm_head, dtype)


class DSparkRings:
    """The private rings of up to ``capacity`` requests: ``kv [capacity + 1, window, stages, head_dim]``
    and the position each row holds, ``pos [capacity + 1, window]`` (-1: empty). The last slot is a
    scratch row that absorbs a commit's dropped rows, so a commit is one scatter without a host sync."""

    def __init__(self, config: DSparkConfig, capacity: int, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):
        self.config, self.capacity = config, capacity
        w, hd = config.window, config.trunk.head_dim
        self.kv = torch.zeros(capacity + 1, w, config.n_stages, hd, device=device, dtype=dtype)
        self.pos = torch.full((capacity + 1, w), -1, dtype=torch.long, device=device)
        self._free = list(range(capacity - 1, -1, -1))

    def new_state(self) -> "DSparkState":
        if not self._free:
            raise RuntimeError(f"all {self.capacity} DSpark ring slots are in use")
        slot = self._free.pop()
        self.pos[slot] = -1
        self.kv[slot] = 0
        return DSparkState(self, slot)

    def release(self, state: "DSparkState") -> None:
        self._free.append(state.slot)

    def complete(self, states: Sequence["DSparkState"], last: torch.Tensor) -> torch.Tensor:
        """``[R]`` bool: each ring holds every row the block after committed position ``last[r]`` may
        see (``min(window, last + 1)`` rows). After a prefix-cache hit, draft only where this holds."""
        slots = _slots(self, states)
        valid = ring_valid(self.pos.index_select(0, slots), last, self.config.window)
        return valid.sum(dim=1) == torch.clamp(last + 1, max=self.config.window)


@dataclass(frozen=True)
class DSparkState:
    """One request's rings: a slot of a ``DSparkRings`` pool."""

    rings: DSparkRings
    slot: int

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of this request's rows and positions (for a prefix-cache entry, or a test)."""
        return self.rings.kv[self.slot].clone(), self.rings.pos[self.slot].clone()

    def restore(self, snap: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.rings.kv[self.slot].copy_(snap[0])
        self.rings.pos[self.slot].copy_(snap[1])


@dataclass(frozen=True)
class DraftResult:
    """Per request ``r`` and block slot ``i`` (slot ``i`` drafts the token at position ``p + 2 + i``):
    ``tokens [R, B]``; ``q [R, B, V]`` the distribution each token was drawn from (one-hot at the argmax
    for greedy rows), for exact rejection sampling; ``logits [R, B, V]`` the Markov-corrected logits
    (before the request's processors and temperature); ``confidence [R, B]`` P(slot i survives | slots < i did) and
    ``survival [R, B]`` their running product (§5.3); ``base_logits [R, B, V]`` and ``hidden [R, B, D]``
    (the pre-norm ``hc_head`` output the confidence reads) for inspection and tests."""

    tokens: torch.Tensor
    q: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor
    survival: torch.Tensor
    base_logits: torch.Tensor
    hidden: torch.Tensor


def ring_valid(ring_pos: torch.Tensor, last: torch.Tensor, window: int) -> torch.Tensor:
    """``[R, W]`` bool: ring rows visible to a block after committed position ``last [R]``."""
    p = last.unsqueeze(1)
    return (ring_pos >= 0) & (ring_pos <= p) & (ring_pos > p - window)


def confident_length(survival: torch.Tensor, threshold: float) -> torch.Tensor:
    """``[R]``: how many leading drafts have survival >= ``threshold`` (DeepSpec's truncation, §5.3)."""
    return (survival >= threshold).long().cumprod(dim=1).sum(dim=1)


def _slots(rings: DSparkRings, states: Sequence[DSparkState]) -> torch.Tensor:
    if any(s.rings is not rings for s in states):
        raise ValueError("DSpark states of one call must share one DSparkRings pool")
    return torch.tensor([s.slot for s in states], dtype=torch.long, device=rings.pos.device)


def _rope_freqs(cfg: DSparkConfig, device) -> torch.Tensor:
    """The stages rotate like the trunk's sliding layers: ``rope_main`` (θ, no YaRN; §3.4)."""
    return inverse_frequencies(cfg.trunk.rope_main, cfg.trunk.rope_dim).to(device)


def compute_dtype(weights: DSparkWeights) -> torch.dtype:
    """The drafter's activations: the dtype its projections were loaded in (rings may be wider)."""
    return weights.stages[0]["attn.wq_a.weight"].dtype


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w.to(x.dtype))


def commit(weights: DSparkWeights, states: Sequence[DSparkState], positions: torch.Tensor,
           captured: torch.Tensor, owners: torch.Tensor) -> None:
    """Write ring rows for committed positions. ``positions [N]``, ``captured [N, L, D]`` (or
    ``[N, L * D]``), ``owners [N]`` the index into ``states`` of each row. Per request, only its last
    ``window`` rows of this call are kept, and a row never replaces one of a later position; positions
    must be distinct per request within one call."""
    if not states or positions.shape[0] == 0:
        return
    cfg, st0 = weights.config, weights.stages[0]
    width = len(cfg.target_layer_ids) * cfg.trunk.hidden_size
    if captured.shape[0] != positions.shape[0] or math.prod(captured.shape[1:]) != width:
        raise ValueError(f"captured must be [N = {positions.shape[0]}, {len(cfg.target_layer_ids)}, "
                         f"{cfg.trunk.hidden_size}] (one HC-mean row per dspark_target_layer_ids entry), "
                         f"got {list(captured.shape)}")
    rings = states[0].rings
    slots = _slots(rings, states).index_select(0, owners)
    eps, w = cfg.trunk.rms_norm_eps, cfg.window
    flat = captured.reshape(captured.shape[0], -1).to(compute_dtype(weights))
    main_x = rms_norm(_linear(flat, st0["main_proj.weight"]), st0["main_norm.weight"], eps)
    rot = rotations(positions, _rope_freqs(cfg, positions.device))
    rows = torch.stack([store_kv(apply_rope(rms_norm(_linear(main_x, st["attn.wkv.weight"]), st["attn.kv_norm.weight"],
                                                     eps), rot)) for st in weights.stages], dim=1)  # [N, S, hd]
    newest = torch.full((len(states),), -1, dtype=torch.long, device=positions.device)
    newest = newest.scatter_reduce(0, owners, positions, reduce="amax")
    ring_row = positions % w
    keep = (positions > newest.index_select(0, owners) - w) & (positions >= rings.pos[slots, ring_row])
    dest = torch.where(keep, slots * w + ring_row, torch.full_like(slots, rings.capacity * w))  # else: scratch
    rings.kv.view(-1, cfg.n_stages, rows.shape[-1]).index_copy_(0, dest, rows.to(rings.kv.dtype))
    rings.pos.view(-1).index_copy_(0, dest, torch.where(keep, positions, torch.full_like(positions, -1)))


def draft(weights: DSparkWeights, states: Sequence[DSparkState], anchors: torch.Tensor,
          anchor_positions: torch.Tensor, head: SharedHead, temperature: torch.Tensor | float | None = None,
          generator: torch.Generator | Sequence[torch.Generator] | None = None,
          logits_processor: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
          sampler: Sampler | None = None) -> DraftResult:
    """Draft one block per request. ``anchors [R]``: the token the target sampled last, at position
    ``anchor_positions [R]`` (= p + 1; the rings hold rows <= p). Reads the rings, writes nothing.

    Sampling, built in: ``temperature`` ``[R]`` or a float, rows with temperature <= 0 (or None) drafting
    greedily; ``generator`` one per request, or one for the batch, needed when any row samples (when
    given, ``B`` uniforms per request are drawn whatever the temperature, so a generator advances the same
    way for every draft); ``logits_processor(logits [R, V], slot)`` the request's own processors (top-k,
    grammar masks...) applied to the corrected logits before temperature, so ``q`` is the distribution
    tokens are drawn from. Or the engine's own: ``sampler(logits [R, V], slot) -> (tokens [R], q [R, V])``
    (e.g. ``engine.spec_verify``'s ``draft_probs`` then ``draw_drafts``, keyed by request seed and
    position), in which case the three arguments above must be left unset."""
    if sampler is not None and (temperature is not None or generator is not None or logits_processor is not None):
        raise ValueError("pass either sampler or temperature / generator / logits_processor, not both")
    cfg = weights.config
    rings = states[0].rings
    n_req, b = anchors.shape[0], cfg.block_size
    device = rings.kv.device
    slots = _slots(rings, states)
    ids = torch.full((n_req, b), cfg.noise_token_id, dtype=torch.long, device=device)
    ids[:, 0] = anchors
    pos = anchor_positions.unsqueeze(1) + torch.arange(b, device=device)
    ring_kv = rings.kv.index_select(0, slots)  # [R, W, S, hd]
    valid = ring_valid(rings.pos.index_select(0, slots), anchor_positions - 1, cfg.window)
    rot = rotations(pos.reshape(-1), _rope_freqs(cfg, device))
    x = head.embed(ids.reshape(-1)).to(compute_dtype(weights))
    streams = x.unsqueeze(1).expand(-1, cfg.trunk.hc_mult, -1).contiguous()
    for s, st in enumerate(weights.stages):
        streams = stage_block(cfg, st, streams, ring_kv[:, :, s], valid, rot, ids.reshape(-1))
    last = weights.stages[-1]
    tc = cfg.trunk
    h = hc_head(streams, last["hc_head_fn"], last["hc_head_base"], last["hc_head_scale"], tc.hc_eps, tc.rms_norm_eps)
    normed = rms_norm(h, last["norm.weight"], tc.rms_norm_eps)
    base = head.lm_head(normed.to(head.dtype or normed.dtype)).float().view(n_req, b, -1)
    if sampler is None:
        sampler = temperature_sampler(temperature, generator, logits_processor, n_req, b, device)
    return markov_sample(weights, base, h.view(n_req, b, -1), anchors, sampler)


def stage_block(cfg: DSparkConfig, st: dict[str, torch.Tensor], streams: torch.Tensor, ring_kv: torch.Tensor,
                valid: torch.Tensor, rot: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """One stage (a V4 block) on the flattened block rows ``streams [R*B, hc, D]``: mHC, DSparkAttention
    over ``ring_kv [R, W, hd]`` (``valid [R, W]``) and the block, mHC, learned-routing MoE."""
    tc = cfg.trunk
    hc_args = (tc.hc_sinkhorn_iters, tc.hc_eps, tc.rms_norm_eps)
    x, post, comb = hc_pre(streams, st["hc_attn_fn"], st["hc_attn_base"], st["hc_attn_scale"], *hc_args)
    y = stage_attention(cfg, st, rms_norm(x, st["attn_norm.weight"], tc.rms_norm_eps), ring_kv, valid, rot)
    streams = hc_post(y, streams, post, comb)
    x, post, comb = hc_pre(streams, st["hc_ffn_fn"], st["hc_ffn_base"], st["hc_ffn_scale"], *hc_args)
    y = stage_moe(cfg, st, rms_norm(x, st["ffn_norm.weight"], tc.rms_norm_eps), ids)
    return hc_post(y, streams, post, comb)


def stage_attention(cfg: DSparkConfig, st: dict[str, torch.Tensor], x: torch.Tensor, ring_kv: torch.Tensor,
                    valid: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """DSparkAttention (§3.6) of ``x [R*B, D]`` (normed): every query of request r sees the same keys,
    r's valid ring rows then all B block rows (no causal mask), plus a per-head sink; -> ``[R*B, D]``."""
    tc = cfg.trunk
    n_req, b, eps = ring_kv.shape[0], cfg.block_size, tc.rms_norm_eps
    qr = rms_norm(_linear(x, st["attn.wq_a.weight"]), st["attn.q_norm.weight"], eps)
    q = _linear(qr, st["attn.wq_b.weight"]).view(n_req * b, tc.num_heads, tc.head_dim)
    if Q_HEAD_NORM:
        q = rms_norm_unweighted(q, eps)
    q = apply_rope(q, rot)
    kv = store_kv(apply_rope(rms_norm(_linear(x, st["attn.wkv.weight"]), st["attn.kv_norm.weight"], eps), rot))
    keys = torch.cat((ring_kv.to(kv.dtype), kv.view(n_req, b, -1)), dim=1)  # [R, W + B, hd]
    ok = torch.cat((valid, valid.new_ones(n_req, b)), dim=1)
    out = sink_attention(q, keys.repeat_interleave(b, dim=0), ok.repeat_interleave(b, dim=0), st["attn.attn_sink"],
                         tc.head_dim**-0.5)
    out = apply_rope(out, rot, inverse=True)
    g = tc.o_groups
    grouped = out.reshape(out.shape[0], g, -1).transpose(0, 1)  # [G, N, H/G * hd]
    w_a = st["attn.wo_a.weight"].to(out.dtype).view(g, tc.o_lora_rank, -1)
    low = torch.bmm(grouped, w_a.transpose(1, 2)).transpose(0, 1).reshape(out.shape[0], -1)
    return _linear(low, st["attn.wo_b.weight"])


def stage_moe(cfg: DSparkConfig, st: dict[str, torch.Tensor], x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The stage's MoE: learned top-k routing (bias for selection only) plus the shared expert."""
    tc = cfg.trunk
    weights, idx = route(x, st["ffn.gate.weight"], top_k=cfg.n_activated_experts, scoring_func=tc.scoring_func,
                         scaling=tc.routed_scaling_factor, normalize=tc.norm_topk_prob, bias=st["ffn.gate.bias"],
                         tid2eid=None, ids=ids)
    out = run_experts(x, idx, weights, _experts(st["experts.gate_up"], x.dtype), _experts(st["experts.down"], x.dtype),
                      tc.swiglu_limit)
    if "ffn.shared_experts.w1.weight" in st:
        gate, up = _linear(x, st["ffn.shared_experts.w1.weight"]), _linear(x, st["ffn.shared_experts.w3.weight"])
        out = out + _linear(swiglu(gate, up, tc.swiglu_limit), st["ffn.shared_experts.w2.weight"])
    return out


def _experts(stack, dtype: torch.dtype):
    """A dequantised stack in the compute dtype; a ``PackedExperts`` as it is (it dequantises per step)."""
    return stack if isinstance(stack, PackedExperts) else stack.to(dtype)


def _temperatures(temperature, n_req: int, device) -> torch.Tensor:
    if temperature is None:
        return torch.zeros(n_req, device=device)
    if isinstance(temperature, (int, float)):
        return torch.full((n_req,), float(temperature), device=device)
    return temperature.to(device=device, dtype=torch.float32).reshape(n_req)


def draft_uniforms(generator, n_req: int, b: int, device) -> torch.Tensor:
    """``[R, B]`` uniforms in [0, 1): from one generator for the batch (row-major), or ``B`` from each
    request's own generator (a loop over requests for the random draws only)."""
    if isinstance(generator, torch.Generator):
        return torch.rand(n_req, b, generator=generator, device=generator.device).to(device)
    if len(generator) != n_req:
        raise ValueError(f"{len(generator)} generators for {n_req} requests")
    return torch.stack([torch.rand(b, generator=g, device=g.device).to(device) for g in generator])


def temperature_sampler(temperature, generator, logits_processor, n_req: int, b: int, device) -> Sampler:
    """The built-in ``Sampler``: ``q = softmax(processed logits / T)`` and a draw from it by inverse CDF
    with one uniform per (request, slot); greedy rows (T <= 0): the argmax and a one-hot ``q``."""
    temps = _temperatures(temperature, n_req, device)
    if generator is None and temperature is not None and bool((temps > 0).any()):  # sync-ok: an argument check
        raise ValueError("sampled drafting (temperature > 0) needs a torch.Generator")
    uniforms = None if generator is None else draft_uniforms(generator, n_req, b, device)
    greedy = (temps <= 0).unsqueeze(1)
    safe_t = torch.where(greedy, torch.ones_like(temps.unsqueeze(1)), temps.unsqueeze(1))

    def step(logits: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if logits_processor is not None:
            logits = logits_processor(logits, i)
        top = logits.argmax(dim=-1)
        q = torch.softmax(logits / safe_t, dim=-1)
        tok = top if uniforms is None else torch.where(greedy[:, 0], top, inverse_cdf(q, uniforms[:, i]))
        return tok, torch.where(greedy, F.one_hot(top, logits.shape[-1]).to(q.dtype), q)

    return step


def markov_sample(weights: DSparkWeights, base: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor,
                  sampler: Sampler) -> DraftResult:
    """The Markov head and the confidence head, left to right over the block slots (§3.7):
    ``m_i = w1[prev_i]``, ``logits_i = U_i + w2 m_i``, ``(tok_i, q_i) = sampler(logits_i, i)``,
    ``c_i = sigmoid(w_c [h_i ; m_i])``, ``prev_0 = anchor``, ``prev_{i+1} = tok_i`` (the token drawn)."""
    last = weights.stages[-1]
    w1, w2 = last["markov_head.markov_w1.weight"].float(), last["markov_head.markov_w2.weight"].float()
    wc = last["confidence_head.proj.weight"].float()
    prev = anchors
    toks, qs, outs, confs = [], [], [], []
    for i in range(base.shape[1]):
        m = w1.index_select(0, prev)  # [R, r]
        logits = base[:, i] + F.linear(m, w2)
        tok, q = sampler(logits, i)
        conf = torch.sigmoid(calibrate_confidence(F.linear(torch.cat((hidden[:, i].float(), m), dim=-1), wc)[:, 0], i))
        for acc, value in ((toks, tok), (qs, q), (outs, logits), (confs, conf)):
            acc.append(value)
        prev = tok
    confidence = torch.stack(confs, dim=1)
    return DraftResult(torch.stack(toks, dim=1), torch.stack(qs, dim=1), torch.stack(outs, dim=1), confidence,
                       torch.cumprod(confidence, dim=1), base, hidden)


def inverse_cdf(q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row of ``q [R, V]`` from uniforms ``u [R]``: the first token whose cumulative mass
    exceeds ``u`` times the total (a token of zero mass is never drawn)."""
    cdf = q.cumsum(dim=-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1).contiguous(), right=True).squeeze(1)
    return idx.clamp(max=q.shape[-1] - 1)
