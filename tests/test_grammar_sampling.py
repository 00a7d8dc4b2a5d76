"""Grammars inside the engine's batched sampler (engine/constraints.py).

The sampler brings each request's matcher to exactly its accepted output before every draw, so an
undone step, a suspend/restore or a recompute needs nothing special: these tests undo tokens the way
the scheduler does (shrinking ``output_ids``) and check the masks and the final answer.
"""

from __future__ import annotations

import json

import torch
from grammar_helpers import PERSON, matcher, tiny, validate

from ds4serve.chat.grammar_runtime import fill_bitmasks
from ds4serve.engine.sampling import SamplerState, SamplingParams, sample_rows


def _state(m, max_tokens=300, **kw) -> SamplerState:
    return SamplerState(SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw), (3,), [], (tiny()[0].eos_id,),
                        constraint=m)


def _walk(states, seed, steps, undo_every=0):
    """Greedy draws on seeded random logits (boosted towards structure), appended as the scheduler
    appends accepted tokens; every ``undo_every`` steps the last two tokens of every row are undone."""
    tok, comp, boost = tiny()
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        live = [s for s in states if not s.output_ids or s.output_ids[-1] != tok.eos_id]
        if not live:
            return
        logits = torch.randn(len(live), comp.vocab_size, generator=gen) + boost
        for s, d in zip(live, sample_rows(logits, live)):
            assert d.ok
            s.output_ids.append(d.token)
        if undo_every and step % undo_every == undo_every - 1:
            for s in live:
                del s.output_ids[-2:]


def test_constrained_rows_answer_in_schema_beside_free_rows_even_with_undone_steps():
    tok = tiny()[0]
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    states = [_state(matcher(response_format=schema)), _state(None, max_tokens=40),
              _state(matcher(response_format={"type": "json_object"}))]
    _walk(states, seed=3, steps=400, undo_every=7)
    person, free, obj = (s.output_ids for s in states)
    for ids in (person, obj):
        assert ids and ids[-1] == tok.eos_id
    validate(json.loads(tok.decode(person[:-1])), PERSON)
    assert isinstance(json.loads(tok.decode(obj[:-1])), dict)
    assert states[0].constraint.num_tokens in (len(person) - 1, len(person))  # synced to the output
    assert len(free) > 0


def test_undone_tokens_are_rolled_back_before_the_next_draw():
    tok, comp, _ = tiny()
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    s = _state(matcher(response_format=schema))
    _walk([s], seed=5, steps=12)
    assert len(s.output_ids) == 12
    keep = list(s.output_ids[:5])
    del s.output_ids[5:]
    fresh = _state(matcher(response_format=schema))
    fresh.output_ids.extend(keep)
    logits = torch.randn(1, comp.vocab_size, generator=torch.Generator().manual_seed(9)).repeat(2, 1)
    a, b = sample_rows(logits, [s, fresh])  # same logits: the undone row must now draw what a fresh one draws
    assert s.constraint.num_tokens == fresh.constraint.num_tokens == 5 and a.token == b.token
    masks = comp.allocate_bitmask(2)
    fill_bitmasks([s.constraint, fresh.constraint], masks)
    assert torch.equal(masks[0], masks[1])


def test_the_reasoning_budget_forces_think_end_then_the_grammar_applies():
    tok, comp, _ = tiny()
    s = _state(matcher(thinking=True, response_format={"type": "json_object"}), max_reasoning_tokens=6)
    gen = torch.Generator().manual_seed(1)
    for _ in range(8):
        logits = torch.randn(1, comp.vocab_size, generator=gen)
        logits[0, tok.think_end_id] = -1e9  # the model would never close its reasoning by itself
        s.output_ids.append(sample_rows(logits, [s])[0].token)
    assert s.output_ids[6] == tok.think_end_id and tok.think_end_id not in s.output_ids[:6]
    assert not s.constraint.in_reasoning
    assert tok.decode(s.output_ids[7:8]).lstrip()[:1] in ("{", "")  # the JSON begins right after
