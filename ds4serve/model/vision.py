"""DS4V vision encoder: ViT tower + aligner (spec ds4-vision §1, §2.1, §2.2, §3.3).

The tower turns one image's ``[N, 3, p, p]`` patches (row-major tile order) into ``N`` features;
the aligner folds each ``r x r`` neighbourhood of features (channel-major) into one LLM embedding
row. The result replaces the IMAGE slots of the image block in the LM input (§3.3).

Like ``decoder.py``, modules here only *hold* weights (created with ``torch.empty``, later assigned
by the loader, possibly after being built on the meta device), so nothing is derived from weight
values in ``__init__`` and no buffer is registered: RoPE tables are rebuilt per forward on the input
device, which also keeps the forward free of host syncs and safe under CUDA-graph capture.

This file deliberately does not import ``decoder.py``: the decoder is expected to import it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig, VisionConfig
from .norms import rms_norm

__all__ = [
    "Aligner",
    "VisionEncoder",
    "VisionTower",
    "apply_rope_2d",
    "expected_vision_tensors",
    "fold_features",
    "grid_cos_sin",
    "llm_grid",
    "vision_inverse_frequencies",
]


# --------------------------------------------------------------------------------------------------
# weight holders
# --------------------------------------------------------------------------------------------------


def _param(*shape: int) -> nn.Parameter:
    """Uninitialised, frozen parameter: the loader assigns the real tensor (dtype/device) later."""
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class _Norm(nn.Module):
    """RMSNorm weight holder; the math is ``norms.rms_norm`` (fp32 statistics and weight)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = _param(dim)


class _Linear(nn.Module):
    """``weight [out, in]`` and optional ``bias [out]``; the vision tower mixes both kinds."""

    def __init__(self, d_in: int, d_out: int, bias: bool):
        super().__init__()
        self.weight = _param(d_out, d_in)
        if bias:
            self.bias = _param(d_out)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


# --------------------------------------------------------------------------------------------------
# 2-D RoPE (spec §2.1)
# --------------------------------------------------------------------------------------------------


def vision_inverse_frequencies(head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """``head_dim // 4`` fp32 inverse frequencies ``1 / theta**(arange(0, rope_dim, 2) / rope_dim)``.

    ``rope_dim = head_dim // 2`` angles per patch: the same frequencies are used once for the row
    index and once for the column index, so each axis gets ``head_dim // 4`` of them.
    """
    rope_dim = head_dim // 2
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim
    return 1.0 / (theta**exponents)


def grid_cos_sin(vit_h: int, vit_w: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)``, each ``[vit_h * vit_w, 2 * len(inv_freq)]``, in row-major patch order.

    Patch ``(i, j)`` gets angles ``[i*f_0 .. i*f_{k-1}, j*f_0 .. j*f_{k-1}]``. Built with ``arange``
    on ``inv_freq``'s device, so it needs no host data and no sync.
    """
    k = inv_freq.shape[0]
    rows = torch.arange(vit_h, dtype=torch.float32, device=inv_freq.device)
    cols = torch.arange(vit_w, dtype=torch.float32, device=inv_freq.device)
    row_angles = torch.outer(rows, inv_freq)[:, None, :].expand(vit_h, vit_w, k)
    col_angles = torch.outer(cols, inv_freq)[None, :, :].expand(vit_h, vit_w, k)
    angles = torch.cat((row_angles, col_angles), dim=-1).reshape(vit_h * vit_w, 2 * k)
    return angles.cos(), angles.sin()


def apply_rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the whole head, in fp32, cast back to ``x.dtype``.

    ``x`` is ``[N, heads, head_dim]``, ``cos``/``sin`` are ``[N, head_dim // 2]``. The head splits
    into halves ``x1``, ``x2`` (NeoX style, unlike the LM's interleaved pairs) and becomes
    ``[x1*cos - x2*sin, x2*cos + x1*sin]``: channel ``m`` and ``m + head_dim/2`` share angle ``m``.
    """
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


# --------------------------------------------------------------------------------------------------
# ViT
# --------------------------------------------------------------------------------------------------


class VisionAttention(nn.Module):
    """Full bidirectional MHA over one image's patches, fused ``wqkv`` (bias) and ``wo`` (bias)."""

    def __init__(self, vcfg: VisionConfig):
        super().__init__()
        self.n_heads = vcfg.n_heads
        self.head_dim = vcfg.dim // vcfg.n_heads
        self.wqkv = _Linear(vcfg.dim, 3 * vcfg.dim, bias=True)
        self.wo = _Linear(vcfg.dim, vcfg.dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [..., N, dim]``: leading axes are independent images of the same grid."""
        lead = x.shape[:-1]
        q, k, v = self.wqkv(x).view(*lead, 3, self.n_heads, self.head_dim).unbind(-3)
        q, k = apply_rope_2d(q, cos, sin), apply_rope_2d(k, cos, sin)
        # [..., N, H, D] -> [..., H, N, D]: heads act as a batch axis; no mask = bidirectional
        out = F.scaled_dot_product_attention(q.transpose(-2, -3), k.transpose(-2, -3), v.transpose(-2, -3),
                                             scale=self.head_dim**-0.5)
        return self.wo(out.transpose(-2, -3).reshape(*lead, -1))


class VisionMLP(nn.Module):
    """SwiGLU with fused ``w1`` (gate rows first, then up) and ``w2``; neither has a bias."""

    def __init__(self, vcfg: VisionConfig):
        super().__init__()
        self.w1 = _Linear(vcfg.dim, 2 * vcfg.inter_dim, bias=False)
        self.w2 = _Linear(vcfg.inter_dim, vcfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + ffn(norm(x))``."""

    def __init__(self, vcfg: VisionConfig):
        super().__init__()
        self.eps = vcfg.norm_eps
        self.attn_norm = _Norm(vcfg.dim)
        self.attn = VisionAttention(vcfg)
        self.ffn_norm = _Norm(vcfg.dim)
        self.ffn = VisionMLP(vcfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(rms_norm(x, self.attn_norm.weight, self.eps), cos, sin)
        return x + self.ffn(rms_norm(x, self.ffn_norm.weight, self.eps))


class VisionTower(nn.Module):
    """The DS4V ViT: linear patch embed, ``n_layers`` blocks with 2-D RoPE, final RMSNorm.

    No CLS token and no absolute position embedding: position enters only through RoPE, which is
    why the grid ``(vit_h, vit_w)`` must be passed alongside the patches.
    """

    def __init__(self, vcfg: VisionConfig):
        super().__init__()
        self.vcfg = vcfg
        p = vcfg.patch_size
        self.patch_embed = _Linear(3 * p * p, vcfg.dim, bias=True)
        self.blocks = nn.ModuleList(VisionBlock(vcfg) for _ in range(vcfg.n_layers))
        self.norm = _Norm(vcfg.dim)

    def forward(self, patches: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        """``patches [vit_h*vit_w, 3, p, p]`` of ONE image -> features ``[vit_h*vit_w, dim]``.

        Computes in the dtype of ``patch_embed.weight`` (norms and RoPE in fp32).
        """
        self._check_patches(patches, vit_h, vit_w)
        n = patches.shape[0]
        x = self.patch_embed(patches.reshape(n, -1).to(self.patch_embed.weight.dtype))  # (c, y, x) order
        head_dim = self.vcfg.dim // self.vcfg.n_heads
        inv_freq = vision_inverse_frequencies(head_dim, self.vcfg.rope_theta, device=x.device)
        cos, sin = grid_cos_sin(vit_h, vit_w, inv_freq)
        for block in self.blocks:
            x = block(x, cos, sin)
        return rms_norm(x, self.norm.weight, self.vcfg.norm_eps)

    def forward_same_grid(self, patches: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        """``patches [B, vit_h*vit_w, 3, p, p]`` of B images with one grid -> ``[B, N, dim]``.

        Images still attend only to themselves (the batch axis is outside attention); used by
        training, where every synthetic image has the same size."""
        b, n = patches.shape[:2]
        x = self.patch_embed(patches.reshape(b, n, -1).to(self.patch_embed.weight.dtype))
        head_dim = self.vcfg.dim // self.vcfg.n_heads
        cos, sin = grid_cos_sin(vit_h, vit_w, vision_inverse_frequencies(head_dim, self.vcfg.rope_theta, x.device))
        for block in self.blocks:
            x = block(x, cos, sin)
        return rms_norm(x, self.norm.weight, self.vcfg.norm_eps)

    def forward_batch(self, images: list[tuple[torch.Tensor, int, int]]) -> list[torch.Tensor]:
        """Encode several images; each attends only to itself, so they are run one by one.

        One image already fills the GPU (up to 3366 patches), so packing would buy little and a
        per-image loop makes cross-image attention impossible by construction.
        """
        return [self(patches, vit_h, vit_w) for patches, vit_h, vit_w in images]

    def _check_patches(self, patches: torch.Tensor, vit_h: int, vit_w: int) -> None:
        """Shape-only validation (no device data is read, so no sync)."""
        p = self.vcfg.patch_size
        if vit_h < 1 or vit_w < 1:
            raise ValueError(f"vision grid must be at least 1x1, got {vit_h}x{vit_w}")
        want = (vit_h * vit_w, 3, p, p)
        if tuple(patches.shape) != want:
            raise ValueError(f"patches for a {vit_h}x{vit_w} grid must have shape {want}, got {tuple(patches.shape)}")


# --------------------------------------------------------------------------------------------------
# aligner (spec §2.2)
# --------------------------------------------------------------------------------------------------


def llm_grid(vit_h: int, vit_w: int, ratio: int) -> tuple[int, int]:
    """LLM grid of an image: each side ceil-divided by the downsample ratio."""
    return -(-vit_h // ratio), -(-vit_w // ratio)


def fold_features(feats: torch.Tensor, vit_h: int, vit_w: int, ratio: int) -> torch.Tensor:
    """``[vit_h*vit_w, C]`` -> ``[llm_h*llm_w, C*ratio*ratio]`` (pixel-unshuffle of ViT features).

    The grid is zero-padded at the bottom/right up to multiples of ``ratio`` (padding is on
    features, not pixels), then each ``ratio x ratio`` cell becomes one row whose entries are
    ordered **channel-major**: index ``c*ratio*ratio + di*ratio + dj``. Rows are row-major.
    """
    c = feats.shape[-1]
    if feats.shape[0] != vit_h * vit_w:
        raise ValueError(f"features for a {vit_h}x{vit_w} grid must have {vit_h * vit_w} rows, got {feats.shape[0]}")
    grid = feats.reshape(vit_h, vit_w, c)
    pad_h, pad_w = (-vit_h) % ratio, (-vit_w) % ratio
    if pad_h or pad_w:
        grid = F.pad(grid, (0, 0, 0, pad_w, 0, pad_h))  # (C: none, W: right, H: bottom)
    lh, lw = llm_grid(vit_h, vit_w, ratio)
    cells = grid.reshape(lh, ratio, lw, ratio, c).permute(0, 2, 4, 1, 3)  # [lh, lw, c, di, dj]
    return cells.reshape(lh * lw, c * ratio * ratio)


class Aligner(nn.Module):
    """Projector from folded ViT features to LM embeddings: Linear -> exact GELU -> Linear."""

    def __init__(self, vcfg: VisionConfig, hidden_size: int):
        super().__init__()
        self.ratio = vcfg.downsample_ratio
        self.w1 = _Linear(vcfg.dim * self.ratio * self.ratio, hidden_size, bias=True)
        self.w2 = _Linear(hidden_size, hidden_size, bias=True)

    def forward(self, feats: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        """``[vit_h*vit_w, dim]`` -> ``[llm_h*llm_w, hidden]`` in row-major LLM-grid order."""
        x = fold_features(feats, vit_h, vit_w, self.ratio).to(self.w1.weight.dtype)
        return self.w2(F.gelu(self.w1(x), approximate="none"))


# --------------------------------------------------------------------------------------------------
# the whole encoder
# --------------------------------------------------------------------------------------------------


class VisionEncoder(nn.Module):
    """ViT + aligner under the checkpoint prefixes ``vision.*`` and ``aligner.*``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if not cfg.vision.enabled:
            raise ValueError("VisionEncoder needs a vision checkpoint (config vision_n_layers > 0)")
        self.cfg = cfg
        self.vision = VisionTower(cfg.vision)
        self.aligner = Aligner(cfg.vision, cfg.hidden_size)

    def encode(self, patches: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        """One image's patches -> its ``[llm_h*llm_w, hidden]`` IMAGE-slot embeddings (grid order)."""
        return self.aligner(self.vision(patches, vit_h, vit_w), vit_h, vit_w)

    def encode_same_grid(self, patches: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        """``[B, vit_h*vit_w, 3, p, p]`` -> ``[B, llm_h*llm_w, hidden]`` (training batches)."""
        feats = self.vision.forward_same_grid(patches, vit_h, vit_w)
        folded = torch.stack([fold_features(f, vit_h, vit_w, self.aligner.ratio) for f in feats])
        a = self.aligner
        return a.w2(F.gelu(a.w1(folded.to(a.w1.weight.dtype)), approximate="none"))

    def encode_batch(self, images: list[tuple[torch.Tensor, int, int]]) -> list[torch.Tensor]:
        """``encode`` for several independent images (no cross-image attention)."""
        return [self.encode(patches, vit_h, vit_w) for patches, vit_h, vit_w in images]


def expected_vision_tensors(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every vision tensor name with shape and (meta) dtype, built on meta: nothing is allocated.

    Empty for a text-only config, so callers can merge it unconditionally.
    """
    if not cfg.vision.enabled:
        return {}
    with torch.device("meta"):
        encoder = VisionEncoder(cfg)
    return {k: (tuple(v.shape), v.dtype) for k, v in encoder.state_dict().items()}
