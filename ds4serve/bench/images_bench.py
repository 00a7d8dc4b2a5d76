"""``ds4serve bench images``: what users feel while others send images.

Scenario (in-process, on the engine the server uses): two streaming text requests decode while three
one-image requests and one eight-image request arrive. Reported: the median inter-token gap of the
text streams, the longest pause in them while the images prefill (and the ratio), the time to the
first token of each image request, and the time for four concurrent image answers against running
the same four one after another.
"""

from __future__ import annotations

import base64
import io
import statistics
import time
from pathlib import Path

import torch
from PIL import Image, ImageDraw

_COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]


def _image_url(seed: int) -> str:
    im = Image.new("RGB", (320, 240), _COLOURS[seed % 8])
    d = ImageDraw.Draw(im)
    d.ellipse((20 + seed * 9 % 100, 30, 140 + seed * 9 % 100, 150), fill=_COLOURS[(seed + 3) % 8])
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _prompt(core, tok, pipeline, text: str, seeds: list[int]):
    from ..chat import render_chat

    parts = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": _image_url(s)}}
                                                for s in seeds]
    prepared = pipeline.prepare(render_chat(tok, [{"role": "user", "content": parts}]))
    return prepared.ids, prepared.images


def run(model: Path | None = None, step_tokens: int = 24, new_tokens: int = 12, threads: int | None = None) -> dict:
    from ..chat import Tokenizer
    from ..engine.sampling import SamplingParams
    from ..llm import LLM
    from ..multimodal.pipeline import ImagePipeline
    from ..tiny.random_model import default_model

    if threads:
        torch.set_num_threads(threads)
    path = Path(model) if model else default_model()[0]
    llm = LLM(path, max_seqs=8, step_tokens=step_tokens, max_prefill_tokens=512)
    core, tok = llm.core, Tokenizer(path)
    pipeline = ImagePipeline.for_engine(core, tok)
    specs = [("Describe the picture.", [1]), ("What colour is the circle?", [2]), ("Count the shapes.", [3]),
             ("Which image is the brightest?", [4, 5, 6, 7, 8, 9, 10, 11])]
    prompts = [_prompt(core, tok, pipeline, t, s) for t, s in specs]
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)

    text_ids = [tok.encode_text("Tell me a long story about a lighthouse keeper.") for _ in range(2)]
    texts = [core.make_request([tok.bos_id] + t, SamplingParams(max_tokens=160, temperature=0, ignore_eos=True))
             for t in text_ids]
    for r in texts:
        core.add(r)
    stamps = {r.request_id: [] for r in texts}
    arrival, first, images, step, window = {}, {}, [], 0, [0.0, 0.0]
    while core.has_work:
        if step == 8:
            images = [core.make_request(p, params, images=ims) for p, ims in prompts]
            window[0] = time.monotonic()
            for r in images:
                arrival[r.request_id] = time.monotonic()
                core.add(r)
        outs = core.step()
        now = time.monotonic()
        for o in outs:
            if o.request_id in stamps and o.new_token_ids:
                stamps[o.request_id].append(now)
            if o.request_id in arrival and o.request_id not in first and o.new_token_ids:
                first[o.request_id] = now - arrival[o.request_id]
        if images and not window[1] and all(r.status.finished for r in images):
            window[1] = now
        step += 1
    gaps = [b - a for s in stamps.values() for a, b in zip(s, s[1:])]
    pauses = [b - a for s in stamps.values() for a, b in zip(s, s[1:]) if b >= window[0] and a <= window[1]]
    concurrent = window[1] - window[0]
    t0 = time.monotonic()
    for p, ims in prompts:
        r = core.make_request(p, params, images=ims)
        core.add(r)
        core.run_until_idle()
    sequential = time.monotonic() - t0
    t0 = time.monotonic()
    for p, ims in prompts:
        core.add(core.make_request(p, params, images=ims))
    core.run_until_idle()
    together = time.monotonic() - t0
    result = {
        "median_gap_ms": 1000 * statistics.median(gaps), "longest_pause_ms": 1000 * max(pauses),
        "pause_ratio": max(pauses) / statistics.median(gaps),
        "image_ttft_ms": [1000 * first.get(r.request_id, float("nan")) for r in images],
        "images_with_text_s": concurrent, "four_concurrent_s": together, "four_sequential_s": sequential,
        "concurrency_speedup": sequential / together, "leaks": core.leaks() or "none",
    }
    print(render(result, path, step_tokens))
    return result


def render(r: dict, path: Path, step_tokens: int) -> str:
    ttft = ", ".join(f"{t:.0f}" for t in r["image_ttft_ms"])
    return "\n".join([
        f"mixed image traffic on {path.name} ({torch.get_num_threads()} threads, step budget {step_tokens} tokens)",
        "",
        "| figure | value |",
        "|---|---:|",
        f"| text streams: median inter-token gap | {r['median_gap_ms']:.1f} ms |",
        f"| text streams: longest pause while 11 images prefill | {r['longest_pause_ms']:.1f} ms "
        f"({r['pause_ratio']:.2f}x median; target <= 3x) |",
        f"| image requests: time to first token | {ttft} ms |",
        f"| 4 image answers, concurrent | {r['four_concurrent_s']:.2f} s |",
        f"| 4 image answers, one after another | {r['four_sequential_s']:.2f} s "
        f"({r['concurrency_speedup']:.2f}x slower) |",
        f"| leaks after the run | {r['leaks']} |",
    ])
