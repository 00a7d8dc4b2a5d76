"""The wild eval set: its independent renderer keeps every answer exact, and it is served like the
original eval.

The renderer is checked from the pixels it produces (shape masks drawn by the same drawing path),
not from its own bookkeeping: a position answer names the cell holding the drawn shape's centre, a
colour answer names the drawn colour, shapes stay inside the canvas and apart, and both file
formats decode with the server's decoder. The end-to-end tests check the report's structure, and
that the serving path is right (pictures in the training style, drawn by this renderer, are answered
as well as the training set is); they do not ask for a high wild accuracy, which is what the set is
there to measure.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from ds4serve.multimodal.images import decode_image, parse_data_url, sniff_format
from ds4serve.tiny import data
from ds4serve.tiny.random_model import BUNDLED
from ds4serve.tiny.wild_eval import (PARAPHRASES, WILD_SEED, WILD_TASKS, WildExample, make_wild_example,
                                     render_wild, wild_examples)
from ds4serve.tiny.wild_render import (HUES, KINDS, MAX_SIDE, MIN_SIDE, POSITIONS, WildImage, WildShape, cell_of,
                                       colour_name, draw, encode, position_of, random_image, shape_mask)

seeds = st.integers(0, 2**32 - 1)


def _mask(shape: WildShape, image: WildImage, pad: int = 0) -> np.ndarray:
    return np.asarray(shape_mask(shape, image.width, image.height, pad)) > 0


@settings(max_examples=60)
@given(seeds, st.integers(1, 4))
def test_shapes_inside_canvas_and_centred_in_their_answer_cell(seed, n):
    image = random_image(random.Random(seed), n)
    assert MIN_SIDE <= image.width <= MAX_SIDE and MIN_SIDE <= image.height <= MAX_SIDE
    pad = 16
    for shape in image.shapes:
        grown = _mask(shape, image, pad)
        inner = grown[pad:-pad, pad:-pad]
        assert inner.sum() == grown.sum() >= 8, "shape clipped by the canvas or invisible"
        ys, xs = np.nonzero(inner)
        cell = POSITIONS.index(position_of(shape, image.width, image.height))
        bbox_centre = ((xs.min() + xs.max() + 1) / 2, (ys.min() + ys.max() + 1) / 2)  # pixel (x, y) covers [x, x+1)
        assert cell_of(*bbox_centre, image.width, image.height) == cell
        if not shape.stroke:
            assert cell_of(xs.mean() + 0.5, ys.mean() + 0.5, image.width, image.height) == cell


@settings(max_examples=60)
@given(seeds, st.integers(1, 4))
def test_shapes_apart_and_drawn_in_their_answer_colour(seed, n):
    image = random_image(random.Random(seed), n)
    pixels = np.asarray(draw(image))
    masks = [_mask(s, image) for s in image.shapes]
    assert sum(m.sum() for m in masks) == np.logical_or.reduce(masks).sum(), "shapes overlap"
    for shape, mask in zip(image.shapes, masks):
        assert colour_name(shape.rgb) == shape.colour
        assert (pixels[mask] == shape.rgb).all()
    assert colour_name(image.bg_rgb) is None
    kinds, colours = [s.kind for s in image.shapes], [s.colour for s in image.shapes]
    assert len(set(kinds)) == len(kinds) and len(set(colours)) == len(colours)


@settings(max_examples=40)
@given(seeds, st.sampled_from(WILD_TASKS))
def test_png_and_jpeg_decode_through_the_server_decoder(seed, task):
    ex = make_wild_example(random.Random(seed), task)
    for image, url in zip(ex.images, ex.data_urls()):
        raw = parse_data_url(url)
        assert url.startswith(f"data:image/{image.fmt};base64,") and sniff_format(raw) == image.fmt.upper()
        got = np.asarray(decode_image(raw), dtype=np.int16)
        want = np.asarray(draw(image), dtype=np.int16)
        assert got.shape == want.shape == (image.height, image.width, 3)
        if image.fmt == "png":
            assert (got == want).all()
        else:
            # JPEG at quality 85-95 stays close to the drawing (it smooths part of a noisy background away)
            assert np.abs(got - want).mean() < 4.0 + 0.5 * image.noise


def test_colour_answer_survives_jpeg():
    """The colour a user sees is still the answer's after JPEG: the median pixel inside a filled
    target shape (its edge trimmed, where JPEG blurs) still lies in the colour's band."""
    checked = 0
    for ex in wild_examples(WILD_SEED + 1, 200, ("colour",)):
        image = ex.images[0]
        target = next(s for s in image.shapes if s.kind == ex.slot)
        if image.fmt != "jpeg" or target.stroke or target.size < 10:
            continue
        inner = dataclasses.replace(target, size=target.size - 4)
        decoded = np.asarray(Image.open(io.BytesIO(encode(image)[1])).convert("RGB"))
        median = np.median(decoded[_mask(inner, image)], axis=0)
        assert colour_name(tuple(int(v) for v in median)) == ex.answer, (ex.question, median)
        checked += 1
    assert checked >= 20


def test_paraphrases_keep_the_answer_and_start_from_the_training_wording():
    """Every wording of a question names the same shape or colour and has the same answer; wording 0
    is the training question exactly (compared with the training generator's own text)."""
    for ex in wild_examples(WILD_SEED, 60):
        variants = [ex.reworded(k) for k in range(len(PARAPHRASES[ex.task]))]
        assert len({v.question for v in variants}) == len(variants)
        assert {v.answer for v in variants} == {ex.answer}
        assert all(ex.slot in v.question for v in variants)
    training = {ex.task: ex for ex in data.examples(3, 14)}
    for task in WILD_TASKS:
        ex = training[task]
        slot = next((w for w in list(HUES) + list(KINDS) if w in ex.question), "")
        assert PARAPHRASES[task][0].format(kind=slot, colour=slot) == ex.question


def test_answers_use_the_training_formats():
    allowed = {"colour": set(HUES), "shape": set(KINDS), "where": set(data.POSITIONS), "count": {"1", "2", "3", "4"},
               "compare": {"first", "second"}}
    assert set(HUES) == set(data.COLOURS) and set(KINDS) == set(data.SHAPES) and POSITIONS == data.POSITIONS
    for ex in wild_examples(WILD_SEED, 100):
        assert ex.answer in allowed[ex.task]


def test_same_seed_same_set_and_the_set_varies():
    a, b = wild_examples(WILD_SEED, 40), wild_examples(WILD_SEED, 40)
    assert a == b and [x.data_urls() for x in a[:10]] == [x.data_urls() for x in b[:10]]
    assert wild_examples(WILD_SEED + 1, 40) != a
    exs = wild_examples(WILD_SEED, 200)
    images = [im for ex in exs for im in ex.images]
    assert {im.fmt for im in images} == {"png", "jpeg"}
    assert {im.background for im in images} == {"white", "grey", "tint", "noisy"}
    assert min(im.width for im in images) < 100 and max(im.width for im in images) > 550
    assert sum(im.width != im.height for im in images) > 0.9 * len(images)
    shapes = [s for im in images for s in im.shapes]
    assert 0.15 < np.mean([s.stroke > 0 for s in shapes]) < 0.5 and any(s.tilt for s in shapes)
    assert 0.2 < np.mean([ex.template == 0 for ex in exs]) < 0.5
    assert {ex.task for ex in exs} == set(WILD_TASKS)


def _training_style(rng: random.Random, task: str) -> WildExample:
    """A question on a picture like the training renderer's (126 x 126, 250 grey, one filled shape
    filling each chosen cell), drawn by the wild renderer: the control for the serving path."""
    rgb = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220), "yellow": (235, 210, 30),
           "purple": (140, 50, 170), "orange": (245, 140, 20)}
    n = rng.randint(1, 4)
    picked = zip(rng.sample(KINDS, n), rng.sample(list(HUES), n), rng.sample(range(9), n))
    shapes = tuple(WildShape(k, c, rgb[c], cell % 3 * 42 + 21, cell // 3 * 42 + 21, 19, 0.0, 1.0, 0)
                   for k, c, cell in picked)
    target = rng.choice(shapes)
    image = WildImage(126, 126, "grey", (250, 250, 250), 0.0, 0, shapes, "png", 90)
    return WildExample(task, (image,), target.colour if task == "shape" else target.kind, 0)


@pytest.fixture(scope="module")
def llm():
    from ds4serve.llm import LLM

    return LLM(BUNDLED, max_seqs=8, max_model_len=512)


def test_wild_eval_report_structure(llm, capsys):
    from ds4serve.tiny.wild_eval import evaluate_wild

    r = evaluate_wild(BUNDLED, n=20, in_flight=8, llm=llm)
    assert r["set"] == "wild" and r["n"] == 20 and r["seed"] == WILD_SEED and r["leaks"] == "none"
    assert set(r["per_task"]) == set(WILD_TASKS) and 0.0 <= r["overall"] <= 1.0
    assert r["overall"] == pytest.approx(sum(r["per_task"].values()) / len(WILD_TASKS))  # 4 questions per task
    assert set(r["by_condition"]) == {"wording", "file", "background", "shapes", "tilt", "longer side"}
    for group, labels in r["by_condition"].items():
        assert sum(count for count, _ in labels.values()) == 16, group  # all but the 4 comparisons
    assert len(r["wrong_examples"]) == min(10, round(20 * (1 - r["overall"])))
    out = capsys.readouterr().out
    assert out.strip().endswith(render_wild(r, BUNDLED).strip())
    assert "| task | exact match |" in out and "| **overall** |" in out and "| wording: canonical |" in out and "| compare |" in out


def test_the_bundled_model_meets_the_wild_targets(llm, capsys):
    """Issue 17's bar on the independent renderer, through the real engine: >= 90% overall and >= 80%
    on every task, the README's 500 questions of seed 1717 (deterministic: greedy, seeded pictures)."""
    from ds4serve.tiny.wild_eval import evaluate_wild

    r = evaluate_wild(BUNDLED, n=500, in_flight=8, llm=llm)
    assert r["overall"] >= 0.9 and min(r["per_task"].values()) >= 0.8, (r["overall"], r["per_task"])


def test_serving_path_answers_training_style_pictures(llm):
    from ds4serve.chat import Tokenizer
    from ds4serve.engine.sampling import SamplingParams
    from ds4serve.multimodal.pipeline import ImagePipeline
    from ds4serve.tiny.evaluate import answer_text, run_examples
    from ds4serve.tiny.wild_eval import wild_prepare

    rng = random.Random(4)
    exs = [_training_style(rng, ("colour", "shape", "count", "where")[i % 4]) for i in range(24)]
    tok = Tokenizer(BUNDLED)
    outs = run_examples(llm.core, tok, ImagePipeline.for_engine(llm.core, tok), exs, 8,
                        SamplingParams(max_tokens=12, temperature=0.0), prepare_fn=wild_prepare)
    answers = [answer_text(tok, ids) for ids in outs]
    right = sum(a == ex.answer for a, ex in zip(answers, exs))
    assert right >= 0.9 * len(exs), [(ex.question, ex.answer, a) for a, ex in zip(answers, exs) if a != ex.answer]


def test_cli_both_prints_both_tables(capsys):
    from ds4serve.cli import main

    assert main(["tiny", "eval", "--set", "both", "--n", "10", "--in-flight", "4"]) == 0
    out = capsys.readouterr().out
    assert "held-out exact match of ds4v-tiny: 10 questions" in out
    assert "wild held-out exact match of ds4v-tiny: 10 questions (seed 1717)" in out
    assert out.count("| **overall** |") == 2


def test_data_url_is_base64_of_the_encoded_file():
    ex = wild_examples(WILD_SEED, 1)[0]
    mime, raw = encode(ex.images[0])
    assert ex.data_urls()[0] == f"data:{mime};base64," + base64.b64encode(raw).decode()
