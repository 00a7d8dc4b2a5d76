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


def test_a_stream_sends_its_next_prompt_once_the_one_before_finished(ckpt_factory):
    """``--requests-per-stream``: each stream's prompts run one after another (a request's first token comes
    after the previous request of its stream gave its last), the streams beside each other, and every
    output is what ``generate`` gives that prompt."""
    from ds4serve.llm import LLM

    _, path = ckpt_factory("A")
    llm = LLM(path, max_seqs=4, warmup=False)
    streams = [[[5, 6, 7, 8] * 3, [9, 10, 11] * 2, [12, 13] * 4], [[20, 21, 22] * 3, [23, 24] * 3, [25] * 5]]
    flat = [p for s in streams for p in s]
    outs, times = llm.generate_timed(flat, max_tokens=5, ignore_eos=True, stream_of=[0, 0, 0, 1, 1, 1])
    assert outs == llm.generate(flat, max_tokens=5, ignore_eos=True)
    for s in range(2):
        mine = times[3 * s:3 * s + 3]
        assert all(first <= last for first, last in mine)
        assert all(mine[i][1] < mine[i + 1][0] for i in range(2)), mine  # one request of a stream at a time
    # the two streams overlap: the second stream's first request starts before the first stream ends
    assert times[3][0] < times[2][1]


def test_the_bench_runs_streams_of_several_prompts(ckpt_factory, capsys):
    _, path = ckpt_factory("A")
    rows = run(path, streams=(2,), new_tokens=12, rounds=1, warmup=False, per_stream=3)
    assert rows[0].identical and rows[0].spec_e2e_tok_s > 0 and rows[0].plain_tok_s > 0
    assert "3 prompt(s) a stream, one after another" in capsys.readouterr().out
