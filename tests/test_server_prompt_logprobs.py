"""Prompt logprobs over HTTP through the `openai` client: completions' ``echo`` with ``logprobs`` (what
lm-eval's ``local-completions`` loglikelihood sends and parses), ``max_tokens: 0``, and vLLM's
``prompt_logprobs`` on both routes, each exact against ``LLM`` on the same checkpoint.

The server runs the native forward with chunks of 16 tokens; the reference is the same engine forward
over the full prompt (``LLM.prompt_logits(engine=True)``), so the values are bit-equal."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from ds4serve.llm import LLM

SETTINGS = {"max_prefill_tokens": 16, "step_tokens": 16, "min_prefill_tokens": 8, "host_kernels": "on"}
CONTEXT = "The quick brown fox jumps over the lazy dog because"
CONTINUATIONS = [" it was bored", " the dog was asleep and did not care"]


@pytest.fixture(scope="module")
def srv(random_ckpt):
    from server_harness import serve

    with serve(random_ckpt, settings=SETTINGS) as s:
        yield s


@pytest.fixture(scope="module")
def llm(random_ckpt):
    return LLM(random_ckpt, **SETTINGS)


@pytest.fixture()
def client(srv):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=60)


def _ids(srv, text: str) -> list[int]:
    return httpx.post(srv.base + "/tokenize", json={"prompt": text}).json()["tokens"]


def _ref(llm, ids: list[int]) -> torch.Tensor:
    """Reference logprobs: the serving engine's forward and head over the whole prompt, log_softmax."""
    return torch.log_softmax(llm.prompt_logits(ids, engine=True), dim=-1)


def _lm_eval_loglikelihood(choice, ctxlen: int, generated: int) -> tuple[float, bool]:
    """What lm-eval's ``LocalCompletionsAPI.parse_logprobs`` computes from one choice: the sum of the
    continuation's token logprobs (the generated tokens at the end dropped), and whether every one of
    them is the top-1 alternative."""
    lp = choice.logprobs
    stop = len(lp.token_logprobs) - generated
    logprob = sum(lp.token_logprobs[ctxlen:stop])
    greedy = all(tok == max(top.values()) for tok, top in zip(lp.token_logprobs[ctxlen:stop], lp.top_logprobs[ctxlen:stop]))
    return logprob, greedy


def _llm_loglikelihood(llm, ids: list[int], ctxlen: int) -> tuple[float, bool]:
    ref = _ref(llm, ids)
    target = torch.tensor(ids[ctxlen:])
    rows = ref[ctxlen - 1:-1]
    lps = rows.gather(1, target.unsqueeze(1)).squeeze(1)
    return sum(lps.tolist()), bool((rows.argmax(-1) == target).all())


@pytest.mark.parametrize("max_tokens", [0, 1])
@pytest.mark.parametrize("as_ids", [True, False], ids=["token-ids", "text"])
def test_lm_eval_loglikelihood_request(srv, llm, client, max_tokens, as_ids):
    """lm-eval's loglikelihood request (context + continuation, echo, logprobs 1, temperature 0; lm-eval
    itself sends max_tokens 1 and drops the generated token) for a batch of continuations, as token ids
    (its default) and as text; its log-likelihood and is_greedy equal LLM's."""
    ctx = _ids(srv, CONTEXT)
    fulls = [_ids(srv, CONTEXT + c) for c in CONTINUATIONS]
    assert all(f[:len(ctx)] == ctx for f in fulls)
    prompt = [CONTEXT + c for c in CONTINUATIONS]
    if as_ids:  # and the greedy continuation of the context, so is_greedy is true for one of them
        fulls.append(ctx + llm.generate([ctx], max_tokens=3, ignore_eos=True)[0])
        prompt = fulls
    out = client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=1, max_tokens=max_tokens,
                                    temperature=0, seed=1234)
    got = [_lm_eval_loglikelihood(c, len(ctx), max_tokens) for c in sorted(out.choices, key=lambda c: c.index)]
    want = [_llm_loglikelihood(llm, f, len(ctx)) for f in fulls]
    assert got == want
    assert got[-1][1] is as_ids and not any(g for _, g in got[:2])
    for c, f in zip(sorted(out.choices, key=lambda c: c.index), fulls):
        assert len(c.logprobs.tokens) == len(f) + max_tokens
        assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
        assert c.finish_reason == "length" and c.logprobs.text_offset[0] == 0
    assert out.usage.completion_tokens == max_tokens * len(fulls)


def test_echo_text_stream_and_long_prompt(srv, llm, client):
    """A prompt of several chunks: echo puts the prompt text first, streamed and not; every prompt
    logprob is bit-equal to the reference, and the generated entries follow."""
    text = CONTEXT * 3
    ids = _ids(srv, text)
    assert len(ids) > 3 * SETTINGS["max_prefill_tokens"]
    out = client.completions.create(model="tiny", prompt=text, echo=True, logprobs=2, max_tokens=3, temperature=0)
    choice = out.choices[0]
    assert choice.text.startswith(text) and len(choice.text) > len(text)
    ref = _ref(llm, ids)
    want = ref[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()
    assert choice.logprobs.token_logprobs[1:len(ids)] == want
    assert all(len(t) == 2 for t in choice.logprobs.top_logprobs[1:])
    chunks = list(client.completions.create(model="tiny", prompt=text, echo=True, logprobs=2, max_tokens=3,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == choice.logprobs.token_logprobs
    plain = client.completions.create(model="tiny", prompt=text, echo=True, max_tokens=0)
    assert plain.choices[0].text == text and plain.choices[0].logprobs is None


def _vllm_check(prompt_logprobs: list, ids: list[int], ref: torch.Tensor, top: int) -> None:
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for pos, (entry, tok) in enumerate(zip(prompt_logprobs[1:], ids[1:]), start=1):
        row = ref[pos - 1]
        mine = entry[str(tok)]
        assert mine["logprob"] == float(row[tok]) and mine["rank"] == int((row > row[tok]).sum()) + 1
        tv, ti = torch.topk(row, top)
        for r, (v, i) in enumerate(zip(tv.tolist(), ti.tolist()), start=1):
            assert entry[str(i)]["logprob"] == v
            assert entry[str(i)]["rank"] == (r if i != tok else mine["rank"])
        assert set(entry) == {str(i) for i in ti.tolist()} | {str(tok)}
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())


def test_vllm_prompt_logprobs_on_both_routes(srv, llm, client):
    """vLLM's ``prompt_logprobs``: per completion choice, and on the chat response (its rendered prompt)."""
    ids = _ids(srv, CONTEXT)
    out = client.completions.create(model="tiny", prompt=CONTEXT, max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    _vllm_check(out.choices[0].model_extra["prompt_logprobs"], ids, _ref(llm, ids), 2)
    msgs = [{"role": "user", "content": CONTEXT}]
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 1})
    chat_ids = httpx.post(srv.base + "/tokenize", json={"messages": msgs}).json()["tokens"]
    _vllm_check(chat.model_extra["prompt_logprobs"], chat_ids, _ref(llm, chat_ids), 1)
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, temperature=0,
                                                 stream=True, extra_body={"prompt_logprobs": 1}))
    carried = [c.model_extra["prompt_logprobs"] for c in chunks if (c.model_extra or {}).get("prompt_logprobs")]
    assert carried == [chat.model_extra["prompt_logprobs"]]
    plain = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, temperature=0)
    assert "prompt_logprobs" not in (plain.model_extra or {})


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": -1, "echo": True}, "max_tokens"),
    ({"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "a", "echo": True, "logprobs": 21}, "logprobs"),
])
def test_bad_prompt_scoring_requests_are_400(srv, body, param):
    r = httpx.post(srv.base + "/v1/completions", json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert param in r.text
