"""``RequestSpec`` and the one fit check (issue 27, item 1).

A request is one frozen record from where it is prepared to the scheduler, and whether it can ever run is
answered by one pure function, ``admission.fit``, wherever it is asked. Checked here:

* ``fit`` against an oracle written from the rules in plain loops (context limit, page pool, image rows
  budget, largest prefill pass), over random limits and requests;
* the three doors agree: the server (``jobs.build_completion``, then ``serving.admit``: a 400 before a
  stream opens), ``EngineLoop.check`` (any thread) and ``Scheduler.add`` (on the engine thread) accept
  the same requests and refuse the others with the same message, on the bundled DS4V model;
* the spec the server builds is the object the scheduler holds (nothing copied or rebuilt on the way).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ds4serve.chat import Tokenizer
from ds4serve.engine.sampling import SamplingParams
from ds4serve.multimodal.layout import image_block
from ds4serve.multimodal.pipeline import ImagePipeline
from ds4serve.multimodal.records import ImageInput
from ds4serve.runtime import EngineLoop, FitLimits, RequestSpec, RequestTooLarge, fit, load_core
from ds4serve.scheduler.request import Request
from ds4serve.server import jobs, serving
from ds4serve.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from ds4serve.server.state import ServerState
from ds4serve.settings import EngineSettings
from ds4serve.tiny.random_model import BUNDLED
from image_helpers import image_url


def _image(n_h: int, n_w: int, start: int = 1) -> ImageInput:
    """A prepared image record of an ``n_h x n_w`` grid (pixels are irrelevant to the fit check)."""
    return ImageInput(torch.zeros(1, 3, 2, 2), 1, 1, image_block(n_h, n_w, start), f"img-{n_h}x{n_w}")


# ---- fit against an oracle -----------------------------------------------------------------------
def _oracle(prompt: int, new: int, grids: list[tuple[int, int, int]], lim: FitLimits) -> str:
    """Which rule refuses (or "ok"), from the rules as stated, counted in plain loops:
    prompt + new tokens within the context; the pages they cover within the pool; then, for images, a
    vision encoder, their rows' bytes within the budget, and each block within one prefill pass."""
    if prompt + new > lim.max_model_len:
        return "context"
    pages, covered = 0, 0
    while covered < prompt + new:
        covered += lim.page_tokens
        pages += 1
    if pages > lim.n_pages:
        return "pages"
    if not grids:
        return "ok"
    if lim.image_row_bytes == 0:
        return "vision"
    rows = 0
    for n_h, n_w, _ in grids:
        for _ in range(n_h * n_w):
            rows += 1
    if rows * lim.image_row_bytes > lim.image_rows_budget:
        return "budget"
    for _, _, length in grids:
        if length > lim.max_prefill_tokens:
            return "block"
    return "ok"


def _rule(message: str | None) -> str:
    """The rule a refusal names, read from its message (each names what to change)."""
    if message is None:
        return "ok"
    for rule, words in (("context", "context limit"), ("pages", "cache pages"), ("vision", "no vision encoder"),
                        ("budget", "image budget"), ("block", "largest prefill pass")):
        if words in message:
            return rule
    raise AssertionError(f"a refusal that names no rule: {message!r}")


limits_st = st.builds(FitLimits, max_model_len=st.integers(1, 500), page_tokens=st.sampled_from([1, 8, 64]),
                      n_pages=st.integers(0, 80), max_prefill_tokens=st.integers(8, 120),
                      image_rows_budget=st.integers(0, 8192), image_row_bytes=st.sampled_from([0, 8, 64]))


@settings(max_examples=400)
@given(lim=limits_st, prompt=st.integers(1, 250), new=st.integers(0, 250),
       grids=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), max_size=3))
def test_fit_follows_the_rules(lim, prompt, new, grids):
    images = [_image(h, w) for h, w in grids]
    spec = RequestSpec(list(range(prompt)), SamplingParams(max_tokens=new), images)
    want = _oracle(prompt, new, [(h, w, im.block.length) for (h, w), im in zip(grids, images)], lim)
    message = fit(spec, lim)
    event(want)  # --hypothesis-show-statistics: every rule is exercised
    assert _rule(message) == want, message
    assert fit(spec, lim) == message  # pure: asked again, the same words


def test_a_prompt_that_fills_the_context_says_so():
    lim = FitLimits(max_model_len=64, page_tokens=8, n_pages=100, max_prefill_tokens=64)
    assert "fills the context limit of 64" in fit(RequestSpec([1] * 64, SamplingParams(max_tokens=1)), lim)
    assert fit(RequestSpec([1] * 64, SamplingParams(max_tokens=0)), lim) is None  # scoring it alone fits
    assert "shorten the prompt or lower max_tokens" in fit(RequestSpec([1] * 60, SamplingParams(max_tokens=5)), lim)


# ---- the record itself ---------------------------------------------------------------------------
def test_the_spec_is_frozen_and_owns_its_fields():
    ids, points = [5, 6, 7], [2]
    spec = RequestSpec(ids, SamplingParams(max_tokens=3), None, cache_salt="t", cache_points=points)
    ids.append(8)
    points.append(1)  # the caller's lists are not the spec's
    assert spec.prompt_ids == (5, 6, 7) and spec.images == () and spec.cache_points == (2,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.prompt_ids = (1,)
    with pytest.raises(ValueError, match="prompt is empty"):
        RequestSpec([], SamplingParams())
    with pytest.raises(TypeError, match="SamplingParams"):
        RequestSpec([1], {"max_tokens": 3})
    req = Request("r", spec)  # the scheduler's request reads the spec's fields, never a copy of them
    assert req.params is spec.params and req.images is spec.images and req.cache_salt == "t"
    assert req.prompt_ids == [5, 6, 7] and req.total_len == 3


# ---- the three doors, on the bundled model -------------------------------------------------------
@pytest.fixture(scope="module")
def doors():
    settings_ = EngineSettings(max_seqs=2, warmup=False, max_model_len=512, kv_budget=384, max_prefill_tokens=32,
                               image_rows_budget="16KiB", host_kernels="off")  # 32 rows of 512 bytes
    core = load_core(BUNDLED, settings=settings_)
    tok = Tokenizer(BUNDLED)
    pipeline = ImagePipeline.for_engine(core, tok)  # start-up's wiring (server/launch.py) of a DS4V model
    loop = EngineLoop(core).start()
    state = ServerState(loop=loop, tokenizer=tok, model_id="tiny", image_pipeline=pipeline)
    yield state
    loop.shutdown()
    state.executor.shutdown()


_ids = itertools.count()


def _server_door(state: ServerState, job: jobs.Job) -> str | None:
    """What an HTTP client would get: ``serving.admit`` submits every choice of the job the builder made;
    a refusal is the 400 it answers with (its message), an accepted request is cancelled at once."""
    async def admit() -> str | None:
        try:
            await serving.admit(state, job)
        except APIError as exc:
            assert exc.status == 400 and exc.code == "context_length_exceeded"
            return exc.message
        for stream in job.streams:
            await stream.aclose()
        return None

    return asyncio.run(admit())


def _completion(state: ServerState, prompt: list[int], max_tokens: int | None, **kw) -> jobs.Job:
    body = CompletionRequest(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)
    return asyncio.run(jobs.build_completion(state, body, f"cmpl-{next(_ids)}"))


def _check_door(state: ServerState, spec: RequestSpec) -> str | None:
    try:
        state.loop.check(spec)
    except RequestTooLarge as exc:
        return str(exc)
    return None


def _scheduler_door(state: ServerState, spec: RequestSpec) -> str | None:
    """``Scheduler.add`` on the engine thread (through the test-only ``call``); an accepted request is
    aborted at once, so it never runs."""
    def ask(core) -> str | None:
        try:
            core.add(core.make_request(spec, "fit-probe"))
        except RequestTooLarge as exc:
            return str(exc)
        core.abort("fit-probe")
        core.scheduler.take_outputs()
        return None

    return state.loop.call(ask)


near = st.one_of(st.integers(1, 600), st.sampled_from([383, 384, 385, 511, 512, 513]))


@settings(max_examples=60)
@given(prompt=near, new=st.one_of(st.integers(1, 600), st.sampled_from([1, 128, 129])))
def test_the_three_doors_agree_on_text(doors, prompt, new):
    """A completions request through the server (the job builder, then ``admit``), ``EngineLoop.check``
    and ``Scheduler.add``: the same answer, in the same words, as ``fit`` itself."""
    job = _completion(doors, [7] * prompt, new)
    spec = job.specs[0]
    assert spec.prompt_ids == (7,) * prompt and spec.params.max_tokens == new
    by_server = _server_door(doors, job)
    answers = {by_server, _check_door(doors, spec), _scheduler_door(doors, spec)}
    assert answers == {fit(spec, doors.loop.fit_limits)}, answers
    event(_rule(by_server))


pictures = st.lists(st.sampled_from([(28, 28), (60, 40), (200, 150)]), min_size=1, max_size=3)


@settings(max_examples=30)
@given(words=st.integers(0, 500), new=st.integers(1, 200), sizes=pictures)
def test_the_three_doors_agree_on_images(doors, words, new, sizes):
    """A chat request with pictures (decoded, resized and laid out by the real pipeline: 3x3 to 4x5
    grids here) through the server, ``EngineLoop.check`` and ``Scheduler.add``: rows budget (32 rows),
    context and pool, the same answer everywhere. (A block beyond the prefill pass never gets this far:
    the image pipeline refuses it first, sized by the same ``max_prefill_tokens``.)"""
    parts = [{"type": "text", "text": "x " * words}] + [
        {"type": "image_url", "image_url": {"url": image_url(i, size)}} for i, size in enumerate(sizes)]
    body = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=new,
                                 temperature=0)
    job = asyncio.run(jobs.build_chat(doors, body, f"chatcmpl-{next(_ids)}"))
    spec = job.specs[0]
    assert len(spec.images) == len(sizes)
    by_server = _server_door(doors, job)
    answers = {by_server, _check_door(doors, spec), _scheduler_door(doors, spec)}
    assert answers == {fit(spec, doors.loop.fit_limits)}, answers
    event(_rule(by_server))


def test_the_default_max_tokens_fits_or_the_prompt_is_refused(doors):
    """Without max_tokens the builder takes the server default within the room the prompt leaves (in the
    context and in the page pool: 6 pages of 64 tokens here); a prompt that leaves none is refused on
    submit with fit's words."""
    assert (doors.loop.fit_limits.n_pages, doors.loop.fit_limits.page_tokens) == (6, 64)
    job = _completion(doors, [7] * 300, None)
    assert job.specs[0].params.max_tokens == min(doors.limits.default_max_tokens, 6 * 64 - 300)
    assert _server_door(doors, job) is None
    full = _completion(doors, [7] * 512, None)
    assert full.specs[0].params.max_tokens == 1
    assert "fills the context limit of 512" in _server_door(doors, full)
    pool = _completion(doors, [7] * 400, None)  # inside the context, beyond the 384-token pool
    assert "cache pages" in _server_door(doors, pool)


def test_the_scheduler_holds_the_spec_the_server_built(doors):
    """``admit`` hands each choice's spec down whole: the scheduler's request holds that very object."""
    job = _completion(doors, [[7, 8, 9], [10, 11]], 300, n=2, ignore_eos=True, cache_salt="s")
    assert [s.prompt_ids for s in job.specs] == [(7, 8, 9)] * 2 + [(10, 11)] * 2
    assert job.prompts == [(7, 8, 9), (10, 11)] and len({s.cache_salt for s in job.specs}) == 1
    ids = [f"{job.request_id}-{i}" for i in range(4)]

    async def run() -> list:
        await serving.admit(doors, job)
        held = doors.loop.call(lambda core: [core.scheduler.requests[rid].spec for rid in ids])
        for stream in job.streams:  # 300 tokens each: all four are still live when asked; stop them now
            await stream.aclose()
        return held

    held = asyncio.run(run())
    assert all(h is s for h, s in zip(held, job.specs, strict=True))
