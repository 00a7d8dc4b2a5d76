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


def test_the_bench_command_writes_its_figures(tmp_path):
    import json

    from ds4serve.cli import main

    out = tmp_path / "grammar.json"
    assert main(["bench", "grammar", "--batch", "2", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["batch"] == 2 and figures["kinds"]
    assert all(k["per_token_overhead_ms"] > 0 and k["terminated"] for k in figures["kinds"].values())
