"""The grammar bench runs end to end on the tiny tokenizer and reports what it promises."""

from __future__ import annotations

from ds4serve.bench.grammar_bench import run


def test_grammar_bench_reports_per_token_overhead(tmp_path, capsys):
    out = tmp_path / "grammar.json"
    report = run(batch=4, kinds=("json_schema", "tool_named", "tool_auto"), out=out)
    assert out.exists() and '"per_token_overhead_ms"' in capsys.readouterr().out
    assert report["batch"] == 4 and report["library"] == "llguidance"
    for kind in ("json_schema", "tool_named", "tool_auto"):
        figures = report["kinds"][kind]
        assert figures["terminated"] and figures["steps"] > 10
        assert figures["per_token_overhead_ms"] > 0 and figures["fill_parallel"]["mean_ms"] > 0
