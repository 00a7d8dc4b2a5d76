"""bench serve's load generator and its figures: real requests against a real server, and the
summary arithmetic (TTFT, TPOT, ITL, throughput, longest pause) on known inputs."""

from __future__ import annotations

import asyncio

import pytest

from ds4serve.bench.serve_bench import Result, make_requests, markdown, read_usage, run_level, summarise


def test_summary_arithmetic():
    results = [Result(True, ttft=0.1, e2e=1.1, itl=[0.2, 0.3, 0.5], output_tokens=5, prompt_tokens=40),
               Result(True, ttft=0.3, e2e=0.7, itl=[0.4], output_tokens=2, prompt_tokens=30),
               Result(False, error="HTTP 503"), Result(False, error="HTTP 503")]
    lv = summarise("c=2", 2, None, results, duration=2.0)
    assert lv.completed == 2 and lv.requests == 4 and lv.errors == {"HTTP 503": 2}
    assert lv.output_throughput == pytest.approx(3.5) and lv.request_throughput == pytest.approx(1.0)
    assert lv.tpot_ms["p50"] in (pytest.approx(250.0), pytest.approx(400.0))  # (1.1-0.1)/4, (0.7-0.3)/1
    assert lv.longest_pause_ms == pytest.approx(500.0)
    assert lv.prompt_tok_s_ttft == pytest.approx(250.0)  # median of 40 / 0.1 and 30 / 0.3
    assert lv.prompt_throughput == pytest.approx(35.0)
    assert lv.ttft_ms["p99"] <= 300.0 + 1e-6
    table = markdown([lv])
    assert "| c=2 | 4 | 2 |" in table and "HTTP 503" in table and "| 250 |" in table


def test_cached_tokens_are_read_when_reported_and_none_when_absent():
    usage = {"prompt_tokens": 90, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 64}}
    assert read_usage(usage) == (7, 90, 64)
    assert read_usage({"prompt_tokens": 90, "completion_tokens": 7}) == (7, 90, None)
    assert read_usage({"prompt_tokens": 9, "completion_tokens": 1, "prompt_tokens_details": None}) == (1, 9, None)
    reported = [Result(True, ttft=0.1, e2e=0.2, output_tokens=2, cached_tokens=c) for c in (64, None, 0)]
    assert summarise("x", 1, None, reported, 1.0).cached_tokens == 64
    assert summarise("x", 1, None, [Result(True, ttft=0.1, e2e=0.2, output_tokens=2)], 1.0).cached_tokens is None


def test_bodies_are_seeded_and_honour_ignore_eos():
    a = make_requests(8, 3, 0.5, 6, 9, "m")
    assert a == make_requests(8, 3, 0.5, 6, 9, "m")
    assert all(b["ignore_eos"] for b in a) and any(isinstance(b["messages"][0]["content"], list) for b in a)
    assert all("ignore_eos" not in b for b in make_requests(4, 3, 0.0, 6, 9, "m", ignore_eos=False))


@pytest.mark.parametrize("concurrency,rate", [(3, None), (None, 50.0)])
def test_load_levels_against_a_live_server(server, concurrency, rate):
    bodies = make_requests(6, 0, 0.34, 5, 7, "tiny")
    results, duration = asyncio.run(run_level(server.base + "/v1", bodies, concurrency, rate, 0, None, False))
    assert len(results) == 6 and all(r.ok for r in results), [r.error for r in results]
    assert all(r.output_tokens == 7 for r in results)  # ignore_eos: every answer is max_tokens long
    assert all(0 < r.ttft <= r.e2e <= duration for r in results)
    assert all(len(r.itl) <= 6 for r in results)
    lv = summarise("x", concurrency, rate, results, duration)
    assert lv.output_throughput == pytest.approx(42 / duration)
    assert all(r.prompt_tokens > 0 for r in results) and lv.prompt_tok_s_ttft > 0  # the server's usage
    assert all(r.text for r in results)  # the streamed content, joined
    assert all(r.cached_tokens is None or 0 <= r.cached_tokens <= r.prompt_tokens for r in results)
