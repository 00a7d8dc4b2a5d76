"""An eval-only renderer of coloured-shape pictures, written independently of ``tiny.data``'s.

The training renderer draws on one fixed 126 x 126 canvas, every shape filling a cell of a 3 x 3 grid
on a 250-grey background. Pictures users draw look nothing like that, so this renderer varies what
the training one keeps fixed, while every question keeps one exact answer:

* canvas: each side 64-640 px (the aspect ratio capped at 4:1, beyond which the shapes on the short
  side would be a few pixels), background white, grey, a light tint, or one of those with mild noise;
* shapes: centred anywhere, not on a grid, 0.5-1.5 of the shorter cell side tall (less when crowded;
  they may cross cell lines), filled or outlined, squares / triangles / diamonds tilted up to 10
  degrees, colours drawn from a hue band per colour name rather than one RGB value;
* the picture is encoded as PNG or as JPEG (quality 85-95), as users send them.

A position answer is the 3 x 3 cell (the canvas split in thirds) that holds the shape's centre. To keep
that answer well defined, both the bounding-box centre and the vertex centroid of a shape lie in the
same cell, at least ``MARGIN`` of a cell away from its edges; shapes never overlap (each keeps its
exact colour) and stay inside the canvas; at most one shape per cell, each kind and colour at most
once per picture (so "the circle" and "the red one" each name one shape). Noise is added to the
background only, so a shape's pixels are exactly its colour until JPEG touches them.

Everything is a pure function of the ``random.Random`` passed in (noise is seeded from it too).
"""

from __future__ import annotations

import colorsys
import io
import math
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

KINDS = ("circle", "square", "triangle", "diamond")
POSITIONS = ("top-left", "top-center", "top-right", "middle-left", "center", "middle-right",
             "bottom-left", "bottom-center", "bottom-right")
# colour name -> (hue range in degrees, saturation range, value range); dark oranges read as brown and
# dark yellows as olive, so those two stay bright
HUES = {"red": ((-8, 8), (0.75, 1.0), (0.65, 1.0)), "orange": ((24, 34), (0.85, 1.0), (0.9, 1.0)),
        "yellow": ((50, 58), (0.8, 1.0), (0.88, 1.0)), "green": ((100, 140), (0.7, 1.0), (0.5, 0.85)),
        "blue": ((215, 240), (0.7, 1.0), (0.6, 1.0)), "purple": ((275, 295), (0.6, 0.9), (0.45, 0.75))}
BACKGROUNDS = ("white", "grey", "tint", "noisy")
MIN_SIDE, MAX_SIDE, MAX_ASPECT = 64, 640, 4.0
MARGIN = 0.12  # of a cell: the closest a shape's centre comes to a cell edge
MAX_TILT = 10.0  # degrees; a square tilted 45 degrees would be a diamond


@dataclass(frozen=True)
class WildShape:
    """One drawn shape: geometry in canvas pixels, the exact RGB it is filled or stroked with."""

    kind: str
    colour: str
    rgb: tuple[int, int, int]
    cx: float
    cy: float
    size: float  # half the height of the shape's untilted bounding box
    tilt: float  # degrees
    aspect: float  # width / height of the untilted shape (diamonds are taller than wide)
    stroke: int  # 0 = filled, else the outline's width in pixels

    def polygon(self) -> list[tuple[float, float]]:
        """Vertices (a circle is a 72-gon, used for bounds and centres; it is drawn as an ellipse)."""
        s, w = self.size, self.size * self.aspect
        if self.kind == "circle":
            pts = [(s * math.cos(a), s * math.sin(a)) for a in np.linspace(0, 2 * math.pi, 72, endpoint=False)]
        elif self.kind == "square":
            pts = [(-s, -s), (s, -s), (s, s), (-s, s)]
        elif self.kind == "triangle":
            pts = [(0.0, -s), (w, s), (-w, s)]
        else:
            pts = [(0.0, -s), (w, 0.0), (0.0, s), (-w, 0.0)]
        t = math.radians(self.tilt)
        c, n = math.cos(t), math.sin(t)
        return [(self.cx + x * c - y * n, self.cy + x * n + y * c) for x, y in pts]

    def bbox(self) -> tuple[float, float, float, float]:
        pts = self.polygon()
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        return min(xs), min(ys), max(xs), max(ys)

    def centres(self) -> list[tuple[float, float]]:
        """The points a person might call the centre: bounding-box centre and vertex centroid."""
        x0, y0, x1, y1 = self.bbox()
        pts = self.polygon()
        return [((x0 + x1) / 2, (y0 + y1) / 2), (sum(p[0] for p in pts) / len(pts), sum(p[1] for p in pts) / len(pts))]

    def radius(self) -> float:
        return max(math.hypot(x - self.cx, y - self.cy) for x, y in self.polygon())


@dataclass(frozen=True)
class WildImage:
    """A picture as data: everything needed to draw and encode it again, bit for bit."""

    width: int
    height: int
    background: str
    bg_rgb: tuple[int, int, int]
    noise: float  # standard deviation of the background noise (0 = none)
    noise_seed: int
    shapes: tuple[WildShape, ...]
    fmt: str  # "png" or "jpeg"
    quality: int  # JPEG quality (unused for PNG)


def cell_of(x: float, y: float, width: int, height: int) -> int:
    """The 3 x 3 cell (row-major) holding the point, the canvas split in thirds."""
    return min(2, int(3 * y / height)) * 3 + min(2, int(3 * x / width))


def position_of(shape: WildShape, width: int, height: int) -> str:
    return POSITIONS[cell_of(shape.cx, shape.cy, width, height)]


def colour_rgb(rng: random.Random, name: str) -> tuple[int, int, int]:
    """A random rendition of the colour ``name`` inside its hue band."""
    (h0, h1), (s0, s1), (v0, v1) = HUES[name]
    r, g, b = colorsys.hsv_to_rgb((rng.uniform(h0, h1) % 360) / 360, rng.uniform(s0, s1), rng.uniform(v0, v1))
    return round(255 * r), round(255 * g), round(255 * b)


def colour_name(rgb: tuple[int, int, int]) -> str | None:
    """The colour name whose band holds ``rgb`` (the inverse of ``colour_rgb``; None if none does)."""
    h, s, v = colorsys.rgb_to_hsv(*(c / 255 for c in rgb))
    deg = h * 360
    for name, ((h0, h1), (s0, s1), (v0, v1)) in HUES.items():
        tol = 0.01  # rgb rounding
        in_hue = h0 - 1 <= deg <= h1 + 1 or h0 - 1 <= deg - 360 <= h1 + 1
        if in_hue and s0 - tol <= s <= s1 + tol and v0 - tol <= v <= v1 + tol:
            return name
    return None


def random_canvas(rng: random.Random) -> tuple[int, int]:
    while True:
        w, h = rng.randint(MIN_SIDE, MAX_SIDE), rng.randint(MIN_SIDE, MAX_SIDE)
        if max(w, h) / min(w, h) <= MAX_ASPECT:
            return w, h


def random_background(rng: random.Random) -> tuple[str, tuple[int, int, int], float]:
    """(kind, base RGB, noise sigma): light enough that no shape colour is mistaken for it."""
    kind = rng.choice(BACKGROUNDS)
    base = rng.choice(("white", "grey", "tint")) if kind == "noisy" else kind
    if base == "white":
        rgb = (255, 255, 255)
    elif base == "grey":
        g = rng.randint(185, 245)
        rgb = (g, g, g)
    else:
        r, g, b = colorsys.hsv_to_rgb(rng.random(), rng.uniform(0.04, 0.15), rng.uniform(0.92, 1.0))
        rgb = (round(255 * r), round(255 * g), round(255 * b))
    return kind, rgb, (rng.uniform(3.0, 10.0) if kind == "noisy" else 0.0)


def _inside_cell(shape: WildShape, cell: int, width: int, height: int) -> bool:
    """Both centres of ``shape`` lie in ``cell``, at least ``MARGIN`` of a cell from its edges."""
    row, col = divmod(cell, 3)
    for x, y in shape.centres():
        fx, fy = 3 * x / width, 3 * y / height
        if int(fx) != col or int(fy) != row:
            return False
        if not (MARGIN <= fx - col <= 1 - MARGIN and MARGIN <= fy - row <= 1 - MARGIN):
            return False
    return True


def _fits(shape: WildShape, cell: int, others: list[WildShape], width: int, height: int) -> bool:
    """In the canvas (a pixel to spare), centred in its cell, and clear of every other shape."""
    x0, y0, x1, y1 = shape.bbox()
    if x0 < 1 or y0 < 1 or x1 > width - 2 or y1 > height - 2:
        return False
    if not _inside_cell(shape, cell, width, height):
        return False
    return all(math.hypot(shape.cx - o.cx, shape.cy - o.cy) > shape.radius() + o.radius() + 2 for o in others)


def _propose(rng: random.Random, kind: str, colour: str, cell: int, width: int, height: int,
             scale: float) -> WildShape:
    """A random shape of ``kind`` centred somewhere in ``cell`` (not checked yet)."""
    row, col = divmod(cell, 3)
    cw, ch = width / 3, height / 3
    size = max(4.0, rng.uniform(0.25, 0.75) * min(cw, ch) * scale)
    aspect = rng.uniform(0.6, 0.85) if kind == "diamond" else rng.uniform(0.85, 1.15) if kind == "triangle" else 1.0
    tilt = rng.uniform(-MAX_TILT, MAX_TILT) if kind != "circle" and rng.random() < 0.6 else 0.0
    stroke = 0 if rng.random() < 0.7 else max(2, round(size * rng.uniform(0.12, 0.25)))
    cx = (col + rng.uniform(MARGIN, 1 - MARGIN)) * cw
    cy = (row + rng.uniform(MARGIN, 1 - MARGIN)) * ch
    return WildShape(kind, colour, colour_rgb(rng, colour), cx, cy, size, tilt, aspect, stroke)


def random_shapes(rng: random.Random, n: int, width: int, height: int) -> tuple[WildShape, ...]:
    """``n`` shapes of distinct kinds, colours and cells that satisfy every rule of the module doc.

    Rejection sampling: a shape that does not fit is proposed again a little smaller (down to 0.4 of
    its size range, so crowded pictures keep visible shapes); a scene that still cannot be completed
    starts over with other cells (it always ends: small shapes fit)."""
    while True:
        kinds, colours, cells = rng.sample(KINDS, n), rng.sample(list(HUES), n), rng.sample(range(9), n)
        placed: list[WildShape] = []
        for kind, colour, cell in zip(kinds, colours, cells):
            for attempt in range(60):
                shape = _propose(rng, kind, colour, cell, width, height, max(0.4, 0.96 ** attempt))
                if _fits(shape, cell, placed, width, height):
                    placed.append(shape)
                    break
            else:
                break
        if len(placed) == n:
            return tuple(placed)


def random_image(rng: random.Random, n_shapes: int) -> WildImage:
    width, height = random_canvas(rng)
    background, bg_rgb, noise = random_background(rng)
    shapes = random_shapes(rng, n_shapes, width, height)
    fmt = rng.choice(("png", "jpeg"))
    return WildImage(width, height, background, bg_rgb, noise, rng.getrandbits(32), shapes, fmt, rng.randint(85, 95))


def _px(v: float) -> int:
    """Round half up (not to even), so moving a shape by whole pixels moves its pixels the same."""
    return math.floor(v + 0.5)


def draw_shape(d: ImageDraw.ImageDraw, shape: WildShape, ink) -> None:
    """Draw one shape with ``ink`` (an RGB triple, or 255 on a mask): the one drawing path, so a test's
    mask covers exactly the pixels the picture has."""
    if shape.kind == "circle":
        box = (_px(shape.cx - shape.size), _px(shape.cy - shape.size), _px(shape.cx + shape.size),
               _px(shape.cy + shape.size))
        if shape.stroke:
            d.ellipse(box, outline=ink, width=shape.stroke)
        else:
            d.ellipse(box, fill=ink)
        return
    pts = [(_px(x), _px(y)) for x, y in shape.polygon()]
    if shape.stroke:
        d.polygon(pts, outline=ink, width=shape.stroke)
    else:
        d.polygon(pts, fill=ink)


def draw(image: WildImage) -> Image.Image:
    """The picture before encoding (RGB)."""
    if image.noise:
        gen = np.random.default_rng(image.noise_seed)
        base = np.array(image.bg_rgb, dtype=np.float64)
        pixels = base + gen.normal(0.0, image.noise, (image.height, image.width, 1))  # grey noise
        im = Image.fromarray(np.clip(np.rint(pixels), 0, 255).astype(np.uint8), "RGB")
    else:
        im = Image.new("RGB", (image.width, image.height), image.bg_rgb)
    d = ImageDraw.Draw(im)
    for shape in image.shapes:
        draw_shape(d, shape, shape.rgb)
    return im


def shape_mask(shape: WildShape, width: int, height: int, pad: int = 0) -> Image.Image:
    """The pixels ``shape`` covers on a ``width`` x ``height`` canvas grown by ``pad`` on every side."""
    mask = Image.new("L", (width + 2 * pad, height + 2 * pad), 0)
    moved = WildShape(shape.kind, shape.colour, shape.rgb, shape.cx + pad, shape.cy + pad, shape.size, shape.tilt,
                      shape.aspect, shape.stroke)
    draw_shape(ImageDraw.Draw(mask), moved, 255)
    return mask


def encode(image: WildImage) -> tuple[str, bytes]:
    """(media type, file bytes) as a user would upload the picture."""
    buf = io.BytesIO()
    if image.fmt == "jpeg":
        draw(image).save(buf, "JPEG", quality=image.quality)
        return "image/jpeg", buf.getvalue()
    draw(image).save(buf, "PNG")
    return "image/png", buf.getvalue()
