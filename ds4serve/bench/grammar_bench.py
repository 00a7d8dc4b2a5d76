"""Per-token overhead of grammar-constrained decoding at 16 concurrent requests (CPU).

Each kind of grammar gets ``batch`` matchers replaying ``batch`` different valid answers (the
tokens a model would write: JSON documents, or DSML tool calls rendered by our own encoder), all
in step as a batched decode would be. Per step it times what the sampler adds: filling the
``[batch, V/32]`` bitmask (llguidance's thread pool, and one row at a time), masking ``[batch, V]``
logits in one vectorised op, and accepting the sampled tokens. Also reported: the uncached
compile time, the per-request matcher copy, and the resident memory the compiler and matchers add.

``run(tokenizer=...)`` takes any ``tokenizer.json`` (default: the bundled tiny model's); point it
at the real DS4 tokenizer for the 129k-vocabulary figure.
"""

from __future__ import annotations

import json
import random
import resource
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..chat import Tokenizer, dsml
from ..chat.grammar import grammar_spec
from ..chat.grammar_runtime import GrammarCompiler, apply_bitmask, fill_bitmasks

TINY = Path(__file__).resolve().parents[2] / "models" / "ds4v-tiny"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}, "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "score": {"type": "number"}, "active": {"type": "boolean"}},
    "required": ["name", "age", "role", "tags", "address", "score", "active"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"enum": ["celsius", "fahrenheit"]}, "hours": {"type": "array", "items": {"type": "integer"}}},
    "required": ["city", "days"]}}}


def _person(rng: random.Random, i: int, extra: bool) -> dict[str, Any]:
    doc = {"name": f"Person {i} " + "é" * rng.randint(0, 6), "age": rng.randint(0, 99),
           "role": rng.choice(["admin", "user", "guest"]), "tags": [f"t{j}" for j in range(rng.randint(0, 4))],
           "address": {"city": rng.choice(["Paris", "Zürich", "東京"]), "zip": f"{rng.randint(10000, 99999)}"},
           "score": round(rng.random() * 100, rng.randint(0, 6)), "active": bool(i % 2)}
    if extra:
        doc["notes"] = {"seen": [1, 2.5, None, {"k": "v"}], "text": "a longer note, with words " * rng.randint(1, 4)}
    return doc


def workloads(batch: int, seed: int = 0) -> dict[str, tuple[dict, list[str]]]:
    """kind -> (the request fields that ask for the grammar, ``batch`` valid answers)."""
    rng = random.Random(seed)
    people = [json.dumps(_person(rng, i, False), ensure_ascii=False) for i in range(batch)]
    objects = [json.dumps(_person(rng, i, True), ensure_ascii=False) for i in range(batch)]
    calls = [dsml.render_tool_calls([{"function": {"name": "get_weather", "arguments": {
        "city": rng.choice(["Paris", "Lyon <north>", "São Paulo"]), "days": rng.randint(1, 14),
        "unit": rng.choice(["celsius", "fahrenheit"]), "hours": list(range(rng.randint(0, 6)))}}}], "bench")
        for _ in range(batch)]
    words = ["the", "weather", "in", "<b>Paris</b>", "is", "mild,", "x < y", "ok."]
    prose = [f"Answer {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) for i in range(batch)]
    return {
        "json_schema": ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}}, people),
        "json_object": ({"response_format": {"type": "json_object"}}, objects),
        "tool_named": ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                       calls),
        "tool_auto": ({"tools": [WEATHER], "tool_choice": "auto"},
                      [p + (c if i % 2 else "") for i, (p, c) in enumerate(zip(prose, calls))]),
    }


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"mean_ms": 1e3 * sum(xs) / len(xs), "p50_ms": 1e3 * pick(0.5), "p99_ms": 1e3 * pick(0.99),
            "max_ms": 1e3 * xs[-1]}


def _rounded(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 3)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return x


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def replay(comp: GrammarCompiler, tok: Tokenizer, request: dict, answers: list[str]) -> dict[str, Any]:
    """Run ``len(answers)`` matchers in lockstep over their answers; per-step timings."""
    spec = grammar_spec(**request)
    compile_s = _timed(lambda: GrammarCompiler.compile(comp, spec))
    copy_s = _timed(lambda: comp.matcher(spec))
    seqs = [tok.encode_text(a) + [tok.eos_id] for a in answers]
    ms, serial = [comp.matcher(spec) for _ in seqs], [comp.matcher(spec) for _ in seqs]
    bm, bm_serial = comp.allocate_bitmask(len(seqs)), comp.allocate_bitmask(len(seqs))
    logits = torch.zeros(len(seqs), comp.vocab_size)
    fill, fill_serial, mask, accept = [], [], [], []
    for step in range(max(len(s) for s in seqs)):
        live = [m if step < len(s) else None for m, s in zip(ms, seqs)]
        fill.append(_timed(lambda: fill_bitmasks(live, bm, parallel=True)))
        fill_serial.append(_timed(lambda: fill_bitmasks(
            [m if step < len(s) else None for m, s in zip(serial, seqs)], bm_serial, parallel=False)))
        mask.append(_timed(lambda: apply_bitmask(logits.zero_(), bm)))
        todo = [(m, m2, s[step]) for m, m2, s in zip(ms, serial, seqs) if step < len(s)]
        for m, _, t in todo:
            if not (bm[ms.index(m), t // 32] >> (t % 32)) & 1:
                raise AssertionError(f"the grammar masks a token of a valid answer at step {step}")
        accept.append(_timed(lambda: [(m.accept(t), m2.accept(t)) for m, m2, t in todo]))
        accept[-1] /= 2  # both sets of matchers accepted
    return {"steps": len(fill), "compile_ms": 1e3 * compile_s, "matcher_copy_ms": 1e3 * copy_s,
            "fill_parallel": _stats(fill[1:]), "fill_serial": _stats(fill_serial[1:]), "first_fill_ms": 1e3 * fill[0],
            "apply_mask": _stats(mask), "accept": _stats(accept),
            "per_token_overhead_ms": 1e3 * (min(sum(fill), sum(fill_serial)) + sum(mask) + sum(accept)) / len(fill),
            "terminated": all(m.is_terminated() for m in ms)}


KINDS = ("json_schema", "json_object", "tool_named", "tool_auto")


def run(tokenizer: Path | str | None = None, batch: int = 16, threads: int = 1, seed: int = 0,
        kinds: tuple[str, ...] = KINDS, out: Path | None = None) -> dict:
    """Measure each kind at ``batch`` concurrent requests; print and return the figures.
    ``threads``: torch's CPU threads for the logit mask (1: the figure does not depend on how busy
    the other cores are)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(Tokenizer(tokenizer or TINY), batch, seed, kinds, out)
    finally:
        torch.set_num_threads(before)


def _run(tok: Tokenizer, batch: int, seed: int, kinds: tuple[str, ...], out: Path | None) -> dict:
    rss0 = _rss_mb()
    t = time.perf_counter()
    comp = GrammarCompiler.for_tokenizer(tok)
    report: dict[str, Any] = {"vocab": comp.vocab_size, "batch": batch, "library": "llguidance",
                              "tokenizer_index_s": time.perf_counter() - t, "kinds": {}}
    loads = workloads(batch, seed)
    for kind in kinds:
        request, answers = loads[kind]
        report["kinds"][kind] = replay(comp, tok, request, answers)
    report["peak_rss_added_mb"] = _rss_mb() - rss0
    text = json.dumps(_rounded(report), indent=1)
    print(text)
    if out is not None:
        Path(out).write_text(text)
    return report
