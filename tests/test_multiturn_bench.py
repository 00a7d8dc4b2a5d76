"""bench serve --multi-turn: the conversations it sends (what a chat client sends: the whole history
every turn), the per-turn arithmetic on known inputs, the on/off comparison, the CLI wiring, and one
short run against the bundled model served for real."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from ds4serve.bench import multiturn
from ds4serve.bench.multiturn import (SAMPLE_IMAGE, SYSTEM_LEAD, MultiTurnReport, MultiTurnSpec, TurnRecord, answers_of,
                                      build_messages, compare, image_data_url, is_image_turn, markdown,
                                      markdown_comparison, per_turn, plan_conversations, request_body, run,
                                      system_prompt, turn_stats, url_target)
from ds4serve.bench.serve_bench import Result
from ds4serve.cli import _bench_multiturn, _serve_accepts, build_parser

IMG = "data:image/png;base64,AAAA"


def test_history_is_the_whole_conversation_in_order():
    users = [{"role": "user", "content": f"q{i}"} for i in range(3)]
    msgs = build_messages("sys", users, ["a0", "a1"])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in msgs] == ["sys", "q0", "a0", "q1", "a1", "q2"]
    assert build_messages("sys", users[:1], []) == [{"role": "system", "content": "sys"}, users[0]]
    with pytest.raises(ValueError):
        build_messages("sys", users, ["a0"])


def test_plan_is_seeded_and_puts_images_on_every_third_turn():
    spec = MultiTurnSpec(conversations=3, turns=7, user_words=5, seed=4)
    plan = plan_conversations(spec, 20, IMG)
    assert plan == plan_conversations(spec, 20, IMG)
    assert plan.users != plan_conversations(MultiTurnSpec(conversations=3, turns=7, seed=5), 20, IMG).users
    assert len(plan.users) == 3 and all(len(u) == 7 for u in plan.users)
    assert plan.users[0] != plan.users[1]  # conversations differ, the system prompt is shared
    assert len(plan.system.split("House notes: ")[1].split()) == 20 and plan.system_words == 20 and plan.images
    for turn, msg in enumerate(plan.users[0], 1):
        if is_image_turn(turn, 3):
            assert turn in (3, 6)
            image, text = msg["content"]
            assert image == {"type": "image_url", "image_url": {"url": IMG}} and text["type"] == "text"
            assert text["text"].endswith("?")  # a question about the picture
        else:
            assert isinstance(msg["content"], str) and msg["content"].split("\n")[0].count(" ") == 4
    text_only = plan_conversations(spec, 20, None)
    assert not text_only.images and all(isinstance(m["content"], str) for u in text_only.users for m in u)
    assert not any(is_image_turn(t, 0) for t in range(1, 9))


def test_system_prompt_and_body():
    assert system_prompt(1, 30) == system_prompt(1, 30) != system_prompt(2, 30)
    assert system_prompt(1, 30).startswith(SYSTEM_LEAD) and len(system_prompt(1, 30).split(": ")[1].split()) == 30
    assert system_prompt(1, 0) == SYSTEM_LEAD
    body = request_body("m", [{"role": "user", "content": "x"}], 32, True)
    assert body["temperature"] == 0 and body["max_tokens"] == 32 and body["stream"] and body["ignore_eos"]
    assert body["stream_options"] == {"include_usage": True}
    assert "ignore_eos" not in request_body("m", [], 32, False)


def test_the_sample_image_is_the_bundled_one():
    assert SAMPLE_IMAGE.name == "sample.png"
    url = image_data_url(MultiTurnSpec())
    assert url.startswith("data:image/png;base64,") and len(url) > 100


def test_probes_size_the_system_prompt_and_ask_for_images_without_generating(monkeypatch):
    sent = []

    def fake_post(url, json, headers, timeout, answer):
        sent.append((url, json))
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(answer[0], json=answer[1])

    def answering(answer):
        monkeypatch.setattr(multiturn.httpx, "post", lambda url, **kw: fake_post(url, answer=answer, **kw))

    spec = MultiTurnSpec(system_tokens=100)
    answering((200, {"count": 250}))  # 2.5 tokens per word: 40 words make ~100 tokens
    assert multiturn.probe_system_words("http://h", "m", spec, {}) == 40
    assert sent[-1] == ("http://h/tokenize", {"model": "m", "prompt": system_prompt(0, 100)})
    answering((404, {"detail": "Not Found"}))  # no /tokenize: one word per token
    assert multiturn.probe_system_words("http://h", "m", spec, {}) == 100
    assert multiturn.probe_system_words("http://h", "m", MultiTurnSpec(system_tokens=0), {}) == 0
    assert multiturn.probe_vision("http://h", "m", IMG, {})  # a route that cannot say: images stay on
    assert sent[-1][1]["messages"][0]["content"][0]["image_url"]["url"] == IMG
    answering((400, {"error": {"message": "model 'm' does not accept images"}}))
    assert not multiturn.probe_vision("http://h", "m", IMG, {})
    answering(httpx.ConnectError("refused"))
    assert multiturn.probe_vision("http://h", "m", IMG, {})
    assert multiturn.probe_system_words("http://h", "m", spec, {}) == 100


def _rec(conv, turn, ttft=0.0, prompt=0, cached=None, ok=True, text="x"):
    res = Result(True, ttft=ttft, prompt_tokens=prompt, cached_tokens=cached, text=text) if ok else \
        Result(False, error="HTTP 400")
    return TurnRecord(conv, turn, res)


def test_per_turn_figures_count_an_absent_cached_field_as_zero():
    records = [_rec(0, 1, 0.1, 100), _rec(1, 1, 0.3, 100, 0), _rec(2, 1, 0.2, 120, 20),
               _rec(0, 2, 0.05, 200, 150), _rec(1, 2, ok=False)]
    t1, t2 = per_turn(records, 2)
    assert (t1.turn, t1.requests, t1.completed) == (1, 3, 3)
    assert t1.ttft_ms_p50 == pytest.approx(200.0) and t1.ttft_ms_mean == pytest.approx(200.0)
    assert t1.prompt_tokens_mean == pytest.approx(320 / 3) and t1.cached_tokens_mean == pytest.approx(20 / 3)
    assert t1.hit_rate == pytest.approx(20 / 320) and t1.errors == {}
    assert (t2.requests, t2.completed, t2.errors) == (2, 1, {"HTTP 400": 1})
    assert t2.hit_rate == pytest.approx(0.75) and t2.ttft_ms_p50 == pytest.approx(50.0)
    total = turn_stats(None, records)
    assert (total.turn, total.requests, total.completed) == (None, 5, 4)
    assert total.hit_rate == pytest.approx(170 / 520)
    empty = turn_stats(3, [])
    assert empty.requests == 0 and math.isnan(empty.ttft_ms_p50) and math.isnan(empty.hit_rate)
    assert answers_of([_rec(1, 2, text="b"), _rec(1, 1, text="a"), _rec(0, 1, ok=False)], 2) == [[], ["a", "b"]]


def _report(label, ttfts, prompts, answers):
    records = [_rec(0, t, ttft, prompt) for t, (ttft, prompt) in enumerate(zip(ttfts, prompts), 1)]
    stats = per_turn(records, len(ttfts))
    return MultiTurnReport(label=label, base_url="u", model="m", conversations=1, turns=len(ttfts), max_tokens=4,
                           images=False, system_words=10, duration_s=1.0, cached_reported=False, per_turn=stats,
                           total=turn_stats(None, records), answers=answers)


def test_comparison_reports_the_last_turn_with_and_without():
    on = _report("cache on", [0.4, 0.1, 0.1], [50, 90, 130], [["a", "b", "c"]])
    off = _report("cache off", [0.4, 0.3, 0.5], [50, 90, 130], [["a", "b", "c"]])
    cmp = compare(on, off)
    assert cmp.turn == 3 and cmp.ttft_ms_p50_on == pytest.approx(100.0) and cmp.ttft_ms_p50_off == pytest.approx(500.0)
    assert cmp.ratio_p50 == pytest.approx(5.0) and cmp.ratio_mean == pytest.approx(5.0)
    assert [r["ratio_p50"] for r in cmp.per_turn] == pytest.approx([1.0, 3.0, 5.0])
    assert cmp.prompt_tokens_equal and cmp.answers_identical
    other = compare(on, _report("cache off", [0.4, 0.3, 0.5], [50, 91, 130], [["a", "b", "d"]]))
    assert not other.prompt_tokens_equal and not other.answers_identical
    assert "| 3 | 100 | 500 | 5.00x |" in markdown_comparison(cmp) and "same answers: no" in markdown_comparison(other)
    table = markdown(on)
    assert "| 2 | 1 | 1 | 100 | 100 | 90.0 | 0.0 | 0.0% | - |" in table and "| all | 3 | 3 |" in table


def test_cli_wiring():
    args = build_parser().parse_args(["bench", "serve", "--multi-turn", "--conversations", "2", "--turns", "3",
                                      "--no-images", "--system-tokens", "50", "--launch-args=--threads 2"])
    assert args.multi_turn and (args.conversations, args.turns, args.system_tokens) == (2, 3, 50)
    assert args.images is False and args.ignore_eos is False and args.launch_args == "--threads 2"
    assert build_parser().parse_args(["bench", "serve", "--multi-turn"]).images is None  # auto
    assert _serve_accepts("--max-seqs") and not _serve_accepts("--no-such-flag")
    compare_without_a_baseline = build_parser().parse_args(["bench", "serve", "--multi-turn", "--compare"])
    assert _bench_multiturn(compare_without_a_baseline) == 2


@pytest.fixture(scope="module")
def bundled_server():
    from server_harness import serve

    with serve(SAMPLE_IMAGE.parent, name="ds4v-tiny", random_weights=False) as srv:
        yield srv


def test_a_short_run_against_the_bundled_model(bundled_server, tmp_path):
    spec = MultiTurnSpec(conversations=2, turns=3, system_tokens=60, user_words=3, max_tokens=4)
    (report,), cmp = run([url_target("run", bundled_server.base)], spec, None, tmp_path, progress=False)
    assert cmp is None and report.model == "ds4v-tiny" and report.images  # a vision model: the probe says so
    assert [s.turn for s in report.per_turn] == [1, 2, 3] and report.total.requests == 6
    assert all(s.completed == s.requests == 2 and not s.errors for s in report.per_turn)
    assert all(len(a) == 3 and all(a) for a in report.answers)
    prompts = [s.prompt_tokens_mean for s in report.per_turn]
    assert prompts[0] >= 60 and prompts[0] < prompts[1] < prompts[2]  # the system prompt, then each turn adds
    assert prompts[2] - prompts[1] > prompts[1] - prompts[0]  # turn 3 attaches the image
    assert all(s.ttft_ms_p50 > 0 and s.ttft_ms_mean > 0 for s in report.per_turn)
    if report.cached_reported:  # the server has a prefix cache: later turns reuse the history
        assert all(s.cached_tokens_mean > 0 and 0 < s.hit_rate <= 1 for s in report.per_turn[1:])
    doc = json.loads((tmp_path / "bench_multiturn.json").read_text())
    assert doc["comparison"] is None and len(doc["runs"]) == 1
    assert [t["turn"] for t in doc["runs"][0]["per_turn"]] == [1, 2, 3] and doc["runs"][0]["total"]["turn"] is None
    assert "| all | 6 | 6 |" in (tmp_path / "bench_multiturn.md").read_text()


def test_the_comparison_runs_the_same_conversations_against_a_cache_off_server(bundled_server, tmp_path):
    from server_harness import serve

    # another seed than the run above: that run's conversations are in this server's cache already
    spec = MultiTurnSpec(conversations=2, turns=3, system_tokens=60, user_words=3, max_tokens=4, seed=1)
    with serve(SAMPLE_IMAGE.parent, name="ds4v-tiny", random_weights=False,
               settings={"enable_prefix_caching": False}) as off:
        (on_run, off_run), cmp = run([url_target("cache on", bundled_server.base), url_target("cache off", off.base)],
                                     spec, None, tmp_path, progress=False)
    assert cmp is not None and cmp.turn == 3 and len(cmp.per_turn) == 3
    assert cmp.ttft_ms_p50_on == on_run.per_turn[-1].ttft_ms_p50
    assert cmp.ttft_ms_p50_off == off_run.per_turn[-1].ttft_ms_p50
    assert cmp.ratio_p50 == pytest.approx(cmp.ttft_ms_p50_off / cmp.ttft_ms_p50_on)
    assert cmp.prompt_tokens_equal  # one plan for both servers: the same system prompt and user turns
    assert cmp.answers_identical  # greedy, and a prefix cache must not change an answer
    assert off_run.total.cached_tokens_mean == 0  # nothing reused with the cache off
    doc = json.loads((tmp_path / "bench_multiturn.json").read_text())
    assert [r["label"] for r in doc["runs"]] == ["cache on", "cache off"] and doc["comparison"]["turn"] == 3
    assert "## cache on vs off" in (tmp_path / "bench_multiturn.md").read_text()
