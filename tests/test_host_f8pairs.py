"""FP8 projections on bf16-rounded rows (model/csrc/host_f8pairs.c, ``fp8_activations="bf16"``): the kernel
and its scalar reference against the definition, written here from its words in numpy (the codes' values
from the e4m3 formula, the rounding by distance: test_host_pairs' helpers), bit for bit; every row the
same bits alone or in a batch, on one thread or two; the start-up probe; the modes; and the forward's
FP8 projections wired to it. test_build_targets runs this file again for x86-64-v2 (plain C, libm's fused
fmaf) and znver3 (AVX2), where the plain C definition runs instead of the instructions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ds4serve.llm import LLM
from ds4serve.model import host_f8pairs
from ds4serve.model.stored import StoredWeight
from ds4serve.settings import FP8_ACTIVATION_MODES, ConfigError, EngineSettings
from model_helpers import random_ids
from test_host_pairs import _fma, _round_bf16, _same, _value, lib  # noqa: F401  (lib: the module fixture)
from test_stored_weights import flash_dir  # noqa: F401  (the module fixture: FP8 + bf16 head + MXFP4)


def _e4m3(codes: np.ndarray) -> np.ndarray:
    """Code -> value from the format's definition: sign, 4 exponent bits (bias 7), 3 mantissa bits;
    exponent 0 is subnormal (m / 8 * 2^-6)."""
    c = codes.astype(np.int64)
    e, m = (c >> 3) & 15, c & 7
    mag = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7))
    return np.where(c & 0x80, -mag, mag).astype(np.float32)


def _oracle(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """The definition: rows rounded to bf16; per block of bk inputs a partial sum from +0 over the pairs
    (k + 1 first, then k, each a flushed fused multiply-add), then y = fma(partial, scale, y) from +0."""
    xb = _value(_round_bf16(x))
    w = _e4m3(codes)  # [N, K]
    M, K = xb.shape
    N = w.shape[0]
    bn, bk = block
    y = np.zeros((M, N), np.float32)
    col_scale = scales[np.arange(N) // bn]  # [N, K // bk]
    for k0 in range(0, K, bk):
        p = np.zeros((M, N), np.float32)
        for k in range(k0, min(K, k0 + bk), 2):
            p = _fma(xb[:, None, k + 1], w[None, :, k + 1], p)
            p = _fma(xb[:, None, k], w[None, :, k], p)
        s = col_scale[:, k0 // bk][None, :].astype(np.float64)
        y = (p.astype(np.float64) * s + y.astype(np.float64)).astype(np.float32)  # p s exact: s is 2^j
    return y


def _weight(N: int, K: int, block: tuple[int, int], seed: int) -> StoredWeight:
    """Random FP8 codes (every code but the two NaNs, subnormals included) with power-of-two block scales."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (N, K), generator=g, dtype=torch.int64)
    codes[(codes & 0x7F) == 0x7F] = 0x3E
    codes[0, : min(K, 16)] = torch.tensor([0, 0x80, 1, 0x81, 7, 0x87, 8, 0x7E, 0xFE, 0x40, 2, 3, 4, 5, 6, 0x86])[: min(K, 16)]
    bn, bk = block
    scales = torch.pow(2.0, torch.randint(-12, -2, (-(-N // bn), -(-K // bk)), generator=g).float())
    return StoredWeight("fp8", codes.to(torch.uint8), scales, block, name=f"w{seed}")


def _rows(M: int, K: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    edge = torch.tensor([1e-39, -1e-39, -0.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, float.fromhex("0x1.ffffp0"), 3e-3, 1e-30])
    x[0, : min(K, 8)] = edge[: min(K, 8)]
    return x


@pytest.mark.parametrize("M,N,K,block", [(1, 64, 256, (128, 128)), (3, 96, 200, (32, 64)), (8, 32, 128, (32, 128)),
                                         (9, 160, 384, (32, 128)), (17, 64, 130, (64, 128)), (50, 128, 512, (128, 128))])
def test_kernel_and_reference_equal_the_definition(lib, M, N, K, block):
    w = _weight(N, K, block, seed=M * 100 + K)
    x = _rows(M, K, seed=M + K)
    want = _oracle(x.numpy(), w.data.numpy(), w.scales.numpy(), block)
    assert _same(host_f8pairs.reference(lib, x, w).numpy(), want)
    for threads in (1, 2):
        assert _same(host_f8pairs.product(lib, x, w, threads).numpy(), want), threads


def test_a_row_has_the_same_bits_alone_or_in_any_batch(lib):
    w = _weight(256, 1024, (128, 128), seed=5)
    x = _rows(45, 1024, seed=6)
    batch = host_f8pairs.product(lib, x, w, threads=2)
    for rows in (slice(0, 1), slice(3, 5), slice(7, 15), slice(0, 41), slice(2, 45)):
        part = host_f8pairs.product(lib, x[rows], w, threads=1)
        assert torch.equal(part.view(torch.int32), batch[rows].view(torch.int32)), rows


def test_close_to_the_fp32_product_but_not_it(lib):
    """bf16 rows move each input by up to 2^-9 of itself: near the exact product, and (a check that the
    rounding happens at all) not equal to it."""
    w = _weight(128, 512, (128, 128), seed=7)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(8))
    got = host_f8pairs.product(lib, x, w)
    exact = x.double() @ w.dense().double().t()
    scale = exact.abs().max()
    assert float((got.double() - exact).abs().max() / scale) < 1e-2
    assert not torch.equal(got, exact.float())


def test_shapes_it_does_not_take(lib):
    odd = _weight(64, 130, (128, 65), seed=9)  # odd input blocks
    assert "even" in host_f8pairs.takes(odd)
    narrow = _weight(48, 128, (16, 128), seed=10)
    assert "multiples of 32" in host_f8pairs.takes(narrow)
    with pytest.raises(ValueError, match="does not take"):
        host_f8pairs.product(lib, torch.randn(1, 128), narrow)


def test_the_start_up_probe_passes_here_and_catches_a_difference(lib, monkeypatch):
    w = _weight(256, 512, (128, 128), seed=11)
    assert host_f8pairs.f8p_disagrees(lib, w) is None
    real = host_f8pairs.reference
    monkeypatch.setattr(host_f8pairs, "reference", lambda *a, **k: real(*a, **k) * (1 + 2 ** -20))
    assert "differs from its definition" in host_f8pairs.f8p_disagrees(lib, w)


def test_the_modes_and_their_checks(lib, flash_dir):  # noqa: F811
    assert FP8_ACTIVATION_MODES == host_f8pairs.FP8_ACTIVATIONS
    with pytest.raises(ConfigError, match="fp8_activations"):
        EngineSettings(fp8_activations="int8")
    with pytest.raises(ValueError, match="fp8_activations"):
        host_f8pairs.choose_fp8_activations(torch.nn.Linear(2, 2), "bf16x", lib)
    assert host_f8pairs.choose_fp8_activations(torch.nn.Linear(2, 2), "bf16", lib) == "fp32"  # no FP8 weights
    model = LLM(flash_dir, max_seqs=2, packed_experts=True, stored_weights=True, host_kernels="on").model
    assert host_f8pairs.fp8_weights(model)
    assert host_f8pairs.choose_fp8_activations(model, "fp32", lib) == "fp32"
    assert host_f8pairs.choose_fp8_activations(model, "bf16", lib) == "bf16"
    assert host_f8pairs.choose_fp8_activations(model, "auto", lib) == ("bf16" if lib.ds4_f8p_native() else "fp32")


def test_the_forward_projections_multiply_bf16_pairs(flash_dir):  # noqa: F811
    """``fp8_activations="bf16"``: the native forward's FP8 projections take the pair kernel (their
    descriptors, the start-up probe); its logprobs stay near the exact fp32 forward's and off them; a
    request's tokens and logprobs are the same alone or in a batch."""
    kw = dict(max_seqs=4, packed_experts=True, stored_weights=True, host_kernels="on", head_activations="fp32",
              moe_activations="fp32")
    pairs = LLM(flash_dir, fp8_activations="bf16", **kw)
    exact = LLM(flash_dir, fp8_activations="fp32", **kw)
    host, plain = pairs.core.executor.host, exact.core.executor.host
    assert host.fp8_activations == "bf16" and host.fp8_pairs and not host.fp8_kept
    assert host.f8p_disagrees() is None
    assert plain.fp8_activations == "fp32" and not plain.fp8_pairs and plain.f8p_disagrees() is None
    layer, plain_layer = host._layers[0], plain._layers[0]
    assert (layer.q_b.fmt, plain_layer.q_b.fmt) == (host_f8pairs.FMT_F8_PAIRS, 1)
    prompts = [random_ids(n, 1000, seed=70 + n) for n in (9, 33, 50)]
    got = pairs.generate_with_logprobs(prompts, max_tokens=6, ignore_eos=True, logprobs=2)
    solo = [pairs.generate_with_logprobs([p], max_tokens=6, ignore_eos=True, logprobs=2)[0] for p in prompts]
    assert got == solo
    # the first token's top logprobs (both forwards saw the same prompt), token by token: not the same, and
    # near (the random test model amplifies the 2^-9 input roundings: up to 0.10 on the x86-64-v2 build's
    # fp32 side, which has no FMA; a wrong layout moves them by the logprobs' whole spread)
    diffs = []
    for p in prompts:
        top = dict(pairs.generate_with_logprobs([p], max_tokens=1, logprobs=5)[0][1][0][1])
        ref = dict(exact.generate_with_logprobs([p], max_tokens=1, logprobs=5)[0][1][0][1])
        diffs += [abs(top[t] - ref[t]) for t in top.keys() & ref.keys()]
    assert len(diffs) >= 3 and 0 < max(diffs) < 0.25
