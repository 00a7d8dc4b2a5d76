"""A seeded storm of real traffic against an in-process server, with the invariants checked after.

Many clients send text and image requests over HTTP (streaming or not); some disconnect while
their prompt is prefilling, while their images are in a pass, or mid-stream; some send malformed
or hostile input. The pool and host budget are small, so requests are suspended, dropped and
recomputed. Afterwards:

* the server is alive;
* every completed answer equals that prompt's solo answer (greedy, measured on the same server
  before the storm);
* every other request ended cleanly (an abort we caused, or a 4xx/503 with an OpenAI error body;
  never a 500, never a stall);
* the counters add up: requests the engine accepted = completed + failed + aborted;
* nothing leaked: slots, pages, pass staging, host snapshots, encoder jobs, image rows.

The plan is a pure function of the seed, and every request with its outcome is written to a JSONL
log, so a failing seed can be replayed.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

TEXTS = ["Tell me about rivers.", "Count to ten slowly.", "What is a lighthouse?", "Name some colours.",
         "Write a short poem about snow.", "Explain the rules of chess.", "Describe a busy market.",
         "What do cats eat?"]
BAD_BODIES = [
    b"{not json", b"[]", b'{"model": "tiny"}',
    json.dumps({"model": "tiny", "messages": []}).encode(),
    json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).encode(),
    json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -3}).encode(),
    json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9}).encode(),
    json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "<｜deepseek_image｜>"}]}).encode(),
    json.dumps({"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,Zm9v"}}]}]}).encode(),
    json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{"x": 1}]}).encode(),
]


@dataclass
class Planned:
    index: int
    action: str  # complete | complete_stream | abort_prefill | abort_image | abort_stream | malformed
    prompt: int  # index into the prompt table (-1 for malformed)
    delay_s: float  # arrival offset
    abort_after_s: float = 0.0
    abort_after_chunks: int = 0
    bad: int = -1


@dataclass
class Outcome:
    index: int
    action: str
    status: str  # completed | aborted | rejected | mismatch | stalled | error
    detail: str = ""
    text: str = ""


@dataclass
class Report:
    seed: int
    requests: int
    counts: dict[str, int]
    problems: list[str] = field(default_factory=list)
    engine_stats: dict = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems


def _image_url(seed: int) -> str:
    import base64
    import io

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    im = Image.new("RGB", (140 + 20 * (seed % 3), 120), tuple(rng.randrange(256) for _ in range(3)))
    d = ImageDraw.Draw(im)
    d.rectangle((10, 10, 60, 70), fill=tuple(rng.randrange(256) for _ in range(3)))
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def prompt_table(n_image_prompts: int = 6) -> list[dict]:
    """Distinct prompts (each with its own max_tokens); requests reuse them so solo answers are few."""
    table = [{"messages": [{"role": "user", "content": t}], "max_tokens": 6 + 2 * i, "images": 0}
             for i, t in enumerate(TEXTS)]
    for i in range(n_image_prompts):
        n_img = 1 + i % 3
        parts = [{"type": "text", "text": f"Compare these {n_img} pictures."}]
        parts += [{"type": "image_url", "image_url": {"url": _image_url(10 * i + k)}} for k in range(n_img)]
        table.append({"messages": [{"role": "user", "content": parts}], "max_tokens": 8 + i, "images": n_img})
    return table


DEFAULT_MIX = {"complete": 3, "complete_stream": 4, "abort_prefill": 1, "abort_image": 1, "abort_stream": 1,
               "malformed": 1}


def make_plan(seed: int, n: int, table: list[dict], spread_s: float,
              mix: dict[str, int] | None = None) -> list[Planned]:
    """The storm's requests: a pure function of the seed. Prefill aborts hang up within 0.15 s of
    sending; image aborts within 0.05-1 s (their images queue, encode and run a pass first)."""
    rng = random.Random(seed)
    image_prompts = [i for i, p in enumerate(table) if p["images"]]
    weights = mix or DEFAULT_MIX
    actions = list(weights)
    plan = []
    for i in range(n):
        action = rng.choices(actions, [weights[a] for a in actions])[0]
        prompt = rng.choice(image_prompts) if action == "abort_image" else rng.randrange(len(table))
        u = rng.random()
        plan.append(Planned(i, action, -1 if action == "malformed" else prompt, rng.uniform(0, spread_s),
                            abort_after_s=0.05 + 0.95 * u if action == "abort_image" else 0.15 * u,
                            abort_after_chunks=rng.randint(1, 4),
                            bad=rng.randrange(len(BAD_BODIES))))
    return plan


def _body(table: list[dict], p: Planned, stream: bool) -> dict:
    t = table[p.prompt]
    body = {"model": "tiny", "messages": t["messages"], "max_tokens": t["max_tokens"], "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if p.action == "abort_image":
        body["seed"] = 10_000 + p.index  # marks the request for _PassWatcher; greedy answers ignore it
    return body


class _PassWatcher:
    """Which requests are inside a multi-step image pass right now, polled from the engine loop.

    ``abort_image`` requests carry a unique ``seed`` (greedy answers ignore it), so a client can hang up
    exactly while its own images are in a pass rather than hoping a timer lands there."""

    def __init__(self, loop):
        self.loop = loop
        self.in_pass: set[int] = set()
        self.changed = asyncio.Event()

    @staticmethod
    def _probe(core) -> set[int]:
        return {r.params.seed for r in core.scheduler.running if r.pass_id is not None and r.params.seed is not None}

    async def run(self) -> None:
        while True:
            self.in_pass = await asyncio.to_thread(self.loop.call, self._probe)
            self.changed.set()
            self.changed = asyncio.Event()
            await asyncio.sleep(0.003)

    async def wait_in_pass(self, seed: int) -> None:
        while seed not in self.in_pass:
            await self.changed.wait()


async def _stream(client, url, body, p: Planned, timeout_s: float, watcher: _PassWatcher | None) -> Outcome:
    """Stream one answer. ``abort_prefill`` hangs up on a timer, whatever has arrived, so the disconnect
    lands while the prompt is still being computed; ``abort_image`` hangs up once its images are seen in
    a pass (in-process servers) or on a timer (any other server)."""
    t0 = time.monotonic()
    if p.action == "abort_image" and watcher is not None:
        reading = asyncio.ensure_future(_read_stream(client, url, body, p, timeout_s))
        seen = asyncio.ensure_future(watcher.wait_in_pass(body["seed"]))
        await asyncio.wait({reading, seen}, return_when=asyncio.FIRST_COMPLETED)
        if reading.done():
            seen.cancel()
            return reading.result()  # answered before any pass was observed (a one-step pass)
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        return Outcome(p.index, p.action, "aborted", f"in its image pass after {time.monotonic() - t0:.3f}s")
    if p.action in ("abort_prefill", "abort_image"):
        try:
            async with asyncio.timeout(p.abort_after_s):
                out = await _read_stream(client, url, body, p, timeout_s)
        except TimeoutError:
            return Outcome(p.index, p.action, "aborted", f"after {time.monotonic() - t0:.3f}s")
        return out
    return await _read_stream(client, url, body, p, timeout_s)


async def _read_stream(client, url, body, p: Planned, timeout_s: float) -> Outcome:
    text, chunks = "", 0
    try:
        async with client.stream("POST", url, json=body, timeout=timeout_s) as r:
            if r.status_code != 200:
                data = json.loads(await r.aread())
                return _refusal(p, r.status_code, data)
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Outcome(p.index, p.action, "error", json.dumps(chunk["error"]))
                for c in chunk.get("choices", []):
                    text += c.get("delta", {}).get("content") or ""
                chunks += 1
                if p.action == "abort_stream" and chunks >= p.abort_after_chunks:
                    return Outcome(p.index, p.action, "aborted", f"after {chunks} chunks")
    except httpx.TimeoutException:
        return Outcome(p.index, p.action, "stalled", f"no end within {timeout_s}s ({chunks} chunks)")
    return Outcome(p.index, p.action, "completed", text=text)


def _refusal(p: Planned, status: int, data: dict) -> Outcome:
    err = data.get("error") if isinstance(data, dict) else None
    clean = isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err)
    if clean and (400 <= status < 500 or status == 503):
        return Outcome(p.index, p.action, "rejected", f"{status} {err.get('code')}")
    return Outcome(p.index, p.action, "error", f"{status} {data}")


async def _one(client, base: str, table, p: Planned, timeout_s: float, watcher: _PassWatcher | None) -> Outcome:
    await asyncio.sleep(p.delay_s)
    try:
        return await _send(client, base, table, p, timeout_s, watcher)
    except httpx.TransportError as exc:  # the server dropped or refused the connection: a finding
        return Outcome(p.index, p.action, "error", f"connection failed: {type(exc).__name__}: {exc}")


async def _send(client, base: str, table, p: Planned, timeout_s: float, watcher: _PassWatcher | None) -> Outcome:
    url = base + "/v1/chat/completions"
    if p.action == "malformed":
        r = await client.post(url, content=BAD_BODIES[p.bad], headers={"content-type": "application/json"})
        try:
            return _refusal(p, r.status_code, r.json())
        except ValueError:
            return Outcome(p.index, p.action, "error", f"{r.status_code} non-JSON body")
    if p.action == "complete":
        try:
            r = await client.post(url, json=_body(table, p, False), timeout=timeout_s)
        except httpx.TimeoutException:
            return Outcome(p.index, p.action, "stalled", f"no answer within {timeout_s}s")
        if r.status_code != 200:
            return _refusal(p, r.status_code, r.json())
        return Outcome(p.index, p.action, "completed", text=r.json()["choices"][0]["message"]["content"])
    return await _stream(client, url, _body(table, p, True), p, timeout_s, watcher)


async def _storm(base: str, table, plan: list[Planned], timeout_s: float, loop=None) -> list[Outcome]:
    # every request on its own connection, like many separate users: reusing idle keep-alive connections
    # races the server closing them (a client-side ReadError that says nothing about the server)
    limits = httpx.Limits(max_connections=len(plan) + 8, max_keepalive_connections=0)
    watcher = _PassWatcher(loop) if loop is not None else None
    polling = asyncio.ensure_future(watcher.run()) if watcher else None
    try:
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
            return list(await asyncio.gather(*(_one(client, base, table, p, timeout_s, watcher) for p in plan)))
    finally:
        if polling is not None:
            polling.cancel()
            await asyncio.gather(polling, return_exceptions=True)


async def _solo(base: str, table) -> list[str]:
    async with httpx.AsyncClient(timeout=120) as client:
        out = []
        for i in range(len(table)):
            r = await client.post(base + "/v1/chat/completions", json=_body(table, Planned(0, "complete", i, 0), False))
            r.raise_for_status()
            out.append(r.json()["choices"][0]["message"]["content"])
        return out


def _wait_idle(loop, timeout_s: float = 60) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if not loop.call(lambda core: core.has_work):
            return
        time.sleep(0.05)


def run_chaos(srv, seed: int, n: int, log_path: Path | None = None, spread_s: float | None = None,
              timeout_s: float = 60.0, mix: dict[str, int] | None = None) -> Report:
    """Run the storm against a running in-process server ``srv`` and check every invariant."""
    t0 = time.time()
    table = prompt_table()
    solo = asyncio.run(_solo(srv.base, table))
    before = srv.loop.call(lambda core: dict(core.scheduler.stats))
    plan = make_plan(seed, n, table, spread_s if spread_s is not None else n / 40, mix)
    outcomes = asyncio.run(_storm(srv.base, table, plan, timeout_s, srv.loop))
    _wait_idle(srv.loop)
    problems = []
    for p, o in zip(plan, outcomes):
        if o.status == "completed" and o.text != solo[p.prompt]:
            o.status, o.detail = "mismatch", f"expected {solo[p.prompt]!r}"
        if o.status in ("mismatch", "stalled", "error"):
            problems.append(f"request {p.index} ({p.action}, prompt {p.prompt}): {o.status}: {o.detail[:200]}")
    health = httpx.get(srv.base + "/health", timeout=10)
    if health.status_code != 200:
        problems.append(f"server not alive after the storm: /health {health.status_code}")
    stats = srv.loop.call(lambda core: dict(core.scheduler.stats))
    delta = {k: stats[k] - before.get(k, 0) for k in stats}
    if delta["added"] != delta["completed"] + delta["aborted"] + delta["failed"]:
        problems.append(f"counters do not add up: added {delta['added']} != completed {delta['completed']} + "
                        f"aborted {delta['aborted']} + failed {delta['failed']}")
    leaks = srv.loop.call(lambda core: core.leaks())
    if leaks:
        problems.append(f"leaks: {leaks}")
    counts = dict(Counter(o.status for o in outcomes))
    if log_path:
        with open(log_path, "w") as f:
            for p, o in zip(plan, outcomes):
                f.write(json.dumps({"seed": seed, "plan": asdict(p), "outcome": asdict(o)}) + "\n")
    return Report(seed, n, counts, problems, delta, time.time() - t0)


# Small on purpose: 6 slots and 4 pages force suspension, recompute and page contention; a queue of 128
# turns overload into clean 503s rather than minute-long waits that would read as stalls.
CHAOS_SETTINGS = {"max_seqs": 6, "kv_budget": 256, "host_budget": "120KB", "step_tokens": 16,
                  "max_prefill_tokens": 256, "max_queue": 128, "max_model_len": 256}


def run(model: Path | None, seed: int, n: int, log_path: Path | None, rate: float = 8.0) -> Report:
    """``ds4serve bench chaos``: start an in-process server on ``model`` with tight memory and storm it
    with ``n`` requests arriving at about ``rate`` per second.

    The default model is the random placeholder: its byte tokenizer makes prompts long enough that
    sequences cross page boundaries and the tiny pool must suspend and recompute (the bundled model's
    BPE prompts are short and rarely do)."""
    import logging

    from ..server.inprocess import serve
    from ..tiny.random_model import ensure_random_checkpoint

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the report
    path, random_weights = (Path(model), False) if model else (ensure_random_checkpoint(), True)
    with serve(path, settings=CHAOS_SETTINGS, random_weights=random_weights) as srv:
        report = run_chaos(srv, seed, n, log_path, spread_s=n / rate)
    print(f"chaos seed {seed}: {n} requests in {report.elapsed_s:.0f} s; outcomes {report.counts}; engine "
          f"{ {k: v for k, v in report.engine_stats.items() if v} }")
    print("PASS" if report.ok else "FAIL:\n  " + "\n  ".join(report.problems))
    return report
