"""Drafts under a grammar or a reasoning budget (issue 28: "grammars: drafted tokens checked against the
matcher, its state rolled back with the rejected tail").

A draft's L + 1 verify rows share the request's matcher; ``constraints.constrain`` advances it through the
draft one row at a time and rolls it back after. The oracle here gives every row its *own* fresh matcher,
fed the row's whole history token by token (plain loops, no shared state): each row's mask must equal
it, up to and including the row where the draft's first refused token is checked (rows after a refused
token are never read). Then the engine: greedy and seeded outputs with drafts (n-gram and the bundled
model's DSpark drafter) equal plain decoding's token for token under a JSON schema, the answers
validate, and drafts were really verified and accepted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from grammar_helpers import PERSON, matcher, tiny, validate

from ds4serve.chat.grammar_runtime import fill_bitmasks
from ds4serve.engine.constraints import allowed_prefix, constrain
from ds4serve.engine.drafted import row_states
from ds4serve.engine.sampling import SamplerState, SamplingParams
from ds4serve.scheduler.spec import RequestSpec
from model_helpers import feed

SCHEMA = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
BUNDLED = Path(__file__).resolve().parents[1] / "models" / "ds4v-tiny"


def _state(m, output: list[int], **kw) -> SamplerState:
    return SamplerState(SamplingParams(max_tokens=300, temperature=0.0, **kw), (3,), output,
                        (tiny()[0].eos_id,), constraint=m)


def _answer_prefix() -> list[int]:
    tok = tiny()[0]
    return tok.encode_text('{"name": "ab", "age": 4')


def _oracle_mask(history: list[int], **request) -> tuple[torch.Tensor, bool]:
    """A fresh matcher fed ``history`` one token at a time; its mask, and whether every token was allowed."""
    m = matcher(**request)
    ok = all([m.accept(t) for t in history])
    bm = tiny()[1].allocate_bitmask(1)
    fill_bitmasks([m], bm)
    return bm[0], ok


def _bits(row: torch.Tensor, vocab: int) -> torch.Tensor:
    """A bitmask row as ``[vocab]`` bool, bit by bit (token t is bit t % 32 of word t // 32)."""
    return torch.tensor([bool((int(row[t // 32]) >> (t % 32)) & 1) for t in range(vocab)])


def _masks(states: list[SamplerState], vocab: int) -> torch.Tensor:
    return torch.isfinite(constrain(torch.zeros(len(states), vocab), states))


@pytest.mark.parametrize("tail", ["allowed", "refused"])
def test_each_draft_row_is_masked_as_a_fresh_matcher_fed_its_history(tail):
    tok, comp, _ = tiny()
    out = _answer_prefix()
    draft = tok.encode_text(', "role": "user"')
    if tail == "refused":
        draft = draft[:3] + tok.encode_text("}}}") + draft[3:]  # a closing brace where a value must come
    free = _state(None, [5, 6])
    s = _state(matcher(response_format=SCHEMA), list(out))
    rows = row_states(s, tuple(draft), torch.device("cpu"))
    states = [free] + rows  # a free row beside the draft's rows: untouched
    got = _masks(states, comp.vocab_size)
    assert got[0].all()
    read = len(draft) + 1
    for i in range(len(draft) + 1):
        want, ok = _oracle_mask(out + draft[:i], response_format=SCHEMA)
        if not ok:
            read = i  # the row after the first refused token is never read
            break
        assert torch.equal(got[1 + i], _bits(want, comp.vocab_size)), i
    assert (read < len(draft) + 1) == (tail == "refused")
    assert s.constraint.num_tokens == len(out)  # rolled back to the committed output
    # the committed output goes on from there as if nothing had been drafted
    want, _ = _oracle_mask(out, response_format=SCHEMA)
    again = _masks([s], comp.vocab_size)[0]
    assert torch.equal(again, _bits(want, comp.vocab_size))


def test_allowed_prefix_cuts_a_draft_where_the_grammar_refuses_and_leaves_the_matcher():
    tok = tiny()[0]
    out = _answer_prefix()
    good = tok.encode_text(', "role": "user"')
    bad = good[:2] + tok.encode_text("]]") + good[2:]
    s = _state(matcher(response_format=SCHEMA), list(out))
    m = matcher(response_format=SCHEMA)
    assert all(m.accept(t) for t in out)
    want = 0
    for t in bad:  # the oracle: a fresh matcher, token by token
        if not m.accept(t):
            break
        want += 1
    assert allowed_prefix(s, tuple(good)) == len(good)
    assert allowed_prefix(s, tuple(bad)) == want < len(bad)
    assert s.constraint.num_tokens == len(out)
    assert allowed_prefix(_state(None, [1]), (1, 2, 3)) == 3


def test_the_reasoning_budget_and_the_answer_grammar_cut_drafts():
    tok = tiny()[0]
    m = matcher(thinking=True, response_format={"type": "json_object"})
    s = _state(m, tok.encode_text("hmm")[:2], max_reasoning_tokens=4)
    words = tok.encode_text(" so then")
    assert allowed_prefix(s, tuple(words + words)) == 2  # output index 4 may only be </think>
    assert allowed_prefix(s, (words[0], words[1], tok.think_end_id, *tok.encode_text("{"))) == 4
    assert allowed_prefix(s, (words[0], tok.eos_id)) == 1  # no end of sequence inside the reasoning
    rows = row_states(s, (words[0], words[1], words[0]), torch.device("cpu"))
    masks = _masks(rows, tiny()[1].vocab_size)
    assert masks[2].sum() == 1 and masks[2][tok.think_end_id]  # the budget's row: </think> alone
    assert masks[0][words[0]] and not masks[0][tok.eos_id]
    assert m.num_tokens == 2


def _schema_prompt(tok, i: int) -> list[int]:
    """A prompt holding JSON like the answer's, so prompt lookup finds what to draft."""
    example = json.dumps({"name": "ab", "age": 30 + i, "role": "user", "ok": True, "pets": ["cat"],
                          "home": {"zip": "123"}})
    return tok.encode_text(f"Example: {example}\nAnother: {example}\nAnswer: ")


def _run(llm, prompts, params) -> tuple[list[list[int]], object]:
    reqs = [llm.core.make_request(RequestSpec(p, q, constraint=matcher(response_format=SCHEMA)))
            for p, q in zip(prompts, params)]
    feed(llm.core, reqs, 1)
    assert llm.core.leaks() == "", llm.core.leaks()
    return [list(r.output_ids) for r in reqs], llm.core.scheduler.spec


@pytest.mark.parametrize("method", ["ngram", "dspark", "dspark-rejection"])
@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_constrained_outputs_with_drafts_equal_plain_decoding(method, mode):
    """The bundled model, three requests under a JSON schema: the drafts are cut at refused tokens, verified
    against masks built through them, and the committed tokens are plain decoding's, token for token
    (rejection sampling of DSpark's blocks, exact in distribution only, is compared greedy; sampled, its
    answers must still validate)."""
    from ds4serve.llm import LLM

    tok = tiny()[0]
    spec = {"method": method.split("-")[0], "num_speculative_tokens": 4}
    if method == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
    if method.endswith("rejection"):
        spec["acceptance"] = "rejection"
    prompts = [_schema_prompt(tok, i) for i in range(3)]
    params = [SamplingParams(max_tokens=160, temperature=0.0 if mode == "greedy" else 0.7, seed=11 + i)
              for i in range(3)]
    plain, _ = _run(LLM(BUNDLED, max_seqs=3, warmup=False), prompts, params)
    drafted, figures = _run(LLM(BUNDLED, max_seqs=3, warmup=False, speculative=json.dumps(spec)), prompts, params)
    if mode == "greedy" or not method.endswith("rejection"):
        assert drafted == plain
    assert figures["drafted_tokens"] > 0 and figures["accepted_tokens"] > 0, figures
    for ids in drafted:  # every answer closes its object and validates
        assert ids[-1] == tok.eos_id, tok.decode(ids)
        validate(json.loads(tok.decode(ids[:-1])), PERSON)


def test_forced_tokens_are_what_the_grammar_forces_after_the_committed_output():
    from ds4serve.engine.constraints import forced_tokens

    tok = tiny()[0]
    s = _state(matcher(response_format=SCHEMA), [])
    assert tok.decode(list(forced_tokens(s, 64))) == '{"name": "'
    assert len(forced_tokens(s, 3)) == 3
    s.output_ids.extend(tok.encode_text('{"name": "ab"'))
    assert tok.decode(list(forced_tokens(s, 64))) == ', "age":'
    assert s.constraint.num_tokens == len(s.output_ids)  # the matcher stays at the committed output
    s.output_ids.extend(tok.encode_text(' 4'))
    assert forced_tokens(s, 64) == ()  # a number may go on: nothing is forced
    assert forced_tokens(_state(None, [1, 2]), 8) == ()
    thinking = _state(matcher(thinking=True, response_format=SCHEMA), tok.encode_text("hm"))
    assert forced_tokens(thinking, 8) == ()  # inside the reasoning the grammar does not apply yet
    spent = _state(matcher(thinking=True, response_format=SCHEMA), tok.encode_text("hm"), max_reasoning_tokens=2)
    got = forced_tokens(spent, 64)  # the budget is spent: </think>, then the answer's forced start
    assert got[0] == tok.think_end_id and tok.decode(list(got[1:])) == '{"name": "'
    assert spent.constraint.num_tokens == len(spent.output_ids) and spent.constraint.in_reasoning


@pytest.mark.parametrize("method", ["ngram", "dspark"])
def test_a_schemas_forced_tokens_are_drafted_and_accepted(method):
    """A prompt without any JSON in it: prompt lookup finds nothing and the bundled drafter never saw the
    schema, so the drafts that are accepted are the grammar's forced keys and punctuation (the answer is
    96 tokens; 24 were accepted in drafts before forced tokens were drafted). Outputs equal plain decoding's."""
    from ds4serve.llm import LLM

    tok = tiny()[0]
    prompt = tok.encode_text("Describe a person as JSON.\nAnswer: ")
    params = [SamplingParams(max_tokens=160, temperature=0.0)] * 2
    plain, _ = _run(LLM(BUNDLED, max_seqs=2, warmup=False), [prompt] * 2, params)
    drafted, figures = _run(LLM(BUNDLED, max_seqs=2, warmup=False, speculative=json.dumps({"method": method})),
                            [prompt] * 2, params)
    assert drafted == plain
    assert figures["accepted_tokens"] >= 2 * 40, figures  # of 2 x 96 tokens, over half came as drafts


def _planned(policy, reqs, step: int = 1):
    from ds4serve.scheduler.admission import SchedulerLimits

    limits = SchedulerLimits(num_layers=2, max_model_len=512, step_tokens=256, max_prefill_tokens=64,
                             min_prefill_tokens=16, prefill_mode="chunk", max_queue=8,
                             step_costs=(4e-3, 1e-4, 1e-4))
    return policy.plan(reqs, limits, step=step)


def _constrained_request(prompt: list[int], rate: float):
    from ds4serve.scheduler.request import Request

    r = Request("r0", RequestSpec(prompt, SamplingParams(max_tokens=100, temperature=0.0),
                                  constraint=matcher(response_format=SCHEMA)))
    r.draft_rate = rate
    return r


def test_forced_tokens_are_drafted_whatever_the_rate_and_refused_lookups_lower_it():
    """A request whose rate is below the bar (not a probe step) still drafts what its grammar forces (a row
    with one allowed choice pays wherever a row does); a lookup the grammar refuses from its first token is
    never verified but counts against the rate, as a draft rejected at its first row."""
    from ds4serve.engine.constraints import forced_tokens
    from ds4serve.scheduler.drafting import DraftPolicy

    tok = tiny()[0]
    policy = DraftPolicy(k=4, min_n=1, max_n=3, window=512, max_rows=7, vocab_size=tiny()[1].vocab_size)
    low = _constrained_request(tok.encode_text("hello"), rate=0.01)
    drafted = _planned(policy, [low])["r0"]
    assert len(drafted) == 4 and '{"name": "'.startswith(tok.decode(list(drafted)))
    r = _constrained_request(tok.encode_text("7q7q"), rate=1.0)  # after a 7 the prompt has a q
    r.output_ids.extend(tok.encode_text('{"name": "ab", "age": 7'))  # a number: nothing is forced
    lookup = policy._lookup(r, 4)
    assert forced_tokens(r.sampler, 4) == () and lookup and allowed_prefix(r.sampler, lookup) == 0
    assert _planned(policy, [r]) == {} and r.draft_rate < 1.0
