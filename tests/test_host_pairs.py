"""The bf16 LM head on bf16-rounded rows (model/csrc/host_pairs.c, ``head_activations="bf16"``): the kernel
and its scalar reference against the definition, written here from its words in numpy (rounding by
distance, not by the C's bit tricks), bit for bit; every row the same bits alone or in a batch, on one
thread or two; the AVX-512F emulation built here beside the instruction; the start-up probe; and the
forward's head wired to it. test_build_targets runs this file again for x86-64-v2 (plain C, libm's fused
fmaf) and znver3 (AVX2)."""

from __future__ import annotations

import ctypes
import logging
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ds4serve.llm import LLM
from ds4serve.model import host_forward, host_pairs
from ds4serve.model.host_abi import _Weight
from ds4serve.model.stored import StoredWeight
from ds4serve.settings import HEAD_ACTIVATION_MODES, ConfigError, EngineSettings
from model_helpers import random_ids
from test_stored_weights import flash_dir  # noqa: F401  (the module fixture: FP8 + bf16 head + MXFP4)

TINY = 2.0 ** -126


def _round_bf16(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits: the nearer of the two bf16 neighbours (ties: the even one), found by distance
    in float64; zero and subnormals to a zero of their sign; NaN stays NaN."""
    x = np.asarray(x, np.float32)
    b = x.view(np.uint32).astype(np.uint64)
    down = (b >> 16).astype(np.uint64)
    up = down + 1
    as_f = lambda h: (h.astype(np.uint32) << 16).view(np.float32).astype(np.float64)  # noqa: E731
    with np.errstate(invalid="ignore", over="ignore"):
        xd = x.astype(np.float64)
        # past the largest finite bf16 the upper neighbour is inf, at the distance 2^128 would be
        up_value = np.where((up & 0x7FFF) == 0x7F80, np.copysign(2.0 ** 128, xd), as_f(up))
        d_down, d_up = np.abs(xd - as_f(down)), np.abs(up_value - xd)
    pick_up = (d_up < d_down) | ((d_up == d_down) & (down % 2 == 1))
    out = np.where(pick_up, up, down)
    out = np.where(np.abs(xd) < TINY, (b >> 16) & 0x8000, out)
    out = np.where(np.isnan(x), (b >> 16) | 0x40, out)
    out = np.where(np.isinf(x), b >> 16, out)
    return out.astype(np.uint16)


def _value(h: np.ndarray) -> np.ndarray:
    f = (h.astype(np.uint32) << 16).view(np.float32)
    return _flush(f)


def _flush(v: np.ndarray) -> np.ndarray:
    return np.where(np.abs(v) < TINY, np.copysign(np.float32(0), v), v).astype(np.float32)


def _fma(a, b, c):
    """a * b + c rounded once: the product of two bf16 values is exact in float64, and so is its sum
    with a float32 unless one is below the other's last bit (then the float32 rounding is unchanged)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return _flush((a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32))


def _oracle(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The definition: rows rounded to bf16; per output 16 lanes, lane j taking inputs 32t + 2j + 1, then
    32t + 2j, for t = 0, 1, ...; the lanes added as a tree (i += i + h, h = 8, 4, 2, 1); the inputs past
    the last whole 32 one at a time. Subnormal products' inputs count as zero, subnormal sums flush."""
    xb, wv = _value(_round_bf16(x)), _value(w)
    M, K = xb.shape
    kv = K - K % 32
    acc = np.zeros((M, wv.shape[0], 16), np.float32)
    for t in range(0, kv, 32):
        for odd in (1, 0):
            ks = t + 2 * np.arange(16) + odd
            acc = _fma(xb[:, None, ks], wv[None, :, ks], acc)
    for h in (8, 4, 2, 1):
        acc = (acc[..., :h] + acc[..., h:2 * h]).astype(np.float32)
    s = acc[..., 0]
    for k in range(kv, K):
        s = _fma(xb[:, None, k], wv[None, :, k], s)
    return s


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return bool(((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))).all())


def _inputs(M: int, N: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    edge = torch.tensor([1e-39, -1e-39, -0.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, float.fromhex("0x1.ffffp0"), -float.fromhex("0x1.ff8p-1"), 3e-3])
    x[0, : min(K, 8)] = edge[: min(K, 8)]
    w = (torch.randn(N, K, generator=g) * 0.05).to(torch.bfloat16)
    w[0, : min(K, 2)] = torch.tensor([1e-39, -1e-39]).to(torch.bfloat16)[: min(K, 2)]  # subnormal weights
    if N >= 4 and K >= 8:  # outputs whose only product is subnormal (flushed): a weight in the lanes, one
        w[1:4] = 0        # in the tail (or last lane), and two normal values whose product is subnormal
        x[0, 5], x[0, K - 1] = 1e-20, 1.0
        w[1, 6], w[2, K - 1], w[3, 5] = 1e-39, 1e-39, 1e-20
    return x, w


@pytest.fixture(scope="module")
def lib():
    got = host_forward.library()
    if got is None:
        pytest.skip("native kernels unavailable")
    return got


def _bits(w: torch.Tensor) -> np.ndarray:
    return w.view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("M,N,K", [(1, 37, 96), (3, 50, 100), (8, 29, 64), (9, 13, 4096), (2, 5, 31), (17, 7, 160)])
def test_kernel_and_reference_equal_the_definition(lib, M, N, K):
    x, w = _inputs(M, N, K, seed=M * 1000 + K)
    want = _oracle(x.numpy(), _bits(w))
    assert _same(host_pairs.reference(lib, x, w).numpy(), want)
    for threads in (1, 2):
        assert _same(host_pairs.product(lib, x, w, threads).numpy(), want), threads


def test_non_finite_rows(lib):
    x, w = _inputs(3, 9, 64, seed=3)
    x[0, 5], x[1, 40], x[2, 1] = float("inf"), float("nan"), 3.4e38  # 3.4e38 rounds up to inf
    got = host_pairs.product(lib, x, w).numpy()
    assert _same(got, _oracle(x.numpy(), _bits(w)))
    assert np.isnan(got[1]).all() and not np.isfinite(got[2]).any()


def test_a_row_has_the_same_bits_alone_or_in_any_batch(lib):
    """Tiles of 1-8 rows (one row alone takes its own, wider tile) and the groups of 9-19 rows."""
    x, w = _inputs(19, 61, 4096 + 48, seed=7)
    alone = torch.cat([host_pairs.product(lib, x[i:i + 1], w) for i in range(19)])
    for m in (2, 3, 8, 9, 17, 19):
        assert torch.equal(host_pairs.product(lib, x[:m], w, threads=2).view(torch.int32), alone[:m].view(torch.int32)), m


def test_close_to_the_fp32_product_but_not_it(lib):
    """Rounding the rows to bf16 moves the outputs by ~2^-9 of |x| |w|, no more: a wrong lane order or a
    lost pair would be off by whole products."""
    x, w = _inputs(4, 64, 4096, seed=11)
    got = host_pairs.product(lib, x, w).double()
    exact = x.double() @ w.double().T
    mag = x.abs().double() @ w.abs().double().T
    assert ((got - exact).abs() <= 2 ** -8 * mag + 1e-37).all()  # (+: the subnormal products flushed)
    assert not torch.equal(got, exact.float().double())


def _build(march: str, tmp: Path) -> ctypes.CDLL | None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    csrc = Path(host_forward.__file__).with_name("csrc")
    out = tmp / f"host-{march}.so"
    done = subprocess.run([cc, "-O2", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-fast-math", "-Wno-psabi",
                           f"-march={march}", f"-I{csrc}", str(csrc / "host.c"), "-o", str(out), "-lm"],
                          capture_output=True, text=True)
    if done.returncode:
        return None
    so = ctypes.CDLL(str(out))
    so.ds4_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(_Weight), ctypes.c_int64,
                              ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    host_pairs.bind(so)
    return so


def test_the_avx512f_emulation_equals_the_instruction(lib, tmp_path, caplog):
    """A build for an AVX-512 CPU without BF16 (Skylake) emulates vdpbf16ps with fused multiply-adds: the
    same bits as this build's kernel and the definition."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if not all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq")):
        pytest.skip("this CPU runs no AVX-512F code")
    so = _build("skylake-avx512", tmp_path)
    if so is None:
        pytest.skip("no compiler for -march=skylake-avx512")
    assert so.ds4_p16_native() == 0 and b"emulation" in so.ds4_p16_kernel()
    # on such a CPU auto keeps the fp32 rows (the emulation is slower); an explicit bf16 gets it, warned
    model = SimpleNamespace(lm_head=SimpleNamespace(weight=StoredWeight("bf16", torch.zeros(32, 64, dtype=torch.bfloat16))))
    assert host_pairs.choose_head_activations(model, "auto", so) == "fp32"
    with caplog.at_level(logging.WARNING, logger="ds4serve.model.host_pairs"):
        assert host_pairs.choose_head_activations(model, "bf16", so) == "bf16"
    assert "emulation" in caplog.text and "slower" in caplog.text
    assert host_pairs.choose_head_activations(model, "auto", lib) == ("bf16" if lib.ds4_p16_native() else "fp32")
    x, w = _inputs(9, 23, 4096 + 17, seed=5)
    want = _oracle(x.numpy(), _bits(w))
    assert _same(host_pairs.product(so, x, w, threads=2).numpy(), want)
    assert _same(host_pairs.product(lib, x, w, threads=2).numpy(), want)


def test_the_start_up_probe_passes_here_and_catches_a_difference(lib, monkeypatch):
    head = (torch.randn(300, 256, generator=torch.Generator().manual_seed(2)) * 0.05).to(torch.bfloat16)
    assert host_pairs.p16_disagrees(lib, head) is None
    real = host_pairs.reference
    monkeypatch.setattr(host_pairs, "reference", lambda lib_, x, w: real(lib_, x, w).nextafter(torch.tensor(1e30)))
    why = host_pairs.p16_disagrees(lib, head)
    assert why is not None and "row 0, output 0" in why


def test_the_modes_and_their_checks():
    assert host_pairs.HEAD_ACTIVATIONS == HEAD_ACTIVATION_MODES
    with pytest.raises(ConfigError, match="head_activations"):
        EngineSettings(head_activations="int8")


def test_the_forward_head_multiplies_bf16_pairs(flash_dir):  # noqa: F811
    """``head_activations="bf16"``: the native head takes the pair kernel (its descriptor, the start-up
    probe), its logits sit on the definition over the torch path's head input (which differs from the
    native one in summation order only) and off the fp32 head's; a request's tokens and logprobs are the
    same alone or in a batch."""
    pairs = LLM(flash_dir, max_seqs=4, packed_experts=True, stored_weights=True, host_kernels="on",
                head_activations="bf16")
    exact = LLM(flash_dir, max_seqs=4, packed_experts=True, stored_weights=True, host_kernels="on",
                head_activations="fp32")
    host = pairs.core.executor.host
    assert host.head_activations == "bf16" and exact.core.executor.host.head_activations == "fp32"
    assert host.model.lm_head.fmt == host_pairs.FMT_PAIRS and exact.core.executor.host.model.lm_head.fmt == 2
    assert host.p16_disagrees() is None
    cfg, model = pairs.cfg, pairs.model
    streams = torch.randn(3, cfg.hc_mult, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    got, fp32 = host.logits(streams), exact.core.executor.host.logits(streams)
    from ds4serve.model.mhc import hc_head
    from ds4serve.model.norms import rms_norm
    m = model.model
    h = rms_norm(hc_head(streams, m.hc_head.hc_fn, m.hc_head.hc_base, m.hc_head.hc_scale, cfg.hc_eps, cfg.rms_norm_eps),
                 m.norm.weight, cfg.rms_norm_eps)
    want = host_pairs.reference(host.lib, h, model.lm_head.weight.data)
    scale = float(fp32.abs().max())
    assert float((got - want).abs().max()) <= 1e-3 * scale
    assert 0 < float((got - fp32).abs().max()) <= 0.02 * scale
    prompts = [random_ids(n, 1000, seed=60 + n) for n in (9, 33, 50)]
    solo = [pairs.generate_with_logprobs([p], max_tokens=6, ignore_eos=True, logprobs=2)[0] for p in prompts]
    assert pairs.generate_with_logprobs(prompts, max_tokens=6, ignore_eos=True, logprobs=2) == solo
