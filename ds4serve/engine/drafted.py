"""Verifying a decoder's draft in the batched step (speculative decoding, issue 28).

A decoder with a draft ``d_1 .. d_L`` feeds ``[token, d_1 .. d_L]``; row ``i`` of its logits is the
target's distribution for output index ``k0 + i`` (``k0`` = its output count before the step) given the
draft prefix ``d_1 .. d_i``. The committed tokens are the accepted prefix ``d_1 .. d_j`` and then the
target's own token at row ``j``: the correction where ``d_{j+1}`` was rejected, or the bonus after all L.

* greedy: ``d_i`` is accepted while it is the row's argmax (the rule and tie-break of ``sample_rows``), and
  the token at row ``j`` is that row's argmax, so the committed tokens are plain greedy decoding's token
  for token; the native forward computes each row on its own, so the rows are the decode rows' bits;
* random: exact rejection sampling, randomness keyed by (request seed, output index); for point-mass
  drafts in the coupling ``settle`` describes, which commits plain decoding's own draws.

Each row is processed with the history it has in plain decoding (penalties and ``min_tokens`` bans see
``output + d_1 .. d_i``, and its draw is keyed by output index ``k0 + i``: ``row_states``); a grammar's
mask for row ``i`` comes from the request's matcher advanced through ``d_1 .. d_i`` and rolled back after
(``constraints.constrain``), so grammars and reasoning budgets draft too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .sampling import Draw, SamplerState


@dataclass(frozen=True)
class Verified:
    """One decoder's verified draft: the accepted drafted tokens (with their logprobs, when asked) and the
    target's token after them (``draw``)."""

    accepted: tuple[int, ...]
    accepted_logprobs: tuple
    draw: Draw


def settle(draws: Sequence[Draw], draft: tuple[int, ...]) -> Verified:
    """What a decoder commits from the draws of its ``1 + len(draft)`` rows (``sample_rows`` over
    ``row_states``): the draft while it agrees with them, then the draw after it (with no draft: its one
    draw, as plain decoding).

    The drafts are point masses (n-gram proposals). For a point-mass ``q`` at ``d``, rejection sampling
    accepts with probability ``p(d)`` and otherwise draws from ``p`` without ``d``: exactly the law of
    plain decoding's own draw ``t`` from ``p`` (keyed by the request seed and the output index) with
    ``d`` accepted when ``t == d`` and ``t`` committed on a mismatch. So each row is drawn as plain
    decoding draws it and the draft is accepted while it agrees: the committed stream is plain
    decoding's, token for token, seeded or greedy, whatever was drafted, whatever the batch, and after
    an undo. (A drafter with a real ``q``, DSpark, goes through ``spec_verify.verify_rows``.)"""
    j = 0
    while j < len(draft) and draws[j].ok and draws[j].token == draft[j]:
        j += 1
    bad = next((r for r in draws[:j + 1] if not r.ok), None)
    if bad is not None:
        return Verified((), (), bad)
    logprobs = tuple((r.logprob, r.top_logprobs or ()) if r.logprob is not None else None for r in draws[:j])
    return Verified(tuple(draft[:j]), logprobs, draws[j])


class _Extended(Sequence[int]):
    """``base + extra`` as a read-only sequence, without copying ``base`` (a long output)."""

    def __init__(self, base: Sequence[int], extra: Sequence[int]):
        self.base, self.extra = base, extra

    def __len__(self) -> int:
        return len(self.base) + len(self.extra)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return list(self)[i]
        if i < 0:
            i += len(self)
        return self.base[i] if i < len(self.base) else self.extra[i - len(self.base)]

    def __iter__(self):
        yield from self.base
        yield from self.extra


def row_states(state: SamplerState, draft: tuple[int, ...], device: torch.device) -> list[SamplerState]:
    """The state each of a decoder's rows is sampled with (``[state]`` without a draft): row ``i`` has
    ``output + d_1 .. d_i`` as its history, so its penalties, ``min_tokens`` bans and draw (keyed by the
    history's length) are plain decoding's at that index. The request's base seed is fixed first
    (``rng`` draws it once), so every row shares it. A greedy row with no logit bias, penalty, grammar or
    ``min_tokens`` ban left reads nothing of its history: such a decoder's rows share its own state."""
    if not draft:
        return [state]
    p = state.params
    if p.greedy and not p.logit_bias and not p.penalised and state.constraint is None and not state.banned_ids():
        return [state] * (1 + len(draft))  # nothing such a row samples with depends on its history
    if not p.greedy and state.base_seed is None:
        state.rng(device)
    return [state] + [SamplerState(state.params, state.prompt_ids, _Extended(state.output_ids, draft[:i]),
                                   state.eos_ids, base_seed=state.base_seed, constraint=state.constraint, drafted=i)
                      for i in range(1, len(draft) + 1)]
