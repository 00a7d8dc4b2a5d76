"""The bundled tiny DS4V model really answers: correctness under concurrency, eviction and the API.

These extend the vision tests' "same as solo" checks with "and right": the held-out questions have
exact answers. Skipped only if the bundled checkpoint is absent (it ships in models/ds4v-tiny).
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from ds4serve.chat import Tokenizer
from ds4serve.engine.sampling import SamplingParams
from ds4serve.scheduler.spec import RequestSpec
from ds4serve.multimodal.pipeline import ImagePipeline
from ds4serve.tiny.data import examples
from ds4serve.tiny.evaluate import answer_text, prepare, run_examples
from ds4serve.tiny.random_model import BUNDLED

pytestmark = pytest.mark.skipif(not (BUNDLED / "model.safetensors").exists(), reason="bundled model not present")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(BUNDLED)


@pytest.fixture(scope="module")
def make_llm():
    from ds4serve.llm import LLM

    cache = {}

    def get(**kw):
        key = tuple(sorted(kw.items()))
        if key not in cache:
            cache[key] = LLM(BUNDLED, **kw)
        return cache[key]

    return get


def _run(core, tok, exs, in_flight: int, grow: bool = False):
    """Answer ``exs`` with ``in_flight`` requests live at a time. ``grow`` keeps decoding past the answer
    (ignore_eos) so sequences outgrow their pages and a small pool must evict; the answer is the text
    before the first end-of-sentence token either way."""
    params = SamplingParams(max_tokens=48 if grow else 24, temperature=0, ignore_eos=grow)
    outputs = run_examples(core, tok, ImagePipeline.for_engine(core, tok), exs, in_flight, params)
    assert core.leaks() == ""
    return [answer_text(tok, ids[:ids.index(tok.eos_id)] if tok.eos_id in ids else ids) for ids in outputs]


def test_answers_correct_and_equal_to_solo_under_concurrency(make_llm, tok):
    exs = examples(5, 56)
    solo = _run(make_llm(max_seqs=1).core, tok, exs, in_flight=1)
    batched = _run(make_llm(max_seqs=16).core, tok, exs, in_flight=16)
    assert batched == solo
    correct = sum(a == ex.answer for a, ex in zip(batched, exs))
    assert correct >= 0.9 * len(exs), [(ex.question, ex.answer, a) for a, ex in zip(batched, exs) if a != ex.answer]


def test_mixed_traffic_image_answers_correct(make_llm, tok):
    """Two long text streams decode while image questions (one and two images) arrive: the image
    answers are right, and the text streams finish."""
    core = make_llm(max_seqs=8, step_tokens=24, max_prefill_tokens=256).core
    pipeline = ImagePipeline.for_engine(core, tok)
    streams = [core.make_request(RequestSpec(prepare(core, tok, pipeline, ex)[0],
                                             SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)))
               for ex in examples(8, 2, ("math",))]
    for r in streams:
        core.add(r)
    for _ in range(4):
        core.step()
    exs = [ex for ex in examples(9, 40) if ex.images][:12]
    reqs = []
    for ex in exs:
        ids, images = prepare(core, tok, pipeline, ex)
        reqs.append(core.make_request(RequestSpec(ids, SamplingParams(max_tokens=24, temperature=0), images=images)))
        core.add(reqs[-1])
    core.run_until_idle()
    assert all(len(r.output_ids) == 100 for r in streams)
    answers = [answer_text(tok, list(r.output_ids)) for r in reqs]
    correct = sum(a == ex.answer for a, ex in zip(answers, exs))
    assert correct >= 0.9 * len(exs), list(zip([e.question for e in exs], [e.answer for e in exs], answers))
    assert core.leaks() == ""


def test_forced_eviction_answers_correct(make_llm, tok):
    """A pool for about two requests: suspensions and drops happen, and the answers stay right."""
    exs = examples(11, 28)
    solo = _run(make_llm(max_seqs=1).core, tok, exs, in_flight=1, grow=True)
    core = make_llm(max_seqs=8, kv_budget=128, host_budget="40KB", step_tokens=16, max_prefill_tokens=128).core
    got = _run(core, tok, exs, in_flight=8, grow=True)
    stats = core.scheduler.stats
    assert stats["preempt_suspend"] + stats["preempt_drop"] > 0, stats
    assert got == solo
    correct = sum(a == ex.answer for a, ex in zip(got, exs))
    assert correct >= 0.9 * len(exs)


def test_readme_sample_through_the_api(tmp_path):
    import openai

    from ds4serve.server.inprocess import serve

    sample = Path(BUNDLED) / "sample.png"
    url = "data:image/png;base64," + base64.b64encode(sample.read_bytes()).decode()
    with serve(BUNDLED, name="ds4v-tiny", random_weights=False) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(model="ds4v-tiny", max_tokens=16, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What colour is the triangle?"}]}])
        assert out.choices[0].message.content == (Path(BUNDLED) / "sample_answer.txt").read_text().strip()


def test_prefill_page_deadlock_is_broken(tok, monkeypatch):
    """Six three-image requests (two pages each) in a four-page pool, their images held back: each
    prefills the text before its first image and holds a page, then the images arrive and every
    request is prefilling and needs a page another one holds. The scheduler must preempt (not wait
    forever: the chaos storm found this) and every answer must equal its solo run."""
    import random
    import threading

    from ds4serve.engine.encoder import EncoderWorker
    from ds4serve.llm import LLM
    from ds4serve.tiny.data import Example, random_scene

    gate = threading.Event()
    encode = EncoderWorker._encode
    rng = random.Random(5)
    exs = [Example("compare", "Which image has more shapes?", "", [random_scene(rng) for _ in range(3)])
           for _ in range(6)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    core = LLM(BUNDLED, max_seqs=6, kv_budget=256, host_budget="1MB", step_tokens=16, max_prefill_tokens=256).core
    assert core.cache.state.n_pages == 4
    monkeypatch.setattr(EncoderWorker, "_encode", lambda self, job: (gate.wait(30), encode(self, job))[1])  # after warm-up
    pipeline = ImagePipeline.for_engine(core, tok)
    reqs = []
    for ex in exs:
        ids, images = prepare(core, tok, pipeline, ex)
        reqs.append(core.make_request(RequestSpec(ids, params, images=images)))
    assert all(core.cache.layout.pages_for(r.total_len) == 2 for r in reqs)
    for r in reqs:
        core.add(r)
    for _ in range(3):
        core.step()
    assert core.cache.free_pages == 0 and all(r.output_ids == [] for r in reqs)
    gate.set()
    for r in reqs:
        assert core.encoder.wait(r.request_id, 30)
    for _ in range(2000):
        if not core.has_work:
            break
        core.step()
    assert not core.has_work, [(r.status.value, r.computed, r.total_len) for r in reqs]
    stats = core.scheduler.stats
    assert stats["preempt_suspend"] + stats["preempt_drop"] > 0, stats
    assert core.leaks() == ""
    solo_core = LLM(BUNDLED, max_seqs=1).core
    solo_pipeline = ImagePipeline.for_engine(solo_core, tok)
    for ex, r in zip(exs, reqs):
        ids, images = prepare(solo_core, tok, solo_pipeline, ex)
        alone = solo_core.make_request(RequestSpec(ids, params, images=images))
        solo_core.add(alone)
        solo_core.run_until_idle()
        assert list(r.output_ids) == list(alone.output_ids)
