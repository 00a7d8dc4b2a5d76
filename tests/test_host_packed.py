"""The native forward over experts kept packed in MXFP4 (model/csrc/host_packed.c) computes what the
torch path computes over the same packed experts (which equals dequantise-at-load bit for bit,
``test_packed_experts``), reads the codes where they were loaded, and keeps rows batch-invariant."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ds4serve.llm import LLM
from ds4serve.model import host_forward
from ds4serve.model.packed import PackedExperts
from model_helpers import random_ids
from test_host_forward import _decode_steps, _run_both
from test_packed_experts import _checkpoint


@pytest.fixture(scope="module")
def mxfp4_dir(ckpt_factory, tmp_path_factory):
    return _checkpoint(ckpt_factory, tmp_path_factory.mktemp("packed"), "mxfp4")


def test_native_packed_experts_equal_the_torch_path(mxfp4_dir):
    """On fp32 activations (host_packed.c; the int8 product, test_host_q8, is close to it, not equal)."""
    fast = LLM(mxfp4_dir, max_seqs=4, packed_experts=True, host_kernels="on", moe_activations="fp32")
    slow = LLM(mxfp4_dir, max_seqs=4, packed_experts=True, host_kernels="off")
    assert fast.core.executor.host is not None and slow.core.executor.host is None
    cfg = fast.cfg
    w = cfg.sliding_window
    prompts = [random_ids(n, cfg.vocab_size, seed=90 + n) for n in (w + 3, 2 * w + 11, 37)]
    steps = [[(0, 0, prompts[0][:5], ()), (1, 0, prompts[1][:w - 1], ())],
             [(0, 5, prompts[0][5:], ()), (1, w - 1, prompts[1][w - 1:], ()), (2, 0, prompts[2], ())]]
    _run_both(fast, slow, steps + _decode_steps(prompts, 2 * max(cfg.distinct_ratios) + 3, cfg.vocab_size))
    ps = [random_ids(n, 1000, seed=n) for n in (5, 17, 40, 9)]
    assert fast.generate(ps, max_tokens=16, ignore_eos=True) == slow.generate(ps, max_tokens=16, ignore_eos=True)


def test_packed_rows_are_batch_invariant_bit_for_bit(mxfp4_dir):
    llm = LLM(mxfp4_dir, max_seqs=4, packed_experts=True, host_kernels="on", moe_activations="fp32")
    prompts = [random_ids(n, 1000, seed=30 + n) for n in (7, 45, 70)]
    solo = [llm.generate_with_logprobs([p], max_tokens=10, ignore_eos=True, logprobs=3)[0] for p in prompts]
    together = llm.generate_with_logprobs(prompts, max_tokens=10, ignore_eos=True, logprobs=3)
    assert all(len(lps) == 10 for _, lps in solo)  # the float logprobs are compared, not only the tokens
    assert together == solo


def test_the_codes_are_read_where_they_were_loaded(mxfp4_dir):
    """No dequantised or repacked copy: the native forward points at the stacks' own codes and scales,
    and holds no fp32 tensor the size of an expert stack."""
    llm = LLM(mxfp4_dir, max_seqs=4, packed_experts=True, host_kernels="on", moe_activations="fp32")
    host = llm.core.executor.host
    stacks = [getattr(ly.mlp.experts, n) for ly in llm.model.model.layers for n in ("gate_up_proj", "down_proj")]
    assert all(isinstance(s, PackedExperts) for s in stacks)
    kept = {t.data_ptr() for t in host._keep}
    assert all(p.codes.data_ptr() in kept and p.scales.data_ptr() in kept for s in stacks for p in s.parts)
    expert_sizes = {s.n_experts * s.shape[1] * s.shape[2] for s in stacks}
    assert not [t for t in host._keep if t.is_floating_point() and t.numel() in expert_sizes]


def test_fp8_experts_keep_the_torch_path(ckpt_factory, tmp_path):
    d = _checkpoint(ckpt_factory, tmp_path, "fp8")
    llm = LLM(d, max_seqs=2, packed_experts=True)
    assert llm.core.executor.host is None
    why = host_forward.unsupported(llm.cfg, llm.model, llm.core.cache.state.layers)
    assert why == "packed fp8 experts (the native forward reads MXFP4)"
    assert llm.generate([[5, 6, 7]], max_tokens=3, ignore_eos=True)


# ---- the kernel alone (csrc/host_packed.c around a small harness) -------------------------------------

_HARNESS = r"""
#include "host.h"
#include "host_pool.c"
#include "host_packed.c"
void run_q(const uint8_t *codes, const uint8_t *scales, int64_t N, int64_t K, float *x, int64_t M, int64_t ldx,
           float *y, int64_t ldy, int threads) {
    g_threads = threads;
    QStack q = {{codes, NULL}, {scales, NULL}, {N, 0}, 1, K};
    qperm_rows(x, M, K, ldx);
    q_linear(x, ldx, M, &q, 0, N, y, ldy);
}
"""


def compile_harness(tmp_path, source: str, *defines: str):
    """A C harness around the host forward's parts (``#include "host.h"`` and the .c files it needs), built
    as the host forward is for this run (test_build_targets runs these files again for x86-64-v2 and
    znver3, scripts/sanitize.sh under the sanitizers) -> the loaded library; ``defines`` e.g.
    Q_NO_INTERLEAVE."""
    import ctypes
    import shutil
    import subprocess
    from pathlib import Path

    from ds4serve.environment import native_build
    from ds4serve.native_build import sanitized

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    build = native_build()  # the target, and checks / sanitizers as scripts/sanitize.sh asks
    march = ([] if build.target == "baseline" else [f"-march={build.target}"])
    march += sanitized(["-DDS4_CHECK"] if build.check else [], build.sanitize)
    csrc = Path(host_forward.__file__).with_name("csrc")
    src, lib = tmp_path / "harness.c", tmp_path / f"harness{len(defines)}.so"
    src.write_text(source)
    subprocess.run([cc, "-O3", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-fast-math", "-Wno-psabi",
                    *march, *[f"-D{d}" for d in defines], f"-I{csrc}", "-o", str(lib), str(src), "-lm"], check=True)
    return ctypes.CDLL(str(lib))


def _kernel(tmp_path, *defines: str):
    """host_packed.c's q_linear for one expert (``compile_harness``)."""
    import ctypes

    so = compile_harness(tmp_path, _HARNESS, *defines)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    so.run_q.argtypes = [p, p, i64, i64, p, i64, i64, p, i64, ctypes.c_int]

    def run(codes: np.ndarray, scales: np.ndarray, x: np.ndarray, threads: int = 1) -> np.ndarray:
        x = np.array(x, np.float32, order="C")  # reordered in place: a copy
        y = np.full((x.shape[0], codes.shape[0]), np.nan, np.float32)
        so.run_q(codes.ctypes.data, scales.ctypes.data, codes.shape[0], x.shape[1], x.ctypes.data, x.shape[0],
                 x.shape[1], y.ctypes.data, y.shape[1], threads)
        return y

    return run


def _oracle(codes: np.ndarray, scales: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """y = x W^T in float64 from the MXFP4 definition (E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6, bit 3 the
    sign, the even input in the low nibble, each block of 32 times 2^(byte - 127)), in plain loops; and
    sum |x w| for the tolerance"""
    mag = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    N, K = codes.shape[0], 2 * codes.shape[1]
    w = np.zeros((N, K))
    for n in range(N):
        for k in range(K):
            c = int(codes[n, k // 2]) >> (4 * (k % 2)) & 15
            w[n, k] = (-1.0 if c & 8 else 1.0) * mag[c & 7] * 2.0 ** (int(scales[n, k // 32]) - 127)
    xd = x.astype(np.float64)
    return xd @ w.T, np.abs(xd) @ np.abs(w).T


def test_the_kernel_rows_equal_the_definition_and_each_other_bit_for_bit(tmp_path):
    """Every row count 1-13 (the 1-5-row tiles, the interleaved groups of 4 and the rest), outputs that leave
    every tile a remainder, two threads, and the tiles that read rows where they are (the path without
    memory for the interleaved copy): the same bits for a row whatever else is in the batch, within
    float32 rounding of the definition."""
    rng = np.random.default_rng(7)
    N, K = 67, 96
    codes = rng.integers(0, 256, (N, K // 2), dtype=np.uint8)
    scales = rng.integers(117, 131, (N, K // 32), dtype=np.uint8)
    x = rng.standard_normal((13, K)).astype(np.float32)
    want, mag = _oracle(codes, scales, x)
    run, plain = _kernel(tmp_path), _kernel(tmp_path, "Q_NO_INTERLEAVE")
    alone = np.concatenate([run(codes, scales, x[m:m + 1]) for m in range(13)])
    assert np.all(np.abs(alone - want) <= 1e-5 * mag + 1e-30)
    for M in range(1, 14):
        for y in (run(codes, scales, x[:M]), run(codes, scales, x[:M], threads=2), plain(codes, scales, x[:M])):
            assert y.view(np.uint32).tolist() == alone[:M].view(np.uint32).tolist(), M
