"""Packed MXFP4 experts on int8 activations (model/csrc/host_q8.c): the kernel against its definition,
written here in plain loops from the MXFP4 format (not from the C), bit for bit; every row the same bits
alone or in a batch, on one thread or two; the interleaved layout and its inverse; and the forward with
``moe_activations="int8"`` close to the exact products and batch-invariant. test_build_targets runs this
file again for x86-64-v2 (plain C, no FMA) and znver3 (AVX2)."""

from __future__ import annotations

import ctypes
from fractions import Fraction

import numpy as np
import pytest
import torch

from ds4serve.llm import LLM
from ds4serve.model import host_forward, host_q8, moe
from ds4serve.model.packed import PackedExperts, deinterleave_q8, interleave_q8, quantize_rows_q8
from ds4serve.settings import MOE_ACTIVATION_MODES
from model_helpers import random_ids
from test_host_packed import compile_harness
from test_packed_experts import _checkpoint

_HARNESS = r"""
#include "host.h"
#include "host_pool.c"
#include "host_packed.c"
#include "host_q8.c"
int has_fma(void) { return DS4_FMA; }
void run_q8(const uint8_t *codes, const uint8_t *scales, int64_t N, int64_t K, const float *x, int64_t M,
            float *y, int threads) {
    g_threads = threads;
    QStack q = {{codes, NULL}, {scales, NULL}, {N, 0}, 1, K};
    int64_t ld = q8_row_bytes(K);
    uint8_t *xq = aligned_alloc(64, (size_t)(M * ld));
    q8_quantize(x, K, M, K, xq, ld);
    q8_linear(xq, ld, M, &q, 0, N, y, N);
    free(xq);
}
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """host_q8.c built as the host forward is for this run (the target test_build_targets chooses)."""
    so = compile_harness(tmp_path_factory.mktemp("q8"), _HARNESS)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    so.run_q8.argtypes = [p, p, i64, i64, p, i64, p, ctypes.c_int]

    def run(codes: np.ndarray, scales: np.ndarray, x: np.ndarray, threads: int = 1) -> np.ndarray:
        c, s = torch.from_numpy(codes.copy())[None], torch.from_numpy(scales.copy())[None]
        interleave_q8(c, s)
        c, s, x = c[0].numpy(), s[0].numpy(), np.ascontiguousarray(x, np.float32)
        y = np.full((x.shape[0], codes.shape[0]), np.nan, np.float32)
        so.run_q8(c.ctypes.data, s.ctypes.data, codes.shape[0], x.shape[1], x.ctypes.data, x.shape[0],
                  y.ctypes.data, threads)
        return y

    run.fma = bool(so.has_fma())
    return run


def _f32(v: Fraction) -> np.float32:
    """v rounded once to the nearest float32, ties to even."""
    c = np.float32(float(v))
    cands = [np.nextafter(c, np.float32(-np.inf)), c, np.nextafter(c, np.float32(np.inf))]
    return min(cands, key=lambda f: (abs(Fraction(float(f)) - v), int(np.array(f).view(np.uint32)) & 1))


def _oracle(codes: np.ndarray, scales: np.ndarray, x: np.ndarray, fma: bool) -> np.ndarray:
    """The definition, in plain loops: per row and block of 32, amax = max |x|, q = round-half-even(x *
    (127 / amax)) in float32, scale amax / 127; per output, 2 x fp4 integer weights (bit 3 the sign,
    the even input in the low nibble); then from zero, block by block, acc = fma(dot, (scale / 2) *
    2^(byte - 127), acc), fused or (no FMA) rounded twice."""
    two_fp4 = [0, 1, 2, 3, 4, 6, 8, 12]
    M, K = x.shape
    N, nb = codes.shape[0], K // 32
    y = np.zeros((M, N), np.float32)
    for m in range(M):
        q, sx = [], []
        for b in range(nb):
            blk = x[m, 32 * b:32 * b + 32].astype(np.float32)
            amax = np.float32(np.max(np.abs(blk)))
            inv = np.float32(127) / amax if amax > 0 else np.float32(0)
            q += [int(np.rint(np.float32(v * inv))) for v in blk]
            sx.append(np.float32(np.float32(amax / np.float32(127)) * np.float32(0.5)))
        for n in range(N):
            acc = np.float32(0)
            for b in range(nb):
                dot = 0
                for i in range(32):
                    c = int(codes[n, 16 * b + i // 2]) >> (4 * (i % 2)) & 15
                    dot += (-1 if c & 8 else 1) * two_fp4[c & 7] * q[32 * b + i]
                s = np.float32(sx[b] * np.float32(2.0 ** (int(scales[n, b]) - 127)))
                exact = Fraction(dot) * Fraction(float(s))
                acc = _f32(exact + Fraction(float(acc))) if fma else _f32(Fraction(float(_f32(exact))) + Fraction(float(acc)))
            y[m, n] = acc
    return y


def _weights(rng, N: int, K: int):
    codes = rng.integers(0, 256, (N, K // 2), dtype=np.uint8)
    scales = rng.integers(118, 130, (N, K // 32), dtype=np.uint8)
    return codes, scales


def test_the_kernel_equals_its_definition_bit_for_bit(kernel):
    rng = np.random.default_rng(11)
    N, K = 32, 128
    codes, scales = _weights(rng, N, K)
    scales[3, 1], scales[5, 2] = 0, 1  # byte 0 (2^-127, a subnormal) and the smallest normal scale
    x = rng.standard_normal((3, K)).astype(np.float32) * np.float32(3.0)
    x[1, :32] = 0.0  # an all-zero block
    x[2, 40] = 1e-30  # a block with tiny values beside ordinary ones
    want = _oracle(codes, scales, x, kernel.fma)
    got = kernel(codes, scales, x)
    assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist()


def test_every_row_has_the_same_bits_alone_in_any_batch_and_on_two_threads(kernel):
    """Row counts 1-19 (every tile of 1-8 rows and groups of 8 then the rest), 8 groups of 16 outputs
    (two pool items)."""
    rng = np.random.default_rng(5)
    N, K = 128, 256
    codes, scales = _weights(rng, N, K)
    x = rng.standard_normal((19, K)).astype(np.float32)
    alone = np.concatenate([kernel(codes, scales, x[m:m + 1]) for m in range(19)])
    w = _dequant(codes, scales)
    exact = x.astype(np.float64) @ w.T
    # each input is off by at most half a step, amax / 254, of its block: the worst case over the row
    step = np.repeat(np.abs(x).reshape(19, K // 32, 32).max(-1) / 254, 32, axis=1)
    assert np.all(np.abs(alone - exact) <= 1.001 * step @ np.abs(w).T + 1e-5 * np.abs(x) @ np.abs(w).T)
    for M in (2, 5, 8, 9, 16, 19):
        for threads in (1, 2):
            got = kernel(codes, scales, x[:M], threads=threads)
            assert got.view(np.uint32).tolist() == alone[:M].view(np.uint32).tolist(), (M, threads)


def test_a_block_with_a_nan_or_an_infinity_gives_nan_in_its_row_only(kernel):
    rng = np.random.default_rng(3)
    codes, scales = _weights(rng, 16, 64)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    x[0, 7], x[2, 50] = np.nan, np.inf
    y = kernel(codes, scales, x)
    assert np.isnan(y[0]).all() and np.isnan(y[2]).all() and np.isfinite(y[1]).all()


def _dequant(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    fp4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    N, K = codes.shape[0], 2 * codes.shape[1]
    w = np.zeros((N, K))
    for n in range(N):
        for k in range(K):
            c = int(codes[n, k // 2]) >> (4 * (k % 2)) & 15
            w[n, k] = (-1 if c & 8 else 1) * fp4[c & 7] * 2.0 ** (int(scales[n, k // 32]) - 127)
    return w


def test_interleave_and_deinterleave_are_inverse_and_place_each_nibble_where_the_kernel_reads_it():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (3, 32, 64), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 256, (3, 32, 4), dtype=torch.uint8, generator=g)
    c, s = codes.clone(), scales.clone()
    interleave_q8(c, s)
    e, n, k = 2, 21, 77  # output 21 = group 1, lane 5; input 77 = block 2, t 1, high nibble, r 1
    j, b, t, hi, r = n % 16, k // 32, (k % 32) // 8, (k % 8) // 4, k % 4
    byte = int(c[e].reshape(-1)[((n // 16 * 4 + b) * 4 + t) * 64 + 4 * j + r])
    assert (byte >> (4 * hi)) & 15 == (int(codes[e, n, k // 2]) >> (4 * (k % 2))) & 15
    assert int(s[e].reshape(-1)[(n // 16 * 4 + b) * 16 + j]) == int(scales[e, n, b])
    back_c, back_s = deinterleave_q8(c, s)
    assert torch.equal(back_c, codes) and torch.equal(back_s, scales)


def test_interleaved_stacks_dequantise_to_the_same_weights():
    """The torch path's view of an interleaved stack (the C loop, and without it the torch inverse)."""
    from ds4serve.model.packed import PackedPart

    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 256, (4, 32, 48), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (4, 32, 3), dtype=torch.uint8, generator=g)
    plain = PackedExperts("mxfp4", [PackedPart(codes.clone(), scales.clone())], (4, 32, 96), torch.float32)
    mixed = PackedExperts("mxfp4", [PackedPart(codes.clone(), scales.clone())], (4, 32, 96), torch.float32)
    mixed.interleave(True)
    assert mixed.parts[0].interleaved and not torch.equal(mixed.parts[0].codes, codes)
    used = torch.tensor([0, 2, 3])
    assert torch.equal(mixed.take(used), plain.take(used))
    assert torch.equal(mixed.take(torch.arange(4)), plain.take(torch.arange(4)))
    mixed.interleave(False)
    assert torch.equal(mixed.parts[0].codes, codes) and torch.equal(mixed.parts[0].scales, scales)


def test_the_c_interleave_is_the_python_one():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (2, 48, 96), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 256, (2, 48, 6), dtype=torch.uint8, generator=g)
    a = (codes.clone(), scales.clone())
    b = (codes.clone(), scales.clone())
    interleave_q8(*a)
    host_q8.interleave_part(host_forward.library(), *b)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_the_modes_are_one_list():
    assert host_q8.MOE_ACTIVATIONS == MOE_ACTIVATION_MODES


@pytest.fixture(scope="module")
def mxfp4_dir(ckpt_factory, tmp_path_factory):
    return _checkpoint(ckpt_factory, tmp_path_factory.mktemp("q8"), "mxfp4")


def test_int8_experts_stay_close_to_the_exact_products_and_the_torch_path_reads_their_layout(mxfp4_dir, monkeypatch):
    """The forward on int8 activations against the exact one (fp32 activations): close, not equal; the
    stacks are rewritten in place (no second copy) and the torch path still reads them right."""
    q8 = LLM(mxfp4_dir, max_seqs=4, packed_experts=True, host_kernels="on", moe_activations="int8")
    exact = LLM(mxfp4_dir, max_seqs=4, packed_experts=True, host_kernels="on", moe_activations="fp32")
    assert q8.core.executor.host.moe_activations == "int8"
    stacks = [getattr(ly.mlp.experts, n) for ly in q8.model.model.layers for n in ("gate_up_proj", "down_proj")]
    assert all(isinstance(s, PackedExperts) and all(p.interleaved for p in s.parts) for s in stacks)
    kept = {t.data_ptr() for t in q8.core.executor.host._keep}
    assert all(p.codes.data_ptr() in kept for s in stacks for p in s.parts)
    assert q8.core.executor.host.q8_disagrees() is None  # the start-up probe, on this checkpoint
    ids = random_ids(40, q8.cfg.vocab_size, seed=4)
    a, b = q8.prompt_logits(ids, engine=True), exact.prompt_logits(ids, engine=True)
    torch_path = q8.prompt_logits(ids)  # the reference forward: torch, reading the interleaved stacks
    assert float((torch_path - b).abs().max()) <= 1e-4 * float(b.abs().max())
    # what int8 inputs cost this (random, sensitive) model, and that the native forward pays exactly that:
    # it is far closer to torch with the same rounding of the expert inputs than to the exact products
    with monkeypatch.context() as m:
        m.setattr(moe, "grouped_linear", lambda x, w, counts, f=moe.grouped_linear: f(
            quantize_rows_q8(x).float(), w, counts))
        emulated = exact.prompt_logits(ids)
    assert not torch.equal(a, b)
    cost, off = float((a - b).abs().max()), float((a - emulated).abs().max())
    assert cost <= 0.25 * float(b.abs().max()) and off <= cost / 5, (cost, off)


def test_int8_rows_are_batch_invariant_bit_for_bit(mxfp4_dir):
    llm = LLM(mxfp4_dir, max_seqs=4, packed_experts=True, host_kernels="on", moe_activations="int8")
    prompts = [random_ids(n, 1000, seed=60 + n) for n in (6, 33, 71)]
    solo = [llm.generate_with_logprobs([p], max_tokens=10, ignore_eos=True, logprobs=3)[0] for p in prompts]
    together = llm.generate_with_logprobs(prompts, max_tokens=10, ignore_eos=True, logprobs=3)
    assert all(len(lps) == 10 for _, lps in solo)
    assert together == solo
