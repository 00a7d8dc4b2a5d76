"""The bundled DS4V model's DSpark drafter in the server, 16 chat requests at once, half of them with an
image (issue 28: "greedy output equals plain decoding at concurrency 16, text and images mixed"). The
drafter follows the prompts' rows, image blocks included, and drafts only after them (a draft never holds
an image id), so the answers must be the plain server's, token for token, while drafts are verified in
the same steps as the image prefills."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from ds4serve.tiny.random_model import BUNDLED
from image_helpers import SAMPLE_QUESTIONS, SAMPLE_URL
from server_harness import serve

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

IMAGE, QUESTIONS = SAMPLE_URL, SAMPLE_QUESTIONS


def _ask(client: openai.OpenAI, i: int) -> list[str]:
    q = QUESTIONS[i % len(QUESTIONS)]
    content = [{"type": "image_url", "image_url": {"url": IMAGE}}, {"type": "text", "text": q}] if i % 2 else q
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                       max_tokens=24, temperature=0, logprobs=True,
                                       extra_body={"ignore_eos": True})  # past the answer: 24 tokens to draft
    return [t.token for t in r.choices[0].logprobs.content]


def _sixteen(speculative: str | None) -> tuple[list[list[str]], float]:
    settings = {"max_seqs": 16} | ({"speculative": speculative} if speculative else {})
    with serve(BUNDLED, random_weights=False, settings=settings) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0)
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda i: _ask(client, i), range(16)))
        metrics = httpx.get(srv.base + "/metrics", timeout=30).text
        assert srv.loop.call(lambda core: core.leaks()) == ""
    line = [x for x in metrics.splitlines() if x.startswith("ds4serve_spec_decode_num_draft_tokens_total")]
    return answers, float(line[0].split()[-1]) if line else 0.0


def test_sixteen_mixed_requests_with_dspark_drafts_answer_as_the_plain_server():
    plain, _ = _sixteen(None)
    drafted, n_drafted = _sixteen('{"method": "dspark"}')
    assert drafted == plain and all(len(a) == 24 for a in plain)
    assert "".join(plain[0]).startswith("12") and "".join(plain[1]).startswith("green")  # it really answers
    assert n_drafted >= 50
