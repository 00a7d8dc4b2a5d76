"""``ds4serve bench images``: its bookkeeping (rounds, medians, overhead) and one end-to-end run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ds4serve.bench import images_bench as bench
from ds4serve.engine.plan import PassMember, PassSlice, StepPlan


def _run(total: float, worst: float = 0.3, median: float = 0.1, slices: int = 1, cpu: float | None = None):
    return bench.TrafficRun(gaps=[median] * 5 + [worst], pauses=[median, worst], total_s=total, image_ttft_s=[0.5],
                            image_slices={1: slices}, answers=[[1, 2]], text_lengths=[6, 6], steps=7,
                            cpu_s=total if cpu is None else cpu)


def test_interleaved_reverses_the_order_each_round():
    calls = []
    runs = bench.interleaved({name: (lambda name=name: calls.append(name) or _run(1.0)) for name in "abc"}, 3)
    assert calls == list("abccbaabc")  # no configuration always runs first (or last) under drifting load
    assert {name: len(rs) for name, rs in runs.items()} == {"a": 3, "b": 3, "c": 3}


def test_summarise_takes_medians_and_the_overhead():
    runs = {"sliced": [_run(1.10, worst=0.2, slices=6, cpu=1.1), _run(1.06, worst=0.2, slices=6, cpu=1.05),
                       _run(9.0, slices=6, cpu=1.0)],
            "whole": [_run(1.0, worst=0.5), _run(1.02, worst=0.6), _run(0.98, worst=0.5)],
            "text only": [_run(0.8), _run(0.8), _run(0.9)]}
    r = bench.summarise(runs)
    assert r["sliced"]["total_s"] == pytest.approx(1.10)  # one slow round does not move the median
    assert r["overhead"] == pytest.approx(1.10 / 1.0 - 1)  # paired rounds: 1.10/1.0, 1.06/1.02, 9/0.98
    assert r["cpu_overhead"] == pytest.approx(1.05 / 1.02 - 1)
    assert r["image_work_cpu_s"] == pytest.approx(0.2) and r["slicing_extra_cpu_s"] == pytest.approx(0.03)
    assert r["sliced"]["pause_ratio"] == pytest.approx(2.0) and r["whole"]["longest_pause_ms"] == pytest.approx(500)
    assert r["sliced"]["slices_per_image_pass"] == [6] and r["whole"]["slices_per_image_pass"] == [1]
    assert r["answers_match"]
    text = bench.render(r | {"four_concurrent_s": 1.0, "four_sequential_s": 2.0, "concurrency_speedup": 2.0,
                             "leaks": "none", "rounds": 3, "threads": 2, "step_tokens": 24, "model": "m"})
    assert "+10.0% (target <= 3%)" in text and "+2.9% (target <= 3%)" in text and "+30 ms on 200 ms" in text


def test_watch_image_passes_counts_the_steps_of_image_passes_only():
    member = PassMember("r", 0, 0, (1, 2), sample=False)
    image_member = PassMember("i", 1, 0, (1, 2), sample=False, image_rows=(((0,), None),))
    core = SimpleNamespace(executor=SimpleNamespace(step=lambda plan: plan.step_id))
    plans = [StepPlan(1, (), (PassSlice(7, 0, 3, (image_member,)), PassSlice(8, 0, 6, (member,)))),
             StepPlan(2, (), (PassSlice(7, 3, 6, (image_member,)),)),
             StepPlan(3, (), (PassSlice(9, 0, 6, (image_member,)),))]
    with bench.watch_image_passes(core) as slices:
        assert [core.executor.step(p) for p in plans] == [1, 2, 3]  # the engine still runs every plan
    assert slices == {7: 2, 9: 1}
    assert core.executor.step(plans[0]) == 1 and slices == {7: 2, 9: 1}  # unhooked on exit


def test_bench_end_to_end(random_ckpt, capsys):
    """One short round: the sliced engine really slices, the control really does not, the answers
    agree and nothing leaks."""
    r = bench.run(random_ckpt, new_tokens=1, rounds=1, text_tokens=20)
    assert max(r["sliced"]["slices_per_image_pass"]) > 1
    assert r["whole"]["slices_per_image_pass"] == [1]
    assert r["answers_match"] and r["leaks"] == "none"
    assert "slicing overhead" in capsys.readouterr().out
