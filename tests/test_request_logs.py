"""Request ids, the access log and the operator metrics, through a real server on loopback.

Every request gets an ``x-request-id`` (made by the server, or the client's echoed), one access log
line when its answer is over (streams included, and streams the client left), and is counted in
/metrics: errors by status, cancellations by reason; every series carries ``model_name``; the engine
gauges (decode width, passes, preemptions) are there and plausible after real generations.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_harness import serve

NAME = "tiny-logs"
MSG = [{"role": "user", "content": "Tell me a story."}]
GENERATED_ID = re.compile(r"req-[0-9a-f]{32}")


def chat(**kw):
    return {"model": NAME, "messages": MSG, "max_tokens": 4, "temperature": 0, "ignore_eos": True} | kw


class _Lines(logging.Handler):
    """Collects access-log records from the server thread."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._lock = threading.Lock()

    def emit(self, record):
        with self._lock:
            self.records.append(record)

    def lines_for(self, request_id: str) -> list[logging.LogRecord]:
        with self._lock:
            return [r for r in self.records if getattr(r, "request_id", None) == request_id]

    def wait_for(self, request_id: str, timeout: float = 20.0) -> dict:
        """The one access line of a request (its answer may reach us before its line is written)."""
        deadline = time.monotonic() + timeout
        while not self.lines_for(request_id):
            assert time.monotonic() < deadline, f"no access line for {request_id}"
            time.sleep(0.01)
        time.sleep(0.05)  # a second line would follow at once: give it the chance to show up
        lines = self.lines_for(request_id)
        assert len(lines) == 1, [r.getMessage() for r in lines]
        return lines[0].access


@pytest.fixture(scope="module")
def srv(random_ckpt):
    with serve(random_ckpt, name=NAME, settings={"max_seqs": 8}, limits={"max_body_bytes": 100_000}) as s:
        yield s


@pytest.fixture()
def access():
    logger = logging.getLogger("ds4serve.access")
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def _metrics(srv) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from /metrics; an empty label (``key_name=""`` on a
    server without API keys) is left out, as Prometheus itself stores it."""
    text = httpx.get(srv.base + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if v))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _value(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted({"model_name": NAME, **labels}.items()))), 0.0)


def test_request_id_is_made_or_echoed_on_every_answer(srv, access):
    made = httpx.post(srv.base + "/v1/chat/completions", json=chat(), timeout=60)
    assert made.status_code == 200 and GENERATED_ID.fullmatch(made.headers["x-request-id"])
    assert access.wait_for(made.headers["x-request-id"])["completion_id"] == made.json()["id"]
    echoed = httpx.post(srv.base + "/v1/chat/completions", json=chat(), headers={"x-request-id": "client-7"})
    assert echoed.headers["x-request-id"] == "client-7"
    unsafe = httpx.post(srv.base + "/v1/chat/completions", json=chat(), headers={"x-request-id": "a b\"c"})
    assert GENERATED_ID.fullmatch(unsafe.headers["x-request-id"])  # not echoed into headers and logs
    answers = [httpx.post(srv.base + "/v1/chat/completions", json=chat(temperature=9)),  # 400
               httpx.post(srv.base + "/v1/chat/completions", json=chat(model="nope")),  # 404
               httpx.get(srv.base + "/v1/nowhere"),  # 404 route
               httpx.get(srv.base + "/v1/chat/completions"),  # 405
               httpx.post(srv.base + "/v1/chat/completions", content=b"x" * 200_000),  # 413
               httpx.get(srv.base + "/health"), httpx.get(srv.base + "/metrics")]
    assert [a.status_code for a in answers] == [400, 404, 404, 405, 413, 200, 200]
    assert all(GENERATED_ID.fullmatch(a.headers.get("x-request-id", "")) for a in answers)
    ids = {a.headers["x-request-id"] for a in answers} | {made.headers["x-request-id"]}
    assert len(ids) == len(answers) + 1


def test_one_access_line_per_request_with_its_fields(srv, access):
    r = httpx.post(srv.base + "/v1/chat/completions", json=chat(max_tokens=5), timeout=60)
    line = access.wait_for(r.headers["x-request-id"])
    usage = r.json()["usage"]
    assert {k: line[k] for k in ("method", "path", "status", "prompt_tokens", "completion_tokens", "finish")} == {
        "method": "POST", "path": "/v1/chat/completions", "status": 200,
        "prompt_tokens": usage["prompt_tokens"], "completion_tokens": 5, "finish": "length"}
    assert 0 < line["ttft_ms"] <= line["duration_ms"] and line["error"] is None and line["cancelled"] is None

    with httpx.stream("POST", srv.base + "/v1/completions", timeout=60,
                      json={"model": NAME, "prompt": "Once", "max_tokens": 6, "stream": True, "ignore_eos": True,
                            "stop": ["never-seen-stop"]}) as s:
        rid = s.headers["x-request-id"]
        frames = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert frames[-1] == "data: [DONE]"
    line = access.wait_for(rid)  # written when the stream ended, with the stream's totals
    assert (line["path"], line["status"], line["completion_tokens"], line["finish"]) == ("/v1/completions", 200, 6,
                                                                                       "length")
    assert 0 < line["ttft_ms"] <= line["duration_ms"]
    record = access.lines_for(rid)[0]
    assert record.levelno == logging.INFO and f"request_id={rid}" in record.getMessage()
    assert "status=200" in record.getMessage() and "finish=length" in record.getMessage()


def test_errors_are_logged_and_counted_by_status(srv, access):
    before = _metrics(srv)
    bad = [httpx.post(srv.base + "/v1/chat/completions", json=chat(temperature=9)) for _ in range(3)]
    missing = httpx.post(srv.base + "/v1/chat/completions", json=chat(model="gpt-9"))
    line = access.wait_for(bad[0].headers["x-request-id"])
    assert line["status"] == 400 and "temperature" in line["error"] and line["prompt_tokens"] is None
    assert "model_not_found" in access.wait_for(missing.headers["x-request-id"])["error"]
    assert 'error="' in access.lines_for(bad[0].headers["x-request-id"])[0].getMessage()  # free text is quoted
    after = _metrics(srv)
    name = "ds4serve_error_responses_total"
    assert _value(after, name, status="400") - _value(before, name, status="400") == 3
    assert _value(after, name, status="404") - _value(before, name, status="404") == 1


def test_an_internal_error_is_a_500_with_its_id_logged_and_counted(srv, access, monkeypatch):
    def broken(text):
        raise RuntimeError("tokenizer exploded")

    before = _metrics(srv)
    monkeypatch.setattr(srv.state.tokenizer, "encode_text", broken)
    monkeypatch.setattr(srv.state.tokenizer, "encode_markup", broken)  # the DS4 prompt's trusted text
    r = httpx.post(srv.base + "/v1/chat/completions", json=chat(), timeout=60)
    monkeypatch.undo()
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    rid = r.headers["x-request-id"]
    assert GENERATED_ID.fullmatch(rid)
    line = access.wait_for(rid)
    assert line["status"] == 500 and "RuntimeError" in line["error"]
    assert _value(_metrics(srv), "ds4serve_error_responses_total", status="500") - \
        _value(before, "ds4serve_error_responses_total", status="500") == 1


def _leave_stream_after(srv, frames: int) -> str:
    with httpx.stream("POST", srv.base + "/v1/chat/completions", timeout=60,
                      json=chat(max_tokens=900, stream=True)) as s:
        rid = s.headers["x-request-id"]
        seen = 0
        for ln in s.iter_lines():
            seen += ln.startswith("data: ")
            if seen >= frames:
                break  # leaving the block closes the connection mid-stream
    return rid


def test_client_disconnects_are_logged_and_counted_as_cancellations(srv, access):
    before = _metrics(srv)
    rid = _leave_stream_after(srv, 3)
    line = access.wait_for(rid)
    assert line["cancelled"] == "client_disconnect" and line["status"] == 200
    assert 2 <= line["completion_tokens"] < 900 and line["finish"] is None
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        httpx.post(srv.base + "/v1/chat/completions", json=chat(max_tokens=900), timeout=0.5,
                   headers={"x-request-id": "impatient-1"})
    line = access.wait_for("impatient-1")
    assert line["cancelled"] == "client_disconnect" and line["status"] == 499
    after = _metrics(srv)
    name = "ds4serve_cancellations_total"
    assert _value(after, name, reason="client_disconnect") - _value(before, name, reason="client_disconnect") == 2
    assert _value(after, "ds4serve_error_responses_total", status="499") == 0  # nobody was answered
    assert srv.loop.call(lambda core: core.leaks()) == ""


def test_every_series_has_model_name_and_engine_gauges_are_plausible(srv):
    before = _metrics(srv)
    out = httpx.post(srv.base + "/v1/chat/completions", json=chat(max_tokens=12, n=4, temperature=1.0, seed=1),
                     timeout=60).json()
    assert out["usage"]["completion_tokens"] == 48
    text = httpx.get(srv.base + "/metrics").text
    samples = [ln for ln in text.splitlines() if ln.startswith("ds4serve_")]
    assert len(samples) > 30 and all(f'model_name="{NAME}"' in ln for ln in samples), \
        [ln for ln in samples if f'model_name="{NAME}"' not in ln][:5]
    after = _metrics(srv)
    rows = _value(after, "ds4serve_decode_rows_total") - _value(before, "ds4serve_decode_rows_total")
    steps = _value(after, "ds4serve_decode_steps_total") - _value(before, "ds4serve_decode_steps_total")
    assert 4 * 11 <= rows <= 48  # each choice's first token comes from its prefill, the rest from decode rows
    assert 11 <= steps <= rows and rows / steps > 1.5  # the four choices decode side by side
    width = _value(after, "ds4serve_decode_width")
    assert 1.0 < width <= 8  # a recent mean: above one after a 4-wide decode, never above max_seqs
    assert _value(after, "ds4serve_passes_in_flight") == 0  # idle again
    for kind in ("suspend", "drop", "fail"):
        assert (("ds4serve_preemptions_total", tuple(sorted({"model_name": NAME, "kind": kind}.items())))
                in after), kind
    assert _value(after, "ds4serve_engine_steps_total") > _value(before, "ds4serve_engine_steps_total")
    assert json.dumps(out)  # the answer itself is a normal chat completion
