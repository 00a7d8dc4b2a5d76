"""DS4V vision tower + aligner (spec ds4-vision §1, §2.1, §2.2) against independent references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ds4serve.config import ModelConfig
from ds4serve.model.vision import (
    Aligner,
    VisionEncoder,
    VisionTower,
    apply_rope_2d,
    expected_vision_tensors,
    fold_features,
    grid_cos_sin,
    vision_inverse_frequencies,
)

TINY_TEXT = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "o_groups": 2, "head_dim": 64,
             "vocab_size": 300, "layer_types": ["sliding_attention"], "mlp_layer_types": ["moe"]}
TINY_VISION = {"vision_n_layers": 2, "vision_dim": 32, "vision_n_heads": 2, "vision_inter_dim": 48,
               "vision_patch_size": 14}


def tiny_cfg(**over) -> ModelConfig:
    return ModelConfig.from_dict({**TINY_TEXT, **TINY_VISION, **over})


def init_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Seeded weights (``__init__`` leaves them empty): fan-in scaled matrices, norms near 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))
    return module


def rand_patches(vit_h: int, vit_w: int, p: int = 14, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(vit_h * vit_w, 3, p, p, generator=gen) * 2 - 1


@pytest.fixture(scope="module")
def encoder() -> VisionEncoder:
    return init_(VisionEncoder(tiny_cfg())).eval()


# ---- independent references ----------------------------------------------------------------------


def ref_rope(x: torch.Tensor, vit_w: int, theta: float) -> torch.Tensor:
    """Per-element 2-D RoPE of ``x [N, H, D]`` in float64, written straight from spec §2.1."""
    n, heads, d = x.shape
    half, k = d // 2, d // 4
    freqs = [1.0 / theta ** (2 * t / half) for t in range(k)]
    out = torch.empty(n, heads, d, dtype=torch.float64)
    for idx in range(n):
        i, j = divmod(idx, vit_w)
        for m in range(half):
            angle = (i if m < k else j) * freqs[m % k]
            c, s = math.cos(angle), math.sin(angle)
            for h in range(heads):
                x1, x2 = float(x[idx, h, m]), float(x[idx, h, m + half])
                out[idx, h, m] = x1 * c - x2 * s
                out[idx, h, m + half] = x2 * c + x1 * s
    return out


def ref_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def ref_tower(tower: VisionTower, patches: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
    """Float64 ViT with explicit softmax attention and loop RoPE."""
    v = tower.vcfg
    sd = {k: t.double() for k, t in tower.state_dict().items()}
    heads, hd = v.n_heads, v.dim // v.n_heads
    n = vit_h * vit_w
    x = patches.double().reshape(n, -1) @ sd["patch_embed.weight"].T + sd["patch_embed.bias"]
    for b in range(v.n_layers):
        pre = f"blocks.{b}."
        h = ref_rms(x, sd[pre + "attn_norm.weight"], v.norm_eps)
        qkv = h @ sd[pre + "attn.wqkv.weight"].T + sd[pre + "attn.wqkv.bias"]
        q, k, val = (qkv[:, i * v.dim:(i + 1) * v.dim].reshape(n, heads, hd) for i in range(3))
        q, k = ref_rope(q, vit_w, v.rope_theta), ref_rope(k, vit_w, v.rope_theta)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), val).reshape(n, v.dim)
        x = x + att @ sd[pre + "attn.wo.weight"].T + sd[pre + "attn.wo.bias"]
        h = ref_rms(x, sd[pre + "ffn_norm.weight"], v.norm_eps)
        gu = h @ sd[pre + "ffn.w1.weight"].T
        gate, up = gu[:, :v.inter_dim], gu[:, v.inter_dim:]
        x = x + (gate * torch.sigmoid(gate) * up) @ sd[pre + "ffn.w2.weight"].T
    return ref_rms(x, sd["norm.weight"], v.norm_eps)


def ref_fold(feats: torch.Tensor, vit_h: int, vit_w: int, r: int) -> torch.Tensor:
    """Explicit-loop channel-major fold with zero padding outside the ViT grid."""
    c = feats.shape[1]
    lh, lw = -(-vit_h // r), -(-vit_w // r)
    out = torch.zeros(lh * lw, c * r * r, dtype=feats.dtype)
    for a in range(lh):
        for b in range(lw):
            for ch in range(c):
                for di in range(r):
                    for dj in range(r):
                        y, x = a * r + di, b * r + dj
                        if y < vit_h and x < vit_w:
                            out[a * lw + b, ch * r * r + di * r + dj] = feats[y * vit_w + x, ch]
    return out


def erf_gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


# ---- parameter names and shapes ------------------------------------------------------------------


def _expected_vit_shapes(dim: int, inter: int, p: int, n_layers: int) -> dict[str, tuple[int, ...]]:
    out = {"patch_embed.weight": (dim, 3 * p * p), "patch_embed.bias": (dim,), "norm.weight": (dim,)}
    for i in range(n_layers):
        out.update({
            f"blocks.{i}.attn_norm.weight": (dim,), f"blocks.{i}.attn.wqkv.weight": (3 * dim, dim),
            f"blocks.{i}.attn.wqkv.bias": (3 * dim,), f"blocks.{i}.attn.wo.weight": (dim, dim),
            f"blocks.{i}.attn.wo.bias": (dim,), f"blocks.{i}.ffn_norm.weight": (dim,),
            f"blocks.{i}.ffn.w1.weight": (2 * inter, dim), f"blocks.{i}.ffn.w2.weight": (dim, inter),
        })
    return out


def test_tiny_parameter_names_and_shapes():
    cfg = tiny_cfg()
    tower = VisionTower(cfg.vision)
    got = {k: tuple(v.shape) for k, v in tower.state_dict().items()}
    assert got == _expected_vit_shapes(32, 48, 14, 2)
    assert len(got) == 8 * 2 + 3
    aligner = {k: tuple(v.shape) for k, v in Aligner(cfg.vision, 64).state_dict().items()}
    assert aligner == {"w1.weight": (64, 9 * 32), "w1.bias": (64,), "w2.weight": (64, 64), "w2.bias": (64,)}


def test_real_sizes_on_meta():
    cfg = ModelConfig.from_dict({"hidden_size": 4096, "vision_n_layers": 32, "vision_dim": 1024,
                                 "vision_n_heads": 16, "vision_inter_dim": 2816})
    tensors = expected_vision_tensors(cfg)
    vit = {k[len("vision."):]: shape for k, (shape, _) in tensors.items() if k.startswith("vision.")}
    aligner = {k: shape for k, (shape, _) in tensors.items() if k.startswith("aligner.")}
    assert len(vit) == 259 and vit == _expected_vit_shapes(1024, 2816, 14, 32)
    assert aligner == {"aligner.w1.weight": (4096, 9216), "aligner.w1.bias": (4096,),
                       "aligner.w2.weight": (4096, 4096), "aligner.w2.bias": (4096,)}
    assert len(tensors) == 263
    assert expected_vision_tensors(ModelConfig.from_dict(TINY_TEXT)) == {}


def test_forward_runs_on_meta_without_host_reads():
    """Any ``.item()``/``.tolist()``/data-dependent branch would fail on meta tensors."""
    with torch.device("meta"):
        enc = VisionEncoder(tiny_cfg())
        out = enc.encode(torch.empty(4 * 5, 3, 14, 14), 4, 5)
    assert out.shape == (4, 64) and out.device.type == "meta"


# ---- 2-D RoPE ------------------------------------------------------------------------------------


def test_rope_matches_loop_reference():
    vit_h, vit_w, heads, hd = 3, 4, 2, 16
    x = torch.randn(vit_h * vit_w, heads, hd, generator=torch.Generator().manual_seed(3))
    cos, sin = grid_cos_sin(vit_h, vit_w, vision_inverse_frequencies(hd, 100.0))
    assert cos.shape == (vit_h * vit_w, hd // 2)
    got = apply_rope_2d(x, cos, sin)
    torch.testing.assert_close(got.double(), ref_rope(x, vit_w, 100.0), rtol=1e-5, atol=1e-5)


def test_rope_dot_product_depends_only_on_offset():
    vit_h, vit_w, hd = 7, 7, 16
    cos, sin = grid_cos_sin(vit_h, vit_w, vision_inverse_frequencies(hd, 10000.0))
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 1, hd, generator=gen), torch.randn(1, 1, hd, generator=gen)

    def dot(pq: tuple[int, int], pk: tuple[int, int]) -> float:
        iq, ik = pq[0] * vit_w + pq[1], pk[0] * vit_w + pk[1]
        rq = apply_rope_2d(q, cos[iq:iq + 1], sin[iq:iq + 1])
        rk = apply_rope_2d(k, cos[ik:ik + 1], sin[ik:ik + 1])
        return float((rq * rk).sum())

    for di, dj in [(0, 0), (1, 2), (-2, 1), (2, -2)]:  # all positions stay inside the 7x7 grid
        base = dot((3, 3), (3 + di, 3 + dj))
        for si, sj in [(1, 0), (0, 1), (-1, -1), (1, -1)]:
            assert dot((3 + si, 3 + sj), (3 + di + si, 3 + dj + sj)) == pytest.approx(base, abs=1e-4)
    # and the offset matters on both axes (rows and columns really are rotated)
    assert dot((0, 0), (1, 0)) != pytest.approx(dot((0, 0), (0, 0)), abs=1e-3)
    assert dot((0, 0), (0, 1)) != pytest.approx(dot((0, 0), (0, 0)), abs=1e-3)
    assert dot((0, 0), (1, 0)) != pytest.approx(dot((0, 0), (0, 1)), abs=1e-3)


# ---- the tower -----------------------------------------------------------------------------------


@pytest.mark.parametrize("grid", [(3, 4), (1, 1), (2, 5)])
def test_tower_matches_float64_reference(encoder, grid):
    patches = rand_patches(*grid)
    got = encoder.vision(patches, *grid)
    assert got.shape == (grid[0] * grid[1], 32) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref_tower(encoder.vision, patches, *grid), rtol=1e-4, atol=1e-4)


def test_attention_is_bidirectional(encoder):
    patches = rand_patches(3, 3)
    changed = patches.clone()
    changed[-1] = -changed[-1]
    a, b = encoder.vision(patches, 3, 3), encoder.vision(changed, 3, 3)
    assert not torch.allclose(a[0], b[0], atol=1e-4)


def test_grid_shape_enters_through_rope(encoder):
    """The same 6 patches read as 2x3 or 3x2 are different images (positions differ)."""
    patches = rand_patches(2, 3)
    assert not torch.allclose(encoder.vision(patches, 2, 3), encoder.vision(patches, 3, 2), atol=1e-4)


def test_forward_batch_has_no_cross_image_attention(encoder):
    a, b = rand_patches(3, 4, seed=5), rand_patches(2, 5, seed=6)
    alone_a, alone_b = encoder.vision(a, 3, 4), encoder.vision(b, 2, 5)
    got_a, got_b = encoder.vision.forward_batch([(a, 3, 4), (b, 2, 5)])
    torch.testing.assert_close(got_a, alone_a, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_b, alone_b, rtol=1e-6, atol=1e-6)
    enc_a, enc_b = encoder.encode_batch([(a, 3, 4), (b, 2, 5)])
    torch.testing.assert_close(enc_a, encoder.encode(a, 3, 4), rtol=1e-6, atol=1e-6)
    assert enc_b.shape == (2, 64)


def test_bad_patch_shapes_are_rejected(encoder):
    with pytest.raises(ValueError, match="3x4"):
        encoder.vision(rand_patches(2, 5), 3, 4)
    with pytest.raises(ValueError, match="shape"):
        encoder.vision(torch.zeros(4, 3, 16, 16), 2, 2)


# ---- aligner -------------------------------------------------------------------------------------


@pytest.mark.parametrize("grid", [(3, 3), (4, 5), (6, 6), (1, 1), (7, 2)])
def test_fold_is_channel_major_with_zero_padding(grid):
    vit_h, vit_w = grid
    feats = torch.randn(vit_h * vit_w, 5, generator=torch.Generator().manual_seed(7))
    got = fold_features(feats, vit_h, vit_w, 3)
    assert torch.equal(got, ref_fold(feats, vit_h, vit_w, 3))


def test_fold_pads_features_with_zeros():
    """vit 4x5 -> llm 2x2: the padded row 4..5 / column 5 of the feature grid are exact zeros."""
    feats = torch.randn(4 * 5, 2, generator=torch.Generator().manual_seed(8)) + 10.0  # never zero
    got = fold_features(feats, 4, 5, 3).view(2, 2, 2, 3, 3)  # [lh, lw, c, di, dj]
    assert got.shape[:2] == (2, 2)
    assert torch.all(got[1, :, :, 1:, :] == 0)  # vit rows 4, 5
    assert torch.all(got[:, 1, :, :, 2] == 0)  # vit column 5
    assert torch.all(got[0, 0] != 0) and torch.all(got[1, 1, :, 0, :2] != 0)
    assert got[1, 1, 1, 0, 1] == feats[3 * 5 + 4, 1]  # llm (1,1), c=1, di=0, dj=1 -> vit (3, 4)


def test_aligner_matches_reference_with_exact_gelu():
    cfg = tiny_cfg()
    aligner = init_(Aligner(cfg.vision, 64), seed=9)
    with torch.no_grad():  # w2 = identity exposes GELU's output itself
        aligner.w2.weight.copy_(torch.eye(64))
        aligner.w2.bias.zero_()
    feats = torch.randn(4 * 5, 32, generator=torch.Generator().manual_seed(10))
    got = aligner(feats, 4, 5)
    sd = {k: v.double() for k, v in aligner.state_dict().items()}
    pre = ref_fold(feats, 4, 5, 3).double() @ sd["w1.weight"].T + sd["w1.bias"]
    want = erf_gelu(pre) @ sd["w2.weight"].T + sd["w2.bias"]
    assert got.shape == (4, 64)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    tanh = F.gelu(pre, approximate="tanh") @ sd["w2.weight"].T + sd["w2.bias"]
    assert (tanh - want).abs().max() > 1e-4  # 100x the tolerance: the test tells the two GELUs apart


def test_aligner_generalises_downsample_ratio():
    cfg = tiny_cfg(vision_downsample_ratio=2)
    enc = init_(VisionEncoder(cfg), seed=11)
    assert enc.aligner.w1.weight.shape == (64, 4 * 32)
    feats = torch.randn(3 * 5, 32, generator=torch.Generator().manual_seed(12))
    assert torch.equal(fold_features(feats, 3, 5, 2), ref_fold(feats, 3, 5, 2))
    assert enc.encode(rand_patches(3, 5), 3, 5).shape == (2 * 3, 64)


# ---- the whole encoder ---------------------------------------------------------------------------


@pytest.mark.parametrize("grid,llm", [((1, 1), (1, 1)), ((3, 3), (1, 1)), ((4, 5), (2, 2)), ((7, 2), (3, 1)),
                                      ((10, 12), (4, 4))])
def test_encode_shapes(encoder, grid, llm):
    out = encoder.encode(rand_patches(*grid), *grid)
    assert out.shape == (llm[0] * llm[1], 64) and torch.isfinite(out).all()


def test_encode_is_aligner_of_tower(encoder):
    patches = rand_patches(4, 5)
    want = encoder.aligner(encoder.vision(patches, 4, 5), 4, 5)
    torch.testing.assert_close(encoder.encode(patches, 4, 5), want, rtol=0, atol=0)


def test_bf16_stays_close_to_fp32(encoder):
    """bf16 weights (norm weights kept fp32, as the loader does) and bf16 patches, like serving."""
    enc16 = init_(VisionEncoder(tiny_cfg()))
    enc16.load_state_dict(encoder.state_dict())
    with torch.no_grad():
        for name, p in enc16.named_parameters():
            if not name.endswith("norm.weight"):
                p.data = p.data.to(torch.bfloat16)
    patches = rand_patches(5, 7, seed=13)
    ref = encoder.encode(patches, 5, 7)
    got = enc16.encode(patches.to(torch.bfloat16), 5, 7)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    cos = F.cosine_similarity(got.float().flatten(), ref.flatten(), dim=0)
    assert cos > 0.999
    assert (got.float() - ref).abs().max() < 0.05 * ref.abs().max()
