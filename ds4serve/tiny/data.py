"""Seeded synthetic tasks for the bundled tiny DS4V model, with exact answers.

Images (126 x 126 PNG-able Pillow images) show one to four coloured shapes in the cells of a 3 x 3
grid; each shape kind and each colour appears at most once per image, so every question has one
right answer. The grid matches the model's vision geometry (9 x 9 patches -> a 3 x 3 aligner grid:
one aligner row per cell). Tasks:

* ``colour``: What colour is the {shape}?            -> red
* ``shape``: Which shape is {colour}?                 -> triangle
* ``count``: How many shapes are there?               -> 3
* ``where``: Where is the {shape}?                    -> top-left
* ``compare``: two images, Which image has more shapes? -> first / second
* ``math``: What is 7 + 5?                             -> 12
* ``reverse``: Reverse the letters: c a t              -> t a c

Everything is a pure function of the seed (``random.Random``), so the training set, the held-out
set (another seed) and the eval are reproducible.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from PIL import Image, ImageDraw

SIZE = 126
CELL = SIZE // 3
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220), "yellow": (235, 210, 30),
           "purple": (140, 50, 170), "orange": (245, 140, 20)}
SHAPES = ("circle", "square", "triangle", "diamond")
POSITIONS = ("top-left", "top-center", "top-right", "middle-left", "center", "middle-right",
             "bottom-left", "bottom-center", "bottom-right")
TASKS = ("colour", "shape", "count", "where", "compare", "math", "reverse")
# The training mix: "describe" (naming every shape links what the vision tower sees to words) is
# training-only; the two questions that look a row up by shape kind are the hardest and get 3x weight.
TRAIN_TASKS = TASKS + ("describe", "colour", "colour", "where", "where")
NUMBER_WORDS = ("zero", "one", "two", "three", "four")
WORDS = ("cat", "dog", "sun", "map", "cup", "red", "box", "pen", "hat", "key", "bird", "fish", "tree", "milk",
         "star", "moon", "rain", "lamp", "door", "book", "frog", "ship", "wolf", "bear", "coin", "leaf",
         "rock", "sand", "king", "bell", "kite", "ring", "nest", "road", "cake", "gold", "salt", "wind",
         "snow", "fire", "apple", "bread", "chair", "cloud", "dream", "grape", "house", "lemon", "light",
         "mouse", "night", "ocean", "piano", "river", "robot", "smile", "stone", "table", "tiger", "train",
         "water", "zebra", "horse", "plant", "queen", "sheep", "storm", "sweet", "tooth", "world")


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    cell: int  # 0..8, row-major


@dataclass
class Example:
    task: str
    question: str
    answer: str
    images: list[list[Shape]] = field(default_factory=list)  # one shape list per image
    pictures: list[Image.Image] | None = None  # already drawn (``freehand``); else ``draw`` each scene

    def render_images(self) -> list[Image.Image]:
        return list(self.pictures) if self.pictures is not None else [draw(s) for s in self.images]


def draw(shapes: list[Shape]) -> Image.Image:
    im = Image.new("RGB", (SIZE, SIZE), (250, 250, 250))
    d = ImageDraw.Draw(im)
    for s in shapes:
        r, c = divmod(s.cell, 3)
        # shapes fill most of their cell, so the corner patches tell the kinds apart
        x0, y0 = c * CELL + 2, r * CELL + 2
        x1, y1 = x0 + CELL - 4, y0 + CELL - 4
        mx, my = (x0 + x1) // 2, (y0 + y1) // 2
        fill = COLOURS[s.colour]
        if s.kind == "circle":
            d.ellipse((x0, y0, x1, y1), fill=fill)
        elif s.kind == "square":
            d.rectangle((x0 + 3, y0 + 3, x1 - 3, y1 - 3), fill=fill)
        elif s.kind == "triangle":
            d.polygon([(mx, y0), (x1, y1), (x0, y1)], fill=fill)
        else:
            d.polygon([(mx, y0), (x1, my), (mx, y1), (x0, my)], fill=fill)
    return im


def random_scene(rng: random.Random, n: int | None = None) -> list[Shape]:
    n = n if n is not None else rng.randint(1, 4)
    kinds = rng.sample(SHAPES, n)
    colours = rng.sample(list(COLOURS), n)
    cells = rng.sample(range(9), n)
    return [Shape(k, c, cell) for k, c, cell in zip(kinds, colours, cells)]


def make_example(rng: random.Random, task: str) -> Example:
    if task in ("colour", "shape", "where"):
        scene = random_scene(rng)
        target = rng.choice(scene)
        if task == "colour":
            return Example(task, f"What colour is the {target.kind}?", target.colour, [scene])
        if task == "shape":
            return Example(task, f"Which shape is {target.colour}?", target.kind, [scene])
        return Example(task, f"Where is the {target.kind}?", POSITIONS[target.cell], [scene])
    if task == "describe":
        scene = random_scene(rng)
        parts = [f"{s.colour} {s.kind} {POSITIONS[s.cell]}" for s in sorted(scene, key=lambda s: s.cell)]
        return Example(task, "Describe the image.", ", ".join(parts), [scene])
    if task == "count":
        scene = random_scene(rng)
        return Example(task, "How many shapes are there?", str(len(scene)), [scene])
    if task == "compare":
        a, b = rng.sample(range(1, 5), 2)
        return Example(task, "Which image has more shapes?", "first" if a > b else "second",
                       [random_scene(rng, a), random_scene(rng, b)])
    if task == "math":
        x, y = rng.randint(0, 10), rng.randint(0, 10)
        if rng.random() < 0.5:
            return Example(task, f"What is {x} + {y}?", str(x + y))
        x, y = max(x, y), min(x, y)
        return Example(task, f"What is {x} - {y}?", str(x - y))
    if task == "reverse":
        word = rng.choice(WORDS)
        return Example(task, f"Reverse the letters: {' '.join(word)}", " ".join(reversed(word)))
    raise ValueError(f"unknown task {task!r}")


def examples(seed: int, n: int, tasks: tuple[str, ...] = TASKS) -> list[Example]:
    """``n`` examples cycling through ``tasks`` (balanced), fully determined by ``seed``."""
    rng = random.Random(seed)
    return [make_example(rng, tasks[i % len(tasks)]) for i in range(n)]


def messages(ex: Example, image_urls: list[str] | None = None) -> list[dict]:
    """The example as an OpenAI chat message: image parts first, then the question (so the question's
    own tokens can attend to the picture; the tiny model is trained in this order)."""
    if not ex.images:
        return [{"role": "user", "content": ex.question}]
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in image_urls or []]
    return [{"role": "user", "content": parts + [{"type": "text", "text": ex.question}]}]


def corpus(seed: int, n: int) -> list[str]:
    """Plain text of questions and answers, for training the tokenizer."""
    out = []
    for ex in examples(seed, n):
        out.append(ex.question)
        out.append(ex.answer)
    out += list(POSITIONS) + list(COLOURS) + list(SHAPES) + list(NUMBER_WORDS)
    return out
