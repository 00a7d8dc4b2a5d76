"""Shared pieces of the grammar tests: the tiny tokenizer's compiler and a random-logits driver."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest
import torch

from ds4serve.chat import OutputParser, Tokenizer, token_pieces
from ds4serve.chat.grammar import grammar_spec
from ds4serve.chat.grammar_runtime import GrammarCompiler, RequestMatcher, apply_bitmask, fill_bitmasks

TINY = Path(__file__).resolve().parent.parent / "models" / "ds4v-tiny"

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6},
                   "days": {"type": "integer", "minimum": 1, "maximum": 9},
                   "unit": {"enum": ["c", "f"]},
                   "hourly": {"type": "boolean"},
                   "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3}},
    "required": ["city", "days"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 5}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 20}},
    "required": ["q"], "additionalProperties": False}}}
NOARGS = {"type": "function", "function": {"name": "ping"}}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user"]}, "ok": {"type": "boolean"},
    "pets": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    "home": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{3}$"}},
             "required": ["zip"], "additionalProperties": False}},
    "required": ["name", "age", "role", "ok", "pets", "home"], "additionalProperties": False}


def validate(instance, schema) -> None:
    """JSON Schema validation with whichever validator the test environment has (schemathesis
    brings ``jsonschema_rs``; ``jsonschema`` is used where installed); skips if neither is."""
    try:
        import jsonschema_rs
        jsonschema_rs.validate(schema, instance)
    except ImportError:
        jsonschema = pytest.importorskip("jsonschema")
        jsonschema.validate(instance, schema)


@lru_cache(maxsize=1)
def tiny() -> tuple[Tokenizer, GrammarCompiler, torch.Tensor]:
    """The tiny tokenizer, its compiler and a logit boost for structural characters: with plain
    random logits a 392-token walk takes hundreds of steps to close a string; the boost keeps
    each walk to tens of steps without changing what the grammar allows."""
    tok = Tokenizer(TINY)
    comp = GrammarCompiler.for_tokenizer(tok)
    boost = torch.zeros(comp.vocab_size)
    for i in range(tok.vocab_size):
        if any(c in tok.token_text(i) for c in '"}]<>,\n'):
            boost[i] = 3.0
    boost[tok.eos_id] = 2.0
    return tok, comp, boost


def drive(m: RequestMatcher, seed: int, max_steps: int = 800, prefix: list[int] = ()) -> list[int]:
    """Sample with seeded random logits under the matcher's masks until it terminates."""
    tok, comp, boost = tiny()
    gen = torch.Generator().manual_seed(seed)
    bm = comp.allocate_bitmask(1)
    ids = list(prefix)
    for t in prefix:
        assert m.accept(t)
    for _ in range(max_steps):
        fill_bitmasks([m], bm)
        logits = apply_bitmask(torch.randn(1, comp.vocab_size, generator=gen) + boost, bm)
        t = int(logits.argmax())
        assert m.accept(t), t
        ids.append(t)
        if m.is_terminated() or t == tok.eos_id:
            break
    assert m.is_terminated(), f"no end in {max_steps} steps: {tok.decode(ids, skip_special_tokens=False)!r}"
    return ids


def parse(ids: list[int], thinking: bool = False):
    tok = tiny()[0]
    p = OutputParser.for_tokenizer(tok, thinking=thinking)
    p.feed_many(ids, token_pieces(tok, ids))
    p.finish()
    return p


def matcher(thinking: bool = False, **request) -> RequestMatcher:
    return tiny()[1].matcher(grammar_spec(**request), thinking=thinking)
