"""Injected faults in the real engine fail one request alone; the others get their solo tokens.

The bundled tiny DS4V serves 16 concurrent requests (image and text questions; half greedy, half
seeded sampling, so a step that drew tokens before failing must not shift anyone's random stream).
One request is poisoned in a different way per test: its sampler raises, its image rows are
corrupt (wrong width: the forward raises; wrong count: refused before compute), or the engine
raises inside one of its layer slices. Every other request must finish with exactly the tokens it
gets alone, the poisoned one fails with an error, and nothing leaks. Also here: the issue's staging
overflow (an image prompt of ~1,040 tokens while another request decodes). Each test runs on the
native host forward and on the torch forward CUDA runs (``host_kernels``: ``host-on`` / ``host-off``), the
solo references in the same mode.
"""

from __future__ import annotations

import pytest
import torch

from ds4serve.chat import Tokenizer
from ds4serve.engine import executor
from ds4serve.engine.sampling import SamplingParams
from ds4serve.scheduler.spec import RequestSpec
from ds4serve.multimodal.pipeline import ImagePipeline
from ds4serve.scheduler.request import RequestStatus
from ds4serve.tiny.data import examples
from ds4serve.tiny.evaluate import prepare
from ds4serve.tiny.random_model import BUNDLED

pytestmark = pytest.mark.skipif(not (BUNDLED / "model.safetensors").exists(), reason="bundled model not present")

N = 16
SLICED = {"max_seqs": N, "step_tokens": 24}  # image passes run one layer per step beside 16 decoders


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(BUNDLED)


@pytest.fixture(scope="module")
def llms(host_kernels):
    """The solo reference and the batch engine, both on the one forward (``host_kernels``) under test."""
    from ds4serve.llm import LLM

    return {"solo": LLM(BUNDLED, max_seqs=1, host_kernels=host_kernels),
            "batch": LLM(BUNDLED, host_kernels=host_kernels, **SLICED)}


@pytest.fixture(scope="module")
def work(llms, tok):
    """16 prepared requests (ids, images, params) and each one's tokens when it runs alone."""
    core = llms["solo"].core
    pipe = ImagePipeline.for_engine(core, tok)
    items = []
    for i, ex in enumerate(examples(7, N)):
        ids, images = prepare(core, tok, pipe, ex)
        params = SamplingParams(max_tokens=10, temperature=0) if i % 2 else \
            SamplingParams(max_tokens=10, temperature=0.9, seed=100 + i, ignore_eos=True)
        items.append((ids, images, params))
    solo = []
    for ids, images, params in items:
        req = core.make_request(RequestSpec(ids, params, images=images))
        core.add(req)
        core.run_until_idle()
        assert req.status.finished and req.error is None
        solo.append(list(req.output_ids))
    assert sum(1 for _, im, _ in items if im) >= 4, "expected image requests in the mix"
    return items, solo


def _serve_all(core, items):
    reqs = [core.make_request(RequestSpec(ids, params, images=images)) for ids, images, params in items]
    for r in reqs:
        core.add(r)
    core.run_until_idle()
    assert core.leaks() == ""
    return reqs


def _check(core, reqs, solo, bad: int, needle: str) -> None:
    assert reqs[bad].status is RequestStatus.FINISHED_ERROR, reqs[bad].status
    assert needle in reqs[bad].error, reqs[bad].error
    for i, r in enumerate(reqs):
        if i != bad:
            assert r.error is None and r.output_ids == solo[i], (i, r.error)


def _first_image(items) -> int:
    return next(i for i, (_, images, _) in enumerate(items) if images)


def test_a_sampler_that_raises_for_one_request(llms, work, monkeypatch):
    items, solo = work
    core = llms["batch"].core
    bad = 5
    real = executor.sample_rows
    victim = {}

    def sample_rows(logits, states):
        if any(s is victim.get("sampler") for s in states):
            raise RuntimeError("injected sampler fault")
        return real(logits, states)

    monkeypatch.setattr(executor, "sample_rows", sample_rows)
    reqs = [core.make_request(RequestSpec(ids, params, images=images)) for ids, images, params in items]
    victim["sampler"] = reqs[bad].sampler
    before = dict(core.scheduler.stats)
    for r in reqs:
        core.add(r)
    core.run_until_idle()
    assert core.leaks() == ""
    _check(core, reqs, solo, bad, "injected sampler fault")
    st = core.scheduler.stats
    assert st["isolated_failures"] - before["isolated_failures"] == 1
    assert st["recomputed_after_failure"] > before["recomputed_after_failure"]


@pytest.mark.parametrize("poison,needle", [
    (lambda rows: torch.cat([rows, rows[:, :1]], dim=1), "failed again when it ran alone"),  # the forward raises
    (lambda rows: rows[:-1], "refused before compute"),  # IMAGE slots without their rows
], ids=["too-wide", "too-few"])
def test_poisoned_image_rows(llms, work, poison, needle):
    """The target's rows are poisoned before the worker publishes them (``ready.set``): poisoned after
    publication, as this test once did, a step that ran between the two read the good rows, and the
    target finished normally (seen on a loaded 2-core machine)."""
    items, solo = work
    core = llms["batch"].core
    bad = _first_image(items)
    worker = core.encoder
    real = worker._encode
    target: dict = {}

    def encode(job):
        if job.request_id == target.get("rid"):
            publish = job.ready.set

            def poison_then_publish() -> None:
                if job.rows is not None:
                    job.rows = poison(job.rows)
                publish()

            job.ready.set = poison_then_publish  # the worker's own set() call now poisons first
        real(job)

    worker._encode = encode
    try:
        reqs = [core.make_request(RequestSpec(ids, params, images=images)) for ids, images, params in items]
        target["rid"] = reqs[bad].request_id
        for r in reqs:
            core.add(r)
        core.run_until_idle()
    finally:
        worker._encode = real
    assert core.leaks() == ""
    _check(core, reqs, solo, bad, needle)


@pytest.mark.parametrize("persistent", [False, True])
def test_an_engine_exception_inside_a_pass_slice(llms, work, monkeypatch, persistent):
    """The engine raises inside a layer slice (layer_start > 0) of the target's image pass. Only in
    slices, the fault depends on company (alone, the target's pass runs whole): the undo must still
    be exact for everyone, the target included. ``persistent``: every forward of the target's pass
    rows raises, so the target fails alone."""
    items, solo = work
    core = llms["batch"].core
    bad = _first_image(items)
    engine = core.executor
    real_advance, real_merged = engine._advance, engine._merged_forward
    hits = []
    target: dict = {}

    def advance(p, rows, owners, *scored):
        if (p.layer_start > 0 or persistent) and any(m.request_id == target["rid"] for m in p.members):
            hits.append(p.pass_id)
            raise RuntimeError("injected fault in a layer slice")
        return real_advance(p, rows, owners, *scored)

    def merged(decodes, whole, rows, owners, *scored):
        if persistent and any(m.request_id == target["rid"] for p in whole for m in p.members):
            hits.append("whole")
            raise RuntimeError("injected fault in a layer slice")
        return real_merged(decodes, whole, rows, owners, *scored)

    monkeypatch.setattr(engine, "_advance", advance)
    monkeypatch.setattr(engine, "_merged_forward", merged)
    reqs = [core.make_request(RequestSpec(ids, params, images=images)) for ids, images, params in items]
    target["rid"] = reqs[bad].request_id
    for r in reqs:
        core.add(r)
    core.run_until_idle()
    assert core.leaks() == "" and hits, "the fault never fired"
    if persistent:
        _check(core, reqs, solo, bad, "injected fault in a layer slice")
    else:
        assert any(h != "whole" for h in hits), "no multi-step pass for the target"
        assert [r.output_ids for r in reqs] == solo and all(r.error is None for r in reqs)


@pytest.mark.parametrize("length", [1020, 1029, 1035, 1039, 1040, 1045, 1060])
def test_a_long_image_prompt_beside_a_decoder_completes(llms, tok, length, host_kernels):
    """The issue's staging overflow: one text request decoding, then an image request of ~1,040 tokens
    whose first chunk (block + swallowed tail) exceeds max_prefill_tokens and runs as a layer-sliced
    pass through staging. A step budget just over max_prefill_tokens gets that chunk beside a decoder
    (with the default budget an image chunk beside decoders ends with its block) and slices it (a
    budget of 1,029 tokens x L row-layers holds L - 1 layers of ~1,039 rows). No prefix cache: the
    lengths share their prefix, and a hit would shorten every chunk after the first length's."""
    from ds4serve.llm import LLM

    if "step-1030" not in llms:
        llms["step-1030"] = LLM(BUNDLED, step_tokens=1030, enable_prefix_caching=False, host_kernels=host_kernels)
    llm = llms["step-1030"]
    core = llm.core
    ex = next(e for e in examples(3, 40) if e.images)
    pipe = ImagePipeline.for_engine(core, tok)
    ids, images = prepare(core, tok, pipe, ex)
    filler = tok.encode_text(" a")[-1]
    ids = list(ids[:-4]) + [filler] * (length - len(ids)) + list(ids[-4:])
    text = core.make_request(RequestSpec(tok.encode_text("What is 7 + 5?"),
                                         SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)))
    core.add(text)
    for _ in range(3):
        core.step()
    req = core.make_request(RequestSpec(ids, SamplingParams(max_tokens=4, temperature=0), images=images))
    core.add(req)
    core.run_until_idle()
    assert req.error is None and text.error is None, (req.error, text.error)
    assert req.status is RequestStatus.FINISHED_LENGTH or req.status is RequestStatus.FINISHED_STOP
    assert len(text.output_ids) == 40 and core.leaks() == ""
