"""Tensor and expert parallel over torch.distributed (gloo, 2 CPU processes) on the bundled model.

The reference is the same server in one process: 16 concurrent chat requests, half of them with an
image, greedy, must give the same text, and their top-5 logprobs may differ only by the reordered
floating-point sums of the all-reduces. Then the failure paths: a rank raising inside a step fails
that step's requests on every rank and the server keeps serving; a rank that dies or hangs stops the
server with a clear error instead of a hang.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from ds4serve.runtime.tp_group import ParallelSettings
from ds4serve.tiny.random_model import BUNDLED
from image_helpers import SAMPLE_QUESTIONS, SAMPLE_URL
from server_harness import serve
from tp_faults import MAGIC

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

IMAGE, QUESTIONS = SAMPLE_URL, SAMPLE_QUESTIONS
SETTINGS = {"warmup": True, "max_seqs": 8}


def _ask(client: openai.OpenAI, i: int) -> tuple[str, list[list[tuple[str, float]]]]:
    q = QUESTIONS[i % len(QUESTIONS)]
    content = [{"type": "image_url", "image_url": {"url": IMAGE}}, {"type": "text", "text": q}] if i % 2 else q
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                       max_tokens=12, temperature=0, logprobs=True, top_logprobs=5)
    top = [[(t.token, t.logprob) for t in c.top_logprobs] for c in r.choices[0].logprobs.content]
    return r.choices[0].message.content, top


def _sixteen(parallel: ParallelSettings | None):
    with serve(BUNDLED, random_weights=False, settings=SETTINGS, parallel=parallel) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0)
        with ThreadPoolExecutor(16) as pool:
            return list(pool.map(lambda i: _ask(client, i), range(16)))


@pytest.fixture(scope="module")
def one_process():
    return _sixteen(None)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep"])
def test_two_ranks_answer_as_one_process(one_process, expert_parallel):
    got = _sixteen(ParallelSettings(2, expert_parallel, timeout_s=60))
    assert [g[0] for g in got] == [b[0] for b in one_process]
    assert got[0][0] == "12" and got[1][0] == "green"  # the model really answers, on text and on the image
    diffs = [abs(x[1] - y[1]) for a, b in zip(one_process, got) for ta, tb in zip(a[1], b[1])
             for x, y in zip(ta, tb) if x[0] == y[0]]
    assert len(diffs) >= 16 * 5
    logging.getLogger(__name__).warning("tp=2 ep=%s: max top-5 logprob difference %.3g", expert_parallel, max(diffs))
    assert max(diffs) < 1e-4


NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'
ECHO = [5, 9, 14, 22, 5, 9, 14, 22, 5, 9, 14, 22, 5, 9]  # a repeating prompt: lookup finds matches


def _drafted_answers(parallel: ParallelSettings | None, speculative: str | None):
    """Completions one after another (one stream: drafting pays) and the accepted-draft total."""
    import httpx

    settings = SETTINGS | ({"speculative": speculative} if speculative else {})
    with serve(BUNDLED, random_weights=False, settings=settings, parallel=parallel) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0)
        texts = [client.completions.create(model="tiny", prompt=ECHO[i:], max_tokens=40, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].text
                 for i in range(4)]
        texts.append(_ask(client, 1)[0])  # and the image question: its answer is known
        metrics = httpx.get(srv.base + "/metrics", timeout=30).text
        assert srv.loop.call(lambda core: core.leaks()) == ""
    line = [x for x in metrics.splitlines() if x.startswith("ds4serve_spec_decode_num_accepted_tokens_total")]
    return texts, float(line[0].split()[-1]) if line else 0.0


@pytest.fixture(scope="module")
def plain_answers():
    return _drafted_answers(None, None)[0]


@pytest.mark.parametrize("spec", [NGRAM, '{"method": "dspark"}'], ids=["ngram", "dspark"])
def test_drafts_under_two_ranks_answer_as_one_plain_process(plain_answers, spec):
    """Rank 0 samples and verifies (and runs the bundled DSpark drafter whole, on the target layers' full
    rows); every rank rolls back the same rejected rows (the accepted counts agreed in one all-reduce), so
    two ranks with drafts answer as one process without them."""
    drafted, accepted = _drafted_answers(ParallelSettings(2, False, timeout_s=60), spec)
    assert drafted == plain_answers and plain_answers[-1] == "green"
    assert accepted > 0


def test_a_rank_that_raises_in_a_drafted_step_fails_it_everywhere(plain_answers, caplog):
    """The drafted step's collectives include the accepted counts' all-reduce: the failing rank drains it
    too, so rank 0 is not left waiting; the step fails on every rank and is undone, and its request,
    recomputed, answers as one plain process does (the fault fires once)."""
    par = ParallelSettings(2, False, timeout_s=60, worker_hook="tp_faults:raise_on_first_draft")
    settings = SETTINGS | {"speculative": NGRAM}
    with serve(BUNDLED, random_weights=False, settings=settings, parallel=par) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0)
        with caplog.at_level(logging.ERROR, logger="ds4serve"):
            text = client.completions.create(model="tiny", prompt=ECHO, max_tokens=40, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
        assert any("failed on another tensor-parallel rank" in r.getMessage() for r in caplog.records)
        assert text == plain_answers[0]
        assert _ask(client, 0)[0] == "12" and _ask(client, 1)[0] == "green"
        assert srv.loop.call(lambda core: core.leaks()) == ""


def test_a_rank_that_raises_fails_the_step_everywhere_and_the_server_goes_on(caplog):
    par = ParallelSettings(2, False, timeout_s=60, worker_hook="tp_faults:raise_on_token")
    with serve(BUNDLED, random_weights=False, settings=SETTINGS, parallel=par) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0)
        with caplog.at_level(logging.ERROR, logger="ds4serve"):
            with pytest.raises(openai.APIStatusError) as err:
                client.completions.create(model="tiny", prompt=[5, 9, MAGIC, 11], max_tokens=4, temperature=0)
        assert err.value.status_code >= 500
        assert any("failed on another tensor-parallel rank" in r.getMessage() for r in caplog.records)
        assert _ask(client, 0)[0] == "12" and _ask(client, 1)[0] == "green"  # both ranks still agree
        assert srv.loop.call(lambda core: core.leaks()) == ""


# The collective timeout of the lost-rank test: how long a step waits for a hung rank. It must stay far
# above any healthy wait between the ranks on a loaded machine (a 4 s timeout ran out on 2 busy cores
# while the worker was still in a step), and every wait on the lost rank's consequences is a wait for an
# event with several times this as its bound, so only a real hang can take that long.
LOST_RANK_TIMEOUT_S = 20.0


def _wait_for(what: str, happened, within_s: float) -> None:
    """Poll ``happened()`` until it is true; fail naming ``what`` when ``within_s`` pass first."""
    deadline = time.monotonic() + within_s
    while not happened():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {within_s:.0f} s")
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_a_lost_rank_stops_the_server_with_a_clear_error(how, caplog):
    """A rank that dies is noticed by rank 0's watchdog at once, with no request needed: it logs the rank
    and its exit code and stops the server. One that hangs (SIGSTOP) is noticed by the next step's
    collective timeout, which stops the server with a fatal step error. Either way the request fails with
    the server's error, not the client's timeout (4x the collective timeout), so a hang fails the test."""
    par = ParallelSettings(2, False, timeout_s=LOST_RANK_TIMEOUT_S)
    with serve(BUNDLED, random_weights=False, settings=SETTINGS, parallel=par) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0,
                               timeout=4 * LOST_RANK_TIMEOUT_S)
        assert _ask(client, 0)[0] == "12"
        worker = srv.loop.core.parallel.workers[0]

        def logged() -> str:
            return " ".join(r.getMessage() for r in caplog.records)

        with caplog.at_level(logging.CRITICAL, logger="ds4serve"):
            os.kill(worker.pid, signal.SIGKILL if how == "dies" else signal.SIGSTOP)
            try:
                if how == "dies":
                    _wait_for("the watchdog stopping the server", lambda: not srv.loop.alive,
                              4 * LOST_RANK_TIMEOUT_S)
                with pytest.raises(openai.APIError) as err:
                    _ask(client, 0)
                assert not isinstance(err.value, openai.APITimeoutError), "the request hung until the client gave up"
                _wait_for("the server stopping", lambda: not srv.loop.alive, 4 * LOST_RANK_TIMEOUT_S)
                if how == "dies":
                    assert f"tensor-parallel rank 1 (pid {worker.pid}) exited with code -9" in logged(), logged()
                else:
                    assert "fatal step error" in logged() and "tensor-parallel" in logged(), logged()
            finally:
                if how == "hangs":
                    os.kill(worker.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def mtp_splittable(tmp_path_factory):
    """A random config C trunk with two output groups (o_groups 1 does not split over two ranks), its random
    MTP block, and a byte tokenizer padded to the vocabulary (so the server decodes every id)."""
    from dspark_checkpoint import build_trunk
    from mtp_checkpoint import write_byte_tokenizer, write_mtp_checkpoint

    root = tmp_path_factory.mktemp("mtp_tp")
    ckpt = write_mtp_checkpoint(build_trunk(root, o_groups=2), root / "ckpt", o_groups=2)
    return write_byte_tokenizer(ckpt)


def _mtp_answers(path, parallel: ParallelSettings | None, speculative: str | None):
    """Greedy completions of the repeating prompt, their tokens, and the drafted-token total. No warm-up,
    so no start-up calibration: a random block's drafts pay nothing, and a calibration on a loaded machine
    may price even the first probe out (a CI run drafted none); the uncalibrated prior lets the first
    decode steps draft, whatever the machine."""
    import httpx

    settings = {"max_seqs": 8} | ({"speculative": speculative} if speculative else {})
    with serve(path, random_weights=False, settings=settings, parallel=parallel) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0)
        choices = [client.completions.create(model="tiny", prompt=ECHO[i:], max_tokens=30, temperature=0, logprobs=1,
                                             extra_body={"ignore_eos": True}).choices[0] for i in range(4)]
        metrics = httpx.get(srv.base + "/metrics", timeout=30).text
        assert srv.loop.call(lambda core: core.leaks()) == ""
    line = [x for x in metrics.splitlines() if x.startswith("ds4serve_spec_decode_num_draft_tokens_total")]
    return [(c.text, c.logprobs.tokens) for c in choices], float(line[0].split()[-1]) if line else 0.0


def test_mtp_drafts_under_two_ranks_answer_as_one_plain_process(mtp_splittable):
    """The serial MTP block runs whole on rank 0 over the last layer's full rows (its own layers reduce
    nothing); its blocks are verified in the two ranks' step and the rejected rows rolled back on both, so
    two ranks with MTP drafts give one plain process's tokens. (A random block's drafts are rejected: the
    accepted side of the agreement is the n-gram and DSpark tests'.)"""
    plain, _ = _mtp_answers(mtp_splittable, None, None)
    got, drafted = _mtp_answers(mtp_splittable, ParallelSettings(2, False, timeout_s=60),
                                '{"method": "mtp", "num_speculative_tokens": 2}')
    assert got == plain and all(len(tokens) == 30 for _, tokens in plain)
    assert drafted > 0
