"""``ds4serve tiny eval``: exact-match accuracy of a tiny DS4V checkpoint on a held-out set, served
through the real engine with many requests in flight.

Every question goes the way a user's would: the image is PNG-encoded into a ``data:`` URL, rendered
with the DS4 chat template, decoded, resized and expanded by the server's ``ImagePipeline``, then
scheduled by ``EngineCore`` together with up to ``in_flight`` others (chunked prefill, shared image
passes, batched decode). Answers are greedy and compared exactly (after stripping whitespace).
"""

from __future__ import annotations

import base64
import io
import logging
import time
from collections import defaultdict
from pathlib import Path

from ..chat import IncrementalDetokenizer, Tokenizer, render_chat
from ..engine.sampling import SamplingParams
from ..scheduler.spec import RequestSpec
from ..multimodal.pipeline import ImagePipeline
from .data import TASKS, Example, examples, messages

log = logging.getLogger(__name__)

HELD_OUT_SEED = 2


def png_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def prepare(core, tok: Tokenizer, pipeline: ImagePipeline, ex: Example):
    return prepare_urls(tok, pipeline, ex, [png_url(im) for im in ex.render_images()])


def prepare_urls(tok: Tokenizer, pipeline: ImagePipeline, ex, urls: list[str]):
    """The server's path from a question and its image URLs to engine ids and image records (shared
    with the wild eval, whose pictures are not always PNG)."""
    rendered = render_chat(tok, messages(ex, urls))
    if not rendered.images:
        return rendered.ids, None
    prepared = pipeline.prepare(rendered)
    return prepared.ids, prepared.images


def answer_text(tok: Tokenizer, ids: list[int]) -> str:
    d = IncrementalDetokenizer(tok)
    return (d.push([i for i in ids if i != tok.eos_id]) + d.flush()).strip()


def run_examples(core, tok: Tokenizer, pipeline: ImagePipeline, exs: list[Example], in_flight: int,
                 params: SamplingParams, prepare_fn=prepare) -> list[list[int]]:
    """Every example's output token ids, keeping ``in_flight`` requests live in ``core`` at a time
    (a new one joins as soon as one finishes, like traffic on the server). ``prepare_fn`` builds a
    request's ids and images (the wild eval passes its own, for JPEG pictures)."""
    pending = list(enumerate(exs))
    live: dict[str, tuple[int, object]] = {}
    outputs: dict[int, list[int]] = {}
    while pending or live:
        while pending and len(live) < in_flight:
            i, ex = pending.pop(0)
            ids, images = prepare_fn(core, tok, pipeline, ex)
            req = core.make_request(RequestSpec(ids, params, images=images))
            core.add(req)
            live[req.request_id] = (i, req)
        for out in core.step():
            if out.finished and out.request_id in live:
                i, req = live.pop(out.request_id)
                if out.finish_reason == "error":
                    raise RuntimeError(f"example {i} failed: {out.error}")
                outputs[i] = list(req.output_ids)
    return [outputs[i] for i in range(len(exs))]


def evaluate(model: Path, n: int = 500, in_flight: int = 16, seed: int = HELD_OUT_SEED, llm=None) -> dict:
    """Per-task and overall exact match; ``llm`` may be passed to reuse a loaded model."""
    from ..llm import LLM

    llm = llm or LLM(model, max_seqs=in_flight, max_model_len=512)
    core, tok = llm.core, Tokenizer(model)
    pipeline = ImagePipeline.for_engine(core, tok)
    exs = examples(seed, n)
    t0 = time.time()
    outputs = run_examples(core, tok, pipeline, exs, in_flight, SamplingParams(max_tokens=12, temperature=0.0))
    answers = {i: answer_text(tok, ids) for i, ids in enumerate(outputs)}
    elapsed = time.time() - t0
    leaks = core.leaks()
    by_task: dict[str, list[bool]] = defaultdict(list)
    for i, ex in enumerate(exs):
        by_task[ex.task].append(answers[i] == ex.answer)
    per_task = {t: sum(v) / len(v) for t, v in by_task.items()}
    overall = sum(sum(v) for v in by_task.values()) / n
    result = {"n": n, "in_flight": in_flight, "overall": overall, "per_task": per_task, "elapsed_s": elapsed,
              "leaks": leaks or "none",
              "wrong_examples": [(ex.task, ex.question, ex.answer, answers[i]) for i, ex in enumerate(exs)
                                 if answers[i] != ex.answer][:10]}
    print(render(result, model))
    return result


def render(r: dict, model: Path) -> str:
    lines = [f"held-out exact match of {Path(model).name}: {r['n']} questions, {r['in_flight']} in flight, "
             f"{r['elapsed_s']:.0f} s", "", "| task | exact match |", "|---|---:|"]
    for t in TASKS:
        if t in r["per_task"]:
            lines.append(f"| {t} | {100 * r['per_task'][t]:.1f}% |")
    lines.append(f"| **overall** | **{100 * r['overall']:.1f}%** |")
    return "\n".join(lines)
