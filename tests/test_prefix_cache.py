"""Prefix caching (issue 14): a hit computes exactly what a cold run cut at the same point computes.

Checked on checkpoint A (fp32): a hit at an interval point is bit-identical (tokens and logprobs) to a
cold run after a reset (the same cuts); every hit equals the cache-off engine token for token and
within the chunked-prefill tolerance in logprobs (DESIGN §6); under concurrency 16 with pools small
enough to force evictions, suspends and drops; images under a hit are not re-encoded. No page,
snapshot or refcount is left behind. Every test runs on the native host forward and on the torch forward
CUDA runs (``host_kernels``: ``host-on`` / ``host-off``); the runs a test compares share its mode.
"""

from __future__ import annotations

import pytest

from ds4serve.engine.sampling import SamplingParams
from ds4serve.scheduler.spec import RequestSpec
from model_helpers import feed, random_ids

LOGPROB_TOL = 1e-4  # DESIGN §6: chunked prefill's tolerance


def _params(n: int, seed: int | None = None) -> SamplingParams:
    if seed is None:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2)
    return SamplingParams(max_tokens=n, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True, logprobs=2)


def _run(core, prompts, params, every: int = 0, **kw):
    """Requests arrive ``every`` steps apart (0: all at once); returns them when all are done."""
    reqs = [core.make_request(RequestSpec(p, q, **kw)) for p, q in zip(prompts, params)]
    feed(core, reqs, every)
    assert core.leaks() == "", core.leaks()
    return reqs


def _logprobs(req) -> list[float]:
    return [lp[0] for lp in req.output_logprobs]


def _close(a, b) -> None:
    assert a.output_ids == b.output_ids
    diff = max(abs(x - y) for x, y in zip(_logprobs(a), _logprobs(b)))
    assert diff <= LOGPROB_TOL, diff


@pytest.fixture(scope="module")
def shared():
    return random_ids(300, 1000, seed=11)


def test_a_hit_is_the_cold_run_cut_at_that_point(llm_factory, shared, host_kernels):
    """Two prompts sharing 300 tokens: the second hits at the interval point 256 (captured inside the
    first prompt's single chunk, which is not cut for it) and computes bit for bit what a cold run
    whose prefill is cut at 256 computes; a cold uncut run agrees within the chunking tolerance."""
    core = llm_factory("A", max_seqs=4, host_kernels=host_kernels).core
    core.reset_prefix_cache()
    p1, p2 = shared + random_ids(40, 1000, seed=12), shared + random_ids(50, 1000, seed=13)
    first = _run(core, [p1], [_params(12)])[0]
    prefills = [h.prefill_rows for h in core.history if h.prefill_rows]
    assert prefills[-1] == len(p1)  # one chunk: the snapshot at 256 came from inside the forward
    hit = _run(core, [p2], [_params(12)])[0]
    assert first.cached_tokens == 0 and hit.cached_tokens == 256
    assert core.reset_prefix_cache() > 0 and core.cache.state.pages.used_pages == 0
    cold = _run(core, [p2], [_params(12)])[0]
    assert cold.cached_tokens == 0
    _close(hit, cold)
    cut = _run(llm_factory("A", max_seqs=4, max_prefill_tokens=256, enable_prefix_caching=False,
                       host_kernels=host_kernels).core, [p2], [_params(12)])[0]
    assert hit.output_ids == cut.output_ids and _logprobs(hit) == _logprobs(cut)


def test_the_next_turn_hits_the_end_of_the_output(llm_factory, shared, host_kernels):
    """Turn 2 resends turn 1's prompt and answer: it hits where turn 1 stopped computing."""
    core = llm_factory("A", max_seqs=4, host_kernels=host_kernels).core
    core.reset_prefix_cache()
    p1 = shared[:120]
    t1 = _run(core, [p1], [_params(20, seed=5)])[0]
    p2 = p1 + t1.output_ids + random_ids(30, 1000, seed=14)
    t2 = _run(core, [p2], [_params(15, seed=6)])[0]
    assert t2.cached_tokens == len(p1) + len(t1.output_ids) - 1
    off = _run(llm_factory("A", max_seqs=4, enable_prefix_caching=False, host_kernels=host_kernels).core, [p2],
               [_params(15, seed=6)])[0]
    _close(t2, off)


def test_a_cache_point_makes_the_end_of_the_user_turn_reusable(llm_factory, shared, host_kernels):
    """DS4 thinking mode drops the last prompt token's successor from the next turn: the server asks for
    a snapshot one token before the end of the prompt, and the next turn hits exactly there."""
    core = llm_factory("A", max_seqs=4, host_kernels=host_kernels).core
    core.reset_prefix_cache()
    p1 = shared[:150]
    _run(core, [p1], [_params(4)], cache_points=(len(p1) - 1,))
    p2 = p1[:-1] + random_ids(20, 1000, seed=15)
    t2 = _run(core, [p2], [_params(6)])[0]
    assert t2.cached_tokens == len(p1) - 1


def test_hits_are_salted(llm_factory, shared, host_kernels):
    core = llm_factory("A", max_seqs=4, host_kernels=host_kernels).core
    core.reset_prefix_cache()
    prompt = shared + [5, 6, 7]
    _run(core, [prompt], [_params(3)], cache_salt="alice")
    assert _run(core, [prompt], [_params(3)], cache_salt="bob")[0].cached_tokens == 0
    assert _run(core, [prompt], [_params(3)], cache_salt="alice")[0].cached_tokens >= 256


def _groups():
    """16 prompts in four families sharing 260-330 tokens, plus one continuation of each family."""
    prompts = []
    for g in range(4):
        stem = random_ids(260 + 23 * g, 1000, seed=100 + g)
        prompts += [stem + random_ids(10 + 7 * i, 1000, seed=200 + 10 * g + i) for i in range(4)]
    return prompts


@pytest.mark.parametrize("seeded,host_budget,preempted", [(False, "1MB", "preempt_suspend"),
                                                          (True, "150KB", "preempt_drop")], ids=["greedy", "seeded"])
def test_sixteen_concurrent_with_tiny_pools(seeded, host_budget, preempted, llm_factory, host_kernels):
    """Concurrency 16 over a pool of ~2 prompts, with a host budget that takes suspends (greedy) or one
    too small for them, so requests are dropped and recomputed (seeded): hits, evictions and
    preemptions all happen, and every output equals the cache-off solo run."""
    prompts = _groups()
    params = [_params(8 + i % 5, seed=300 + i if seeded else None) for i in range(16)]
    solo_core = llm_factory("A", max_seqs=1, enable_prefix_caching=False, host_kernels=host_kernels).core
    solo = [_run(solo_core, [p], [q])[0] for p, q in zip(prompts, params)]
    core = llm_factory("A", max_seqs=16, kv_budget=640, host_budget=host_budget, step_tokens=64,
                       max_prefill_tokens=128, prefix_cache_budget="2MB", host_kernels=host_kernels).core
    core.reset_prefix_cache()
    before = dict(core.scheduler.stats)
    got = _run(core, prompts, params, every=2)
    stats = {k: v - before.get(k, 0) for k, v in core.scheduler.stats.items()}
    prefix = core.prefix_stats()
    assert stats[preempted] > 0, stats
    assert sum(r.cached_tokens > 0 for r in got) >= 4, [r.cached_tokens for r in got]
    assert prefix["evictions"] > 0, prefix
    for i, (a, b) in enumerate(zip(got, solo)):
        assert a.output_ids == b.output_ids, f"request {i} differs (cached {a.cached_tokens})"
        _close(a, b)
    assert core.cache.host_used == 0
    core.reset_prefix_cache()
    assert core.cache.state.pages.used_pages == 0 and core.prefix_stats()["snapshots"] == 0


def _image_chat(core, tok, question: str):
    from ds4serve.chat import render_chat
    from ds4serve.multimodal.pipeline import ImagePipeline
    from image_helpers import image_url

    text = "Look at this picture carefully and remember every shape in it. " * 5
    parts = [{"type": "image_url", "image_url": {"url": image_url(3)}}, {"type": "text", "text": text + question}]
    prepared = ImagePipeline.for_engine(core, tok).prepare(render_chat(tok, [{"role": "user", "content": parts}]))
    return prepared.ids, prepared.images


def test_an_image_under_a_hit_is_not_encoded_again(random_ckpt, host_kernels):
    """The second question about the same picture hits past its block: the encoder is skipped, the
    answer equals the cache-off engine's, and a drop-and-recompute comes back through the pinned hit."""
    from ds4serve.chat import Tokenizer
    from ds4serve.llm import LLM

    tok = Tokenizer(random_ckpt)
    core = LLM(random_ckpt, max_seqs=4, host_kernels=host_kernels).core
    off = LLM(random_ckpt, max_seqs=4, enable_prefix_caching=False, host_kernels=host_kernels).core
    first = _image_chat(core, tok, "What colour is the circle?")
    second = _image_chat(core, tok, "How many shapes are there?")
    assert first[1][0].span.end < 256 < len(second[0])
    _run(core, [first[0]], [_params(6)], images=first[1])
    encoded = core.encoder.encoded
    hit = _run(core, [second[0]], [_params(6)], images=second[1])[0]
    assert hit.cached_tokens >= 256 and core.encoder.encoded == encoded
    cold = _run(off, [second[0]], [_params(6)], images=second[1])[0]
    _close(hit, cold)
    # a hit request whose image was skipped is still recomputable: it pins the snapshot it came from
    req = core.make_request(RequestSpec(second[0], _params(6), images=second[1]))
    core.add(req)
    core.step()
    assert req.first_image == 1 and req.prefix.pinned is not None and core.scheduler.recomputable(req)
    core.reset_prefix_cache()  # cannot drop the pinned snapshot
    assert req.prefix.pinned.key in {s.key for s in core.cache.prefix._lru.values()}
    core.run_until_idle()
    assert core.leaks() == "" and req.output_ids == hit.output_ids


def _mixed(core, tok, solo_core):
    """16 requests on the DS4V checkpoint: text families sharing 280 tokens, image chats sharing a
    picture and a long question, and second turns of earlier chats (history = turn 1 and its answer,
    taken from the cache-off solo run, as a client would send it back)."""
    prompts, images = [], []
    stem = random_ids(280, 250, seed=40)
    for i in range(6):
        prompts.append(stem + random_ids(12 + 5 * i, 250, seed=41 + i))
        images.append(None)
    for i in range(6):
        ids, ims = _image_chat(core, tok, f"Question number {i % 2} about the shapes, please answer now.")
        prompts.append(ids)
        images.append(ims)
    for i in range(4):  # turn 2 of requests 0, 1, 6 and 7
        j = [0, 1, 6, 7][i]
        first = _run(solo_core, [prompts[j]], [_params(8)], images=images[j])[0]
        prompts.append(prompts[j] + first.output_ids + random_ids(20, 250, seed=60 + i))
        images.append(images[j])
    return prompts, images


def test_text_images_and_turns_at_concurrency_16_with_tiny_pools(random_ckpt, host_kernels):
    """Text, image and multi-turn requests together, arriving every 3 steps into a pool of ~3
    prompts: hits (images under some of them), evictions and preemptions happen, and every output
    equals the cache-off engine's solo run; nothing is left behind."""
    from ds4serve.chat import Tokenizer
    from ds4serve.llm import LLM

    tok = Tokenizer(random_ckpt)
    solo_core = LLM(random_ckpt, max_seqs=1, enable_prefix_caching=False, host_kernels=host_kernels).core
    core = LLM(random_ckpt, max_seqs=16, kv_budget=768, host_budget="400KB", step_tokens=64,
               max_prefill_tokens=128, prefix_cache_budget="4MB", host_kernels=host_kernels).core
    prompts, images = _mixed(core, tok, solo_core)
    params = [_params(8) for _ in prompts]
    solo = [_run(solo_core, [p], [q], images=ims)[0] for p, q, ims in zip(prompts, params, images)]
    reqs = [core.make_request(RequestSpec(p, q, images=ims)) for p, q, ims in zip(prompts, params, images)]
    feed(core, reqs, every=3, encoded=True)  # where the pool fills must not depend on the encoder's speed
    stats, prefix = core.scheduler.stats, core.prefix_stats()
    assert stats["preempt_suspend"] + stats["preempt_drop"] > 0, stats
    assert prefix["evictions"] > 0 and sum(r.cached_tokens > 0 for r in reqs) >= 4, prefix
    assert any(r.first_image for r in reqs), "no image was under a hit"
    assert any(r.cached_tokens >= len(prompts[j]) for r, j in zip(reqs[12:], [0, 1, 6, 7])), \
        "no second turn reused its whole first turn"
    for i, (a, b) in enumerate(zip(reqs, solo)):
        assert a.output_ids == b.output_ids, f"request {i} differs (cached {a.cached_tokens})"
        _close(a, b)
    assert core.leaks() == "" and core.cache.host_used == 0
    core.reset_prefix_cache()
    assert core.cache.state.pages.used_pages == 0


def test_pinned_snapshots_never_stall_the_pool(random_ckpt, host_kernels):
    """The same traffic in a pool of 5 prompt-chunks (640 tokens): requests that skipped their image
    through a hit pin that snapshot while they are parked, and the oldest running request needs those
    very pages. Before the fix nothing moved again: the pinned pages counted as free, so a parked pin
    holder was resumed, found no room, was dropped again, every step (2,968 drops in 3,000 steps). Now
    pins give way (a suspended holder gives its pin up; a parked one that cannot come back without it
    fails alone, loudly) and everything else completes with its solo answer."""
    from ds4serve.chat import Tokenizer
    from ds4serve.llm import LLM

    tok = Tokenizer(random_ckpt)
    solo_core = LLM(random_ckpt, max_seqs=1, enable_prefix_caching=False, host_kernels=host_kernels).core
    core = LLM(random_ckpt, max_seqs=16, kv_budget=640, host_budget="400KB", step_tokens=64,
               max_prefill_tokens=128, prefix_cache_budget="8MB", host_kernels=host_kernels).core
    prompts, images = _mixed(core, tok, solo_core)
    reqs = [core.make_request(RequestSpec(p, _params(8), images=ims)) for p, ims in zip(prompts, images)]
    pending, step = list(reqs), 0
    while (pending or core.has_work) and step < 1000:
        while pending and step >= 3 * (len(reqs) - len(pending)):
            core.add(pending.pop(0))
        for r in core.scheduler.running:
            if r.images_submitted:
                assert core.encoder.wait(r.request_id, 60)
        core.step()
        step += 1
    assert not core.has_work, f"no progress after {step} steps: {core.scheduler.stats}"
    assert core.scheduler.stats["resumed"] < 50, core.scheduler.stats
    failed = [r for r in reqs if r.status.value == "finished_error"]
    assert all("out of cache memory" in r.error for r in failed) and len(failed) <= 2, [r.error for r in failed]
    for i, r in enumerate(reqs):
        if r not in failed:
            want = _run(solo_core, [prompts[i]], [_params(8)], images=images[i])[0]
            assert r.output_ids == want.output_ids, f"request {i} differs"
    assert core.leaks() == ""
    core.reset_prefix_cache()
    assert core.cache.state.pages.used_pages == 0


def test_a_dropped_image_hit_recomputes_through_its_pinned_snapshot(random_ckpt, host_kernels):
    """No host budget, so a preempted request is dropped: the one whose image was skipped by its hit
    comes back through the snapshot it pinned (its image rows were never made) with the same answer."""
    from ds4serve.chat import Tokenizer
    from ds4serve.llm import LLM

    tok = Tokenizer(random_ckpt)
    core = LLM(random_ckpt, max_seqs=4, host_budget=1, host_kernels=host_kernels).core
    first = _image_chat(core, tok, "What colour is the circle?")
    second = _image_chat(core, tok, "How many shapes are there?")
    _run(core, [first[0]], [_params(6)], images=first[1])
    want = _run(core, [second[0]], [_params(6)], images=second[1])[0]
    encoded = core.encoder.encoded
    req = core.make_request(RequestSpec(second[0], _params(6), images=second[1]))
    core.add(req)
    core.step()
    core.step()
    assert req.first_image == 1 and req.output_ids
    assert core.scheduler._preempt() and req.status.value == "parked" and core.cache.host_used == 0
    core.run_until_idle()
    assert core.scheduler.stats["preempt_drop"] >= 1 and core.encoder.encoded == encoded
    assert req.output_ids == want.output_ids and core.leaks() == ""
