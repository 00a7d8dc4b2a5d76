"""Grammar constraints inside the batched sampler (issue 15: structured output, forced tool calls).

A request may carry a *constraint* on its ``SamplerState``: a per-request grammar matcher
(``chat.grammar_runtime.RequestMatcher``: llguidance underneath) that says which tokens may come
next, optionally only after the model's ``</think>``, plus a reasoning budget that forces ``</think>``
when reached so a structured answer always arrives.

The matcher's position is *derived from the request's output*, never carried across steps on
trust: before every draw the matcher is brought to exactly ``len(output_ids)`` tokens (the tokens
the scheduler accepted since the last draw are fed in; tokens of an undone step, a suspended and
restored or a dropped and recomputed request are rolled back). So nothing about grammar state has
to be undone by the paths that undo a step: the same rule as counter-based sampling.

Masks are filled into one ``[rows, vocab/32]`` bitmask by the library's native code and applied to
the batch's logits in one vectorised op; only rows with a constraint are touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch


class Constraint(Protocol):
    """What the sampler needs of a request's grammar state (``RequestMatcher`` has it)."""

    think_end_id: int | None
    eos_id: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def has_grammar(self) -> bool: ...

    @property
    def in_reasoning(self) -> bool: ...

    def accept(self, token_id: int) -> bool: ...

    def rollback(self, n: int) -> None: ...


class ConstraintViolation(RuntimeError):
    """An accepted output token is one the request's grammar forbids (a bug or a forced token)."""


def sync(constraint: Constraint, output_ids: Sequence[int]) -> None:
    """Bring ``constraint`` to exactly the request's ``output_ids``."""
    have, want = constraint.num_tokens, len(output_ids)
    if have > want:
        constraint.rollback(have - want)
    for token in output_ids[have:want]:
        if not constraint.accept(int(token)):
            raise ConstraintViolation(f"output token {int(token)} is not allowed by the request's grammar")


def constrain(logits: torch.Tensor, states: Sequence[Any]) -> torch.Tensor:
    """``logits [N, V]`` with every constrained row masked to its grammar (and reasoning budget);
    unconstrained rows untouched. Returns ``logits`` itself when no row has a constraint."""
    rows = [i for i, s in enumerate(states) if s.constraint is not None]
    if not rows:
        return logits
    from ..chat.grammar_runtime import allocate_bitmask, allow_only, apply_bitmask, fill_bitmasks, forbid

    matchers = []
    for i in rows:
        s = states[i]
        sync(s.constraint, s.output_ids)
        matchers.append(s.constraint)
    bitmask = allocate_bitmask(len(rows), logits.shape[1])
    fill_bitmasks(matchers, bitmask)
    for j, i in enumerate(rows):
        s, c = states[i], states[i].constraint
        if not c.in_reasoning:
            continue
        budget = s.params.max_reasoning_tokens
        if budget is not None and len(s.output_ids) >= budget:  # the budget: only </think> may come next
            allow_only(bitmask[j], c.think_end_id)
        elif c.has_grammar:  # the constrained answer must come: no end of sequence inside the reasoning
            forbid(bitmask[j], c.eos_id)
    out = logits.clone()
    return apply_bitmask(out, bitmask, torch.tensor(rows, device=logits.device))
