"""``ds4serve bench serve``: a load generator for any OpenAI-compatible chat endpoint.

Per load level (a fixed number of concurrent clients, or Poisson arrivals at a request rate) it
sends streaming chat requests from a seeded mix of text and image prompts and reports what users
feel. Definitions (as in the common serving benchmarks):

* TTFT: request sent -> first content token received.
* TPOT: (end-to-end latency - TTFT) / (output tokens - 1), per request.
* ITL: the gap between consecutive streamed content chunks (one token each here).
* end-to-end latency: request sent -> last byte of the stream.
* request throughput: completed requests / wall time of the level; output-token throughput: output
  tokens (from ``usage``) / wall time.
* longest pause: the largest ITL of any stream in the level.
* errors by kind: HTTP status or client exception name.

Figures are percentiles p50 / p90 / p99 over requests (TTFT, TPOT, E2E) or over gaps (ITL).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from tqdm.auto import tqdm

WORDS = ("river", "stone", "light", "garden", "engine", "winter", "signal", "market", "planet", "letter")


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None
    prompt_tokens: int = 0  # as the server counts them (usage.prompt_tokens); 0 when it does not say
    # usage.prompt_tokens_details.cached_tokens (OpenAI's field); None when the server does not send it,
    # so "no prefix cache reported" stays distinguishable from "reported, nothing reused"
    cached_tokens: int | None = None
    text: str = ""  # the streamed content, joined (multi-turn runs send it back as the assistant turn)


@dataclass
class Level:
    label: str
    concurrency: int | None
    rate: float | None
    requests: int
    duration_s: float
    completed: int
    errors: dict[str, int]
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    request_throughput: float
    output_throughput: float
    longest_pause_ms: float
    # prompt processing as users feel it: per request prompt_tokens / TTFT, median (nan when the server
    # reports no usage); and all prompt tokens of the level over its wall time
    prompt_tok_s_ttft: float = float("nan")
    prompt_throughput: float = 0.0
    # prompt tokens the server says it reused from its prefix cache, over completed requests; None when
    # it never reports usage.prompt_tokens_details.cached_tokens
    cached_tokens: int | None = None


def _pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(round(q * (len(v) - 1))))]  # noqa: E731
    return {"p50": 1000 * pick(0.5), "p90": 1000 * pick(0.9), "p99": 1000 * pick(0.99)}


def _image_url(rng: random.Random) -> str:
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (160, 120), tuple(rng.randrange(256) for _ in range(3)))
    d = ImageDraw.Draw(im)
    for _ in range(3):
        x, y = rng.randrange(120), rng.randrange(80)
        d.ellipse((x, y, x + 30, y + 30), fill=tuple(rng.randrange(256) for _ in range(3)))
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def make_requests(n: int, seed: int, image_fraction: float, prompt_words: int, max_tokens: int,
                  model: str, ignore_eos: bool = True) -> list[dict]:
    """Seeded request bodies. ``ignore_eos`` (a vLLM/ds4serve extension) fixes every answer's length;
    servers that reject unknown fields (transformers serve) get greedy bodies without it, which stop
    at the same point on the same weights."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(prompt_words))
        if rng.random() < image_fraction:
            content = [{"type": "text", "text": f"Describe this image. {text}"},
                       {"type": "image_url", "image_url": {"url": _image_url(rng)}}]
        else:
            content = f"Continue: {text}"
        body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        if ignore_eos:
            body["ignore_eos"] = True
        out.append(body)
    return out


def read_usage(usage: dict) -> tuple[int, int, int | None]:
    """(completion tokens, prompt tokens, cached prompt tokens or None) from an OpenAI ``usage`` object.

    ``prompt_tokens_details`` is optional in OpenAI's schema and absent from servers without a prefix
    cache, hence None rather than 0 for the cached count."""
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return usage.get("completion_tokens") or 0, usage.get("prompt_tokens") or 0, (
        int(cached) if cached is not None else None)


async def one_request(client: httpx.AsyncClient, url: str, body: dict, headers: dict,
                      count_reasoning: bool = False) -> Result:
    """One streamed chat request, timed. ``count_reasoning``: a reasoning delta also counts as the
    first token (a thinking model's first visible output), as multi-turn runs measure TTFT."""
    t0 = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    text: list[str] = []
    tokens = pieces = prompt = 0
    cached: int | None = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return Result(False, error=f"HTTP {r.status_code}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Result(False, error=f"stream error: {chunk['error'].get('code')}")
                if chunk.get("usage"):
                    tokens, prompt, cached = read_usage(chunk["usage"])
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta") or {}
                    content = delta.get("content")
                    if content:
                        text.append(content)
                    if content or (count_reasoning and (delta.get("reasoning_content") or delta.get("reasoning"))):
                        pieces += 1
                        now = time.perf_counter()
                        if first is None:
                            first = now
                        else:
                            gaps.append(now - last)
                        last = now
    except httpx.HTTPError as exc:
        return Result(False, error=type(exc).__name__)
    end = time.perf_counter()
    if first is None:
        return Result(False, error="no tokens")
    # servers that ignore include_usage: count content chunks (one token each, or fewer chunks than
    # tokens where the detokenizer holds back a partial character, so never an overcount)
    return Result(True, ttft=first - t0, e2e=end - t0, itl=gaps, output_tokens=tokens or pieces, prompt_tokens=prompt,
                  cached_tokens=cached, text="".join(text))


async def run_level(base: str, bodies: list[dict], concurrency: int | None, rate: float | None, seed: int,
                    api_key: str | None, progress: bool) -> tuple[list[Result], float]:
    url = base.rstrip("/") + "/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=(concurrency or 256) + 8)
    bar = tqdm(total=len(bodies), desc=f"c={concurrency}" if concurrency else f"rate={rate}/s", disable=not progress,
               leave=False)
    results: list[Result] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        if concurrency:
            queue = list(bodies)

            async def worker():
                while queue:
                    body = queue.pop(0)
                    results.append(await one_request(client, url, body, headers))
                    bar.update()

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            rng = random.Random(seed)
            tasks = []
            for body in bodies:
                tasks.append(asyncio.create_task(one_request(client, url, body, headers)))
                tasks[-1].add_done_callback(lambda _: bar.update())
                await asyncio.sleep(rng.expovariate(rate))
            results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
    bar.close()
    return results, duration


def summarise(label: str, concurrency, rate, results: list[Result], duration: float) -> Level:
    ok = [r for r in results if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    gaps = [g for r in ok for g in r.itl]
    return Level(label=label, concurrency=concurrency, rate=rate, requests=len(results), duration_s=duration,
                 completed=len(ok), errors=dict(Counter(r.error for r in results if not r.ok)),
                 ttft_ms=_pct([r.ttft for r in ok]), tpot_ms=_pct(tpot), itl_ms=_pct(gaps),
                 e2e_ms=_pct([r.e2e for r in ok]), request_throughput=len(ok) / duration,
                 output_throughput=sum(r.output_tokens for r in ok) / duration,
                 longest_pause_ms=1000 * max(gaps, default=0.0),
                 prompt_tok_s_ttft=_median([r.prompt_tokens / r.ttft for r in ok if r.prompt_tokens and r.ttft > 0]),
                 prompt_throughput=sum(r.prompt_tokens for r in ok) / duration,
                 cached_tokens=_sum_reported([r.cached_tokens for r in ok]))


def _sum_reported(values: list[int | None]) -> int | None:
    """The sum of the values the server reported (None where it reported none at all)."""
    got = [v for v in values if v is not None]
    return sum(got) if got else None


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def markdown(levels: list[Level]) -> str:
    head = ("| load | req | ok | TTFT p50/p90/p99 ms | TPOT p50/p90 ms | ITL p50/p90/p99 ms | E2E p50/p90 ms | "
            "req/s | out tok/s | prompt tok/s (per request, from TTFT) | longest pause ms | errors |")
    rows = [head, "|" + "---|" * 12]
    for lv in levels:
        t, p, i, e = lv.ttft_ms, lv.tpot_ms, lv.itl_ms, lv.e2e_ms
        rows.append(f"| {lv.label} | {lv.requests} | {lv.completed} | {t['p50']:.0f}/{t['p90']:.0f}/{t['p99']:.0f} | "
                    f"{p['p50']:.1f}/{p['p90']:.1f} | {i['p50']:.1f}/{i['p90']:.1f}/{i['p99']:.1f} | "
                    f"{e['p50']:.0f}/{e['p90']:.0f} | {lv.request_throughput:.2f} | {lv.output_throughput:.1f} | "
                    f"{lv.prompt_tok_s_ttft:.0f} | {lv.longest_pause_ms:.0f} | {lv.errors or '-'} |")
    return "\n".join(rows)


def plot(levels: list[Level], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [lv.concurrency or lv.rate for lv in levels]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(xs, [lv.ttft_ms["p50"] for lv in levels], "o-", label="TTFT p50")
    a.plot(xs, [lv.itl_ms["p90"] for lv in levels], "s-", label="ITL p90")
    a.plot(xs, [lv.longest_pause_ms for lv in levels], "^-", label="longest pause")
    a.set_xlabel("concurrency" if levels[0].concurrency else "request rate (/s)")
    a.set_ylabel("ms")
    a.set_yscale("log")
    a.legend()
    a.set_title("latency")
    b.plot(xs, [lv.output_throughput for lv in levels], "o-", label="output tok/s")
    b.set_xlabel(a.get_xlabel())
    b.set_ylabel("tokens / s")
    b.set_title("throughput")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(base_url: str, model: str | None, concurrency: list[int] | None, rates: list[float] | None,
        requests_per_level: int, image_fraction: float, prompt_words: int, max_tokens: int, seed: int,
        out_dir: Path, api_key: str | None = None, progress: bool = True) -> list[Level]:
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    if model is None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        model = httpx.get(base + "/models", headers=headers, timeout=30).json()["data"][0]["id"]
    levels = []
    plan = [(c, None) for c in (concurrency or [])] + [(None, r) for r in (rates or [])]
    for c, r in plan:
        bodies = make_requests(requests_per_level, seed, image_fraction, prompt_words, max_tokens, model)
        results, duration = asyncio.run(run_level(base, bodies, c, r, seed, api_key, progress))
        levels.append(summarise(f"c={c}" if c else f"{r}/s", c, r, results, duration))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_serve.json").write_text(json.dumps([asdict(lv) for lv in levels], indent=1))
    table = markdown(levels)
    (out_dir / "bench_serve.md").write_text(table + "\n")
    plot(levels, out_dir / "bench_serve.png")
    print(f"model {model} at {base}: {requests_per_level} requests per level, {image_fraction:.0%} with an image, "
          f"max_tokens {max_tokens}")
    print(table)
    print(f"wrote {out_dir / 'bench_serve.json'}, .md and .png")
    return levels

