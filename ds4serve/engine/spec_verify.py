"""Verification of drafted tokens (speculative decoding, issue 28 item 2), batched over requests.

The contract is ``shared/spec/ds4-speculative.md`` §4-§5. Rows and indices: a request at a step has
``k0 = len(state.output_ids)`` committed output tokens and drafts ``d_1..d_L``. The target verifies
``[anchor, d_1..d_L]`` and returns L+1 rows; **row i is the target's distribution for output index
k0 + i**, and draft ``d_{i+1}`` (the candidate for index k0 + i) is checked against row i. The step commits
``d_1..d_j`` and a bonus token drawn at row j (the correction on a rejection, or the extra token from
row L when all L are accepted): j + 1 tokens, at least one, so a step never commits less than plain
decoding.

Interface (the engine integration builds on these; nothing here keeps state across calls):

* ``verify_rows(logits, states, drafts, grammar_mask=None) -> list[Verdict]``: one call per step for
  the requests that verify. ``logits [R, V]`` are the target's *raw* rows (fp32, as ``sample_rows``
  takes them), request r's L_r + 1 rows contiguous and requests in ``states`` order. Processing is
  ``sample_rows``' (logit_bias -> penalties -> min_tokens bans -> grammar -> temperature -> top-k -> top-p ->
  min-p), each row with the history it would have in plain decoding (``row_states``: row i sees
  ``output_ids + d_1..d_i``). Grammar rows need ``grammar_mask [R, V]`` (bool, True: allowed), built
  by the caller from a matcher advanced through the drafts (and rolled back after): this module never
  touches matcher state; a constrained state without a mask is an error, never a silent free row.
  Rows after a draft the matcher refuses are never read (that draft is rejected: its p is 0), so the
  caller may leave them all True.
  An empty draft is plain decoding: bit-identical to ``sample_rows`` for that request.
* ``Draft(tokens, probs)``: d_1..d_L and q_1..q_L (``[L, V]``; ``None``: a point mass at each d_i, what a
  greedy drafter such as n-gram proposes). q must be the distribution d was *really* drawn from
  (spec §5.2: ds4 #482 verified greedy drafts against a dense q and was not lossless).
* ``Verdict``: ``accepted`` (j), ``draws`` (the committed tokens, each a ``sampling.Draw`` with the
  target's raw logprobs as plain decoding reports them), ``ok``/``error``.
* ``draft_probs(logits, params)``: a drafter's q (the request's temperature and filters; one-hot for
  greedy requests). ``draw_drafts(q, seeds, indices)`` draws d from q, ``greedy_drafts(logits)`` the argmax.
* ``request_seed(state, device)``: the request's base seed (fixed once, by ``SamplerState.rng``).

Rules. Greedy requests (``params.greedy``) accept d while it equals ``torch.argmax`` of the processed
row (``sample_rows``' rule, ties included) and take the argmax at the stop row: committed tokens equal
plain greedy decoding token for token. Sampled requests use Leviathan/Chen rejection sampling: accept
d when ``q(d) > 0 and p(d) > u * q(d)`` in float64 (vLLM's test; q(d) = 0 means the drafter could not
have drawn d: reject), on the first rejection draw from ``max(p - q, 0)`` (all zero only by rounding:
then p), and after L acceptances draw the bonus from p_L.

Randomness is counter-based, keyed by (request base seed, output index) as in ``sampling``, in three
domains so no two uses share bits: the *draw* at index k (a correction, a bonus, or plain decoding)
races with the generator seeded ``token_seed(base, k)`` (so L = 0 is ``sample_rows`` exactly); the
*acceptance uniform* at k is ``domain_seed(base, k, ACCEPT_DOMAIN)`` as 53 bits; a *draft* for index k
races with ``domain_seed(base, k, DRAFT_DOMAIN)``. Nothing is carried between steps, so an undone or
recomputed step verifies identically and a request's stream does not depend on its batch. Exactness
across steps: the committed tokens up to index k0 + j depend only on randomness of indices <= k0 + j;
the next step starts at k0 + j + 1 with randomness nothing committed has seen.

A request fails (``ok=False``, as ``sample_rows``' ``Draw(ok=False)``) when a row it needs (rows 0..j)
is not finite, or when its q has a non-finite or negative entry (a broken drafter is loud).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from .sampling import (Draw, SamplerState, SamplingParams, _apply_penalties, _ban, _collect, _filtered_probs, _race,
                       apply_bias, token_seed)

ACCEPT_DOMAIN = (1 << 62) | 0xACCE97  # far above any output index, so never an index of plain sampling
DRAFT_DOMAIN = (1 << 62) | 0xD4AF7
NON_FINITE = "the model produced non-finite logits for this request"
BAD_DRAFT = "the drafter produced an invalid distribution (non-finite or negative q) for this request"


def domain_seed(base: int, index: int, domain: int) -> int:
    """The seed of output index ``index`` in a randomness domain other than plain sampling's."""
    return token_seed(token_seed(base, index), domain)


def accept_uniform(base: int, index: int) -> float:
    """The acceptance uniform in [0, 1) for output index ``index``: the top 53 of the 63 seed bits."""
    return (domain_seed(base, index, ACCEPT_DOMAIN) >> 10) * 2.0**-53


def request_seed(state: SamplerState, device: torch.device | str = "cpu") -> int:
    """The request's base seed; ``SamplerState.rng`` is the one place it is chosen (seeded or random)."""
    if state.base_seed is None:
        state.rng(torch.device(device))
    return int(state.base_seed)


@dataclass(frozen=True)
class Draft:
    """Drafted tokens d_1..d_L of one request and the distributions q_1..q_L they were drawn from."""

    tokens: tuple[int, ...] = ()
    probs: torch.Tensor | None = None  # q [L, V], rows sum to 1; None: a point mass at each d_i

    def __post_init__(self) -> None:
        if self.probs is not None and (self.probs.dim() != 2 or self.probs.shape[0] != len(self.tokens)):
            raise ValueError(f"draft probs must be [L={len(self.tokens)}, V], got {tuple(self.probs.shape)}")


@dataclass(frozen=True)
class Verdict:
    """One request's outcome: j accepted drafts, then the bonus; ``draws`` are the j + 1 committed tokens."""

    accepted: int
    draws: tuple[Draw, ...]
    ok: bool = True
    error: str | None = None

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(d.token for d in self.draws)


@dataclass
class _Layout:
    """Where each request's rows and drafts sit in the flat batch (built once per call, on the host)."""

    starts: list[int]  # the row of each request's row 0
    lengths: list[int]  # L per request
    sampled: list[bool]  # per request: rejection sampling (else greedy)
    rows: torch.Tensor  # [D] the verify row each draft is checked against
    tokens: torch.Tensor  # [D] the drafts
    owner: torch.Tensor  # [D] each draft's request
    slot: torch.Tensor  # [D] each draft's position in its request (0-based)
    uniforms: torch.Tensor  # [D] float64 acceptance uniforms (0 for greedy requests)
    qrow: torch.Tensor  # [D] row in ``q`` of a sampled dense draft, -1 otherwise
    sampled_drafts: list[int]  # the drafts of sampled requests (the rest are greedy)
    q: torch.Tensor | None  # [Dq, V] the dense q rows of the sampled requests


def row_states(state: SamplerState, drafts: Sequence[int]) -> list[SamplerState]:
    """The state each of the L + 1 verify rows is processed with: row i sees ``output_ids + d_1..d_i``,
    so its penalties and ``min_tokens`` bans are plain decoding's at index k0 + i. Rows share ``state``
    when the history cannot matter (no penalty, past ``min_tokens``), so a long output is not copied."""
    p, k0 = state.params, len(state.output_ids)
    if not p.penalised and k0 >= p.min_tokens:
        return [state] * (len(drafts) + 1)
    out = [state]
    for i in range(1, len(drafts) + 1):
        out.append(SamplerState(p, state.prompt_ids, [*state.output_ids, *drafts[:i]], state.eos_ids,
                                base_seed=state.base_seed))
    return out


def _layout(logits: torch.Tensor, states: Sequence[SamplerState], drafts: Sequence[Draft]) -> _Layout:
    n_rows, vocab = logits.shape
    if len(states) != len(drafts) or n_rows != sum(len(d.tokens) + 1 for d in drafts):
        raise ValueError(f"{n_rows} rows for {len(states)} states and drafts of {[len(d.tokens) for d in drafts]}")
    starts, lengths, sampled = [], [], []
    rows, tokens, owner, slot, uniforms, qrow, dense, rd = [], [], [], [], [], [], [], []
    start = n_q = 0
    for r, (s, d) in enumerate(zip(states, drafts)):
        if any(not 0 <= t < vocab for t in d.tokens) or (d.probs is not None and d.probs.shape[1] != vocab):
            raise ValueError(f"request {r}: draft tokens or q outside the vocabulary of {vocab}")
        rand, k0 = not s.params.greedy, len(s.output_ids)
        base = request_seed(s, logits.device) if rand else 0
        use_q = rand and d.probs is not None and len(d.tokens) > 0
        starts.append(start), lengths.append(len(d.tokens)), sampled.append(rand)
        rd += range(len(rows), len(rows) + len(d.tokens)) if rand else []
        for i, t in enumerate(d.tokens):
            rows.append(start + i), tokens.append(t), owner.append(r), slot.append(i)
            uniforms.append(accept_uniform(base, k0 + i) if rand else 0.0)
            qrow.append(n_q + i if use_q else -1)
        if use_q:
            dense.append(d.probs)
            n_q += len(d.tokens)
        start += len(d.tokens) + 1
    dev = logits.device

    def t(x: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype, device=dev)

    q = torch.cat([x.to(dev) for x in dense]) if dense else None
    return _Layout(starts, lengths, sampled, t(rows), t(tokens), t(owner), t(slot), t(uniforms, torch.float64),
                   t(qrow), rd, q)


def _process(logits: torch.Tensor, rstates: Sequence[SamplerState], mask: torch.Tensor | None) -> torch.Tensor:
    """``sample_rows``' processing up to the grammar, per row; the grammar comes from ``mask``. A row
    the grammar and the bans leave empty falls back to the grammar alone, as ``sample_rows`` does."""
    penalised = _apply_penalties(apply_bias(logits, rstates), rstates)
    work = _ban(penalised, rstates)
    if mask is None:
        if any(s.constraint is not None for s in rstates):
            raise ValueError("a request with a grammar needs grammar_mask (its matcher advanced through the drafts)")
        return work
    if mask.shape != logits.shape or mask.dtype != torch.bool:
        raise ValueError(f"grammar_mask must be bool {tuple(logits.shape)}, got {mask.dtype} {tuple(mask.shape)}")
    mask = mask.to(logits.device)
    work = work.masked_fill(~mask, float("-inf"))
    dead = ~torch.isfinite(work).any(dim=-1)
    if bool(dead.any()):
        work = torch.where(dead.unsqueeze(-1), penalised.masked_fill(~mask, float("-inf")), work)
    return work


def _target_probs(work: torch.Tensor, lay: _Layout, states: Sequence[SamplerState]
                  ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """p for every row of the sampled requests (one ``_filtered_probs`` call), and each row's place in it
    (-1: a greedy request's row, which never needs p)."""
    where = torch.full((work.shape[0],), -1, dtype=torch.long, device=work.device)
    rows = [lay.starts[r] + i for r in range(len(states)) if lay.sampled[r] for i in range(lay.lengths[r] + 1)]
    if not rows:
        return None, where
    params = [states[r].params for r in range(len(states)) if lay.sampled[r] for _ in range(lay.lengths[r] + 1)]
    idx = torch.tensor(rows, device=work.device)
    where[idx] = torch.arange(len(rows), device=work.device)
    return _filtered_probs(work.index_select(0, idx), params), where


def _accept(work: torch.Tensor, finite: torch.Tensor, lay: _Layout, probs: torch.Tensor | None,
            where: torch.Tensor) -> torch.Tensor:
    """[D] whether each draft passes its own row's test (the first failure per request decides j)."""
    top = torch.argmax(work, dim=-1)  # sample_rows' greedy rule, ties included
    acc = top.index_select(0, lay.rows) == lay.tokens
    if probs is not None and lay.sampled_drafts:
        rd = torch.tensor(lay.sampled_drafts, dtype=torch.long, device=work.device)
        tok = lay.tokens.index_select(0, rd)
        p_d = probs[where.index_select(0, lay.rows.index_select(0, rd)), tok].double()
        q_d = torch.ones_like(p_d)  # a point mass: q(d) = 1
        qrow = lay.qrow.index_select(0, rd)
        dense = qrow >= 0
        if lay.q is not None:
            q_d = torch.where(dense, lay.q[qrow.clamp(min=0), tok].double(), q_d)
        u = lay.uniforms.index_select(0, rd)
        acc = acc.index_copy(0, rd, (q_d > 0) & (p_d > u * q_d))
    return acc & finite.index_select(0, lay.rows)


def _accepted_counts(acc: torch.Tensor, lay: _Layout) -> list[int]:
    """j per request: the number of leading accepted drafts (vectorised over requests)."""
    n, longest = len(lay.lengths), max(lay.lengths, default=0)
    padded = torch.zeros((n, longest), dtype=torch.long, device=acc.device)
    padded[lay.owner, lay.slot] = acc.long()
    return padded.cumprod(dim=1).sum(dim=1).tolist()


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(p - q, 0) per row (float64; unnormalised: the race does not need it); a row that rounding
    leaves all zero falls back to p."""
    r = (p - q).clamp(min=0)
    empty = ~(r > 0).any(dim=-1, keepdim=True)
    return torch.where(empty, p, r)


def _rejected_q(lay: _Layout, stop_drafts: list[int], vocab: int, dev: torch.device) -> torch.Tensor:
    """[m, V] float64 q of each rejected draft: its dense row, or one-hot at d for a point mass."""
    idx = torch.tensor(stop_drafts, dtype=torch.long, device=dev)
    qrow, tok = lay.qrow.index_select(0, idx), lay.tokens.index_select(0, idx)
    q = torch.zeros((len(stop_drafts), vocab), dtype=torch.float64, device=dev)
    if lay.q is not None:
        q = torch.where((qrow >= 0).unsqueeze(-1), lay.q.index_select(0, qrow.clamp(min=0)).double(), q)
    point = (qrow < 0).double()
    return q.index_put_((torch.arange(len(stop_drafts), device=dev), tok), point, accumulate=True)


def _draw_bonus(states: Sequence[SamplerState], lay: _Layout, counts: list[int], live: list[bool],
                top: torch.Tensor, probs: torch.Tensor | None, where: torch.Tensor) -> list[int]:
    """The token at each request's stop row: argmax (greedy), the residual's race (a rejection) or p's
    race (all accepted: ``sample_rows``' own draw of that index). One host read for all of them."""
    dev = top.device
    stops = torch.tensor([s + j for s, j in zip(lay.starts, counts)], dtype=torch.long, device=dev)
    bonus = top.index_select(0, stops)
    drawn = [r for r in range(len(states)) if lay.sampled[r] and live[r]]
    if not drawn:
        return bonus.tolist()
    rejected = [r for r in drawn if counts[r] < lay.lengths[r]]
    place = {r: m for m, r in enumerate(rejected)}
    p_stop = probs.index_select(0, where.index_select(0, stops).clamp(min=0))  # p at each stop row (sampled: read)
    residual = None
    if rejected:
        offsets = list(accumulate(lay.lengths, initial=0))  # each request's first draft in the flat drafts
        first = [offsets[r] + counts[r] for r in rejected]  # the rejected draft of each
        p = p_stop.index_select(0, torch.tensor(rejected, device=dev)).double()
        residual = _residual(p, _rejected_q(lay, first, p.shape[1], dev))
    races = []
    for r in drawn:  # one generator per request, as sample_rows draws
        gen = states[r].rng(dev)
        gen.manual_seed(token_seed(request_seed(states[r]), len(states[r].output_ids) + counts[r]))
        races.append(_race(residual[place[r]] if r in place else p_stop[r], gen))
    return bonus.index_copy(0, torch.tensor(drawn, device=dev), torch.stack(races)).tolist()


def _drafter_ok(lay: _Layout, n: int) -> list[bool]:
    """Per request: its dense q (if any, sampled requests only) is finite and non-negative."""
    if lay.q is None:
        return [True] * n
    bad_rows = ~torch.isfinite(lay.q).all(dim=-1) | (lay.q < 0).any(dim=-1)
    dense = lay.qrow >= 0
    bad = torch.zeros(n, dtype=torch.bool, device=lay.q.device)
    bad.index_put_((lay.owner[dense],), bad_rows[lay.qrow[dense]], accumulate=True)
    return (~bad).tolist()


def verify_rows(logits: torch.Tensor, states: Sequence[SamplerState], drafts: Sequence[Draft],
                grammar_mask: torch.Tensor | None = None) -> list[Verdict]:
    """Verify each request's drafts against its L + 1 target rows (see the module docstring)."""
    if not states:
        return []
    lay = _layout(logits, states, drafts)
    finite = torch.isfinite(logits).all(dim=-1)
    logits = torch.where(finite.unsqueeze(-1), logits, torch.zeros_like(logits))
    rstates = [rs for s, d in zip(states, drafts) for rs in row_states(s, d.tokens)]
    work = _process(logits, rstates, grammar_mask)
    probs, where = _target_probs(work, lay, states)
    counts = _accepted_counts(_accept(work, finite, lay, probs, where), lay)
    finite_l = finite.tolist()
    drafter_ok = _drafter_ok(lay, len(states))
    live = [finite_l[s + j] and (drafter_ok[r] or not lay.sampled[r])
            for r, (s, j) in enumerate(zip(lay.starts, counts))]
    bonus = _draw_bonus(states, lay, counts, live, torch.argmax(work, dim=-1), probs, where)
    return _verdicts(logits, rstates, drafts, lay, counts, live, bonus, drafter_ok)


def _verdicts(logits: torch.Tensor, rstates: Sequence[SamplerState], drafts: Sequence[Draft], lay: _Layout,
              counts: list[int], live: list[bool], bonus: list[int], drafter_ok: list[bool]) -> list[Verdict]:
    """Each live request's committed tokens as ``Draw``s with the raw logprobs of their own rows
    (``sample_rows``' ``_collect``, so logprobs are plain decoding's)."""
    rows, toks = [], []
    for r, d in enumerate(drafts):
        if live[r]:
            j = counts[r]
            rows += range(lay.starts[r], lay.starts[r] + j + 1)
            toks += [*d.tokens[:j], bonus[r]]
    draws: list[Draw] = []
    if rows:
        dev = logits.device
        sel = logits.index_select(0, torch.tensor(rows, device=dev))
        want_lp = any(rstates[i].params.logprobs is not None for i in rows)
        raw = torch.log_softmax(sel, dim=-1) if want_lp else None
        draws = _collect(torch.tensor(toks, dtype=torch.long, device=dev),
                         torch.ones(len(rows), dtype=torch.bool), raw, [rstates[i] for i in rows])
    out, at = [], 0
    for r in range(len(drafts)):
        if not live[r]:
            error = NON_FINITE if drafter_ok[r] or not lay.sampled[r] else BAD_DRAFT
            out.append(Verdict(accepted=0, draws=(), ok=False, error=error))
            continue
        n = counts[r] + 1
        out.append(Verdict(accepted=counts[r], draws=tuple(draws[at:at + n])))
        at += n
    return out


def draft_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """A drafter's q per row ``[N, V]``: the request's temperature, top-k, top-p and min-p applied as
    the target applies them (``_filtered_probs``); one-hot at the argmax for greedy requests (rtp-llm's
    review: q must degenerate to one-hot when not sampling). Penalties are the target's alone."""
    q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        g = torch.tensor(greedy, device=logits.device)
        q[g, torch.argmax(logits.index_select(0, g), dim=-1)] = 1.0
    if sampled:
        s = torch.tensor(sampled, device=logits.device)
        q[s] = _filtered_probs(logits.index_select(0, s).float(), [params[i] for i in sampled])
    return q


def draw_drafts(q: torch.Tensor, seeds: Sequence[int], indices: Sequence[int]) -> torch.Tensor:
    """One draft per row of ``q [N, V]``, really drawn from q: row n races with the generator of
    (``seeds[n]``, output index ``indices[n]``) in the draft domain, so DSpark's Markov chain and any
    sampled drafter draw d_i from q_i, reproducibly and independently of the acceptance uniforms."""
    if len(seeds) != q.shape[0] or len(indices) != q.shape[0]:
        raise ValueError(f"{q.shape[0]} rows, {len(seeds)} seeds and {len(indices)} indices")
    if q.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=q.device)
    gen = torch.Generator(device=q.device)
    out = []
    for n in range(q.shape[0]):  # one generator per request, as sample_rows draws
        gen.manual_seed(domain_seed(int(seeds[n]), int(indices[n]), DRAFT_DOMAIN))
        out.append(_race(q[n], gen))
    return torch.stack(out)


def greedy_drafts(logits: torch.Tensor) -> torch.Tensor:
    """Greedy drafts ``[N]``: the argmax with ``sample_rows``' tie rule (their q is a point mass)."""
    return torch.argmax(logits, dim=-1)
