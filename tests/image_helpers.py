"""Synthetic images and prepared DS4V prompts for engine tests."""

from __future__ import annotations

import base64
import io

from PIL import Image, ImageDraw

from ds4serve.chat import Tokenizer, render_chat
from ds4serve.multimodal.pipeline import ImagePipeline
from ds4serve.tiny.random_model import BUNDLED

COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black", "cyan"]


# the bundled model's sample picture as a data URL, and questions it answers (about it, and text alone)
SAMPLE_URL = "data:image/png;base64," + base64.b64encode((BUNDLED / "sample.png").read_bytes()).decode()
SAMPLE_QUESTIONS = ["What is 7 + 5?", "What colour is the triangle?", "How many shapes are there?", "Reverse: abc",
                    "What colour is the circle?", "Which shape is blue?", "What is 3 + 4?", "Where is the square?"]


def image_url(seed: int, size=(200, 150)) -> str:
    im = Image.new("RGB", size, COLOURS[seed % len(COLOURS)])
    d = ImageDraw.Draw(im)
    c = COLOURS[(seed * 5 + 3) % len(COLOURS)]
    x = 10 + (seed * 37) % 100
    d.ellipse((x, 20, x + 60, 90), fill=c)
    d.rectangle((5, 100, 5 + (seed * 13) % 150, 140), fill=COLOURS[(seed + 4) % len(COLOURS)])
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_prompt(core, tok: Tokenizer, text: str, seeds: list[int]):
    """(ids with image blocks, ImageInput list) for a user message with these images."""
    parts = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": image_url(s)}}
                                                for s in seeds]
    rendered = render_chat(tok, [{"role": "user", "content": parts}])
    prepared = ImagePipeline.for_engine(core, tok).prepare(rendered)
    return prepared.ids, prepared.images
