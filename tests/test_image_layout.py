"""Image block layout and reference sizing: spec ds4-vision §2.3-§2.5, §3.2 and §10 vectors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from ds4serve.multimodal.layout import (
    ImageBlock,
    TokenType,
    block_length,
    body_tokens,
    image_block,
    lead_pads,
)
from ds4serve.multimodal.resize import ImageGeometry, low_detail_size, plan_resize, preprocess

_LETTERS = {"P": TokenType.IMAGE_PAD, "S": TokenType.IMAGE_START, "I": TokenType.IMAGE,
            "N": TokenType.IMAGE_NEW_LINE, "E": TokenType.IMAGE_END}


def _types(text: str) -> tuple[int, ...]:
    return tuple(_LETTERS[c] for c in text.split())


def _check_block(block: ImageBlock) -> None:
    """Structural invariants every block must satisfy, whatever the grid and position."""
    types = block.types
    assert block.visible_start % 4 == 3
    assert block.visible_end % 4 == 0
    assert block.length == block.lead + body_tokens(block.n_h, block.n_w)
    assert block.length == block_length(block.n_h, block.n_w, block.start)
    assert block.end == block.start + block.length
    assert types[: block.lead] == (TokenType.IMAGE_PAD,) * block.lead
    assert types[block.lead] == TokenType.IMAGE_START
    assert types[-1] == TokenType.IMAGE_END
    assert types.count(TokenType.IMAGE_START) == types.count(TokenType.IMAGE_END) == 1
    assert types.count(TokenType.IMAGE) == block.n_h * block.n_w == block.n_image_rows
    assert types.count(TokenType.IMAGE_NEW_LINE) == block.n_h
    assert sorted(block.perm) == list(range(block.n_h * block.n_w))
    assert len(block.image_positions) == len(block.perm)
    assert all(types[p - block.start] == TokenType.IMAGE for p in block.image_positions)


# --- reference vectors (spec §3.2, §10) -----------------------------------------------------------


def test_reference_vector_3x2_at_0():
    block = image_block(3, 2, 0)
    assert block.types == _types("P P P S I I I I N N I P I P N P E")
    assert block.length == 17
    assert block.perm == (0, 2, 1, 3, 4, 5)
    assert block.visible_start == 3 and block.visible_end == 16
    assert block.lead == 3 and block.end == 17
    assert block.image_positions == (4, 5, 6, 7, 10, 12)


def test_reference_vector_2x2_at_0():
    block = image_block(2, 2, 0)
    assert block.types == _types("P P P S I I I I N N P P E")
    assert block.perm == (0, 2, 1, 3)
    assert block.visible_start == 3 and block.visible_end == 12


def test_lead_pads_cycle():
    assert [lead_pads(p) for p in range(8)] == [3, 2, 1, 0, 3, 2, 1, 0]
    block = image_block(3, 2, 3)  # no lead pad: START is the first token
    assert block.types[0] == TokenType.IMAGE_START and block.visible_start == 3


def test_n_layout_pairs_columns():
    """Within a row pair the stream goes (r0,c),(r1,c) column by column, then two NEWLINEs."""
    block = image_block(4, 3, 3)
    assert block.perm == (0, 3, 1, 4, 2, 5, 6, 9, 7, 10, 8, 11)
    assert block.types[1:9] == _types("I I I I I I N N")


@pytest.mark.parametrize("bad", [(0, 1, 0), (1, 0, 0), (1, 1, -1)])
def test_layout_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        image_block(*bad)
    with pytest.raises(ValueError):
        block_length(*bad)


@settings(max_examples=300, deadline=None)
@given(n_h=st.integers(1, 46), n_w=st.integers(1, 40), start=st.integers(0, 100_000))
def test_layout_invariants(n_h, n_w, start):
    _check_block(image_block(n_h, n_w, start))


# --- token-count table (spec §2.4) ---------------------------------------------------------------

# (W, H) -> canvas W×H, ViT h×w, LLM h×w, IMAGE rows, body tokens
TABLE = [
    ((64, 64), (392, 392), (28, 28), (10, 10), 100, 114),
    ((384, 384), (392, 392), (28, 28), (10, 10), 100, 114),
    ((512, 512), (518, 518), (37, 37), (13, 13), 169, 198),
    ((640, 480), (644, 490), (35, 46), (12, 16), 192, 206),
    ((800, 600), (812, 602), (43, 58), (15, 20), 300, 338),
    ((1024, 768), (882, 658), (47, 63), (16, 21), 336, 354),
    ((1024, 1024), (756, 756), (54, 54), (18, 18), 324, 346),
    ((2000, 2000), (756, 756), (54, 54), (18, 18), 324, 346),
    ((4000, 4000), (756, 756), (54, 54), (18, 18), 324, 346),
    ((1280, 720), (1036, 588), (42, 74), (14, 25), 350, 366),
    ((1920, 1080), (1036, 588), (42, 74), (14, 25), 350, 366),
    ((1080, 1920), (560, 1008), (72, 40), (24, 14), 336, 362),
    ((2000, 120), (1092, 140), (10, 78), (4, 26), 104, 110),
    ((60, 1500), (84, 1932), (138, 6), (46, 2), 92, 142),
]


@pytest.mark.parametrize("size,canvas,vit,llm,rows,body", TABLE, ids=[f"{w}x{h}" for (w, h), *_ in TABLE])
def test_token_table(size, canvas, vit, llm, rows, body):
    g = plan_resize(*size)
    assert (g.canvas_w, g.canvas_h) == canvas
    assert (g.vit_h, g.vit_w) == vit
    assert (g.llm_h, g.llm_w) == llm
    assert g.n_image_rows == rows
    assert g.body_tokens == body
    assert g.stretch == (size == (2000, 120))
    for start in range(4):
        assert g.block_length(start) <= 384


def test_detail_high_original_auto_are_reference():
    for w, h in [(640, 480), (1920, 1080), (60, 1500)]:
        ref = plan_resize(w, h)
        assert plan_resize(w, h, detail="high") == ref == plan_resize(w, h, detail="original")


@pytest.mark.parametrize("size,body", [
    ((1920, 1080), 182), ((512, 512), 198), ((513, 513), 198), ((1000, 1000), 198),
    ((4000, 4000), 198), ((500, 500), 158), ((390, 390), 114), ((64, 64), 114),
])
def test_low_detail(size, body):
    assert plan_resize(*size, detail="low").body_tokens == body


def test_low_detail_intermediate_size():
    assert low_detail_size(1920, 1080) == (682, 384)
    assert low_detail_size(500, 500) == (500, 500)
    g = plan_resize(1920, 1080, detail="low")
    assert (g.llm_h, g.llm_w) == (10, 17)


def test_unknown_detail_and_bad_sizes():
    with pytest.raises(ValueError, match="detail"):
        plan_resize(100, 100, detail="medium")
    with pytest.raises(ValueError):
        plan_resize(0, 100)
    with pytest.raises(ValueError):
        plan_resize(100, 100, max_n_token=5)


def test_lower_token_cap_is_respected():
    g = plan_resize(1920, 1080, max_n_token=128)
    assert g.body_tokens <= 125


@settings(max_examples=400, deadline=None)
@given(w=st.integers(1, 20_000), h=st.integers(1, 20_000), start=st.integers(0, 4096),
       detail=st.sampled_from(["auto", "low"]))
def test_plan_resize_blocks_fit(w, h, start, detail):
    g = plan_resize(w, h, detail=detail)
    assert g.canvas_w == 14 * g.vit_w and g.canvas_h == 14 * g.vit_h
    assert g.llm_h == -(-g.vit_h // 3) and g.llm_w == -(-g.vit_w // 3)
    assert g.vit_h * g.vit_w <= 3366
    assert g.body_tokens <= 381
    block = image_block(g.llm_h, g.llm_w, start)
    assert block.length <= 384
    _check_block(block)


# --- pixel preprocessing ------------------------------------------------------------------------


def test_preprocess_stretched():
    img = Image.new("RGB", (2000, 120), (255, 0, 0))
    g = plan_resize(*img.size)
    assert g.stretch
    x = preprocess(img, g)
    assert x.dtype == torch.float32
    assert x.shape == (g.vit_h * g.vit_w, 3, 14, 14)
    assert torch.allclose(x[:, 0], torch.ones(())) and torch.allclose(x[:, 1:], -torch.ones(()))


def _unpatch(x: torch.Tensor, g: ImageGeometry) -> torch.Tensor:
    """Inverse of the row-major tiling: patches back to a [3, H, W] canvas."""
    return x.reshape(g.vit_h, g.vit_w, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(
        3, g.canvas_h, g.canvas_w)


def test_preprocess_letterboxed_fill():
    img = Image.new("RGB", (400, 100), (255, 255, 255))  # 4:1: letterboxed top and bottom
    g = plan_resize(*img.size)
    assert not g.stretch and (g.canvas_w, g.canvas_h) == (770, 196)
    x = preprocess(img, g)
    assert x.shape == (g.vit_h * g.vit_w, 3, 14, 14)
    assert x.min() >= -1.0 and x.max() <= 1.0
    fill = (127 / 255 - 0.5) / 0.5
    assert abs(fill + 0.0039) < 1e-3
    canvas = _unpatch(x, g)
    assert torch.allclose(canvas[:, 0], torch.full((3, g.canvas_w), fill))  # top pad row
    assert torch.allclose(canvas[:, -1], torch.full((3, g.canvas_w), fill))  # bottom pad row
    assert torch.allclose(canvas[:, g.canvas_h // 2], torch.ones(()))  # the white image


def test_preprocess_mostly_padding():
    """A very tall strip is solved to one column and mostly letterboxed with grey."""
    img = Image.new("RGB", (10, 20_000), (0, 0, 0))
    g = plan_resize(*img.size)
    assert g.llm_w == 1 and not g.stretch
    canvas = _unpatch(preprocess(img, g), g)
    fill = (127 / 255 - 0.5) / 0.5
    assert torch.allclose(canvas[:, :, 0], torch.full((3, g.canvas_h), fill))
    assert torch.isclose(canvas, torch.tensor(fill)).float().mean() > 0.5


def test_preprocess_tile_order_and_alpha():
    """Tiles are row-major; RGBA alpha is dropped (not composited)."""
    img = Image.new("RGBA", (392, 392), (0, 0, 0, 0))
    img.paste((255, 255, 255, 0), (14, 0, 28, 14))  # tile (0, 1), fully transparent white
    g = plan_resize(*img.size)
    assert (g.vit_h, g.vit_w) == (28, 28)
    x = preprocess(img, g)
    assert torch.allclose(x[1], torch.ones(()))
    assert torch.allclose(x[0], -torch.ones(())) and torch.allclose(x[28], -torch.ones(()))


def test_preprocess_rejects_mismatched_geometry():
    bad = ImageGeometry(canvas_w=100, canvas_h=100, vit_h=7, vit_w=7, llm_h=3, llm_w=3, stretch=False)
    with pytest.raises(ValueError):
        preprocess(Image.new("RGB", (10, 10)), bad)
