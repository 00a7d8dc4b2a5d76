"""Prefix-cache behaviours checked against their definitions, not against the code's own helpers.

* A key names its prefix's *content*: ``key(H)`` of two sequences with the same tokens differs
  exactly when an image that differs between them starts inside ``[0, H)``, whatever the image's
  offset in its key block (a block boundary included).
* A hit never covers the whole input: at least one token is left to compute, so resending a prompt
  whose end was snapshotted completes with the cold run's output instead of hanging.
* A snapshot captured inside a prefill chunk by the torch forward (``host_kernels="off"``, the path
  GPUs run) holds the rings as they stood at its position, read before the chunk's own writes: a hit
  on it computes bit for bit what a cold run cut at that position computes.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4serve.cache.prefix_keys import BLOCK, PrefixKeys
from ds4serve.engine.sampling import SamplingParams
from ds4serve.scheduler.spec import RequestSpec
from model_helpers import random_ids

PICTURE_A, PICTURE_B = "aa" * 32, "bb" * 32


def _keys(ids: list[int], images: list[tuple[int, str]]) -> PrefixKeys:
    return PrefixKeys("", lambda a, b: ids[a:b], images)


@pytest.mark.parametrize("start", [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, 3 * BLOCK - 1])
def test_a_key_differs_exactly_when_a_differing_image_starts_below_it(start: int) -> None:
    """Same tokens, one image at ``start`` whose picture differs: key(H) differs iff start < H, for
    every H, and boundary(j) differs iff start < j * BLOCK (an image starting on a boundary belongs to
    the block it opens)."""
    ids = list(range(3 * BLOCK + 7))
    other = [(5, PICTURE_A)] if start != 5 else []  # a shared image elsewhere changes nothing
    a = _keys(ids, sorted(other + [(start, PICTURE_A)]))
    b = _keys(ids, sorted(other + [(start, PICTURE_B)]))
    for h in range(1, len(ids) + 1):
        assert (a.key(h) != b.key(h)) == (start < h), (start, h)
    for j in range(len(ids) // BLOCK + 1):
        assert (a.boundary(j) != b.boundary(j)) == (start < j * BLOCK), (start, j)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3 * BLOCK), min_size=1, max_size=4, unique=True), st.data())
def test_two_pictures_never_share_a_key(starts: list[int], data) -> None:
    """Several images; one of them (any) changes picture: every key at or past its start changes."""
    ids = list(range(3 * BLOCK + 1))
    changed = data.draw(st.sampled_from(starts))
    a = _keys(ids, [(s, f"{s:064x}") for s in sorted(starts)])
    b = _keys(ids, [(s, PICTURE_B if s == changed else f"{s:064x}") for s in sorted(starts)])
    for h in range(changed + 1, len(ids) + 1):
        assert a.key(h) != b.key(h), (changed, h)


# ---- engines -------------------------------------------------------------------------------------


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1)


def _run_bounded(core, prompt: list[int], params: SamplingParams, max_steps: int = 400):
    """One request stepped to completion, failing (instead of hanging) if it does not finish."""
    req = core.make_request(RequestSpec(prompt, params))
    core.add(req)
    for _ in range(max_steps):
        if not core.has_work:
            break
        core.step()
    assert not core.has_work, f"the request did not finish in {max_steps} steps: {req.status}"
    assert core.leaks() == "", core.leaks()
    return req


def _logprobs(req) -> list[float]:
    return [lp[0] for lp in req.output_logprobs]


@pytest.mark.parametrize("length", [100, 128])
def test_resending_a_snapshotted_prompt_leaves_a_token_to_compute(llm_factory, length: int) -> None:
    """The end of a prompt is a snapshot point; the same prompt again hits below its end (at least
    its last token is computed, it yields the logits of the first output) and equals the first run."""
    core = llm_factory("A", max_seqs=2, prefix_interval=64, warmup=False).core
    core.reset_prefix_cache()
    prompt = random_ids(length, 1000, seed=31)
    first = _run_bounded(core, prompt, _greedy(6))
    again = _run_bounded(core, prompt, _greedy(6))
    assert first.cached_tokens == 0 and 0 < again.cached_tokens < length
    assert again.status == first.status and again.output_ids == first.output_ids
    assert max(abs(x - y) for x, y in zip(_logprobs(first), _logprobs(again))) <= 1e-4


def test_resending_a_whole_conversation_leaves_a_token_to_compute(llm_factory) -> None:
    """The end of an output is a snapshot point too: prompt + every output token resent as the next
    prompt (no new turn) still computes its last token and continues like the cold run."""
    core = llm_factory("A", max_seqs=2, prefix_interval=64, warmup=False).core
    core.reset_prefix_cache()
    prompt = random_ids(90, 1000, seed=32)
    first = _run_bounded(core, prompt, _greedy(8))
    turn = prompt + first.output_ids
    hit = _run_bounded(core, turn, _greedy(5))
    assert 0 < hit.cached_tokens < len(turn)
    core.reset_prefix_cache()
    cold = _run_bounded(core, turn, _greedy(5))
    assert hit.output_ids == cold.output_ids


@pytest.mark.parametrize("forward", ["on", "off"], ids=["native", "torch"])
def test_a_capture_inside_a_chunk_is_the_cold_state_cut_there(llm_factory, forward) -> None:
    """The first prompt runs in chunks [0, 125) and [125, 250); the snapshot at 128 is captured inside
    the second chunk, where the sliding ring (window 32) and the compressor rings (spans 8 and 16) at 128
    still hold rows of the first chunk, which this chunk then overwrites. A prompt sharing exactly
    [0, 128) hits there and computes [128, 253) as one chunk; a cold engine cut at 128 computes [0, 128)
    then [128, 253). The native forward (every CPU's default) computes each row alone, so the outputs are
    bit-identical. The torch forward (CUDA's) computes positions 125-127 inside other chunks, whose
    attention runs over query tiles padded to other key counts, whose BLAS reductions may then add in
    another order (the likely cause, not isolated): on an AVX2 EPYC (Zen 3, MKL) the logprobs differed in
    the 7th digit while an AVX-512 machine gave equal bits. There it is held to the same tokens and fp32
    rounding."""
    core = llm_factory("A", max_seqs=2, host_kernels=forward, max_prefill_tokens=125, prefix_interval=128,
                       warmup=False).core
    core.reset_prefix_cache()
    shared = random_ids(128, 1000, seed=41)
    first = _run_bounded(core, shared + random_ids(122, 1000, seed=42), _greedy(2))
    assert [h.prefill_rows for h in core.history if h.prefill_rows][-2:] == [125, 125]
    second = shared + random_ids(125, 1000, seed=43)
    hit = _run_bounded(core, second, _greedy(10))
    assert first.cached_tokens == 0 and hit.cached_tokens == 128
    cut_core = llm_factory("A", max_seqs=2, host_kernels=forward, max_prefill_tokens=128,
                           enable_prefix_caching=False, warmup=False).core
    cut = _run_bounded(cut_core, second, _greedy(10))
    assert hit.output_ids == cut.output_ids
    if forward == "on":
        assert _logprobs(hit) == _logprobs(cut)
    else:
        assert _logprobs(hit) == pytest.approx(_logprobs(cut), abs=1e-5, rel=0)
