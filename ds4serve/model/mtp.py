"""The serial MTP drafter of DeepSeek-V4-Flash (``mtp.0.*``) as a batched torch module (issue 28;
contract: ``shared/spec/ds4-speculative.md`` §2, §4-§7).

One extra V4 block (layer index ``num_layers``, 43 on Flash) that mixes the target's residual at position
``t`` with the embedding of token ``t+1`` and predicts token ``t+2``. Chained ``k`` times it drafts ``k``
tokens (§2.2 step 6). Its weights load in ``mtp_weights.py``; this file is the module and the forward.

The forward of one MTP row (spec §2.2), for the pair ``(X, tok)`` at position ``pos``:

1. ``e = enorm(embed(tok))`` (the target's embedding table, shared);
2. ``H = hnorm(X)``, each of the ``hc`` streams normed separately;
3. ``x = e_proj(e) + h_proj(H)``, ``e_proj(e)`` broadcast over the streams;
4. ``x = Block(x, pos)``: the target's own ``DecoderLayer`` class, built for a sliding-only layer with
   learned routing (``block_config``), over the drafter's private SWA ring (window ``sliding_window``,
   RoPE ``rope_main``, no compressor, no indexer);
5. ``logits = head(norm(hc_head(x)))`` with the block's own ``norm`` / ``hc_head`` and the target's head.

Cost note: a row's K=V depends on its own pair only, so ``commit`` computes the last ``W`` rows of each
request and no more (a long prompt costs ``W`` rows); it runs the whole block for them although only the
K=V is kept (a K=V-only path would skip their attention and MoE).

State (``MTPState``, one per request): the block's K=V ring ``[W, head_dim]`` (slot ``pos % W``), the
target residual at the last committed position (the ``X`` of the next row), and position bookkeeping. The
ring holds rows of *committed* positions only: ``commit`` writes them; ``draft`` runs on a scratch copy of
the rings (its chained steps see their own rows, as the peers' MTP caches do), which is dropped when the
call returns, so a rejection needs no rollback at all (spec §6: "never append rejected rows").

Row positions. The MTP row at position ``t`` is computed from the pair ``(X_{t-1}, tok[t])``: the target's
residual at ``t-1`` and the token at ``t`` (spec §2.2 "pos = t+1" for the pair ``(X_t, tok[t+1])``). A
state that starts at position ``s`` (0 for a fresh prompt) therefore has rows from ``s+1`` on: the token
at ``s`` has no residual before it.

What the engine must capture
----------------------------
* **Tensor**: the target's *pre-``hc_head`` residual streams*, ``[T, hc_mult, hidden_size]`` in the model
  dtype: the value ``DS4ForCausalLM.forward_layers(streams, view, states, 0, num_layers)`` returns (the
  output of the last decoder layer), i.e. the ``streams`` the engine passes to ``DS4ForCausalLM.logits``,
  *before* ``hc_head`` collapses them. Not the collapsed ``[T, D]`` row, not the normed row, not a mean
  of the streams (xLLM #1952: anything else lowers acceptance). In ``engine/executor.py`` that is the
  whole-view result of ``_forward`` / ``_segment`` (torch) or ``host.forward`` (native), taken before
  ``_execute`` keeps only the rows it samples: the MTP needs every committed row, not only the last.
* **Rows**: every *committed* target position, in order, with the token that was the input at that
  position: all prompt positions of a prefill chunk (only the last ``sliding_window`` + 1 matter, but
  passing all is correct), and after a verify pass of ``[anchor, d_1..d_L]`` the rows of the anchor and
  of the ``j`` accepted drafts (rows ``0..j``), never rows of rejected drafts. Under layer slicing or
  tiled prefill, the capture point is after the last layer of the pass that finishes the stack.
* **Calls**: ``commit(states, positions, tokens, hidden)`` with those rows (positions contiguous from
  ``state.next_pos``), then ``draft(states, anchor, k, ...)`` with the token the target just sampled
  (the bonus, sitting at ``state.next_pos``). ``draft`` returns ``k`` tokens for positions
  ``next_pos+1 .. next_pos+k``, their q and a confidence.
* **Prefix-cache hits** (spec §6): a hit restores the target but not this ring. Start the request's
  state at the first position the target recomputes (``MTPState.new(..., start=h)``): the ring then has
  no rows before ``h+1`` and the drafts of the next ``W`` steps see a short window (lower acceptance,
  never wrong tokens: verification is exact). Recomputing the last ``W`` prompt positions avoids that.

Decisions where the spec is UNCERTAIN or silent (the one place in code: ``DECISIONS`` below)
-----------------------------------------------------------------------------------------------
* ``row_position``: the pair ``(X_t, tok[t+1])`` runs at position ``t+1`` (spec §2.2 step 4). The spec
  also says vLLM zeroes the embedding input "at position 0", which only means something if vLLM indexes
  the pair by ``t``. RoPE is relative and the block attends only to its own ring, so that shift changes
  nothing but the zeroing; under ``t+1`` no row sits at position 0 and nothing is zeroed (the spec's
  text, and the first row keeps its token).
* ``feedback``: a chained step feeds the block's pre-``hc_head`` output ``[hc, D]`` back as ``X`` (§2.2
  step 6; the Ascend experiment that fed something else is marked UNCERTAIN and was rejected upstream).
* ``confidence``: ``max softmax(raw logits)`` at temperature 1, whatever the request's temperature: the
  drafter's own belief (q is one-hot for greedy requests, so q's max would always be 1).
* ``draft_rows_visible``: chained steps attend to the rows of earlier steps of the same call (like
  vLLM's and MLX's MTP caches); they never survive the call.
* ``activation_quant``: no FP8 activation quantisation of the ring rows (the target's torch forward
  does none either; the block is the target's layer class, so both stay in step).
* ``images``: text only. The Flash preview that ships MTP has no vision tower; an image sentinel id would
  index past the embedding table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import AttnKind, ModelConfig, VisionConfig
from .batch import BatchView, LayerState
from .decoder import DecoderLayer, DS4ForCausalLM, HyperHead, Linear, Norm, RopeTables
from .mhc import hc_head
from .norms import rms_norm
from .rope import rotations

DECISIONS = {
    "row_position": "the pair (X_t, tok[t+1]) runs at position t+1; no row at position 0, nothing zeroed",
    "feedback": "chained steps feed the block's pre-hc_head output [hc, D] back as X",
    "confidence": "max softmax(raw logits) at temperature 1",
    "draft_rows_visible": "a chained step sees the rows of earlier steps of the same draft call only",
    "activation_quant": "none (as the target's torch forward)",
    "images": "text only",
}

# sampler(step, logits [R, V] fp32) -> (tokens [R] long, q [R, V] fp32): the engine's own draw, e.g.
# counter-based seeds keyed by (request, output index) as in engine/spec_verify.py
Sampler = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def block_config(cfg: ModelConfig) -> ModelConfig:
    """The target config extended by one layer, the MTP block: sliding-only (``compress_ratios[43] =
    0``), learned routing with ``gate.bias`` (layer 43 >= ``num_hash_layers``), text only."""
    return dataclasses.replace(
        cfg, num_layers=cfg.num_layers + 1, attn_kinds=cfg.attn_kinds + (AttnKind.SLIDING,),
        compress_ratios=cfg.compress_ratios + (0,), hash_layers=cfg.hash_layers + (False,), vision=VisionConfig())


class MTPBlock(nn.Module):
    """The ``mtp.0.*`` weights (module names; ``mtp_weights.py`` maps the release names onto them)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.hidden_size
        self.enorm = Norm(d)
        self.hnorm = Norm(d)
        self.e_proj = Linear(d, d)
        self.h_proj = Linear(d, d)
        self.norm = Norm(d)
        self.hc_head = HyperHead(cfg)
        self.block = DecoderLayer(block_config(cfg), cfg.num_layers)


@dataclass
class MTPState:
    """One request's drafter state. ``ring [W, head_dim]``: K=V rows of committed positions, slot ``pos %
    W``; ``next_pos``: the next target position ``commit`` takes; ``first_row``: the first position with a
    row; ``prev_hidden [hc, D]``: the target residual at ``next_pos - 1`` (None before the first commit)."""

    ring: torch.Tensor
    next_pos: int
    first_row: int
    prev_hidden: torch.Tensor | None = None

    @classmethod
    def new(cls, drafter: "MTPDrafter", start: int = 0) -> "MTPState":
        cfg = drafter.cfg
        ring = torch.zeros(cfg.sliding_window, cfg.head_dim, dtype=drafter.dtype, device=drafter.device)
        return cls(ring=ring, next_pos=start, first_row=start + 1)


@dataclass(frozen=True)
class MTPDraft:
    """``tokens [R, k]``, ``q [R, k, V]`` (the distribution each token was drawn from: one-hot for greedy
    rows), ``confidence [R, k]`` (``DECISIONS["confidence"]``)."""

    tokens: torch.Tensor
    q: torch.Tensor
    confidence: torch.Tensor


@dataclass(frozen=True)
class _Rows:
    """One forward's rows per request: ``start`` (position of its first row), ``count``, ``first_row``."""

    start: list[int]
    count: list[int]
    first_row: list[int]


def _view(rows: _Rows, ids: torch.Tensor, window: int, device: torch.device) -> tuple[BatchView, torch.Tensor]:
    """The ``BatchView`` of rows over the requests' rings stacked ``[R * W, d]`` (request r at rows ``r*W``):
    a query at ``pos`` sees positions ``(pos - W, pos]``, from the ring below the forward's first row
    (valid from ``first_row``), from this forward's rows above; the last ``W`` rows of a request are
    written to its ring. Host integer arithmetic, moved to ``device`` once. Returns ``(view, positions)``."""
    n_req = len(rows.count)
    count = torch.tensor(rows.count)
    req = torch.repeat_interleave(torch.arange(n_req), count)
    offset = (torch.cumsum(count, 0) - count)[req]
    start, first = torch.tensor(rows.start)[req], torch.tensor(rows.first_row)[req]
    pos = start + torch.arange(req.shape[0]) - offset
    key_pos = pos.unsqueeze(1) - window + 1 + torch.arange(window)  # [T, W]
    new = key_pos >= start.unsqueeze(1)
    keys = torch.where(new, n_req * window + offset.unsqueeze(1) + key_pos - start.unsqueeze(1),
                       req.unsqueeze(1) * window + key_pos.remainder(window))
    valid = new | ((key_pos >= first.unsqueeze(1)) & (key_pos >= 0))
    keys = torch.where(valid, keys, torch.zeros_like(keys))  # padding points at row 0
    written = pos > start + count[req] - 1 - window  # a request's last W rows only (no duplicate slots)
    dst = (req * window + pos.remainder(window))[written]
    src = torch.arange(req.shape[0])[written]
    dev = lambda t: t.to(device)  # noqa: E731
    view = BatchView(ids=ids, positions=dev(pos), swa_keys=dev(keys), swa_valid=dev(valid), swa_dst=dev(dst),
                     swa_src=dev(src))
    return view, view.positions


class MTPDrafter:
    """The MTP block bound to its target (shared embedding and LM head, RoPE tables): ``commit`` and
    ``draft`` are batched over requests (one flattened forward per call / per chained step)."""

    def __init__(self, target: DS4ForCausalLM, block: MTPBlock):
        self.target, self.block, self.cfg = target, block, target.cfg
        self.dtype = block.e_proj.weight.dtype
        self.device = block.e_proj.weight.device

    # ---- the forward of one batch of rows ---------------------------------------------------------
    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.target.model.embed_tokens(tokens)
        return x.to(self.dtype)

    def forward_rows(self, hidden: torch.Tensor, tokens: torch.Tensor, rows: _Rows,
                     ring: torch.Tensor) -> torch.Tensor:
        """Rows of pairs ``(hidden [N, hc, D], tokens [N])`` -> the block's output ``[N, hc, D]``
        (pre-``hc_head``); ``ring [R * W, head_dim]`` is read and written in place."""
        cfg, b, eps = self.cfg, self.block, self.cfg.rms_norm_eps
        view, positions = _view(rows, tokens, cfg.sliding_window, self.device)
        e = rms_norm(self._embed(tokens), b.enorm.weight, eps)
        h = rms_norm(hidden.to(self.dtype), b.hnorm.weight, eps)  # per stream: the norm is over D
        x = b.e_proj(e).unsqueeze(1) + b.h_proj(h)
        rot = rotations(positions, self.target.inv_freq_main, cfg.rope_main.attention_factor)
        return b.block(x.contiguous(), view, LayerState(swa=ring), RopeTables(main=rot, compress=rot, emit={}))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits of block outputs ``x [N, hc, D]``: own ``hc_head`` and ``norm``, the target's head."""
        cfg, b = self.cfg, self.block
        h = hc_head(x, b.hc_head.hc_fn, b.hc_head.hc_base, b.hc_head.hc_scale, cfg.hc_eps, cfg.rms_norm_eps)
        return self.target.lm_head(rms_norm(h, b.norm.weight, cfg.rms_norm_eps)).float()

    # ---- committed rows ---------------------------------------------------------------------------
    @torch.no_grad()
    def commit(self, states: Sequence[MTPState], positions: Sequence[Sequence[int] | int],
               tokens: Sequence[torch.Tensor], hidden: Sequence[torch.Tensor]) -> None:
        """Append committed target positions: per request, ``positions`` (contiguous from
        ``state.next_pos``; an int is the first of ``len(tokens[r])``), ``tokens [n]`` (the input token at
        each position) and ``hidden [n, hc, D]`` (the target's pre-``hc_head`` residual at each position).
        Writes the rows ``(X_{t-1}, tok[t])`` into each ring and keeps ``X`` of the last position."""
        pairs_h, pairs_t, rows, live = [], [], _Rows([], [], []), []
        for st, pos, tok, hid in zip(states, positions, tokens, hidden, strict=True):
            n = _check_commit(st, pos, tok, hid, self.cfg)
            if n == 0:
                continue
            if st.prev_hidden is None:  # DECISIONS["row_position"]: the first position has no row
                h_in, t_in, first = hid[:-1], tok[1:], st.next_pos + 1
            else:
                h_in, t_in, first = torch.cat((st.prev_hidden.unsqueeze(0), hid[:-1].to(st.prev_hidden.dtype))), \
                    tok, st.next_pos
            st.prev_hidden = hid[-1].to(self.dtype).clone()
            st.next_pos += n
            cut = max(int(t_in.shape[0]) - self.cfg.sliding_window, 0)  # a row's K=V needs only its pair:
            h_in, t_in, first = h_in[cut:], t_in[cut:], first + cut  # rows older than W are never read
            if t_in.shape[0]:
                pairs_h.append(h_in), pairs_t.append(t_in), live.append(st)
                rows.start.append(first), rows.count.append(int(t_in.shape[0])), rows.first_row.append(st.first_row)
        if not live:
            return
        ring = torch.cat([st.ring for st in live])
        self.forward_rows(torch.cat(pairs_h), torch.cat(pairs_t).to(self.device), rows, ring)
        for r, st in enumerate(live):
            st.ring.copy_(ring[r * self.cfg.sliding_window:(r + 1) * self.cfg.sliding_window])

    # ---- drafts ----------------------------------------------------------------------------------
    @torch.no_grad()
    def draft(self, states: Sequence[MTPState], anchor: torch.Tensor, k: int,
              generator: torch.Generator | Sequence[torch.Generator] | None = None,
              greedy: bool | Sequence[bool] = True, temperature: float | Sequence[float] = 1.0,
              sampler: Sampler | None = None) -> MTPDraft:
        """``k`` chained MTP steps per request from ``anchor [R]`` (the token at ``state.next_pos``).
        Step ``i`` (1-based) runs the pair ``(X, token)`` at ``next_pos + i - 1``: first ``(prev_hidden,
        anchor)``, then ``(block output of step i-1, d_{i-1})``; it yields ``d_i`` for position
        ``next_pos + i``. Greedy rows take the argmax (q one-hot); sampled rows draw from ``q =
        softmax(logits / T)`` with their generator (one for all rows, or one per row), or ``sampler``
        decides both. The states are not changed."""
        n_req = len(states)
        if any(st.prev_hidden is None for st in states):
            raise ValueError("draft needs a committed position per request: call commit first")
        picker = _Picker(n_req, generator, greedy, temperature, self.device, sampler)
        if n_req == 0 or k == 0:
            empty = torch.empty(n_req, 0, device=self.device)
            return MTPDraft(empty.long(), empty.unsqueeze(-1).expand(n_req, 0, self.cfg.vocab_size).float(), empty)
        ring = torch.cat([st.ring for st in states])  # scratch: dropped on return, the states keep theirs
        x = torch.stack([st.prev_hidden for st in states])
        tok = anchor.to(self.device).long().reshape(n_req)
        out_t, out_q, out_c = [], [], []
        for i in range(k):
            rows = _Rows([st.next_pos + i for st in states], [1] * n_req, [st.first_row for st in states])
            x = self.forward_rows(x, tok, rows, ring)  # writes the scratch: DECISIONS["draft_rows_visible"]
            tok, q, conf = picker(i, self.logits(x))  # x feeds the next step: DECISIONS["feedback"]
            out_t.append(tok), out_q.append(q), out_c.append(conf)
        return MTPDraft(torch.stack(out_t, 1), torch.stack(out_q, 1), torch.stack(out_c, 1))


def _check_commit(st: MTPState, pos: Sequence[int] | int, tok: torch.Tensor, hid: torch.Tensor,
                  cfg: ModelConfig) -> int:
    """The number of positions a request commits; a caller's mistake (gap, overlap, shapes) is an error."""
    n = int(tok.shape[0])
    pos = range(pos, pos + n) if isinstance(pos, int) else pos
    if len(pos) != n or tuple(hid.shape) != (n, cfg.hc_mult, cfg.hidden_size):
        raise ValueError(f"commit: {len(pos)} positions, {n} tokens and hidden {list(hid.shape)} do not match "
                         f"(hidden must be [n, hc_mult={cfg.hc_mult}, hidden_size={cfg.hidden_size}])")
    if n and list(pos) != list(range(st.next_pos, st.next_pos + n)):
        raise ValueError(f"commit: positions must continue from {st.next_pos} without gaps, got "
                         f"{list(pos)[:4]}...")
    return n


class _Picker:
    """Draws each chained step's tokens: argmax for greedy rows, ``q = softmax(logits / T)`` and a draw
    with the row's generator otherwise (or the engine's ``sampler``); confidence per ``DECISIONS``."""

    def __init__(self, n_req: int, generator, greedy, temperature, device: torch.device, sampler: Sampler | None):
        self.greedy = [greedy] * n_req if isinstance(greedy, bool) else list(greedy)
        temps = [float(temperature)] * n_req if isinstance(temperature, (int, float)) else list(temperature)
        if len(self.greedy) != n_req or len(temps) != n_req:
            raise ValueError(f"draft: greedy / temperature need one value per request ({n_req})")
        if any(t <= 0 for t, g in zip(temps, self.greedy) if not g):
            raise ValueError("draft: a sampled (non-greedy) request needs a temperature > 0")
        self.temps = torch.tensor(temps, dtype=torch.float32, device=device).unsqueeze(1)
        self.generator, self.sampler = generator, sampler
        self.mask = torch.tensor(self.greedy, device=device).unsqueeze(1)

    def __call__(self, step: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        conf = torch.softmax(logits, dim=-1).amax(-1)  # DECISIONS["confidence"]
        if self.sampler is not None:
            tok, q = self.sampler(step, logits)
            return tok.long(), q.float(), conf
        best = logits.argmax(-1)
        onehot = F.one_hot(best, logits.shape[-1]).float()
        if all(self.greedy):
            return best, onehot, conf
        q = torch.softmax(logits / self.temps, dim=-1)
        drawn = self._draw(q)
        return torch.where(self.mask.squeeze(1), best, drawn), torch.where(self.mask, onehot, q), conf

    def _draw(self, q: torch.Tensor) -> torch.Tensor:
        """One multinomial draw per row: one call with a shared generator, else row by row."""
        g = self.generator
        if g is None or isinstance(g, torch.Generator):
            return torch.multinomial(q, 1, generator=g).squeeze(1)
        if len(g) != q.shape[0]:
            raise ValueError(f"draft: {len(g)} generators for {q.shape[0]} requests")
        return torch.cat([torch.multinomial(q[r], 1, generator=g[r]) for r in range(q.shape[0])])
