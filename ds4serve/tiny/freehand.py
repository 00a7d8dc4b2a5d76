"""Training pictures drawn "free hand": the scenes of ``tiny.data`` as users draw them.

``tiny.data.draw`` puts every shape in a cell of one 126 x 126, 250-grey canvas, so a model trained
only on it answers nothing sensible about a 224 x 224 white PNG with one circle in the middle. This
renderer keeps the scene (which kinds, colours and cells) and the answers, and varies everything a
person's picture varies:

* canvas 64-640 px a side, aspect ratio up to 4.5:1; background white, grey, a light tint, often with
  per-pixel noise (grey or coloured);
* each shape centred anywhere in its cell (not on a grid), a random size, filled or outlined, squares,
  triangles and diamonds tilted up to 12 degrees, triangles and diamonds of varied width;
* colours jittered in HSV around each colour name (a band per name);
* saved as PNG or as JPEG (quality 60-95) and decoded again, as a server receives them.

A shape's cell is the 3 x 3 cell (canvas split in thirds) holding its centre, which stays a margin
away from the cell's edges so the answer is never a coin toss; shapes do not overlap. Questions are
asked in many wordings (``question``): colour / color, "What's the", "Which colour", lower case,
trailing spaces, missing question marks.

This module is training code; the wild eval's renderer (``wild_render``) is written separately and
shares nothing with it, so the eval measures generalisation, not this file.
"""

from __future__ import annotations

import colorsys
import io
import math
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from .data import Example, Shape, draw, make_example

# name -> (hue degrees, saturation, value) ranges, a little wider than what people usually call them
BANDS = {"red": ((-12, 10), (0.65, 1.0), (0.55, 1.0)), "orange": ((20, 38), (0.75, 1.0), (0.85, 1.0)),
         "yellow": ((46, 62), (0.7, 1.0), (0.82, 1.0)), "green": ((88, 150), (0.6, 1.0), (0.42, 0.9)),
         "blue": ((205, 245), (0.6, 1.0), (0.55, 1.0)), "purple": ((265, 300), (0.5, 0.95), (0.4, 0.8))}
EDGE = 0.1  # a shape's centre stays this far (in cells) from its cell's edges


@dataclass(frozen=True)
class Placement:
    """Where in its cell a shape's centre may fall (fractions of the cell) and its half-size range
    (fractions of the shorter cell side). ``FULL`` is the free-hand distribution; ``EASY`` (large
    shapes near their cell's middle) is the curriculum's first part: the tiny tower learns shape
    *kind* on free-hand pictures far faster when it first sees them large."""

    centre: tuple[float, float] = (EDGE, 1 - EDGE)
    size: tuple[float, float] = (0.2, 0.75)


FULL = Placement()
EASY = Placement(centre=(0.3, 0.7), size=(0.5, 0.75))

TEMPLATES = {
    "colour": ("What colour is the {k}?", "What color is the {k}?", "What's the colour of the {k}?",
               "What is the colour of the {k}?", "What's the color of the {k}?", "What is the color of the {k}?",
               "Which colour is the {k}?", "Which color is the {k}?", "What colour does the {k} have?",
               "Colour of the {k}?", "Tell me what colour the {k} is.", "What colour is the {k} in the image?",
               "What color is the {k} in the picture?", "The {k} is which colour?"),
    "shape": ("Which shape is {c}?", "What shape is {c}?", "Which shape is the {c} one?", "What is the {c} shape?",
              "What's the {c} shape?", "Which shape is colored {c}?", "Which shape is coloured {c}?",
              "Which one is {c}?", "What shape is the {c} one?", "Name the {c} shape.", "The {c} shape is which?"),
    "count": ("How many shapes are there?", "How many shapes are in the image?", "How many shapes are in the picture?",
              "How many shapes can you see?", "How many shapes do you see?", "Count the shapes.",
              "How many shapes?", "Number of shapes?", "How many objects are there?", "How many shapes are shown?"),
    "where": ("Where is the {k}?", "Where's the {k}?", "Where is the {k} located?", "Where is the {k} in the image?",
              "In which part of the image is the {k}?", "Which part of the picture is the {k} in?",
              "Where can you see the {k}?", "Where is the {k} placed?", "Where in the picture is the {k}?"),
    "compare": ("Which image has more shapes?", "Which picture has more shapes?",
                "Which of the two images has more shapes?", "Which image contains more shapes?",
                "Which of the images has more shapes?", "Which one has more shapes?", "Which picture shows more shapes?"),
}


def question(rng: random.Random, task: str, canonical: str, kind: str = "", colour: str = "") -> str:
    """``canonical`` (the training wording) or a paraphrase, then surface noise people type."""
    text = canonical
    if task in TEMPLATES and rng.random() < 0.65:
        text = rng.choice(TEMPLATES[task]).format(k=kind, c=colour)
    r = rng.random()
    if r < 0.2:
        text = text[0].lower() + text[1:]
    elif r < 0.25:
        text = text.lower()
    if rng.random() < 0.12 and text[-1] in "?.":
        text = text[:-1]
    if rng.random() < 0.15:
        text += " " * rng.randint(1, 2)
    return text


def _colour(rng: random.Random, name: str) -> tuple[int, int, int]:
    (h0, h1), (s0, s1), (v0, v1) = BANDS[name]
    rgb = colorsys.hsv_to_rgb((rng.uniform(h0, h1) % 360) / 360, rng.uniform(s0, s1), rng.uniform(v0, v1))
    return tuple(int(round(255 * x)) for x in rgb)  # type: ignore[return-value]


def _canvas(rng: random.Random) -> tuple[int, int]:
    while True:
        w, h = rng.randint(64, 640), rng.randint(64, 640)
        if max(w, h) <= 4.5 * min(w, h):
            return w, h


def _background(rng: random.Random, w: int, h: int) -> Image.Image:
    style = rng.random()
    if style < 0.3:
        base = (255, 255, 255)
    elif style < 0.6:
        g = rng.randint(170, 250)
        base = (g, g, g)
    else:
        r, g, b = colorsys.hsv_to_rgb(rng.random(), rng.uniform(0.03, 0.18), rng.uniform(0.9, 1.0))
        base = (round(255 * r), round(255 * g), round(255 * b))
    if rng.random() < 0.6:
        return Image.new("RGB", (w, h), base)
    gen = np.random.default_rng(rng.getrandbits(32))
    sigma = rng.uniform(2.0, 12.0)
    shape = (h, w, 1) if rng.random() < 0.6 else (h, w, 3)
    px = np.asarray(base, dtype=np.float64) + gen.normal(0.0, sigma, shape)
    return Image.fromarray(np.clip(np.rint(px), 0, 255).astype(np.uint8), "RGB")


def _outline(kind: str, cx: float, cy: float, r: float, widen: float, tilt: float) -> list[tuple[float, float]]:
    if kind == "square":
        pts = [(-r, -r), (r, -r), (r, r), (-r, r)]
    elif kind == "triangle":
        pts = [(0.0, -r), (r * widen, r), (-r * widen, r)]
    else:  # diamond
        pts = [(0.0, -r), (r * widen, 0.0), (0.0, r), (-r * widen, 0.0)]
    c, s = math.cos(math.radians(tilt)), math.sin(math.radians(tilt))
    return [(cx + x * c - y * s, cy + x * s + y * c) for x, y in pts]


def _place(rng: random.Random, sh: Shape, w: int, h: int, placed: list[tuple[float, float, float]],
           where: Placement = FULL):
    """(cx, cy, r) for ``sh`` inside its cell, clear of ``placed`` and of the canvas edge."""
    row, col = divmod(sh.cell, 3)
    cw, ch = w / 3, h / 3
    for attempt in range(80):
        cx = (col + rng.uniform(*where.centre)) * cw
        cy = (row + rng.uniform(*where.centre)) * ch
        r = max(3.0, rng.uniform(*where.size) * min(cw, ch) * 0.97 ** attempt)
        reach = r * 1.45  # tilted squares and wide diamonds reach past r
        if cx - reach < 1 or cy - reach < 1 or cx + reach > w - 2 or cy + reach > h - 2:
            continue
        if all(math.hypot(cx - x, cy - y) > reach + 1.45 * o + 2 for x, y, o in placed):
            return cx, cy, r
    return None


@dataclass(frozen=True)
class FreePicture:
    """A drawn picture and where its shapes went (``spots[i]`` = centre x, y and half-size of
    ``scene[i]``; ``inks[i]`` its RGB), so tests can check the answers the scene implies."""

    image: Image.Image
    spots: tuple[tuple[float, float, float], ...]
    inks: tuple[tuple[int, int, int], ...]
    jpeg: bool


def _layout(rng: random.Random, scene: list[Shape], where: Placement) -> tuple[int, int, list[tuple[float, float, float]]]:
    """A canvas and a spot for every shape (a canvas too small for the scene is drawn again)."""
    while True:
        w, h = _canvas(rng)
        spots: list[tuple[float, float, float]] = []
        for sh in scene:
            spot = _place(rng, sh, w, h, spots, where)
            if spot is None:
                break
            spots.append(spot)
        if len(spots) == len(scene):
            return w, h, spots


def free_picture(rng: random.Random, scene: list[Shape], where: Placement = FULL) -> FreePicture:
    """The scene on a random canvas (see the module doc), after a PNG or JPEG round trip."""
    w, h, spots = _layout(rng, scene, where)
    im = _background(rng, w, h)
    d = ImageDraw.Draw(im)
    inks = []
    for sh, (cx, cy, r) in zip(scene, spots):
        ink = _colour(rng, sh.colour)
        inks.append(ink)
        width = 0 if rng.random() < 0.7 else max(2, round(r * rng.uniform(0.1, 0.3)))
        if sh.kind == "circle":
            box = (cx - r, cy - r, cx + r, cy + r)
            d.ellipse(box, fill=None if width else ink, outline=ink if width else None, width=width or 1)
            continue
        widen = rng.uniform(0.8, 1.2) if sh.kind == "triangle" else rng.uniform(0.55, 0.9) if sh.kind == "diamond" else 1
        tilt = rng.uniform(-12, 12) if rng.random() < 0.6 else 0.0
        pts = _outline(sh.kind, cx, cy, r, widen, tilt)
        if width:
            d.polygon(pts, outline=ink, width=width)
        else:
            d.polygon(pts, fill=ink)
    if rng.random() < 0.5:
        return FreePicture(im, tuple(spots), tuple(inks), jpeg=False)
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=rng.randint(60, 95))
    buf.seek(0)
    return FreePicture(Image.open(buf).convert("RGB"), tuple(spots), tuple(inks), jpeg=True)


def draw_free(rng: random.Random, scene: list[Shape]) -> Image.Image:
    return free_picture(rng, scene).image


IMAGE_TASKS = ("colour", "shape", "count", "where", "compare")


def free_example(rng: random.Random, task: str, free_share: float) -> Example:
    """``data.make_example``'s question and answer, its pictures drawn free hand with probability
    ``free_share`` each (else by the original renderer) and the question possibly reworded."""
    ex = make_example(rng, task)
    if not ex.images:
        return ex
    pictures = [draw_free(rng, scene) if rng.random() < free_share else draw(scene) for scene in ex.images]
    text = ex.question
    if task in IMAGE_TASKS:
        slot = ex.question.rstrip("?").split()[-1]  # the shape kind or colour the question names
        text = question(rng, task, ex.question, kind=slot, colour=slot)
    return Example(task, text, ex.answer, ex.images, pictures)


def free_examples(seed: int, n: int, tasks: tuple[str, ...], free_share: float) -> list[Example]:
    rng = random.Random(seed)
    return [free_example(rng, tasks[i % len(tasks)], free_share) for i in range(n)]
