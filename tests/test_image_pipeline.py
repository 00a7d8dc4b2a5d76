"""Server-side image preparation: placeholder expansion, limits and thread safety (spec ds4-vision §6.1, §7)."""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
import torch
from PIL import Image

from ds4serve.config import VisionConfig
from ds4serve.multimodal.images import ImageError, ImageLimits
from ds4serve.multimodal.layout import TokenType, image_block
from ds4serve.multimodal.pipeline import ImagePipeline, PreparedPrompt
from ds4serve.multimodal.resize import plan_resize

VOCAB = 1000
PH = 999  # the placeholder id (in vocabulary, like <｜deepseek_image｜>)
SMALL = VisionConfig(n_layers=1, max_n_token=64, min_pixels=112 * 112)  # images cost tens of tokens
REAL = VisionConfig(n_layers=1)  # DS4V defaults: 384 tokens, 147456 pixels
S = {t: VOCAB + int(t) for t in TokenType}  # sentinel ids


@dataclass
class Rendered:
    ids: list[int]
    images: list[dict] = field(default_factory=list)
    image_positions: list[int] = field(default_factory=list)


def _picture(w: int, h: int, seed: int = 0) -> Image.Image:
    img = Image.new("RGB", (w, h))
    img.putdata([((x * 7 + seed) % 256, (y * 5 + 3 * seed) % 256, (x + y) % 256) for y in range(h) for x in range(w)])
    return img


def _data_url(img: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


def _part(url: str, detail: str | None = None) -> dict:
    ref = {"url": url} if detail is None else {"url": url, "detail": detail}
    return {"type": "image_url", "image_url": ref}


def _rendered(ids: list[int], parts: list[dict]) -> Rendered:
    return Rendered(ids=list(ids), images=parts, image_positions=[i for i, t in enumerate(ids) if t == PH])


def _pipeline(cfg: VisionConfig = SMALL, **kw) -> ImagePipeline:
    return ImagePipeline(cfg, VOCAB, PH, **kw)


URL_A = _data_url(_picture(112, 112))  # 112² canvas -> 8x8 ViT -> 3x3 LLM grid -> 18 body tokens
URL_B = _data_url(_picture(300, 200, seed=1), "JPEG")  # 308x210 -> 15x22 ViT -> 5x8 LLM -> 58 body tokens


def _check_layout(prep: PreparedPrompt, source_ids: list[int]) -> None:
    """Text ids untouched and in order; every block in place, aligned and built from its own grid."""
    assert [t for t in prep.ids if t < VOCAB] == [t for t in source_ids if t != PH]
    spans = prep.blocks
    assert spans == sorted(spans)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    covered = set()
    for img in prep.images:
        block = img.block
        start, end = img.span.start, img.span.end
        assert prep.ids[start:end] == [VOCAB + int(t) for t in block.types]
        assert block == image_block(block.n_h, block.n_w, start)
        assert block.lead == 3 - start % 4
        assert prep.ids[block.visible_start] == S[TokenType.IMAGE_START] and block.visible_start % 4 == 3
        assert prep.ids[block.visible_end] == S[TokenType.IMAGE_END] and block.visible_end % 4 == 0
        assert img.patches.shape == (img.vit_h * img.vit_w, 3, 14, 14)
        covered.update(range(start, end))
    assert all((t >= VOCAB) == (i in covered) for i, t in enumerate(prep.ids))


# --- expansion -------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", [0, 1, 2, 3, 4, 5])
def test_lead_pads_follow_absolute_start(prefix):
    ids = list(range(1, prefix + 1)) + [PH, 7, 8]
    prep = _pipeline().prepare(_rendered(ids, [_part(URL_A)]))
    lead = 3 - prefix % 4
    assert prep.ids[:prefix] == ids[:prefix]
    assert prep.ids[prefix:prefix + lead] == [S[TokenType.IMAGE_PAD]] * lead
    assert prep.ids[prefix + lead] == S[TokenType.IMAGE_START]
    assert prep.ids[-2:] == [7, 8]
    assert len(prep.ids) == prefix + lead + 18 + 2
    assert prep.blocks == [(prefix, prefix + lead + 18)]
    _check_layout(prep, ids)


def test_hand_computed_block_at_position_zero():
    prep = _pipeline().prepare(_rendered([PH, 7], [_part(URL_A)]))
    P, St, I, N, E = (S[t] for t in (TokenType.IMAGE_PAD, TokenType.IMAGE_START, TokenType.IMAGE,
                                      TokenType.IMAGE_NEW_LINE, TokenType.IMAGE_END))
    # 3x3 grid: lead 3, START, pair 0 (3 columns x 2 rows + 2 NEWLINE), pair 1 (row 2 + parity pad row), END
    expected = [P, P, P, St, I, I, I, I, I, I, N, N, I, P, I, P, I, P, N, P, E, 7]
    assert prep.ids == expected
    assert prep.images[0].block.perm == (0, 3, 1, 4, 2, 5, 6, 7, 8)
    _check_layout(prep, [PH, 7])


def test_back_to_back_images_and_text_between():
    ids = [1, PH, PH, 2, 3, PH, 4]
    parts = [_part(URL_A), _part(URL_B), _part(URL_A)]
    prep = _pipeline().prepare(_rendered(ids, parts))
    _check_layout(prep, ids)
    (a0, a1), (b0, b1), (c0, c1) = prep.blocks
    assert a0 == 1 and b0 == a1 and c0 == b1 + 2  # the second block starts right after the first
    assert a1 % 4 == 1  # END at ≡ 0, so the next block starts at ≡ 1 and needs 2 lead pads
    assert prep.images[1].block.lead == 2
    assert [(i.block.n_h, i.block.n_w) for i in prep.images] == [(3, 3), (5, 8), (3, 3)]
    # the same image at another alignment keeps its content hash (the rows do not depend on position)
    assert prep.images[0].content_hash == prep.images[2].content_hash != prep.images[1].content_hash


def test_prompt_without_images_is_unchanged():
    prep = _pipeline().prepare(Rendered(ids=[1, 2, 3]))
    assert prep.ids == [1, 2, 3] and prep.images == [] and prep.blocks == []


@pytest.mark.parametrize("cfg,size,grid,body", [
    (SMALL, (112, 112), (3, 3), 18),
    (SMALL, (300, 200), (5, 8), 58),
    (SMALL, (40, 400), None, None),
    (REAL, (640, 480), (12, 16), 206),  # spec §2.4 table
])
def test_token_counts_match_plan_resize(cfg, size, grid, body):
    prep = _pipeline(cfg).prepare(_rendered([5, PH], [_part(_data_url(_picture(*size)))]))
    geom = plan_resize(*size, patch=cfg.patch_size, min_pixels=cfg.min_pixels, max_n_token=cfg.max_n_token,
                       max_wh_ratio=cfg.max_wh_ratio, downsample=cfg.downsample_ratio)
    img = prep.images[0]
    assert (img.block.n_h, img.block.n_w) == (geom.llm_h, geom.llm_w)
    assert (img.vit_h, img.vit_w) == (geom.vit_h, geom.vit_w)
    assert img.block.length == geom.block_length(1) <= cfg.max_n_token
    if grid is not None:
        assert (geom.llm_h, geom.llm_w) == grid and geom.body_tokens == body
    _check_layout(prep, [5, PH])


def test_patches_are_normalised_pixels():
    prep = _pipeline().prepare(_rendered([PH], [_part(_data_url(Image.new("RGB", (112, 112), (255, 0, 127))))]))
    patches = prep.images[0].patches
    assert patches.shape == (64, 3, 14, 14) and patches.dtype == torch.float32
    assert torch.allclose(patches[:, 0], torch.tensor(1.0)) and torch.allclose(patches[:, 1], torch.tensor(-1.0))


def test_detail_low_reduces_tokens():
    url = _data_url(_picture(1024, 1024))
    pipe = _pipeline(REAL)
    auto = pipe.prepare(_rendered([PH], [_part(url)])).images[0]
    low = pipe.prepare(_rendered([PH], [_part(url, "low")])).images[0]
    assert (auto.block.n_h, auto.block.n_w) == (18, 18) and auto.block.length == 3 + 346
    assert (low.block.n_h, low.block.n_w) == (13, 13) and low.block.length == 3 + 198
    assert low.content_hash != auto.content_hash


def test_unknown_detail_refused_before_fetching():
    with pytest.raises(ImageError, match=r"image 2: unknown detail 'ultra'"):
        _pipeline().prepare(_rendered([PH, PH], [_part(URL_A), _part("https://example.com/a.png", "ultra")]))


def test_content_hash_distinguishes_same_size_images():
    a = _pipeline().prepare(_rendered([PH], [_part(_data_url(_picture(112, 112, seed=0)))])).images[0]
    b = _pipeline().prepare(_rendered([PH], [_part(_data_url(_picture(112, 112, seed=9)))])).images[0]
    assert a.block.types == b.block.types and a.content_hash != b.content_hash
    assert len(a.content_hash) == 64


# --- refusals --------------------------------------------------------------------------------


def test_too_many_images():
    pipe = _pipeline(limits=ImageLimits(max_images=2))
    with pytest.raises(ImageError, match="3 images; at most 2"):
        pipe.prepare(_rendered([PH, PH, PH], [_part(URL_A)] * 3))


def test_too_many_bytes_in_request():
    size = len(base64.b64decode(URL_A.split(",", 1)[1]))
    pipe = _pipeline(limits=ImageLimits(max_total_bytes=int(size * 1.5)))
    pipe.prepare(_rendered([PH], [_part(URL_A)]))  # one fits
    with pytest.raises(ImageError, match="per-request limit"):
        pipe.prepare(_rendered([PH, PH], [_part(URL_A), _part(URL_A)]))


def test_image_over_per_image_byte_limit_is_named():
    pipe = _pipeline(limits=ImageLimits(max_bytes=100))
    with pytest.raises(ImageError, match=r"^image 1: .*limit"):
        pipe.prepare(_rendered([PH], [_part(URL_A)]))


def test_block_wider_than_prefill_pass_refused():
    pipe = _pipeline(max_block_tokens=30)
    pipe.prepare(_rendered([PH], [_part(URL_A)]))  # 3 + 18 = 21 tokens fit
    with pytest.raises(ImageError, match=r"image 2: .*too large for this server's prefill pass"):
        pipe.prepare(_rendered([PH, PH], [_part(URL_A), _part(URL_B)]))


@pytest.mark.parametrize("ids,n_parts", [([1, PH, PH], 1), ([1, PH], 2), ([1, 2], 1)])
def test_placeholder_count_mismatch_refused(ids, n_parts):
    with pytest.raises(ImageError, match="placeholders"):
        _pipeline().prepare(_rendered(ids, [_part(URL_A)] * n_parts))


def test_wrong_placeholder_positions_refused():
    with pytest.raises(ImageError, match="positions"):
        _pipeline().prepare(Rendered(ids=[1, PH, 2], images=[_part(URL_A)], image_positions=[2]))


def test_sentinel_ids_in_input_refused():
    with pytest.raises(ImageError, match="outside the vocabulary"):
        _pipeline().prepare(_rendered([S[TokenType.IMAGE_START], PH], [_part(URL_A)]))


@pytest.mark.parametrize("url,match", [
    ("https://example.com/cat.png", "remote image URLs are disabled"),
    ("file:///etc/passwd", "unsupported image URL scheme"),
    ("ftp://example.com/a.png", "unsupported image URL scheme"),
    ("data:image/png;base64,bm90IGFuIGltYWdl", "unsupported or unrecognised image format"),
])
def test_bad_sources_refused_with_image_number(url, match):
    with pytest.raises(ImageError, match=rf"image 2: .*{match}"):
        _pipeline().prepare(_rendered([PH, PH], [_part(URL_A), _part(url)]))


def test_part_without_url_refused():
    with pytest.raises(ImageError, match="image 1: has no image URL"):
        _pipeline().prepare(_rendered([PH], [{"type": "image_url", "image_url": {}}]))


def test_responses_style_part_accepted():
    prep = _pipeline().prepare(_rendered([PH], [{"type": "input_image", "image_url": URL_A, "detail": "high"}]))
    assert prep.images[0].block.n_h == 3


# --- construction and concurrency ------------------------------------------------------------


def test_for_engine_reads_core_and_tokenizer():
    class Settings:
        max_prefill_tokens = 256

    class Cfg:
        vision = SMALL
        vocab_size = VOCAB

    class Core:
        cfg, settings = Cfg, Settings

    class Tok:
        image_id = PH

    pipe = ImagePipeline.for_engine(Core, Tok, limits=ImageLimits(max_images=1))
    assert (pipe.vocab_size, pipe.image_token_id, pipe.max_block_tokens) == (VOCAB, PH, 256)
    assert pipe.limits.max_images == 1 and not pipe.fetch.enabled


def test_prepare_is_thread_safe():
    pipe = _pipeline()
    ids = [1, PH, 2, PH, PH, 3]
    parts = [_part(URL_B), _part(URL_A), _part(_data_url(_picture(150, 90, seed=4)), "low")]
    reference = pipe.prepare(_rendered(ids, parts))
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: pipe.prepare(_rendered(ids, parts)), range(16)))
    for prep in results:
        assert prep.ids == reference.ids and prep.blocks == reference.blocks
        for a, b in zip(prep.images, reference.images):
            assert a.content_hash == b.content_hash and a.block == b.block
            assert torch.equal(a.patches, b.patches)
    _check_layout(reference, ids)
