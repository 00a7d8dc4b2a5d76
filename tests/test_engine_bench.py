"""bench engine's arithmetic and its step breakdown on a real (small) engine: FLOP classification of
recorded products, the replayed floor, and the rendered ratios. The full side-by-side run is a
benchmark (``ds4serve bench engine``), not a test."""

from __future__ import annotations

import pytest

from ds4serve.bench.engine_bench import Row, _flops, _Ours, _replay, render, render_breakdown


def test_product_flops():
    assert _flops("aten::mm", [[16, 256], [256, 2048]]) == 2 * 16 * 256 * 2048
    assert _flops("aten::bmm", [[8, 16, 128], [8, 128, 256]]) == 2 * 8 * 16 * 128 * 256
    assert _flops("aten::baddbmm", [[1, 1, 1], [16, 4, 4], [16, 4, 1]]) == 2 * 16 * 4 * 4 * 1
    assert _flops("aten::addmm", [[64], [16, 32], [32, 64]]) == 2 * 16 * 32 * 64


def test_replay_times_real_products():
    assert _replay([]) < 1e-3
    small = _replay([("aten::mm", [[4, 8], [8, 4]])])
    big = _replay([("aten::mm", [[256, 512], [512, 512]])] * 4)
    assert 0 < small < big


def test_render_states_targets():
    rows = [Row(1, 80.0, 12.0, 60.0, 16.0), Row(16, 800.0, 20.0, 640.0, 25.0)]
    text = render(rows, 128, 64, rounds=3)
    assert "| 16 | 800 | 20.0 | 640 | 25.0 | 1.25x |" in text
    assert "16 rows / 1 row: 1.67 (target <= 2)" in text and "1.25x (target >= 5)" in text
    line = render_breakdown({"streams": 16, "step_ms": 20.0, "torch_calls": 3000.0, "products": 100,
                             "products_ms": 4.0}, rows)
    assert "100 matrix products" in line and "needs a 5.0 ms step" in line
    assert "decode graphs" not in line
    line = render_breakdown({"streams": 16, "step_ms": 2.0, "torch_calls": 3000.0, "products": 100,
                             "products_ms": 1.0, "decode_graphs": "cuda", "graph_captures": 3, "graph_replays": 90,
                             "graphs_disabled": "RuntimeError: x"}, rows)
    assert "cuda, 3 captured, 90 replays, TURNED OFF: RuntimeError: x" in line
    line = render_breakdown({"streams": 16, "step_ms": 6.0, "forward_ms": 4.5, "native": True, "torch_calls": 90.0,
                             "products": 0, "products_ms": 0.0}, rows)
    assert "4.5 ms in the native host forward" in line and "matrix products" not in line


@pytest.mark.parametrize("host_kernels", ["auto", "off"])
def test_breakdown_of_a_real_engine(tmp_path, host_kernels):
    pytest.importorskip("transformers")
    from ds4serve.bench.engine_bench import make_checkpoint

    path = make_checkpoint(tmp_path)
    ours = _Ours(path, max_streams=4, prompt_len=8, new_tokens=12, host_kernels=host_kernels)
    tok_s, step_ms = ours(4)
    assert tok_s > 0 and step_ms > 0
    split = ours.breakdown(4, steps=3)
    assert split["streams"] == 4 and 0 < split["forward_ms"] < split["step_ms"]
    assert split["native"] is (ours.llm.core.executor.host is not None)
    if host_kernels == "off":
        assert not split["native"]
    if not split["native"]:  # the torch path's products are recorded and replayed
        assert split["torch_calls"] > 100 and split["products"] > 10 and 0 < split["products_ms"]
    assert split["decode_graphs"] == "off" and split["graph_replays"] == 0
    assert not ours.llm.core.has_work


def test_peak_rss_is_read_for_this_process_and_unknown_for_a_missing_one():
    import sys

    import pytest

    from ds4serve.bench.memory import describe, peak_rss_mib

    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc")
    big = bytearray(64 * 2**20)  # the high-water mark covers at least this
    assert peak_rss_mib() >= 64 and "peak RSS" in describe("me")
    assert peak_rss_mib(2**31 - 1) is None and describe("gone", 2**31 - 1).endswith("unknown")
    del big
