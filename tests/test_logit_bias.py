"""``logit_bias``: added to the raw logits in the batched sampler (before penalties), logprobs stay raw,
and the server refuses what it cannot honour with a 400 naming the entry."""

from __future__ import annotations

import httpx
import pytest
import torch

from ds4serve.engine.drafted import row_states
from ds4serve.engine.sampling import SamplerState, SamplingError, SamplingParams, apply_bias, sample_rows


def _state(**kw) -> SamplerState:
    return SamplerState(SamplingParams(**kw), [1, 2], [], (0,))


def test_bias_is_one_batched_add_matching_a_dense_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 30, generator=gen)
    biases = [((3, 5.0), (29, -2.5)), (), ((0, 100.0),), ((7, -100.0), (8, 1.0), (9, 0.5))]
    states = [_state(temperature=0, logit_bias=b) for b in biases]
    dense = torch.zeros_like(logits)
    for i, b in enumerate(biases):
        for t, v in b:
            dense[i, t] = v
    assert torch.equal(apply_bias(logits, states), logits + dense)
    assert [d.token for d in sample_rows(logits, states)] == (logits + dense).argmax(-1).tolist()


def test_ban_and_force_under_greedy_and_logprobs_stay_raw():
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(1))
    best = int(logits.argmax())
    banned = sample_rows(logits, [_state(temperature=0, logit_bias=((best, -100.0),), logprobs=1)])[0]
    assert banned.token != best and banned.token == int(logits[0].topk(2).indices[1])
    forced = sample_rows(logits, [_state(temperature=0.8, seed=3, logit_bias=((5, 100.0),), logprobs=2)])[0]
    raw = torch.log_softmax(logits[0], -1)
    assert forced.token == 5 and forced.logprob == pytest.approx(float(raw[5]), abs=1e-6)
    assert [t for t, _ in forced.top_logprobs] == raw.topk(2).indices.tolist()


def test_bias_comes_before_penalties():
    """Repetition penalty divides a positive logit: a bias added first is divided with it (vLLM's order)."""
    logits = torch.tensor([[1.0, 2.0, 0.0]])
    s = SamplerState(SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias=((0, 2.0),)), [0], [], ())
    assert sample_rows(logits, [s])[0].token == 1  # (1 + 2) / 2 = 1.5 < 2; bias after the penalty would give 2.5


def test_ids_past_the_head_add_nothing():
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(2))
    out = apply_bias(logits, [_state(logit_bias=((10, 50.0), (2, 1.0))), _state()])
    expect = logits.clone()
    expect[0, 2] += 1.0
    assert torch.equal(out, expect)


def test_drafted_rows_carry_the_bias():
    s = _state(temperature=0, logit_bias=((4, 100.0),))
    rows = row_states(s, (7, 8), torch.device("cpu"))
    assert all(r.params.logit_bias == ((4, 100.0),) for r in rows)
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(3))
    assert [d.token for d in sample_rows(logits, rows)] == [4, 4, 4]


@pytest.mark.parametrize("bias", [((1, 101.0),), ((1, float("nan")),), ((-1, 1.0),), ((2, 1.0), (2, 3.0))])
def test_bad_bias_is_rejected(bias):
    with pytest.raises(SamplingError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


# ---- over HTTP ----------------------------------------------------------------------------------

PROMPT = [{"role": "user", "content": "Name three colours."}]


def _chat(server, **body) -> httpx.Response:
    return httpx.post(server.base + "/v1/chat/completions",
                      json={"model": "tiny", "messages": PROMPT, "temperature": 0, **body}, timeout=60)


def test_http_negative_bias_bans_the_greedy_token(server):
    tok = server.state.tokenizer
    first = _chat(server, max_tokens=1).json()["choices"][0]["message"]["content"]
    assert first
    same = [i for i in range(tok.vocab_size) if tok.decode([i], False) == first]
    assert same, first
    out = _chat(server, max_tokens=1, logit_bias={str(i): -100 for i in same}).json()
    assert out["choices"][0]["message"]["content"] != first


def test_http_positive_bias_forces_a_token_on_both_routes(server):
    tok = server.state.tokenizer
    forced = next(i for i in range(tok.vocab_size) if tok.decode([i], False) == "q")
    out = _chat(server, max_tokens=3, temperature=1.0, seed=7, logit_bias={str(forced): 100}).json()
    assert out["choices"][0]["message"]["content"] == "qqq"
    r = httpx.post(server.base + "/v1/completions", json={"model": "tiny", "prompt": "The", "max_tokens": 3,
                                                          "temperature": 0, "logit_bias": {str(forced): 100}},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "qqq"


@pytest.mark.parametrize("bias, words", [
    ({"10000000": 5}, "10000000 is outside the vocabulary"),
    ({"-3": 5}, "-3 is outside the vocabulary"),
    ({"abc": 5}, "'abc' is not a token id"),
    ({"--5": 5}, "'--5' is not a token id"),
    ({"5": "nan"}, "token 5 is nan"),
    ({"5": 101}, "token 5 is 101"),
    ({"5": -250.5}, "token 5 is -250.5"),
    ({"5": 1, "05": 2}, "twice"),
    ({"5": "lots"}, None),
])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_http_bad_logit_bias_is_a_400_naming_it(server, route, bias, words):
    body = {"model": "tiny", "max_tokens": 1, "logit_bias": bias}
    body.update({"messages": PROMPT} if route.endswith("chat/completions") else {"prompt": "a"})
    r = httpx.post(server.base + route, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith("logit_bias"), err
    if words:
        assert words in err["message"], err
