"""Behaviours a mutation probe found unguarded, each checked against its documented definition.

* grammar: rolled back to exactly the position after ``</think>``, the answer grammar stays on;
* DSML stream: the content and tool calls do not depend on how the text was split into chunks;
* admission: the server admits exactly ``max_seqs + max_queue`` requests and refuses the next;
* isolation: a suspect is cleared only once it recomputed past the step that failed.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_step_contract import FakeEngine, make_core

from ds4serve.chat.dsml import DSML
from ds4serve.chat.dsml_stream import DsmlScanner
from ds4serve.chat.events import ContentDelta, Event, ToolCallDelta, ToolCallEnd, ToolCallStart
from ds4serve.engine.plan import StepResult, StepStatus
from ds4serve.engine.sampling import SamplingParams
from ds4serve.scheduler.spec import RequestSpec
from ds4serve.runtime import EngineLoop
from ds4serve.scheduler.request import RequestStatus
from ds4serve.scheduler.scheduler import QueueFull
from grammar_helpers import PERSON, matcher, tiny

# ---- grammar: rollback to just after </think> ------------------------------------------------------

RF = {"type": "json_schema", "json_schema": {"schema": PERSON}}


def _mask(m) -> torch.Tensor:
    bm = tiny()[1].allocate_bitmask(1)
    m.fill_mask(bm[0])
    return bm[0].clone()


@pytest.mark.parametrize("answer", ['{"', '{"name": "a'])
def test_rollback_to_just_after_think_end_keeps_the_grammar_on(answer: str) -> None:
    """Reasoning, ``</think>``, some answer tokens, then undo exactly the answer tokens: ``</think>``
    is still accepted, so the grammar applies and the mask is the one right after ``</think>``.
    One token further back (over ``</think>``) the output is free again."""
    tok = tiny()[0]
    m = matcher(thinking=True, response_format=RF)
    reasoning = tok.encode_text("let me think")
    assert m.accept_many(reasoning) and m.accept(tok.think_end_id)
    after_think = _mask(m)
    body = tok.encode_text(answer)
    assert m.accept_many(body)
    m.rollback(len(body))
    assert m.num_tokens == len(reasoning) + 1
    assert m.constrained and not m.in_reasoning
    assert torch.equal(_mask(m), after_think) and not (after_think == -1).all()
    m.rollback(1)
    assert not m.constrained and m.in_reasoning and (_mask(m) == -1).all()


def test_rollback_in_steps_to_just_after_think_end() -> None:
    """The same position reached one token at a time (as the engine undoes single steps)."""
    tok = tiny()[0]
    m = matcher(thinking=True, response_format=RF)
    assert m.accept(tok.think_end_id)
    after_think = _mask(m)
    body = tok.encode_text('{"name"')
    assert m.accept_many(body)
    for _ in body:
        m.rollback(1)
    assert m.constrained and torch.equal(_mask(m), after_think)


# ---- DSML stream: every split gives the same result -------------------------------------------------

CALL = (f'\n\n<{DSML}tool_calls>\n<{DSML}invoke name="get_weather">\n'
        f'<{DSML}parameter name="city" string="true">Pa ris\n</{DSML}parameter>\n'
        f'<{DSML}parameter name="days" string="false">3</{DSML}parameter>\n'
        f'</{DSML}invoke>\n</{DSML}tool_calls>')
_FRAGMENTS = ["a", "b c", " ", "  ", "\n", "\n\n", " \n ", "\t", "<", "x<y", f"<{DSML}", f"</{DSML}", "｜",
              CALL, CALL.strip(), f'<{DSML}invoke name="f">', "> ", '"q"']
_TEXTS = st.lists(st.sampled_from(_FRAGMENTS), min_size=1, max_size=10).map("".join)


def _scan(chunks: list[str]) -> tuple[str, list[tuple[str, str, bool]], bool]:
    """(content, [(name, arguments, complete)], malformed) from feeding ``chunks`` in order."""
    sc = DsmlScanner(lambda i: f"call_{i}")
    events: list[Event] = [ev for c in chunks for ev in sc.feed(c)] + sc.finish()
    content, calls = "", []
    for ev in events:
        if isinstance(ev, ContentDelta):
            content += ev.text
        elif isinstance(ev, ToolCallStart):
            calls.append([ev.name, "", None])
        elif isinstance(ev, ToolCallDelta):
            calls[ev.index][1] += ev.arguments
        elif isinstance(ev, ToolCallEnd):
            assert ev.arguments == calls[ev.index][1]
            calls[ev.index][2] = ev.complete
    return content, [tuple(c) for c in calls], sc.malformed


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None)
@given(_TEXTS, st.lists(st.integers(0, 10**6), max_size=12))
def test_any_split_gives_the_whole_texts_result(text: str, cuts: list[int]) -> None:
    """Chunks cut anywhere (inside tags, whitespace runs, or leaving whitespace-only and empty
    chunks) give the content and calls of the whole text fed at once."""
    assert _scan(_split(text, cuts)) == _scan([text])


@pytest.mark.parametrize("chunks", [["a", " ", " ", "b"], ["a ", "\n", " b"], ["a", "\n\n", "\t", "b ", " "],
                                    ["x", " ", "", "  ", "y"]])
def test_whitespace_between_chunks_is_kept(chunks: list[str]) -> None:
    """Whitespace-only chunks between words: all of it reaches the content (a trailing run is
    released at the end, where nothing can follow)."""
    assert _scan(chunks)[0] == "".join(chunks)


def test_character_by_character_equals_whole_with_calls() -> None:
    """A call block streamed one character at a time: same content and call as in one chunk."""
    text = "Sure, checking.  " + CALL + "\n done"
    whole = _scan([text])
    assert whole[1] == [("get_weather", '{"city": "Pa ris\\n", "days": 3}', True)]
    assert _scan(list(text)) == whole


# ---- admission: max_seqs + max_queue in flight, not one more ----------------------------------------


def _held(eng: EngineLoop) -> tuple[threading.Event, threading.Thread]:
    """Hold the loop thread between steps (inside a ``call``) until the returned event is set."""
    release, entered = threading.Event(), threading.Event()

    def hold(core) -> None:
        entered.set()
        release.wait(30)

    t = threading.Thread(target=eng.call, args=(hold, 60), daemon=True)
    t.start()
    assert entered.wait(10)
    return release, t


class _PacedEngine(FakeEngine):
    """``FakeEngine`` at a human pace: no request of the burst below can finish while it is counted."""

    def step(self, plan):
        time.sleep(0.002)
        return super().step(plan)


@pytest.mark.parametrize("max_seqs,max_queue", [(2, 3), (1, 1), (3, 1)])
def test_a_burst_of_exactly_the_cap_is_admitted_and_the_next_refused(max_seqs: int, max_queue: int) -> None:
    """``max_seqs + max_queue`` requests arrive while the engine is between steps (a burst, all seen
    in one drain): every one is accepted. One more is refused at once with QueueFull, before the
    engine thread sees it; once the burst is admitted, another is still refused by the scheduler."""
    # a paced fake engine (2 ms a step): the plain one runs a step in microseconds, and a 3,000-token
    # answer sometimes finished between the burst's admission and the count below (3 of 5, 1 of 2 in flight)
    core = make_core(engine=_PacedEngine, max_seqs=max_seqs, max_queue=max_queue, max_model_len=4096)
    eng = EngineLoop(core).start()
    cap = max_seqs + max_queue
    params = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)

    async def main() -> None:
        release, holder = _held(eng)
        try:
            subs = [asyncio.create_task(eng.submit(RequestSpec([1, 2, 3], params), f"r{i}")) for i in range(cap)]
            await asyncio.sleep(0.05)  # every submit has passed its check and sent its request
            with pytest.raises(QueueFull):
                await asyncio.wait_for(eng.submit(RequestSpec([1, 2, 3], params), "over"), 5)
        finally:
            release.set()
            holder.join(10)
        streams = await asyncio.gather(*subs)  # raises if any of the cap was refused
        n = eng.call(lambda c: len(c.scheduler.running) + len(c.scheduler.waiting))
        assert n == cap
        with pytest.raises(QueueFull):
            core.add(core.make_request(RequestSpec([1, 2, 3], params)))  # the scheduler's own bound, at the cap
        for s in streams:
            await s.aclose()

    try:
        asyncio.run(main())
    finally:
        eng.shutdown()


def test_the_scheduler_admits_the_cap_and_no_more() -> None:
    """Without a loop in front: ``max_seqs + max_queue`` adds before any step succeed, the next
    raises QueueFull; after steps that admit the first ``max_seqs``, still exactly the cap."""
    core = make_core(max_seqs=3, max_queue=2)
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    for _ in range(5):
        core.add(core.make_request(RequestSpec([1, 2], params)))
    with pytest.raises(QueueFull):
        core.add(core.make_request(RequestSpec([1, 2], params)))
    core.step()
    assert len(core.scheduler.running) == 3 and len(core.scheduler.waiting) == 2
    with pytest.raises(QueueFull):
        core.add(core.make_request(RequestSpec([1, 2], params)))


# ---- isolation: suspects are cleared only past their failed step ------------------------------------


class _FailsOnce(FakeEngine):
    """Fails the ``at``-th step whatever it holds (a transient fault), like a forward that raises."""

    at = 5
    seen = 0

    def step(self, plan):
        type(self).seen += 1
        if type(self).seen == self.at:
            self.plans.append(plan)
            self.active_passes -= {p.pass_id for p in plan.passes} | set(plan.retired)
            return StepResult(plan.step_id, (), (), status=StepStatus.FAILED, error="RuntimeError: injected")
        return super().step(plan)


def _failure_ends(plan) -> dict[str, int]:
    """Each member's position after the failed step: decode position + 1, or its chunk's end."""
    ends = {d.request_id: d.position + 1 for d in plan.decodes}
    ends.update({m.request_id: m.start + len(m.ids) for p in plan.passes for m in p.members})
    return ends


@pytest.mark.parametrize("at", [2, 5, 9])
def test_a_suspect_is_cleared_exactly_when_it_recomputed_past_its_failure(at: int) -> None:
    """After a transient failure at step ``at``, every member of that step is a suspect for exactly
    as long as it has computed fewer tokens than it had reached at the end of the failed step: each
    step after the failure, ``suspect is not None`` iff ``computed < end``. All finish normally."""
    engine = type("Executor", (_FailsOnce,), {"at": at, "seen": 0})
    core = make_core(engine=engine, max_seqs=6, step_tokens=24, max_prefill_tokens=16)
    reqs = [core.make_request(RequestSpec(list(range(1, 2 + (i * 11) % 50)),
                                          SamplingParams(max_tokens=12, temperature=0)))
            for i in range(6)]
    for r in reqs:
        core.add(r)
    ends: dict[str, int] = {}
    checked = 0
    while core.has_work:
        core.step()
        if not ends and engine.seen >= at:
            ends = _failure_ends(core.executor.plans[at - 1])
            assert ends and all(r.suspect is not None for r in reqs if r.request_id in ends)
        for r in reqs:
            if r.request_id in ends and not r.status.finished:
                assert (r.suspect is not None) == (r.computed < ends[r.request_id]), \
                    (r.request_id, r.computed, ends[r.request_id], r.suspect)
                checked += r.suspect is not None
    assert checked > 0  # suspects were seen mid-recompute, not only at the end
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert not core.scheduler.quarantine and core.leaks() == ""
