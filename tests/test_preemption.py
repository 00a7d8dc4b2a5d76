"""Who is preempted when pages run short, and what happens to a request that cannot be saved.

Scheduler policy against the fake engine (``test_step_contract``) and a fake encoder whose rows are
retained or not: a request inside a pass is never the victim; among the candidates the cheapest to
rebuild goes first (text before image requests, then the newest); a request that can be neither
suspended (host budget full) nor recomputed (its image rows are gone) fails alone, with an error,
while the others get exactly their tokens.
"""

from __future__ import annotations

import dataclasses
import threading

import torch
from test_step_contract import expected_tokens, make_core

from ds4serve.engine.encoder import EncodedImage
from ds4serve.engine.sampling import SamplingParams
from ds4serve.scheduler.spec import RequestSpec
from ds4serve.multimodal.layout import image_block
from ds4serve.multimodal.records import ImageInput, sentinel_ids
from ds4serve.scheduler.request import RequestStatus

VOCAB = 64  # the fake model's vocabulary (test_step_contract.TINY)


class FakeEncoder:
    """The encoder worker's interface, instantly ready; ``retain=False`` keeps no rows (as if lost)."""

    def __init__(self, hidden: int):
        self.hidden = hidden
        self.retain: dict[str, bool] = {}
        self.live: dict[str, list[EncodedImage]] = {}

    def row_bytes(self, n_rows: int) -> int:
        return n_rows * self.hidden * 4

    def submit(self, request_id: str, images) -> list[EncodedImage]:
        handles = []
        for i, im in enumerate(images):
            h = EncodedImage(request_id, i, im.patches, 1, 1, tuple(im.block.perm), im.block.image_positions)
            if self.retain.get(request_id, True):
                h.rows = torch.zeros(im.n_rows, self.hidden)
            h.ready.set()
            handles.append(h)
        self.live[request_id] = handles
        return handles

    def ready(self, request_id: str):
        return tuple(h.state() for h in self.live.get(request_id, ()))

    def cancel(self, request_id: str) -> None:
        self.live.pop(request_id, None)

    def live_requests(self) -> set[str]:
        return set(self.live)


def _vision_core(**settings):
    core = make_core(**settings)
    enc = FakeEncoder(core.cfg.hidden_size)
    core.encoder = core.scheduler.encoder = enc
    core.scheduler.limits = dataclasses.replace(core.scheduler.limits, image_rows_budget=2**30)
    return core, enc


def _image_request(core, n_text: int, max_tokens: int):
    """``n_text`` text ids, then a 1x1-grid image block, then one more text id."""
    blk = image_block(1, 1, n_text)
    ids = list(range(1, n_text + 1)) + sentinel_ids(blk, VOCAB) + [5]
    image = ImageInput(torch.zeros(1, 3, 2, 2), 1, 1, blk, "fake")
    return core.make_request(RequestSpec(ids, SamplingParams(max_tokens=max_tokens, temperature=0), images=[image]))


def _preempted_in_step(core) -> int:
    return sum(core.scheduler.stats[k] for k in ("preempt_suspend", "preempt_drop", "preempt_fail"))


def test_a_request_inside_a_pass_is_never_the_victim():
    """Two decoders cross a page boundary together while the newest request (the preferred victim
    by age) is inside a layer-sliced pass: one of the decoders must go, never the pass member."""
    core = make_core(prefill_mode="layers", kv_budget=256, max_seqs=4, step_tokens=8, min_prefill_tokens=4,
                     max_prefill_tokens=64)
    decoders = [core.make_request(RequestSpec(list(range(1, 10)), SamplingParams(max_tokens=200, temperature=0)))
                for _ in range(2)]
    for r in decoders:
        core.add(r)
    for _ in range(53):  # 62 tokens each: both need a second page within the next pass's steps
        core.step()
    late = core.make_request(RequestSpec(list(range(1, 60)), SamplingParams(max_tokens=5, temperature=0)))
    core.add(late)
    during_pass = 0
    while core.has_work:
        in_pass = [r for r in core.scheduler.running if r.pass_id is not None]
        before = _preempted_in_step(core)
        core.step()
        if in_pass and _preempted_in_step(core) > before:
            during_pass += 1
            assert all(r.preemptions == 0 for r in in_pass), "a request inside a pass was preempted"
    assert during_pass >= 1, "no preemption happened while a pass was in flight"
    assert late.preemptions == 0 and sum(r.preemptions for r in decoders) >= 1
    for r in decoders + [late]:
        assert r.output_ids == expected_tokens(r.request_id, len(r.prompt_ids), r.params.max_tokens)
    assert core.leaks() == ""


def test_text_is_preempted_before_an_image_request():
    """The text request is older (age alone would pick the image request); rebuilding it is cheaper."""
    core, _ = _vision_core(kv_budget=192, max_seqs=4, max_prefill_tokens=64)
    text = core.make_request(RequestSpec(list(range(1, 20)), SamplingParams(max_tokens=100, temperature=0)))
    image = _image_request(core, 10, max_tokens=100)
    core.add(text)
    core.add(image)
    first = None
    while core.has_work:
        before = _preempted_in_step(core)
        core.step()
        if first is None and _preempted_in_step(core) > before:
            first = (text.preemptions, image.preemptions)
    assert first == (1, 0), first
    for r in (text, image):
        assert r.output_ids == expected_tokens(r.request_id, len(r.prompt_ids), 100)
    assert core.leaks() == ""


def test_a_request_that_cannot_be_saved_fails_alone():
    """No host budget to suspend into, and the newest image request's rows are not retained: it can
    neither be suspended nor recomputed, so it fails with a clear error; the other one finishes."""
    core, enc = _vision_core(kv_budget=192, max_seqs=4, max_prefill_tokens=64, host_budget="1B")
    keeper = _image_request(core, 10, max_tokens=100)
    lost = _image_request(core, 14, max_tokens=100)
    enc.retain[lost.request_id] = False
    core.add(keeper)
    core.add(lost)
    core.run_until_idle()
    assert not core.scheduler.recomputable(lost) or lost.status.finished
    assert lost.status is RequestStatus.FINISHED_ERROR and "out of cache memory" in lost.error, lost.error
    assert core.scheduler.stats["preempt_fail"] == 1 and core.scheduler.stats["preempt_drop"] == 0
    assert keeper.output_ids == expected_tokens(keeper.request_id, len(keeper.prompt_ids), 100)
    assert core.leaks() == ""


def test_only_retained_rows_make_an_image_request_recomputable():
    core, enc = _vision_core()
    kept, lost = _image_request(core, 3, 4), _image_request(core, 3, 4)
    enc.retain[lost.request_id] = False
    for r in (kept, lost):
        enc.submit(r.request_id, r.images)
        r.images_submitted = True
    pending = _image_request(core, 3, 4)
    pending.images_submitted = True
    enc.live[pending.request_id] = [EncodedImage(pending.request_id, 0, torch.zeros(1), 1, 1, (0,), (3,),
                                    ready=threading.Event())]  # still in the encoder: rows will come
    recomputable = core.scheduler.recomputable
    assert recomputable(kept) and recomputable(pending) and not recomputable(lost)
