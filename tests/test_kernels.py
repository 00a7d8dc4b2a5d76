"""The model's fused building blocks against their written-out forms (fp32, seeded).

Decode on CPU is dispatch-bound, so several blocks use fewer, fused ops than the reference's
formulas (``F.rms_norm``, a complex multiply for RoPE, ``baddbmm`` normalisers in Sinkhorn, batched
matvecs for the mHC collapse, weights folded into the dense experts). These tests pin each one to
the formula the spec writes, so a faster form can never quietly change the arithmetic.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4serve.model.mhc import hc_head, hc_post, hc_pre, sinkhorn
from ds4serve.model.moe import _dense_experts, _grouped_experts
from ds4serve.model.norms import rms_norm, rms_norm_unweighted
from ds4serve.model.rope import apply_rope, rotations


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ref_rms(x, weight, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf if weight is None else (weight.float() * xf).to(x.dtype)


def test_rms_norms_match_the_formula():
    g = _gen(0)
    x, w = torch.randn(7, 96, generator=g) * 3, torch.randn(96, generator=g)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), _ref_rms(x, w, 1e-6), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rms_norm_unweighted(x, 1e-6), _ref_rms(x, None, 1e-6), rtol=1e-6, atol=1e-6)
    xb = x.bfloat16()
    assert rms_norm(xb, w, 1e-6).dtype == torch.bfloat16
    torch.testing.assert_close(rms_norm(xb, w, 1e-6), _ref_rms(xb, w, 1e-6), rtol=0, atol=0)


def _ref_rope(x, positions, inv_freq, factor=1.0, inverse=False):
    freqs = positions.float().unsqueeze(-1) * inv_freq
    c, s = freqs.cos() * factor, freqs.sin() * factor
    if inverse:
        s = -s
    half = c.shape[-1]
    shape = (c.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = c.reshape(shape), s.reshape(shape)
    rot = x[..., -2 * half:].float().reshape(*x.shape[:-1], half, 2)
    x0, x1 = rot[..., 0], rot[..., 1]
    out = torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).reshape(*x.shape[:-1], 2 * half)
    return torch.cat((x[..., :-2 * half], out.to(x.dtype)), dim=-1)


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("factor", [1.0, 0.7])
def test_complex_rope_matches_the_pairwise_rotation(inverse, factor):
    g = _gen(1)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    positions = torch.randint(0, 5000, (9,), generator=g)
    rot = rotations(positions, inv_freq, factor)
    for x in (torch.randn(9, 4, 64, generator=g), torch.randn(9, 64, generator=g),
              torch.randn(9, 3, 80, generator=g)[..., 5:69]):  # a strided, oddly offset view
        got = apply_rope(x, rot, inverse=inverse)
        torch.testing.assert_close(got, _ref_rope(x, positions, inv_freq, factor, inverse), rtol=1e-6, atol=1e-6)
    back = apply_rope(apply_rope(x, rot), rotations(positions, inv_freq), inverse=True)
    if factor == 1.0:
        torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)


def _ref_sinkhorn(comb, iters, eps):
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


@settings(max_examples=40, deadline=None, derandomize=True)
@given(n=st.integers(1, 20), hc=st.integers(1, 6), iters=st.integers(1, 25), seed=st.integers(0, 2**16))
def test_sinkhorn_matches_the_sum_form(n, hc, iters, seed):
    comb = torch.softmax(torch.randn(n, hc, hc, generator=_gen(seed)) * 4, dim=-1) + 1e-6
    got = sinkhorn(comb, iters, 1e-6)
    torch.testing.assert_close(got, _ref_sinkhorn(comb, iters, 1e-6), rtol=1e-6, atol=1e-7)
    # the last pass normalises columns: each sums to s / (s + eps) <= 1
    assert torch.isfinite(got).all() and (got.sum(-2) <= 1 + 1e-5).all()


def _ref_hc_pre(streams, fn, base, scale, iters, hc_eps, rms_eps):
    n, hc, _ = streams.shape
    flat = _ref_rms(streams.reshape(n, -1), None, rms_eps)
    pre_w, post_w, comb_w = F.linear(flat, fn.float()).split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    s = scale.float()
    pre = torch.sigmoid(pre_w * s[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * s[1] + post_b)
    comb = torch.softmax(comb_w.view(n, hc, hc) * s[2] + comb_b.view(hc, hc), dim=-1) + hc_eps
    comb = _ref_sinkhorn(comb, iters, hc_eps)
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype), post, comb


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hyper_connections_match_the_formulas(dtype):
    g = _gen(2)
    n, hc, d = 6, 4, 32
    streams = torch.randn(n, hc, d, generator=g).to(dtype)
    fn, base, scale = torch.randn((2 + hc) * hc, hc * d, generator=g) * 0.1, torch.randn((2 + hc) * hc, generator=g), \
        torch.rand(3, generator=g) + 0.5
    got = hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
    ref = _ref_hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    _, post, comb = ref
    y = torch.randn(n, d, generator=g).to(dtype)
    want = post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    torch.testing.assert_close(hc_post(y, streams, post, comb), want, rtol=tol, atol=tol)
    fn_h, base_h = torch.randn(hc, hc * d, generator=g) * 0.1, torch.randn(hc, generator=g)
    pre = torch.sigmoid(F.linear(_ref_rms(streams.reshape(n, -1), None, 1e-6), fn_h) * scale[:1] + base_h) + 1e-6
    want = (pre.unsqueeze(-1) * streams).sum(dim=1).to(dtype)
    torch.testing.assert_close(hc_head(streams, fn_h, base_h, scale[:1], 1e-6, 1e-6), want, rtol=tol, atol=tol)


def test_dense_experts_fold_weights_like_the_grouped_path():
    g = _gen(3)
    n_tok, n_exp, inter, d = 11, 8, 24, 40
    x = torch.randn(n_tok, d, generator=g)
    gate_up, down = torch.randn(n_exp, 2 * inter, d, generator=g) * 0.2, torch.randn(n_exp, d, inter, generator=g) * 0.2
    idx = torch.stack([torch.randperm(n_exp, generator=g)[:2] for _ in range(n_tok)])
    w = torch.rand(n_tok, 2, generator=g)
    want = torch.zeros(n_tok, d)
    for t in range(n_tok):  # the definition: sum over the selected experts, one token at a time
        for k in range(2):
            gt, up = F.linear(x[t], gate_up[idx[t, k]]).chunk(2)
            act = F.silu(gt.clamp(max=10.0)) * up.clamp(-10.0, 10.0)
            want[t] += w[t, k] * F.linear(act, down[idx[t, k]])
    torch.testing.assert_close(_dense_experts(x, idx, w, gate_up, down, 10.0), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_grouped_experts(x, idx, w, gate_up, down, 10.0), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_tok, inter, d, dense", [
    (1, 128, 256, False),  # one token routes to 2 of 8 experts: dense would read 4x the weights it uses
    (8, 128, 256, True),  # Appendix A's experts (3 MiB), a batch whose routes can touch all 8: one GEMM
    (8, 256, 512, False),  # Flash-shaped experts (12.6 MiB): grouped at every batch size
    (64, 128, 256, False),  # past the FLOP limit
])
def test_experts_run_densely_only_where_that_wins(monkeypatch, n_tok, inter, d, dense):
    import ds4serve.model.moe as moe

    taken = []
    monkeypatch.setattr(moe, "_dense_experts", lambda *a: taken.append("dense") or a[0])
    monkeypatch.setattr(moe, "_grouped_experts", lambda *a: taken.append("grouped") or a[0])
    g = _gen(4)
    x = torch.randn(n_tok, d, generator=g)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(n_tok)])
    with torch.no_grad():
        moe.run_experts(x, idx, torch.rand(n_tok, 2), torch.zeros(8, 2 * inter, d), torch.zeros(8, d, inter), 10.0)
    assert taken == ["dense" if dense else "grouped"]
