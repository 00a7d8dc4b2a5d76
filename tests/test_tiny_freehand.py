"""The free-hand training renderer draws what its scene says, and training consumes varied pictures.

Checked from the drawn geometry and pixels (not from the renderer's own bookkeeping alone): every
shape's centre sits in the cell its answer names, a margin from the cell's edges; shapes stay in the
canvas and apart; a PNG picture holds pixels of exactly each shape's ink around its centre, and the
ink lies in its colour name's band and no other. Then the training side: each picture is sized by the
server's ``plan_resize`` from its own size, images of different grids are encoded per grid, and a
two-step stage 2 from the bundled checkpoint runs end to end.
"""

from __future__ import annotations

import colorsys
import json
import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4serve.tiny.data import POSITIONS, TRAIN_TASKS, random_scene
from ds4serve.tiny.freehand import BANDS, EASY, EDGE, FULL, TEMPLATES, free_examples, free_picture, question
from ds4serve.tiny.random_model import BUNDLED


def _band_names(rgb: tuple[int, int, int]) -> list[str]:
    h, s, v = colorsys.rgb_to_hsv(*(c / 255 for c in rgb))
    deg, out = h * 360, []
    for name, ((h0, h1), (s0, s1), (v0, v1)) in BANDS.items():
        hue_in = h0 - 1 <= deg <= h1 + 1 or h0 - 1 <= deg - 360 <= h1 + 1
        if hue_in and s0 - 0.01 <= s <= s1 + 0.01 and v0 - 0.01 <= v <= v1 + 0.01:
            out.append(name)
    return out


def _drawn(seed: int, n: int):
    rng = random.Random(seed)
    scene = random_scene(rng, n)
    return scene, free_picture(rng, scene)


DRAWN = st.builds(_drawn, st.integers(0, 2**31 - 1), st.integers(1, 4))  # (scene, picture)


@settings(max_examples=40, deadline=None)
@given(drawn=DRAWN)
def test_every_shape_centred_in_its_answer_cell_inside_the_canvas_and_apart(drawn):
    scene, pic = drawn
    n = len(scene)
    w, h = pic.image.size
    assert 64 <= w <= 640 and 64 <= h <= 640 and max(w, h) <= 4.5 * min(w, h)
    for sh, (cx, cy, r) in zip(scene, pic.spots, strict=True):
        fx, fy = 3 * cx / w, 3 * cy / h
        assert POSITIONS[int(fy) * 3 + int(fx)] == POSITIONS[sh.cell]
        assert EDGE - 1e-9 <= fx - int(fx) <= 1 - EDGE + 1e-9 and EDGE - 1e-9 <= fy - int(fy) <= 1 - EDGE + 1e-9
        assert cx - 1.45 * r >= 1 and cy - 1.45 * r >= 1 and cx + 1.45 * r <= w - 2 and cy + 1.45 * r <= h - 2
    for i in range(n):
        for j in range(i + 1, n):
            (xa, ya, ra), (xb, yb, rb) = pic.spots[i], pic.spots[j]
            assert math.hypot(xa - xb, ya - yb) > 1.45 * (ra + rb)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 4))
def test_the_curriculums_easy_placement_keeps_shapes_large_and_near_their_cells_middle(seed, n):
    rng = random.Random(seed)
    scene = random_scene(rng, n)
    pic = free_picture(rng, scene, EASY)
    w, h = pic.image.size
    lo, hi = EASY.centre
    for sh, (cx, cy, r) in zip(scene, pic.spots, strict=True):
        fx, fy = 3 * cx / w, 3 * cy / h
        assert POSITIONS[int(fy) * 3 + int(fx)] == POSITIONS[sh.cell]
        assert lo - 1e-9 <= fx - int(fx) <= hi + 1e-9 and lo - 1e-9 <= fy - int(fy) <= hi + 1e-9
        assert r <= EASY.size[1] * min(w, h) / 3 + 1e-9


def test_easy_shapes_are_larger_than_the_full_distributions():
    def mean_size(where, seed=5):
        rng = random.Random(seed)
        sizes = []
        for _ in range(60):
            scene = random_scene(rng, 1)
            pic = free_picture(rng, scene, where)
            sizes.append(pic.spots[0][2] / (min(pic.image.size) / 3))
        return sum(sizes) / len(sizes)

    assert mean_size(EASY) > 1.1 * mean_size(FULL)  # 0.44 vs 0.38 of a cell (canvas edges shrink some)


@settings(max_examples=40, deadline=None)
@given(drawn=DRAWN)
def test_each_shape_is_drawn_in_an_ink_of_its_colour_name(drawn):
    scene, pic = drawn
    px = np.asarray(pic.image, dtype=np.int16)
    for sh, ink, (cx, cy, r) in zip(scene, pic.inks, pic.spots, strict=True):
        assert _band_names(ink) == [sh.colour]
        if pic.jpeg:
            continue  # JPEG moves pixel values; the band check above is on the ink itself
        x0, x1 = max(0, int(cx - 1.5 * r) - 1), int(cx + 1.5 * r) + 2
        y0, y1 = max(0, int(cy - 1.5 * r) - 1), int(cy + 1.5 * r) + 2
        window = px[y0:y1, x0:x1]
        assert (np.abs(window - np.array(ink)).max(axis=-1) == 0).sum() >= 3, (sh, ink, (cx, cy, r))


def test_bands_are_disjoint():
    for rgb in [(r, g, b) for r in range(0, 256, 15) for g in range(0, 256, 15) for b in range(0, 256, 15)]:
        assert len(_band_names(rgb)) <= 1, rgb


def test_reworded_questions_keep_the_slot_and_the_answer():
    rng = random.Random(0)
    seen = set()
    for _ in range(400):
        text = question(rng, "colour", "What colour is the circle?", kind="circle")
        assert "circle" in text.lower()
        seen.add(text)
    assert "What colour is the circle?" in seen and len(seen) > 12  # canonical stays, paraphrases vary
    assert any(t != t.rstrip() for t in seen) and any(t[0].islower() for t in seen)
    for task, templates in TEMPLATES.items():
        for t in templates:
            assert ("{k}" in t or "{c}" in t) == (task in ("colour", "shape", "where")), t
    exs = free_examples(3, 120, TRAIN_TASKS, 1.0)
    for ex in exs:
        if ex.task in ("colour", "where"):
            kind = next(s.kind for s in ex.images[0] if (s.colour == ex.answer or POSITIONS[s.cell] == ex.answer))
            assert kind in ex.question.lower()
        if ex.task == "count":
            assert ex.answer == str(len(ex.images[0]))


def test_free_share_zero_is_the_original_renderer():
    from ds4serve.tiny.data import draw

    for ex in free_examples(4, 24, TRAIN_TASKS, 0.0):
        for scene, im in zip(ex.images, ex.render_images(), strict=True):
            assert np.array_equal(np.asarray(im), np.asarray(draw(scene)))


@pytest.fixture(scope="module")
def prep_and_model():
    from safetensors.torch import load_file

    from ds4serve.chat import Tokenizer
    from ds4serve.config import ModelConfig
    from ds4serve.tiny.train import Encoder, build

    cfg = ModelConfig.from_dict(json.loads((BUNDLED / "config.json").read_text()))
    lm, enc = build(cfg, load_file(str(BUNDLED / "model.safetensors")))
    return Encoder(Tokenizer(BUNDLED), cfg), enc


def test_each_picture_gets_the_server_geometry_and_grids_are_encoded_apart(prep_and_model):
    from ds4serve.multimodal.layout import image_block
    from ds4serve.tiny.train import encode_images

    prep, enc = prep_and_model
    exs = [ex for ex in free_examples(9, 40, ("compare", "colour"), 1.0)][:6]
    samples = [prep.sample(ex) for ex in exs]
    for ex, s in zip(exs, samples):
        for im, grid, blk, patches in zip(ex.render_images(), s.grids, s.blocks, s.patches, strict=True):
            g = prep.geometry(*im.size)
            assert grid == (g.vit_h, g.vit_w) and patches.shape[0] == g.vit_h * g.vit_w
            assert len(blk.types) == len(image_block(g.llm_h, g.llm_w, blk.start).types)
    assert len({g for s in samples for g in s.grids}) > 1
    with torch.no_grad():
        rows = encode_images(enc, samples)
        alone = [enc.encode_same_grid(p[None], *grid)[0] for s in samples for p, grid in zip(s.patches, s.grids)]
    assert len(rows) == len(alone)
    for a, b in zip(rows, alone):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_stage_two_continues_from_a_checkpoint(tmp_path):
    from ds4serve.tiny.train import TrainSettings, train

    summary = train(TrainSettings(out=tmp_path, init=BUNDLED, robust_steps=2, batch=4, eval_every=1000,
                                  held_per_task=2, easy_vision_steps=2, free_vision_steps=2))
    names = [s["name"] for s in summary["stages"]]
    assert names == ["base", "free-hand vision (easy)", "free-hand vision", "robust"]
    robust = summary["stages"][-1]
    assert robust["steps"] == 2 and robust["free_share"] == 0.8
    assert set(robust["history"][-1]) >= {"original", "free hand"}
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "tokenizer_config.json").exists()
    assert json.loads((tmp_path / "TRAINING.json").read_text())["steps"] == summary["steps"]


@settings(max_examples=30, deadline=None)
@given(w=st.integers(64, 640), h=st.integers(64, 640), fx=st.floats(0.1, 0.9), fy=st.floats(0.1, 0.9))
def test_letterbox_map_puts_picture_points_where_preprocess_puts_their_pixels(w, h, fx, fy):
    """A red square at (fx, fy) of a white picture: the mapped point is red on the server's canvas,
    and a canvas pixel the map puts outside the picture is the letterbox grey."""
    from PIL import Image, ImageDraw

    from ds4serve.multimodal.resize import plan_resize, preprocess
    from ds4serve.tiny.vision_pretrain import letterbox_map

    im = Image.new("RGB", (w, h), (255, 255, 255))
    x, y, half = fx * w, fy * h, max(6.0, 0.08 * min(w, h))
    ImageDraw.Draw(im).rectangle((x - half, y - half, x + half, y + half), fill=(255, 0, 0))
    g = plan_resize(w, h, patch=14, min_pixels=15876, max_n_token=32, max_wh_ratio=8, downsample=3)
    patches = preprocess(im, g, 14)  # [vit_h * vit_w, 3, 14, 14], values in [-1, 1]
    canvas = patches.reshape(g.vit_h, g.vit_w, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, g.canvas_h, g.canvas_w)
    sx, sy, ox, oy = letterbox_map(w, h, g)
    px = canvas[:, int(y * sy + oy), int(x * sx + ox)]
    assert px[0] > 0.9 and px[1] < -0.8 and px[2] < -0.8, (px, g)
    if ox >= 2:
        assert torch.allclose(canvas[:, g.canvas_h // 2, 0], torch.full((3,), 127 / 127.5 - 1), atol=1e-6)
    if oy >= 2:
        assert torch.allclose(canvas[:, 0, g.canvas_w // 2], torch.full((3,), 127 / 127.5 - 1), atol=1e-6)


def test_token_labels_name_the_shape_under_each_centre_and_every_token_cell():
    from ds4serve.multimodal.resize import plan_resize
    from ds4serve.tiny.data import SHAPES
    from ds4serve.tiny.vision_pretrain import LETTERBOX, letterbox_map, token_labels

    rng = random.Random(5)
    agree = total = 0
    for _ in range(60):
        scene = random_scene(rng)
        pic = free_picture(rng, scene)
        w, h = pic.image.size
        g = plan_resize(w, h, patch=14, min_pixels=15876, max_n_token=32, max_wh_ratio=8, downsample=3)
        kinds, cols, cells = token_labels(w, h, g, scene, pic.spots, 14, 3)
        assert kinds.shape == (g.llm_h * g.llm_w,)
        labelled = [SHAPES[k - 1] for k in kinds.tolist() if k]
        assert labelled and set(labelled) <= {s.kind for s in scene}  # two small shapes may share a token
        assert ((kinds > 0) == (cols > 0)).all()
        inside = cells[cells != LETTERBOX]
        assert len(inside) > 0 and inside.min() >= 0 and inside.max() <= 8
        sx, sy, ox, oy = letterbox_map(w, h, g)
        for i in torch.nonzero(kinds == 0).flatten().tolist():  # an empty token: the cell of its middle
            r, c = divmod(i, g.llm_w)
            x, y = (min(42 * c + 21, g.canvas_w - 0.5) - ox) / sx, (min(42 * r + 21, g.canvas_h - 0.5) - oy) / sy
            want = LETTERBOX if not (0 <= x < w and 0 <= y < h) else 3 * min(2, int(3 * y / h)) + min(2, int(3 * x / w))
            assert cells[i] == want
        for sh in scene:
            hit = [i for i, k in enumerate(kinds.tolist()) if k and SHAPES[k - 1] == sh.kind]
            if hit:
                total += 1
                agree += int(cells[hit[0]] == sh.cell)
    assert agree == total > 40  # a shape's token carries the shape's answer cell


def test_training_works_in_a_process_that_served_first():
    """Regression: a cached index built during an inference-mode forward broke a later backward
    ("Inference tensors cannot be saved for backward") when the suite ran serving tests first."""
    from ds4serve.model import mhc

    mhc._scale_index.cache_clear()
    with torch.inference_mode():
        mhc._scale_index(3, torch.device("cpu"))
    streams = torch.randn(2, 3, 8, requires_grad=True)
    fn, base, scale = torch.randn(15, 24, requires_grad=True), torch.zeros(15), torch.ones(3, requires_grad=True)
    collapsed, post, comb = mhc.hc_pre(streams, fn, base, scale, 4, 1e-6, 1e-6)
    (collapsed.sum() + post.sum() + comb.sum()).backward()
    assert fn.grad is not None and scale.grad is not None
