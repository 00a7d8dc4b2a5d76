"""The matcher protocol the batched sampler relies on: masks, rollback, thinking activation,
refused tokens, batch fills, the vectorised logit mask, the compile cache and the errors (each a
``GrammarError`` naming the request field, for a 400)."""

from __future__ import annotations

import pytest
import torch

from ds4serve.chat.grammar import GrammarError, grammar_spec
from ds4serve.chat.grammar_runtime import RequestMatcher, allocate_bitmask, apply_bitmask, fill_bitmasks, unpack_bitmask
from grammar_helpers import PERSON, SEARCH, WEATHER, drive, matcher, tiny

RF = {"type": "json_schema", "json_schema": {"schema": PERSON}}


def _mask(m: RequestMatcher) -> torch.Tensor:
    bm = tiny()[1].allocate_bitmask(1)
    m.fill_mask(bm[0])
    return bm[0].clone()


def _trace(m: RequestMatcher, ids: list[int]) -> list[torch.Tensor]:
    """The mask before each token, accepting them in turn."""
    out = []
    for t in ids:
        out.append(_mask(m))
        assert m.accept(t)
    return out


@pytest.mark.parametrize("request_", [{"response_format": RF}, {"tools": [WEATHER, SEARCH], "tool_choice": "required"},
                                      {"tools": [WEATHER], "tool_choice": "auto"}])
def test_rollback_reproduces_the_masks(request_):
    ids = drive(matcher(**request_), seed=7, max_steps=5000)
    m = matcher(**request_)
    masks = _trace(m, ids)
    for back in (1, 5, len(ids) // 2, len(ids)):
        m.rollback(back)
        assert m.num_tokens == len(ids) - back
        assert torch.equal(_mask(m), masks[len(ids) - back])
        again = _trace(m, ids[len(ids) - back:])
        assert all(torch.equal(a, b) for a, b in zip(again, masks[len(ids) - back:]))
    assert m.is_terminated()
    m.reset()
    assert m.num_tokens == 0 and torch.equal(_mask(m), masks[0])


def test_thinking_is_free_until_think_end_and_rolls_back_over_it():
    tok = tiny()[0]
    m = matcher(thinking=True, response_format=RF)
    free = _mask(m)
    assert (free == -1).all() and not m.constrained
    assert m.accept_many(tok.encode_text("no json here"))
    assert (_mask(m) == -1).all()
    assert m.accept(tok.think_end_id) and m.constrained
    first = _mask(m)
    assert not (first == -1).all()
    opening = tok.encode_text('{"')
    assert m.accept_many(opening)
    m.rollback(len(opening) + 1)  # back over </think>: free again
    assert not m.constrained and (_mask(m) == -1).all()
    assert m.accept(tok.think_end_id) and torch.equal(_mask(m), first)


def test_a_literal_think_end_in_text_does_not_activate():
    tok = tiny()[0]
    m = matcher(thinking=True, response_format=RF)
    assert m.accept_many(tok.encode_text("</think>"))  # plain text tokens, not the special token
    assert not m.constrained


def test_refused_token_keeps_state_and_allows_only_eos():
    tok = tiny()[0]
    m = matcher(response_format={"type": "json_object"})
    before = _mask(m)
    bad = tok.encode_text("x")[0]
    assert not m.accept(bad) and m.refused
    only = unpack_bitmask(_mask(m).unsqueeze(0), tok.vocab_size)[0]
    assert only.nonzero().flatten().tolist() == [tok.eos_id]
    m.rollback(1)
    assert not m.refused and torch.equal(_mask(m), before)


def test_batch_fill_matches_row_fills_and_free_rows_are_all_ones():
    tok, comp, _ = tiny()
    ms = [matcher(response_format=RF), None, matcher(tools=[WEATHER], tool_choice="required"),
          comp.matcher(None), matcher(tools=[WEATHER], tool_choice="none")]
    prefix = tok.encode_text('{"name": "Al')
    assert ms[0].accept_many(prefix)
    bm = comp.allocate_bitmask(len(ms))
    bm.zero_()
    fill_bitmasks(ms, bm)
    for b, m in enumerate(ms):
        row = comp.allocate_bitmask(1)[0]
        row.fill_(-1) if m is None else m.fill_mask(row)
        assert torch.equal(bm[b], row), b
    assert (bm[1] == -1).all() and (bm[3] == -1).all()
    serial = comp.allocate_bitmask(len(ms))
    fill_bitmasks(ms, serial, parallel=False)
    assert torch.equal(serial, bm)


def test_a_bitmask_wider_than_the_tokenizer_forbids_the_padding():
    """Checkpoints pad the logits past the tokenizer: those ids are never allowed."""
    tok, comp, _ = tiny()
    ms = [matcher(response_format=RF), matcher(tools=[WEATHER], tool_choice="required")]
    narrow = comp.allocate_bitmask(2)
    fill_bitmasks(ms, narrow)
    wide = allocate_bitmask(2, comp.vocab_size + 100)
    for parallel in (True, False):
        fill_bitmasks(ms, wide, parallel=parallel)
        assert torch.equal(wide[:, :narrow.shape[1]], narrow) and (wide[:, narrow.shape[1]:] == 0).all()
    with pytest.raises(ValueError):
        ms[0].fill_mask(allocate_bitmask(1, 32)[0])


def test_in_reasoning_until_think_end():
    tok = tiny()[0]
    m = matcher(thinking=True, response_format=RF)
    assert m.in_reasoning and m.accept(tok.think_end_id) and not m.in_reasoning
    m.rollback(1)
    assert m.in_reasoning and not matcher(response_format=RF).in_reasoning


def test_apply_bitmask_is_one_vectorised_mask():
    gen = torch.Generator().manual_seed(0)
    vocab = 70  # not a multiple of 32; logits wider than the tokenizer's mask too
    allowed = torch.rand(3, vocab, generator=gen) > 0.5
    bm = allocate_bitmask(3, vocab)
    bm.zero_()
    for b, t in allowed.nonzero().tolist():
        word = 1 << (t % 32)
        bm[b, t // 32] |= word - (1 << 32) if word >= 1 << 31 else word
    assert torch.equal(unpack_bitmask(bm, vocab), allowed)
    logits = torch.randn(3, vocab + 5, generator=gen)
    out = apply_bitmask(logits.clone(), bm)
    assert torch.isinf(out[:, vocab:]).all()
    assert torch.equal(torch.isfinite(out[:, :vocab]), allowed)
    half = apply_bitmask(logits[:, :vocab].to(torch.bfloat16), bm)  # the model's dtype on GPU
    assert half.dtype == torch.bfloat16 and torch.equal(torch.isfinite(half), allowed)
    # rows: only the rows that have a grammar are touched
    wide = torch.randn(5, vocab, generator=gen)
    masked = apply_bitmask(wide.clone(), bm[:2], rows=torch.tensor([1, 3]))
    assert torch.equal(masked[[0, 2, 4]], wide[[0, 2, 4]])
    assert torch.equal(torch.isfinite(masked[[1, 3]]), allowed[:2])


def test_compile_cache_is_keyed_by_spec():
    comp = tiny()[1]
    a = comp.compile(grammar_spec(response_format=RF))
    assert comp.compile(grammar_spec(response_format=RF)) is a
    assert comp.compile(grammar_spec(response_format={"type": "json_object"})) is not a
    m1, m2 = comp.matcher(grammar_spec(response_format=RF)), comp.matcher(grammar_spec(response_format=RF))
    assert m1.accept_many(tiny()[0].encode_text("{")) and m2.num_tokens == 0  # copies, not shared


def test_no_grammar_when_nothing_constrains_the_output():
    assert grammar_spec() is None
    assert grammar_spec(response_format={"type": "text"}) is None
    assert grammar_spec(tool_choice="auto") is None
    assert grammar_spec(tool_choice="none").mode == "none"  # no tools, still no markup


@pytest.mark.parametrize("request_,field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "("}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/$defs/nope"}}}},
     "response_format.json_schema.schema"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "bad", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": "x"}}}}}]},
     "tools[1].function.parameters"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "bad", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "[a-"}}}}}], "tool_choice": "required"},
     "tools[1].function.parameters"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "bad", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-$"}}}}}], "tool_choice": "required"},
     "tools[1].function.parameters"),
])
def test_the_library_rejecting_a_schema_names_the_field(request_, field):
    with pytest.raises(GrammarError) as e:
        tiny()[1].compile(grammar_spec(**request_))
    assert e.value.field == field and field in str(e.value)


@pytest.mark.parametrize("request_,field", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"tools": [WEATHER], "tool_choice": 3}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": 'a"b'}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {}}, "required": ["b"]}}}]}, "tools[0].function.parameters.required"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {'a"': {}}}}}]}, "tools[0].function.parameters.properties"),
    ({"tools": "x"}, "tools"),
])
def test_request_errors_name_the_field(request_, field):
    with pytest.raises(GrammarError) as e:
        grammar_spec(**request_)
    assert e.value.field == field


def test_thinking_needs_the_think_end_id():
    from ds4serve.chat.grammar_runtime import GrammarCompiler
    comp = GrammarCompiler(tiny()[0]._json, eos_id=tiny()[0].eos_id)
    with pytest.raises(ValueError):
        comp.matcher(grammar_spec(response_format=RF), thinking=True)
