"""``ds4serve bench images``: what users feel while others send images, and what slicing costs.

Scenario (in-process, on the engine the server uses): two streaming text requests decode while three
one-image requests and one eight-image request arrive. The same traffic runs on two engines that
differ only in the step budget: the *sliced* one (the budget under test: image passes are cut into
layer slices next to the live decoders) and the *whole* control (a budget so large that every pass
runs in the step it starts). Rounds alternate between the two so load on the machine hits both
alike; every figure is the median over rounds.

Reported: the median inter-token gap of the text streams and their longest pause while the images
prefill, sliced and whole; the time to the first token of each image request; four concurrent image
answers against the same four one after another; and the *slicing overhead*: the total wall time
(first step to idle) of the same traffic sliced over whole, minus one (target <= 3%). Slicing needs
live decoders (with none a pass runs whole), so the work timed is the text streams plus the image
requests, the streams long enough to outlast the image answers: both runs take the same steps and
the difference is what slicing adds to them. The text streams are also timed alone, so the report
says how much image work that difference falls on.

Images are encoded as their requests are admitted, with the clocks stopped (wall and CPU time): the
encoder worker runs beside the engine, and whether it finished before the streams did would otherwise
decide whether an image pass met any decoder at all (with the native host forward the streams can end
first). What is timed is the prefill of encoded images next to live streams, the same in every round.
"""

from __future__ import annotations

import base64
import io
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from ..engine.sampling import SamplingParams
from ..scheduler.spec import RequestSpec

_COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]
OVERHEAD_TARGET = 0.03  # slicing may cost at most 3% of total time (lucebox measured 2.8%)
PAUSE_TARGET = 3.0  # a live stream's longest pause, in median gaps


def whole_step_tokens(max_prefill_tokens: int, max_seqs: int) -> int:
    """A step budget under which no pass is ever sliced: the largest pass (``max_prefill_tokens`` rows
    plus one swallowed block of at most 384 tokens) next to every slot decoding still fits all
    layers. The control run uses it so that "whole" is the only difference from the sliced run."""
    return max_prefill_tokens + 384 + max_seqs


@dataclass
class TrafficRun:
    """One run of the mixed traffic: text-stream gaps, image latencies and how image passes ran."""

    gaps: list[float]  # every inter-token gap of the text streams (s)
    pauses: list[float]  # the gaps that overlap the image window (arrival .. last image answer)
    total_s: float  # wall time, first step to idle
    image_ttft_s: list[float]
    image_slices: dict[int, int] = field(default_factory=dict)  # image pass id -> steps it took
    answers: list[list[int]] = field(default_factory=list)  # image answers, in request order
    text_lengths: list[int] = field(default_factory=list)
    steps: int = 0
    cpu_s: float = 0.0  # process CPU time over the same span, all threads (the encoder worker's too)

    @property
    def median_gap(self) -> float:
        return statistics.median(self.gaps)

    @property
    def worst_pause(self) -> float:
        return max(self.pauses) if self.pauses else 0.0


@contextmanager
def watch_image_passes(core) -> Iterator[dict[int, int]]:
    """Count the steps each image pass takes (pass id -> slices), by watching the plans the engine
    runs: the proof that a run was really sliced, or really whole."""
    slices: dict[int, int] = {}
    step_fn = core.executor.step

    def spy(plan):
        for p in plan.passes:
            if any(m.image_rows for m in p.members):
                slices[p.pass_id] = slices.get(p.pass_id, 0) + 1
        return step_fn(plan)

    core.executor.step = spy
    try:
        yield slices
    finally:
        core.executor.step = step_fn


class _Clock:
    """Timestamps what a streaming client would see: each text token, each image request's first
    token, and the image window (arrival of the images .. their last answer). ``tick``: the clock of
    those stamps (wall time by default)."""

    def __init__(self, streams, tick: Callable[[], float] = time.monotonic):
        self.tick = tick
        self.stopped = [0.0, 0.0]  # stamp-clock and CPU seconds spent with the clocks stopped
        self.stamps: dict[str, list[float]] = {r.request_id: [] for r in streams}
        self.arrival: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.window = [float("inf"), float("inf")]

    def now(self) -> float:
        return self.tick() - self.stopped[0]

    def cpu(self) -> float:
        return time.process_time() - self.stopped[1]

    def encode(self, core, reqs) -> None:
        """Wait, clocks stopped, until every admitted request's images are encoded."""
        wall, cpu = self.tick(), time.process_time()
        for r in reqs:
            if r.images_submitted and not core.encoder.wait(r.request_id, 120):
                raise RuntimeError(f"{r.request_id}: images not encoded in 120 s")
        self.stopped[0] += self.tick() - wall
        self.stopped[1] += time.process_time() - cpu

    def arrive(self, reqs) -> None:
        self.window[0] = self.now()
        for r in reqs:
            self.arrival[r.request_id] = self.now()

    def saw(self, outs, reqs) -> None:
        now = self.now()
        for o in outs:
            if o.new_token_ids and o.request_id in self.stamps:
                self.stamps[o.request_id].append(now)
            if o.new_token_ids and o.request_id in self.arrival and o.request_id not in self.first:
                self.first[o.request_id] = now - self.arrival[o.request_id]
        if reqs and self.window[1] == float("inf") and all(r.status.finished for r in reqs):
            self.window[1] = now

    def gaps(self) -> tuple[list[float], list[float]]:
        """(every inter-token gap, the gaps that overlap the image window)."""
        pairs = [(a, b) for s in self.stamps.values() for a, b in zip(s, s[1:])]
        lo, hi = self.window
        return [b - a for a, b in pairs], [b - a for a, b in pairs if b >= lo and a <= hi]


def mixed_traffic(core, texts: Sequence[list[int]], images: Sequence[tuple[list[int], list]], text_tokens: int,
                  image_tokens: int, arrive_at: int = 8, tick: Callable[[], float] = time.monotonic) -> TrafficRun:
    """Run text streams; before step ``arrive_at`` the image requests arrive; step until idle.

    ``texts`` are prompt ids, ``images`` (ids, ImageInput list) pairs, all greedy with ``ignore_eos``
    so every run does the same work. Gaps are ``tick`` time (wall time by default) between consecutive
    tokens of a text stream as the caller of ``core.step()`` sees them; ``time.thread_time`` instead
    counts only this thread's work, which other processes' load cannot stretch (where the forward runs
    on this one thread). Every run starts with an empty prefix cache: rounds repeat the same prompts,
    and a hit would skip the very image prefill this measures."""
    core.reset_prefix_cache()
    greedy = dict(temperature=0, ignore_eos=True)
    streams = [core.make_request(RequestSpec(t, SamplingParams(max_tokens=text_tokens, **greedy))) for t in texts]
    for r in streams:
        core.add(r)
    clock, reqs, step = _Clock(streams, tick), [], 0
    t0, cpu0 = clock.now(), clock.cpu()
    with watch_image_passes(core) as slices:
        while core.has_work or (images and not reqs):
            if step == arrive_at and images:
                reqs = [core.make_request(RequestSpec(p, SamplingParams(max_tokens=image_tokens, **greedy), images=ims))
                        for p, ims in images]
                clock.arrive(reqs)
                for r in reqs:
                    core.add(r)
            clock.encode(core, reqs)
            clock.saw(core.step(), reqs)
            step += 1
    total, cpu = clock.now() - t0, clock.cpu() - cpu0
    gaps, pauses = clock.gaps()
    return TrafficRun(gaps=gaps, pauses=pauses, total_s=total, cpu_s=cpu,
                      image_ttft_s=[clock.first.get(r.request_id, float("nan")) for r in reqs],
                      image_slices=dict(slices), answers=[list(r.output_ids) for r in reqs],
                      text_lengths=[len(r.output_ids) for r in streams], steps=step)


def interleaved(runs: dict[str, Callable[[], TrafficRun]], rounds: int) -> dict[str, list[TrafficRun]]:
    """Call every runner ``rounds`` times, reversing the order each round (A B C, C B A, ...) so a
    drift in machine load does not favour whichever runs first."""
    out: dict[str, list[TrafficRun]] = {name: [] for name in runs}
    names = list(runs)
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            out[name].append(runs[name]())
    return out


def median_of(runs: Sequence[TrafficRun], figure: str) -> float:
    """The median over rounds of one per-run figure (an attribute or property of ``TrafficRun``)."""
    return statistics.median(getattr(r, figure) for r in runs)


def _image_url(seed: int) -> str:
    im = Image.new("RGB", (320, 240), _COLOURS[seed % 8])
    d = ImageDraw.Draw(im)
    d.ellipse((20 + seed * 9 % 100, 30, 140 + seed * 9 % 100, 150), fill=_COLOURS[(seed + 3) % 8])
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _prompt(tok, pipeline, text: str, seeds: list[int]):
    from ..chat import render_chat

    parts = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": _image_url(s)}}
                                                for s in seeds]
    prepared = pipeline.prepare(render_chat(tok, [{"role": "user", "content": parts}]))
    return prepared.ids, prepared.images


def _concurrency(core, prompts, new_tokens: int) -> tuple[float, float]:
    """(seconds for the image requests one after another, seconds for them all at once), each from an
    empty prefix cache (the second run sends the same prompts)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    core.reset_prefix_cache()
    t0 = time.monotonic()
    for p, ims in prompts:
        core.add(core.make_request(RequestSpec(p, params, images=ims)))
        core.run_until_idle()
    sequential = time.monotonic() - t0
    core.reset_prefix_cache()
    t0 = time.monotonic()
    for p, ims in prompts:
        core.add(core.make_request(RequestSpec(p, params, images=ims)))
    core.run_until_idle()
    return sequential, time.monotonic() - t0


def run(model: Path | None = None, step_tokens: int = 24, new_tokens: int = 12, threads: int | None = None,
        rounds: int = 5, text_tokens: int = 48, device: str = "cpu") -> dict:
    """Build the sliced and whole engines (on ``device``), run the interleaved rounds, print and
    return the figures."""
    from ..chat import Tokenizer
    from ..llm import LLM
    from ..multimodal.pipeline import ImagePipeline
    from ..tiny.random_model import default_model

    if threads:
        torch.set_num_threads(threads)
    path = Path(model) if model else default_model()[0]
    max_seqs, max_prefill = 8, 512
    sliced = LLM(path, device=device, max_seqs=max_seqs, step_tokens=step_tokens, max_prefill_tokens=max_prefill).core
    whole = LLM(path, device=device, max_seqs=max_seqs, step_tokens=whole_step_tokens(max_prefill, max_seqs),
                max_prefill_tokens=max_prefill).core
    tok = Tokenizer(path)
    pipeline = ImagePipeline.for_engine(sliced, tok)
    specs = [("Describe the picture.", [1]), ("What colour is the circle?", [2]), ("Count the shapes.", [3]),
             ("Which image is the brightest?", [4, 5, 6, 7, 8, 9, 10, 11])]
    prompts = [_prompt(tok, pipeline, t, s) for t, s in specs]
    texts = [[tok.bos_id] + tok.encode_text(f"Tell me a long story about lighthouse keeper {i}.") for i in range(2)]
    runs = interleaved({"sliced": lambda: mixed_traffic(sliced, texts, prompts, text_tokens, new_tokens),
                        "whole": lambda: mixed_traffic(whole, texts, prompts, text_tokens, new_tokens),
                        "text only": lambda: mixed_traffic(whole, texts, [], text_tokens, new_tokens)}, rounds)
    sequential, together = _concurrency(sliced, prompts, new_tokens)
    result = summarise(runs) | {
        "four_concurrent_s": together, "four_sequential_s": sequential, "concurrency_speedup": sequential / together,
        "leaks": "; ".join(x for x in (sliced.leaks(), whole.leaks()) if x) or "none", "rounds": rounds,
        "threads": torch.get_num_threads(), "step_tokens": step_tokens, "model": path.name, "device": device,
    }
    print(render(result))
    return result


def summarise(runs: dict[str, list[TrafficRun]]) -> dict:
    """Medians over rounds of each run's figures, and the overhead of slicing.

    The overhead is the median over rounds of ``sliced / whole - 1``, each round's two runs back to
    back, so a burst of load on a shared machine spoils one pair, not the figure. It is given in wall
    time (what users wait) and in process CPU time (the work done: steadier when other processes
    share the cores); the split against the image work is in CPU time for the same reason."""
    out: dict = {}
    for name in ("sliced", "whole"):
        rs = runs[name]
        out[name] = {"median_gap_ms": 1000 * median_of(rs, "median_gap"),
                    "longest_pause_ms": 1000 * median_of(rs, "worst_pause"),
                    "pause_ratio": statistics.median(r.worst_pause / r.median_gap for r in rs),
                    "total_s": median_of(rs, "total_s"), "cpu_s": median_of(rs, "cpu_s"),
                    "total_range_s": (min(r.total_s for r in rs), max(r.total_s for r in rs)),
                    "cpu_range_s": (min(r.cpu_s for r in rs), max(r.cpu_s for r in rs)),
                    "steps": median_of(rs, "steps"),
                    "image_ttft_ms": [1000 * statistics.median(ts) for ts in zip(*(r.image_ttft_s for r in rs))],
                    "slices_per_image_pass": sorted({n for r in rs for n in r.image_slices.values()})}
    pairs = list(zip(runs["sliced"], runs["whole"]))
    text_only = median_of(runs["text only"], "cpu_s")
    out |= {"overhead": statistics.median(s.total_s / w.total_s for s, w in pairs) - 1,
            "cpu_overhead": statistics.median(s.cpu_s / w.cpu_s for s, w in pairs) - 1,
            "text_only_cpu_s": text_only, "image_work_cpu_s": out["whole"]["cpu_s"] - text_only,
            "slicing_extra_cpu_s": statistics.median(s.cpu_s - w.cpu_s for s, w in pairs),
            "answers_match": all(s.answers == w.answers for s, w in pairs)}
    return out


def render(r: dict) -> str:
    s, w = r["sliced"], r["whole"]
    ttft = ", ".join(f"{t:.0f}" for t in s["image_ttft_ms"])
    ttft_whole = ", ".join(f"{t:.0f}" for t in w["image_ttft_ms"])
    where = f"{r['threads']} threads" if r.get("device", "cpu") == "cpu" else r["device"]
    return "\n".join([
        f"mixed image traffic on {r['model']} ({where}, step budget {r['step_tokens']} tokens; "
        f"medians over {r['rounds']} interleaved rounds; whole = the same traffic with a budget that never slices)",
        "",
        "| figure | sliced | whole |",
        "|---|---:|---:|",
        f"| text streams: median inter-token gap | {s['median_gap_ms']:.1f} ms | {w['median_gap_ms']:.1f} ms |",
        f"| text streams: longest pause while 11 images prefill | {s['longest_pause_ms']:.1f} ms "
        f"({s['pause_ratio']:.2f}x median; target <= {PAUSE_TARGET:.0f}x) | {w['longest_pause_ms']:.1f} ms "
        f"({w['pause_ratio']:.2f}x) |",
        f"| steps per image pass | {_counts(s['slices_per_image_pass'])} | {_counts(w['slices_per_image_pass'])} |",
        f"| image requests: time to first token | {ttft} ms | {ttft_whole} ms |",
        f"| text streams + image requests: wall time (rounds' range) | {_span(s, 'total')} | {_span(w, 'total')} |",
        f"| the same: process CPU time, all threads | {_span(s, 'cpu')} | {_span(w, 'cpu')} |",
        f"| steps to serve it | {s['steps']:.0f} | {w['steps']:.0f} |",
        f"| slicing overhead, wall time (sliced / whole - 1, median of paired rounds) | "
        f"{100 * r['overhead']:+.1f}% (target <= {100 * OVERHEAD_TARGET:.0f}%) | |",
        f"| slicing overhead, CPU time | {100 * r['cpu_overhead']:+.1f}% (target <= {100 * OVERHEAD_TARGET:.0f}%) | |",
        f"| slicing's extra CPU time, on the image work's (whole - text streams alone, "
        f"{r['text_only_cpu_s']:.3f} s) | {1000 * r['slicing_extra_cpu_s']:+.0f} ms on "
        f"{1000 * r['image_work_cpu_s']:.0f} ms | |",
        f"| image answers identical sliced and whole | {'yes' if r['answers_match'] else 'NO'} | |",
        f"| 4 image answers, concurrent | {r['four_concurrent_s']:.2f} s | |",
        f"| 4 image answers, one after another | {r['four_sequential_s']:.2f} s "
        f"({r['concurrency_speedup']:.2f}x slower) | |",
        f"| leaks after the run | {r['leaks']} | |",
    ])


def _span(figures: dict, key: str) -> str:
    lo, hi = figures[f"{key}_range_s"]
    return f"{figures[f'{key}_s']:.3f} s ({lo:.2f}-{hi:.2f})"


def _counts(ns: list[int]) -> str:
    return "/".join(map(str, ns)) or "-"


def main(argv: list[str] | None = None) -> int:
    """``python -m ds4serve.bench.images_bench``: the same bench with the options ``ds4serve bench
    images`` lacks (``--device``, sizes, a JSON copy of the figures; used by scripts/gpu_check.sh)."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m ds4serve.bench.images_bench", description=main.__doc__)
    ap.add_argument("--model", type=Path, default=None, help="a DS4V checkpoint (default: the bundled model)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (fp32)")
    ap.add_argument("--step-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=12, help="tokens per image answer")
    ap.add_argument("--text-tokens", type=int, default=48, help="tokens per text stream")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    a = ap.parse_args(argv)
    r = run(a.model, step_tokens=a.step_tokens, new_tokens=a.new_tokens, threads=a.threads, rounds=a.rounds,
            text_tokens=a.text_tokens, device=a.device)
    if a.json:
        a.json.write_text(json.dumps(r, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
