"""``ds4serve tiny eval --set wild``: the tiny model on pictures it was not trained to expect.

The original held-out set comes from the training renderer, so it measures memorisation of one
picture style as much as understanding; users who draw their own shapes get wrong answers. This set
is drawn by ``wild_render`` (an independent renderer: any canvas size, backgrounds, free positions,
outlines, tilts, PNG or JPEG) and asks each question in several wordings, so a retrain can be judged
on what users will send.

Tasks are the training tasks that look at pictures (``colour``, ``shape``, ``count``, ``where``,
``compare``), with the same answer formats (a colour name, a shape name, a digit, a position such as
``top-left``, ``first`` / ``second``). The text-only tasks (sums, reversal) are left out: they do not
touch the renderer, and the original set already measures them. About a third of the questions use
the training wording verbatim, the rest a paraphrase, so the two effects can be told apart.

Serving and scoring are the original eval's: each picture is put in a ``data:`` URL with its own
media type, the request is built and prepared by ``evaluate.prepare_urls`` (the server's path), run
by ``evaluate.run_examples`` with ``in_flight`` requests live, and answers (greedy, stripped) must
equal the expected text exactly.
"""

from __future__ import annotations

import base64
import random
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from ..engine.sampling import SamplingParams
from .wild_render import WildImage, encode, position_of, random_image

WILD_SEED = 1717  # training uses seeds 0, 1, 7, 102 and 1234; the original eval 2
WILD_TASKS = ("colour", "shape", "count", "where", "compare")
CANONICAL_SHARE = 0.35
# index 0 is the training wording; {kind} is a shape name, {colour} a colour name
PARAPHRASES: dict[str, tuple[str, ...]] = {
    "colour": ("What colour is the {kind}?", "What color is the {kind}?", "What's the colour of the {kind}?",
               "What is the color of the {kind}?", "Which colour is the {kind}?", "what colour is the {kind}?",
               "What colour is the {kind}? ", "What colour is the {kind}", "Tell me the colour of the {kind}."),
    "shape": ("Which shape is {colour}?", "What shape is {colour}?", "Which shape is the {colour} one?",
              "What's the {colour} shape?", "which shape is {colour}?", "Which shape is {colour}? ",
              "What shape is colored {colour}?"),
    "count": ("How many shapes are there?", "How many shapes are in the image?", "How many shapes are in the picture?",
              "how many shapes are there?", "How many shapes do you see?", "How many shapes are there? ",
              "Count the shapes."),
    "where": ("Where is the {kind}?", "Where's the {kind}?", "where is the {kind}?", "Where is the {kind} located?",
              "In which part of the image is the {kind}?", "Where is the {kind}? "),
    "compare": ("Which image has more shapes?", "Which picture has more shapes?",
                "Which of the two images has more shapes?", "which image has more shapes?",
                "Which image contains more shapes?", "Which image has more shapes? "),
}


@dataclass(frozen=True)
class WildExample:
    """One question: pictures as data (encoded on demand, so 500 questions hold no pixels), the word
    the question is about (``slot``: a shape kind or a colour name), and which wording asks it."""

    task: str
    images: tuple[WildImage, ...]
    slot: str
    template: int

    @property
    def question(self) -> str:
        return PARAPHRASES[self.task][self.template].format(kind=self.slot, colour=self.slot)

    @property
    def answer(self) -> str:
        return answer_of(self.task, self.images, self.slot)

    @property
    def wording(self) -> str:
        return "canonical" if self.template == 0 else "paraphrase"

    def reworded(self, template: int) -> WildExample:
        return WildExample(self.task, self.images, self.slot, template)

    def data_urls(self) -> list[str]:
        """The pictures as a user's client would send them: base64 ``data:`` URLs, PNG or JPEG."""
        out = []
        for image in self.images:
            mime, data = encode(image)
            out.append(f"data:{mime};base64," + base64.b64encode(data).decode())
        return out


def answer_of(task: str, images: tuple[WildImage, ...], slot: str) -> str:
    """The exact expected answer, from the scene alone (never from the wording)."""
    shapes = images[0].shapes
    if task == "colour":
        return next(s.colour for s in shapes if s.kind == slot)
    if task == "shape":
        return next(s.kind for s in shapes if s.colour == slot)
    if task == "where":
        return position_of(next(s for s in shapes if s.kind == slot), images[0].width, images[0].height)
    if task == "count":
        return str(len(shapes))
    if task == "compare":
        return "first" if len(shapes) > len(images[1].shapes) else "second"
    raise ValueError(f"unknown wild task {task!r}")


def make_wild_example(rng: random.Random, task: str) -> WildExample:
    """One question of ``task``; scenes as the training tasks define them (1-4 shapes, a comparison's
    counts always differ), so each has one right answer in the training format."""
    if task == "compare":
        a, b = rng.sample(range(1, 5), 2)
        images: tuple[WildImage, ...] = (random_image(rng, a), random_image(rng, b))
        slot = ""
    else:
        images = (random_image(rng, rng.randint(1, 4)),)
        target = rng.choice(images[0].shapes)
        slot = {"shape": target.colour, "count": ""}.get(task, target.kind)
    n = len(PARAPHRASES[task])
    template = 0 if rng.random() < CANONICAL_SHARE else rng.randrange(1, n)
    return WildExample(task, images, slot, template)


def wild_examples(seed: int, n: int, tasks: tuple[str, ...] = WILD_TASKS) -> list[WildExample]:
    """``n`` questions cycling through ``tasks`` (balanced), fully determined by ``seed``."""
    rng = random.Random(seed)
    return [make_wild_example(rng, tasks[i % len(tasks)]) for i in range(n)]


def conditions(ex: WildExample) -> list[tuple[str, str]]:
    """(group, label) pairs to break accuracy down by. Only one-picture questions are broken down: a
    comparison's two pictures differ, and its 50% chance level would skew whichever row it joined."""
    if len(ex.images) != 1:
        return []
    image = ex.images[0]
    side = max(image.width, image.height)
    return [("wording", ex.wording), ("file", image.fmt), ("background", image.background),
            ("shapes", "some outlined" if any(s.stroke for s in image.shapes) else "all filled"),
            ("tilt", "some tilted" if any(s.tilt for s in image.shapes) else "none tilted"),
            ("longer side", "64-255 px" if side < 256 else "256-640 px")]


def wild_prepare(core, tok, pipeline, ex: WildExample):
    """``run_examples``' request builder for wild pictures: the server's path, with the picture's own
    media type (``evaluate.prepare`` always PNG-encodes)."""
    from .evaluate import prepare_urls

    return prepare_urls(tok, pipeline, ex, ex.data_urls())


def score(exs: list[WildExample], answers: list[str]) -> dict:
    """Exact match overall, per task and per condition (the original eval's rule: stripped greedy
    text equal to the expected answer)."""
    by_task: dict[str, list[bool]] = defaultdict(list)
    by_cond: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for ex, got in zip(exs, answers, strict=True):
        ok = got == ex.answer
        by_task[ex.task].append(ok)
        for group, label in conditions(ex):
            by_cond[group][label].append(ok)
    return {"overall": sum(got == ex.answer for ex, got in zip(exs, answers)) / len(exs),
            "per_task": {t: sum(v) / len(v) for t, v in by_task.items()},
            "by_condition": {g: {lab: (len(v), sum(v) / len(v)) for lab, v in sorted(labels.items())}
                             for g, labels in by_cond.items()},
            "wrong_examples": [(ex.task, ex.question, ex.answer, got, _describe(ex))
                               for ex, got in zip(exs, answers) if got != ex.answer][:10]}


def _describe(ex: WildExample) -> str:
    return "; ".join(f"{im.width}x{im.height} {im.fmt} {im.background}" for im in ex.images)


def evaluate_wild(model: Path, n: int = 500, in_flight: int = 16, seed: int = WILD_SEED, llm=None) -> dict:
    """Serve the wild set through the real engine and print the tables; ``llm`` may be passed to
    reuse a loaded model (``--set both`` loads it once)."""
    from ..chat import Tokenizer
    from ..llm import LLM
    from ..multimodal.pipeline import ImagePipeline
    from .evaluate import answer_text, run_examples

    llm = llm or LLM(model, max_seqs=in_flight, max_model_len=512)
    core, tok = llm.core, Tokenizer(model)
    pipeline = ImagePipeline.for_engine(core, tok)
    exs = wild_examples(seed, n)
    t0 = time.time()
    outputs = run_examples(core, tok, pipeline, exs, in_flight, SamplingParams(max_tokens=12, temperature=0.0),
                           prepare_fn=wild_prepare)
    answers = [answer_text(tok, ids) for ids in outputs]
    result = {"set": "wild", "n": n, "seed": seed, "in_flight": in_flight, "elapsed_s": time.time() - t0,
              "leaks": core.leaks() or "none", **score(exs, answers)}
    print(render_wild(result, model))
    return result


def render_wild(r: dict, model: Path) -> str:
    """The original eval's table (task, exact match), then the breakdown by condition."""
    lines = [f"wild held-out exact match of {Path(model).name}: {r['n']} questions (seed {r['seed']}), "
             f"{r['in_flight']} in flight, {r['elapsed_s']:.0f} s", "", "| task | exact match |", "|---|---:|"]
    lines += [f"| {t} | {100 * r['per_task'][t]:.1f}% |" for t in WILD_TASKS if t in r["per_task"]]
    lines += [f"| **overall** | **{100 * r['overall']:.1f}%** |", "",
              "| condition (one-picture questions) | questions | exact match |", "|---|---:|---:|"]
    for group, labels in r["by_condition"].items():
        lines += [f"| {group}: {label} | {count} | {100 * acc:.1f}% |" for label, (count, acc) in labels.items()]
    return "\n".join(lines)
