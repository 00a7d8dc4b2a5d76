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
        assert 0 <= r.accepted <= r.drafted and r.verify_steps <= r.drafted
        assert all(0 <= a <= 1 for a in r.acceptance_by_position)
    assert any(r.drafted for r in rows)
    assert "| streams | plain tok/s" in capsys.readouterr().out


def test_the_bench_command_writes_its_figures(ckpt_factory, tmp_path):
    _, path = ckpt_factory("A")
    out = tmp_path / "spec.json"
    done = subprocess.run([sys.executable, "-m", "ds4serve.cli", "bench", "spec", "--model", str(path), "--streams",
                           "2", "--new-tokens", "16", "--rounds", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures[0]["streams"] == 2 and figures[0]["identical"] and figures[0]["ratio"] > 0
