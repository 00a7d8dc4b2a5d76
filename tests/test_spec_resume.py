"""A request suspended with a checkpoint drafter's block pending, and resumed into another slot (issue 28).

A model drafter's block lives in the executor's ``ModelDrafts.pending`` under the slot it was drafted in,
beside the ``q`` it was drawn from; the scheduler sees its tokens (``Request.proposal``) and the decode
row they were drafted for (``proposal_at``). A suspended request keeps its ``computed``, so after a
resume ``proposal_at == computed`` still holds, but the block is not in the new slot's ``pending``: the
scheduler must not plan it (``pressure._resume`` sets ``proposal_at = -1``), else the executor cannot
verify it against its ``q`` and the step fails. Under rejection acceptance, that is: coupled acceptance
never reads ``q`` (a stale block there is only a guess, checked token by token against the target's own
draws), so the test runs with ``"acceptance": "rejection"``, where the executor takes each block with
its ``q`` from ``pending`` (``ModelDrafts.take``). The slot the request had is held by the test's own
allocation while it is parked, so the resume lands in another slot deterministically (the free list is
a stack: without that, the request would get its old slot back and the old block would still be there).
"""

from __future__ import annotations

import json

import pytest

from ds4serve.engine.sampling import SamplingParams
from ds4serve.llm import LLM
from ds4serve.scheduler.request import RequestStatus
from ds4serve.scheduler.spec import RequestSpec

from dspark_checkpoint import build_trunk, drafter_tensors, dspark_config, write_checkpoint

NEW = 24


@pytest.fixture(scope="module")
def dspark_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark_resume")
    config = dspark_config()
    return write_checkpoint(root / "ckpt", build_trunk(root), drafter_tensors(config).stored, config)


def _prompt(vocab: int) -> list[int]:
    phrase = [(13 * j) % (vocab - 10) + 3 for j in range(7)]
    return (phrase * 4)[:20]


def test_a_resumed_request_never_verifies_the_block_drafted_in_its_old_slot(dspark_ckpt):
    settings = dict(max_seqs=2, host_kernels="on", warmup=False, enable_prefix_caching=False, host_budget="1MB")
    plain = LLM(dspark_ckpt, **settings)
    prompt = _prompt(plain.core.cfg.vocab_size)
    want = plain.generate([prompt], max_tokens=NEW, temperature=0.0, ignore_eos=True)[0]

    spec = {"method": "dspark", "num_speculative_tokens": 4, "acceptance": "rejection"}
    drafted = LLM(dspark_ckpt, speculative=json.dumps(spec), **settings)
    core, sched = drafted.core, drafted.core.scheduler
    req = core.make_request(RequestSpec(prompt, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)))
    core.add(req)
    while not (req.status is RequestStatus.DECODING and req.proposal and req.proposal_at == req.computed):
        assert core.has_work, "the request finished before its drafter proposed a block"
        core.step()
    old = int(req.slot)
    assert old in core.executor.drafts.pending  # the block waits under the slot it was drafted in

    assert sched._preempt(among=[req]) and req.status is RequestStatus.SUSPENDED
    held = sched.cache.alloc_slot()  # someone else takes the freed slot while the request is parked
    assert int(held) == old
    try:
        core.step()  # the resume, into another slot, and its first decode step there
        assert sched.stats["resumed"] == 1 and sched.stats["step_failures"] == 0, dict(sched.stats)
        assert req.slot is not None and int(req.slot) != old
        core.run_until_idle()
    finally:
        sched.cache.drop(held)
    assert sched.stats["preempt_suspend"] == 1 and sched.stats["resumed"] == 1
    assert sched.stats["step_failures"] == 0, dict(sched.stats)
    assert list(req.output_ids) == want
    assert core.stats.speculation.get("drafted_tokens", 0) > 0
    assert core.leaks() == ""
