"""The native host kernels compute exactly what their torch forms compute, and fall back cleanly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4serve import native_build
from ds4serve.model import mhc, native, rope


def _torch_form(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    native.enabled = False
    try:
        return mhc.sinkhorn(comb, iters, eps)
    finally:
        native.enabled = True


@pytest.fixture(autouse=True)
def _built():
    if native.library() is None:
        pytest.skip(f"no native kernels here: {native._library.failure}")


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300), hc=st.integers(1, 4), iters=st.integers(1, 25), seed=st.integers(0, 2**31 - 1),
       eps=st.sampled_from([1e-6, 1e-3, 0.0]), sharp=st.floats(0.1, 8.0))
def test_sinkhorn_is_bit_equal_to_the_torch_form(n, hc, iters, seed, eps, sharp):
    gen = torch.Generator().manual_seed(seed)
    comb = torch.softmax(torch.randn(n, hc, hc, generator=gen) * sharp, dim=-1) + max(eps, 1e-6)
    got = native.sinkhorn_native(comb, iters, eps)
    assert got is not None and got.data_ptr() != comb.data_ptr()
    assert torch.equal(got, _torch_form(comb, iters, eps))


def test_sinkhorn_leaves_its_input_alone_and_takes_strided_inputs():
    comb = torch.softmax(torch.randn(8, 4, 4, generator=torch.Generator().manual_seed(0)), -1) + 1e-6
    before = comb.clone()
    strided = comb.transpose(1, 2)  # not contiguous
    assert torch.equal(native.sinkhorn_native(strided, 20, 1e-6), _torch_form(strided, 20, 1e-6))
    assert torch.equal(comb, before)


def test_kernels_are_skipped_where_they_do_not_apply():
    comb = torch.rand(3, 4, 4, dtype=torch.float64) + 0.1
    assert native.sinkhorn_native(comb, 5, 1e-6) is None  # fp64: the torch form
    grad = (torch.rand(3, 4, 4) + 0.1).requires_grad_()
    assert native.sinkhorn_native(grad, 5, 1e-6) is None  # training needs autograd
    assert mhc.sinkhorn(grad, 5, 1e-6).requires_grad


def test_no_compiler_means_the_torch_form_logged_once(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(native, "_library", native._library.fresh())
    monkeypatch.setattr(native_build.shutil, "which", lambda name: None)
    monkeypatch.setattr(native, "cache_root", lambda: tmp_path)
    comb = torch.rand(2, 4, 4) + 0.1
    with caplog.at_level("WARNING", logger="ds4serve.model.native"):
        assert native.sinkhorn_native(comb, 5, 1e-6) is None
        assert native.sinkhorn_native(comb, 5, 1e-6) is None
        assert torch.equal(mhc.sinkhorn(comb, 5, 1e-6), _torch_form(comb, 5, 1e-6))
    warnings = [r for r in caplog.records if "native host kernels unavailable" in r.message]
    assert len(warnings) == 1 and "no C compiler" in warnings[0].message


def _torch_rope(x, rot, inverse):
    native.enabled = False
    try:
        return rope.apply_rope(x, rot, inverse)
    finally:
        native.enabled = True


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 64), heads=st.sampled_from([(), (1,), (3,), (2, 2)]), half=st.sampled_from([1, 8, 32]),
       extra=st.integers(0, 40), inverse=st.booleans(), seed=st.integers(0, 2**31 - 1), strided=st.booleans())
def test_rope_matches_the_torch_form(n, heads, half, extra, inverse, seed, strided):
    """Bit-equal on the machines measured (torch's complex multiply is ``a c - b s, a s + b c`` without
    fused multiply-adds there); held to float32 rounding everywhere."""
    gen = torch.Generator().manual_seed(seed)
    dim = 2 * half + extra
    x = torch.randn(n, *heads, dim + (3 if strided else 0), generator=gen)[..., :dim]
    pos = torch.randint(0, 1 << 20, (n,), generator=gen)
    rot = rope.rotations(pos, 1.0 / (10000 ** (torch.arange(0, 2 * half, 2).float() / (2 * half))), 1.25)
    got = native.rope_native(x, rot, inverse)
    assert got is not None and got.shape == x.shape
    torch.testing.assert_close(got, _torch_rope(x, rot, inverse), rtol=1e-6, atol=1e-6)
    assert torch.equal(got[..., :extra], x[..., :extra])  # channels before the rotary part are untouched


def test_rope_falls_back_where_the_table_does_not_match():
    x = torch.randn(4, 2, 16)
    rot = rope.rotations(torch.arange(1), torch.ones(4))  # one row of rotations for four tokens: broadcast
    assert native.rope_native(x, rot, False) is None
    assert native.rope_native(x.double(), rope.rotations(torch.arange(4), torch.ones(4)), False) is None


@settings(max_examples=40, deadline=None)
@given(lead=st.integers(1, 3), rows=st.integers(1, 40), blocks=st.integers(1, 6), block=st.sampled_from([2, 16, 32]),
       seed=st.integers(0, 2**31 - 1), extreme=st.booleans())
def test_mxfp4_dequantisation_is_bit_equal_to_the_torch_form(lead, rows, blocks, block, seed, extreme):
    from ds4serve.model.quant import dequant_mxfp4

    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (lead, rows, blocks * block // 2), generator=gen, dtype=torch.uint8)
    lo, hi = (0, 256) if extreme else (100, 150)  # 0 and 255: 2^-127 (subnormal) and 2^128 (inf)
    scales = torch.randint(lo, hi, (lead, rows, blocks), generator=gen, dtype=torch.uint8)
    fast = native.mxfp4_native(codes, scales)
    native.enabled = False
    try:
        slow = dequant_mxfp4(codes, scales)
    finally:
        native.enabled = True
    assert fast is not None and fast.shape == slow.shape
    assert torch.equal(fast.view(torch.int32), slow.view(torch.int32))  # bits, so -0.0 and inf count too
    assert torch.equal(dequant_mxfp4(codes, scales).view(torch.int32), slow.view(torch.int32))


def test_mxfp4_native_declines_what_it_does_not_handle():
    codes = torch.zeros(2, 4, dtype=torch.uint8)
    assert native.mxfp4_native(codes, torch.ones(2, 1)) is None  # float scales: the torch form
    assert native.mxfp4_native(codes, torch.zeros(2, 3, dtype=torch.uint8)) is None  # 8 inputs, 3 blocks
    assert native.mxfp4_native(codes.view(torch.int8), torch.zeros(2, 1, dtype=torch.uint8)) is None
