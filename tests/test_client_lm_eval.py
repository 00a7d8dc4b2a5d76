"""lm-eval (EleutherAI's harness) runs its ``local-completions`` model unmodified against the bundled model
served in-process: a multiple-choice task scored by log-likelihood, and a generate task rendered with
``--apply_chat_template`` through the model folder's own tokenizer and chat template.

The tasks are defined here (a YAML task over a local JSON-lines file, loaded by ``datasets``' packaged
``json`` builder), so nothing is downloaded and lm-eval runs offline. The oracles are independent of
the server: every log-likelihood lm-eval reports must equal the one computed in process by ``LLM`` on the
same checkpoint (the serving engine's forward over the whole sequence, log-softmax, summed over the
continuation in a plain loop), and the accuracy must be what those values give; every generated answer
must equal what ``/v1/chat/completions`` answers for the same question, which renders with ds4serve's
own encoder instead of the Jinja template.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from ds4serve.chat import Tokenizer
from ds4serve.llm import LLM
from ds4serve.server.inprocess import serve

BUNDLED = Path(__file__).resolve().parent.parent / "models" / "ds4v-tiny"
# chunks of 16 on both sides, so the server's prompt logprobs and the in-process reference are bit-equal
SETTINGS = {"max_prefill_tokens": 16, "step_tokens": 16, "min_prefill_tokens": 8, "host_kernels": "on"}
SUMS = [(7, 5), (3, 4), (12, 9), (20, 13), (6, 6)]
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}
MC_TASK = """task: ds4_tiny_sums_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GEN_TASK = """task: ds4_tiny_sums_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def server():
    with serve(BUNDLED, name="tiny", random_weights=False, settings=SETTINGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    """The two task YAMLs and their documents in one folder (``--include_path``)."""
    root = tmp_path_factory.mktemp("lm-eval-tasks")
    docs = [{"question": f"What is {x} + {y}?", "answer": str(x + y),
             "choices": [str(x + y + d) for d in (0, 1, -2, 10)], "gold": 0} for x, y in SUMS]
    for i, d in enumerate(docs):  # the right answer not always first
        d["choices"] = d["choices"][i % 4:] + d["choices"][:i % 4]
        d["gold"] = d["choices"].index(d["answer"])
    (root / "sums.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / "mc.yaml").write_text(MC_TASK.format(data=root / "sums.jsonl"))
    (root / "gen.yaml").write_text(GEN_TASK.format(data=root / "sums.jsonl"))
    return root


@pytest.fixture()
def offline(monkeypatch, tmp_path):
    """No network: the Hub and datasets offline, their caches in the test's folder."""
    env = {**OFFLINE, "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(tmp_path / "hf" / "datasets")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)


# simple_evaluate: the per-document samples kept for the checks, every seed fixed
RUN = {"log_samples": True, "random_seed": 0, "numpy_random_seed": 0, "torch_random_seed": 0}


def task_manager(tasks: Path):
    """Only the tasks defined here (indexing lm-eval's thousands of built-in task files takes ~30 s)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(tasks), include_defaults=False)


def model_args(server, **more) -> str:
    args = {"model": "tiny", "base_url": server.base + "/v1/completions", "tokenizer_backend": "huggingface",
            "tokenizer": str(BUNDLED), "num_concurrent": 1, "max_retries": 1, "timeout": 120, **more}
    return ",".join(f"{k}={v}" for k, v in args.items())


def reference_loglikelihood(llm: LLM, tok: Tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """log P(continuation | context) and whether it is the greedy one, from the in-process engine.

    The split is lm-eval's documented one (encode the whole string, the context's tokens first, the rest
    is the continuation); the sum runs token by token in order, as a float sum over the logprobs."""
    whole = tok.encode_text(context + continuation)
    ctx = tok.encode_text(context)
    assert whole[:len(ctx)] == ctx
    logprobs = torch.log_softmax(llm.prompt_logits(whole, engine=True), dim=-1)
    total, greedy = 0.0, True
    for pos in range(len(ctx), len(whole)):
        row = logprobs[pos - 1]
        total += float(row[whole[pos]])
        greedy = greedy and int(row.argmax()) == whole[pos]
    return total, greedy


def test_an_answer_ended_by_eos_keeps_its_logprob_entry(server):
    """What lm-eval relies on: echo with ``max_tokens: 1`` gives prompt + 1 entries even when the one
    token generated is the end of sequence (lm-eval drops the last entry as the generated one; without
    it, it would drop a continuation token). ``Answer: 12`` is followed by EOS on this model."""
    tok = Tokenizer(BUNDLED)
    ids = tok.encode_text("Question: What is 7 + 5?\nAnswer: 12")
    body = {"model": "tiny", "prompt": [ids], "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    r = httpx.post(server.base + "/v1/completions", json=body, timeout=120).json()
    [choice] = r["choices"]
    lp = choice["logprobs"]
    assert choice["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 1
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(ids) + 1
    assert lp["tokens"][-1] == tok.token_text(tok.eos_id) and choice["text"] == tok.decode(ids)
    assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())
    streamed = []
    with httpx.stream("POST", server.base + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"][0]["logprobs"]["token_logprobs"]
    assert streamed == lp["token_logprobs"]


def test_multiple_choice_loglikelihoods_equal_the_in_process_llm(server, tasks, offline):
    """``simple_evaluate`` with ``local-completions`` (token-id prompts, batches of 3, echo + logprobs 1 +
    max_tokens 1 as lm-eval sends them): every (log-likelihood, is_greedy) equals LLM's, and lm-eval's
    accuracy is the fraction of documents whose gold choice has the highest reference log-likelihood."""
    from lm_eval import simple_evaluate  # in the test extra: a missing install fails, it does not skip
    from lm_eval.utils import make_table

    out = simple_evaluate(model="local-completions", model_args=model_args(server, batch_size=3),
                          tasks=["ds4_tiny_sums_mc"], task_manager=task_manager(tasks), **RUN)
    print(make_table(out))
    samples = out["samples"]["ds4_tiny_sums_mc"]
    assert len(samples) == len(SUMS)
    llm, tok = LLM(BUNDLED, **SETTINGS), Tokenizer(BUNDLED)
    right = 0
    for s in samples:
        doc = s["doc"]
        context = f"Question: {doc['question']}\nAnswer:"
        want = [reference_loglikelihood(llm, tok, context, " " + c) for c in doc["choices"]]
        got = [tuple(r[0]) for r in s["resps"]]  # one request per choice, one (loglikelihood, is_greedy) each
        assert got == want, doc
        scores = [lp for lp, _ in want]
        right += scores.index(max(scores)) == doc["gold"]
    assert out["results"]["ds4_tiny_sums_mc"]["acc,none"] == right / len(SUMS)


def chat_answer(server, question: str) -> str:
    body = {"model": "tiny", "messages": [{"role": "user", "content": question}], "max_tokens": 16,
            "temperature": 0, "seed": 1234, "stop": ["\n"]}
    r = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def tokenize(server, **body) -> list[int]:
    r = httpx.post(server.base + "/tokenize", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_generate_task_with_the_chat_template(server, tasks, offline):
    """A generate task with ``apply_chat_template`` (the CLI's ``--apply_chat_template``): the prompt lm-eval
    renders through ``AutoTokenizer`` and the folder's ``chat_template.jinja`` tokenizes on the server to
    ds4serve's own chat prompt, and every answer equals the chat route's answer for the same question;
    exact_match is what those answers give."""
    from lm_eval import simple_evaluate
    from lm_eval.utils import make_table

    out = simple_evaluate(model="local-completions", model_args=model_args(server), tasks=["ds4_tiny_sums_gen"],
                          task_manager=task_manager(tasks), apply_chat_template=True, **RUN)
    print(make_table(out))
    samples = out["samples"]["ds4_tiny_sums_gen"]
    assert len(samples) == len(SUMS)
    right = 0
    for s in samples:
        question = s["doc"]["question"]
        prompt = s["arguments"][0][0]
        assert tokenize(server, prompt=prompt) == tokenize(server, messages=[{"role": "user", "content": question}])
        answer = chat_answer(server, question)
        assert s["resps"] == [[answer]], question
        right += answer.strip() == s["doc"]["answer"]
    assert out["results"]["ds4_tiny_sums_gen"]["exact_match,none"] == right / len(SUMS) and right >= 3
