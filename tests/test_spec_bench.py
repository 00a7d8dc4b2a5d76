"""``ds4serve bench spec``: both engines produce the same greedy output, and the figures add up."""

from __future__ import annotations

import json
import subprocess
import sys

from ds4serve.bench.spec_bench import prompts, run


def test_prompts_repeat_a_seeded_phrase():
    a, b = prompts(2, 1000, length=50, phrase=20), prompts(2, 1000, length=50, phrase=20)
    assert a == b and a[0] != a[1] and len(a[0]) == 50 and a[0][:20] == a[0][20:40]


def test_the_bench_reports_drafts_on_a_random_checkpoint(ckpt_factory, capsys):
    _, path = ckpt_factory("A")
    rows = run(path, streams=(1, 3), new_tokens=24, rounds=1, warmup=False)
    assert [r.streams for r in rows] == [1, 3]
    for r in rows:
        assert r.identical and r.plain_tok_s > 0 and r.spec_tok_s > 0
        # the decode rate leaves the prefill out, so it is above the end-to-end rate of the same round
        assert r.plain_e2e_tok_s > 0 and r.spec_e2e_tok_s > 0 and r.e2e_ratio > 0
        assert 0 <= r.accepted <= r.drafted and r.verify_steps <= r.drafted
        assert all(0 <= a <= 1 for a in r.acceptance_by_position)
    assert any(r.drafted for r in rows)
    assert "| streams | plain decode tok/s | drafts decode tok/s | ratio | end-to-end ratio |" in capsys.readouterr().out


def test_the_bench_command_writes_its_figures(ckpt_factory, tmp_path):
    _, path = ckpt_factory("A")
    out = tmp_path / "spec.json"
    done = subprocess.run([sys.executable, "-m", "ds4serve.cli", "bench", "spec", "--model", str(path), "--streams",
                           "2", "--new-tokens", "16", "--rounds", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures[0]["streams"] == 2 and figures[0]["identical"] and figures[0]["ratio"] > 0
    assert figures[0]["e2e_ratio"] > 0 and figures[0]["plain_e2e_tok_s"] > 0


def test_generate_timed_reports_each_first_token(ckpt_factory):
    """``LLM.generate_timed``: the same tokens as ``generate``, and for each prompt the seconds to its
    first and to its last token, inside the call."""
    import time

    from ds4serve.llm import LLM

    _, path = ckpt_factory("A")
    llm = LLM(path, max_seqs=2, warmup=False)
    batch = [[5, 6, 7, 8] * 3, [9, 10, 11] * 2]
    t = time.perf_counter()
    outs, times = llm.generate_timed(batch, max_tokens=6, ignore_eos=True)
    elapsed = time.perf_counter() - t
    assert outs == llm.generate(batch, max_tokens=6, ignore_eos=True)
    assert len(times) == 2 and all(0 < first < last < elapsed for first, last in times)
