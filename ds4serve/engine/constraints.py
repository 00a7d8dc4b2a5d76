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

Drafts (speculative decoding, issue 28): a decoder verifying ``d_1 .. d_L`` has L + 1 rows whose states
share its matcher, row ``i`` with ``output + d_1 .. d_i`` as its history (``SamplerState.drafted = i``).
Their masks are filled in rounds (round ``r`` holds every matcher's ``r``-th row, so one matcher sits at
one position per round and the native batch fill still serves many requests): the matcher is advanced
through the draft one token per round. A draft token the grammar refuses is not an error (it is rejected
by the row before it, where the grammar gave it no probability, so the rows after it are never read; the
refused matcher allows only EOS there). After the masks, every matcher is rolled back to its committed
output, so a rejected tail never survives a step and the next ``sync`` starts from committed tokens only.
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

    def forced(self, limit: int) -> tuple[int, ...]: ...

    def rollback(self, n: int) -> None: ...


class ConstraintViolation(RuntimeError):
    """An accepted output token is one the request's grammar forbids (a bug or a forced token)."""


def sync(constraint: Constraint, output_ids: Sequence[int], drafted: int = 0) -> None:
    """Bring ``constraint`` to exactly the request's ``output_ids``, whose last ``drafted`` are draft tokens:
    a committed token the grammar forbids is a violation; a draft token it forbids is kept as refused."""
    have, want = constraint.num_tokens, len(output_ids)
    if have > want:
        constraint.rollback(have - want)
    committed = want - drafted
    for k in range(have, want):
        if not constraint.accept(int(output_ids[k])) and k < committed:
            raise ConstraintViolation(f"output token {int(output_ids[k])} is not allowed by the request's grammar")


def constrain(logits: torch.Tensor, states: Sequence[Any]) -> torch.Tensor:
    """``logits [N, V]`` with every constrained row masked to its grammar (and reasoning budget);
    unconstrained rows untouched. Returns ``logits`` itself when no row has a constraint. Rows that share
    a matcher (a draft's rows) are filled in rounds, in order (module docstring)."""
    rows = [i for i, s in enumerate(states) if s.constraint is not None]
    if not rows:
        return logits
    from ..chat.grammar_runtime import allocate_bitmask, apply_bitmask

    bitmask = allocate_bitmask(len(rows), logits.shape[1])
    try:
        for batch in _rounds(rows, states):
            _fill_round(bitmask, batch, states)
    finally:
        _settle(rows, states)
    out = logits.clone()
    return apply_bitmask(out, bitmask, torch.tensor(rows, device=logits.device))


def _rounds(rows: Sequence[int], states: Sequence[Any]) -> list[list[tuple[int, int]]]:
    """``(place in the bitmask, batch row)`` grouped so that no round holds one matcher twice: a matcher's
    ``r``-th row goes to round ``r``, so its rows are visited in order (their histories grow by one)."""
    seen: dict[int, int] = {}
    rounds: list[list[tuple[int, int]]] = []
    for j, i in enumerate(rows):
        r = seen.get(id(states[i].constraint), 0)
        seen[id(states[i].constraint)] = r + 1
        if r == len(rounds):
            rounds.append([])
        rounds[r].append((j, i))
    return rounds


def _fill_round(bitmask: torch.Tensor, batch: Sequence[tuple[int, int]], states: Sequence[Any]) -> None:
    """Sync each row's matcher to its history and fill its mask row (one native batch fill a round)."""
    from ..chat.grammar_runtime import allow_only, fill_bitmasks, forbid

    for _, i in batch:
        sync(states[i].constraint, states[i].output_ids, states[i].drafted)
    places = [j for j, _ in batch]
    part = bitmask if places == list(range(bitmask.shape[0])) else bitmask[places]
    fill_bitmasks([states[i].constraint for _, i in batch], part)
    for (_, i), row in zip(batch, part):
        s, c = states[i], states[i].constraint
        rule = _reasoning_rule(c, s.params.max_reasoning_tokens, len(s.output_ids))
        if rule == THINK_END:
            allow_only(row, c.think_end_id)
        elif rule == NO_EOS:
            forbid(row, c.eos_id)
    if part is not bitmask:
        bitmask[places] = part


THINK_END, NO_EOS = "think_end", "no_eos"


def _reasoning_rule(c: Constraint, budget: int | None, index: int) -> str | None:
    """What the reasoning adds to the grammar at output ``index``: ``THINK_END`` (the budget is spent: only
    ``</think>`` may come), ``NO_EOS`` (the constrained answer must come: no end of sequence inside the
    reasoning) or None. The masks (``_fill_round``) and the drafts (``allowed_prefix``, ``forced_tokens``)
    read this one rule."""
    if not c.in_reasoning:
        return None
    if budget is not None and index >= budget:
        return THINK_END
    return NO_EOS if c.has_grammar else None


def _settle(rows: Sequence[int], states: Sequence[Any]) -> None:
    """Roll every matcher back to its committed output: no draft token outlives the masks it shaped."""
    for i in rows:
        s = states[i]
        committed = len(s.output_ids) - s.drafted
        if s.constraint.num_tokens > committed:
            s.constraint.rollback(s.constraint.num_tokens - committed)


def allowed_prefix(state: Any, draft: Sequence[int]) -> int:
    """How many leading tokens of ``draft`` the request's grammar and reasoning budget allow after its
    committed output (all of them without a grammar): a draft is cut there before it is verified, since a
    refused token and every row after it would be rejected. The matcher is left where it was."""
    c = state.constraint
    if c is None or not draft:
        return len(draft)
    try:
        sync(c, state.output_ids)
    except ConstraintViolation:  # the sampler reports it, with the request's failure
        return 0
    budget, n = state.params.max_reasoning_tokens, 0
    try:
        for k, token in enumerate(draft, start=len(state.output_ids)):
            rule = _reasoning_rule(c, budget, k)
            if (rule == THINK_END and token != c.think_end_id) or (rule == NO_EOS and token == c.eos_id):
                break  # what ``_fill_round`` masks at this row
            if not c.accept(int(token)):
                break
            n += 1
    finally:
        c.rollback(c.num_tokens - len(state.output_ids))
    return n


def forced_tokens(state: Any, limit: int) -> tuple[int, ...]:
    """Up to ``limit`` tokens the request's grammar forces after its committed output (none without a
    grammar): a draft that is accepted whenever the model writes the grammar's own tokenization of the
    forced text (the only one a small vocabulary has; another tokenization rejects the rest, exactly).
    A reasoning budget that is spent forces ``</think>`` first, then what the answer's grammar forces."""
    c = state.constraint
    if c is None or limit <= 0:
        return ()
    try:
        sync(c, state.output_ids)
    except ConstraintViolation:
        return ()
    if _reasoning_rule(c, state.params.max_reasoning_tokens, len(state.output_ids)) == THINK_END:
        c.accept(c.think_end_id)
        try:
            forced = (c.think_end_id, *c.forced(limit - 1))
        finally:
            c.rollback(1)
    else:
        forced = c.forced(limit)
    return forced[:allowed_prefix(state, forced)]
