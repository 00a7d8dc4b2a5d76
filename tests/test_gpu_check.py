"""scripts/gpu_check.{sh,py}: the summary table, the results file a killed run leaves, the JUnit
counts that decide whether the CUDA test really ran, and the step commands (no step is run here)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod
    spec.loader.exec_module(mod)
    return mod


gc = _load()


def _steps():
    return [gc.Step("install", "pass", 31, "wheelhouse; torch 2.11.0+cu130 untouched"),
            gc.Step("device", "pass", 2, "NVIDIA H200, 139.8 GiB"),
            gc.Step("tests", "FAIL", 80, "8 passed, 1 failed, 0 skipped"),
            gc.Step("bench engine", "TIMEOUT", 120, "16 streams 900 tok/s | a pipe\nand a newline"),
            gc.Step("serve smoke", "pass", 12, "HTTP 200, answer 'green' (right)"),
            gc.Step("images", "skipped", 0, "no time left in the budget")]


def test_the_table_has_one_row_per_step_and_says_what_failed():
    text = gc.render(_steps(), {"device": "cuda", "machine": "NVIDIA H200", "out": "/tmp/x"})
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows[0] == "| step | result | time | figures |"
    body = rows[1:]
    assert [r.split(" | ")[0][2:] for r in body] == ["install", "device", "tests", "bench engine", "serve smoke",
                                                     "images"]
    assert all(r.count(" | ") == 3 for r in body)  # a figure's own '|' and newlines cannot break the table
    assert "| bench engine | TIMEOUT | 120 s | 16 streams 900 tok/s / a pipe; and a newline |" in body
    assert text.splitlines()[-1].startswith("total 245 s; SOME STEPS DID NOT PASS")
    passed = [gc.Step(s.name, "pass", s.seconds, s.figures) for s in _steps()]
    assert "ALL PASSED" in gc.render(passed, {"device": "cpu", "quick": True})
    assert "(quick: small sizes)" in gc.render(passed, {"device": "cpu", "quick": True})


def test_a_saved_partial_run_renders_and_fails(tmp_path, capsys):
    gc.save(tmp_path, _steps()[:3] + [gc.Step("images")], {"device": "cuda"})
    assert gc.main(["--render", str(tmp_path / "results.json")]) == 1
    out = capsys.readouterr().out
    assert "| images | not run | 0 s | - |" in out and "| tests | FAIL |" in out


def test_junit_counts_see_a_skipped_cuda_test(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite name="pytest">'
                   '<testcase classname="tests.test_decode_graphs" name="test_buckets"/>'
                   '<testcase classname="tests.test_decode_graphs" name="test_cuda_graph_decode_equals_eager">'
                   '<skipped message="CUDA graphs need a CUDA device"/></testcase>'
                   '<testcase classname="t" name="test_x"><failure message="boom"/></testcase>'
                   '</testsuite></testsuites>')
    counts, cuda = gc.junit_counts(xml)
    assert counts == {"passed": 1, "failed": 1, "skipped": 1}
    assert cuda == {"test_cuda_graph_decode_equals_eager": "skipped"}
    assert gc.junit_counts(tmp_path / "missing.xml") == ({"passed": 0, "failed": 0, "skipped": 0}, {})


def test_the_steps_run_on_the_asked_device_and_skip_transformers_when_absent(tmp_path):
    cmds = gc.plan("cuda", quick=False, out=tmp_path, transformers=False)
    assert "tests/test_decode_graphs.py" in cmds["tests"]
    for name in ("bench engine", "images", "serve smoke"):
        i = cmds[name].index("--device")
        assert cmds[name][i + 1] == "cuda"
    assert "--no-transformers" in cmds["bench engine"]
    assert "--no-transformers" not in gc.plan("cpu", quick=True, out=tmp_path, transformers=True)["bench engine"]


def test_steps_that_each_use_all_their_time_stay_inside_the_budget():
    for device in ("cuda", "cpu"):
        for budget in (400.0, 300.0):
            left, limits = budget, []
            for i in range(len(gc.LIMITS)):
                limits.append(gc.step_limit(i, left, device))
                left -= max(limits[-1], 0)
            assert sum(limits) <= budget and left >= 0
            assert all(lim >= 5 for lim in limits)  # and none is starved


def test_the_shell_script_explains_itself():
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--quick" in r.stdout and "GPU_CHECK_DEVICE" in r.stdout
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--bogus"], capture_output=True, text=True)
    assert r.returncode == 2


def test_bench_engine_makes_its_checkpoint_without_transformers(tmp_path):
    """A GPU machine without transformers still gets `bench engine` (ds4serve's side): Appendix A's
    shapes from ds4serve's own random init, loadable and decoding."""
    from ds4serve.bench.engine_bench import APPENDIX_A, make_checkpoint_without_transformers
    from ds4serve.llm import LLM

    llm = LLM(make_checkpoint_without_transformers(tmp_path / "ckpt"), max_seqs=2, max_model_len=32)
    cfg = llm.cfg
    assert list(cfg.compress_ratios) == [0, 0, 4, 16, 4, 16]
    assert (cfg.vocab_size, cfg.num_layers, cfg.hidden_size, cfg.sliding_window) == (
        APPENDIX_A["vocab_size"], APPENDIX_A["num_hidden_layers"], APPENDIX_A["hidden_size"],
        APPENDIX_A["sliding_window"])
    outs = llm.generate([[0, 17, 23], [0, 5]], max_tokens=3)
    assert [len(o) for o in outs] == [3, 3]
