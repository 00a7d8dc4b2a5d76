"""The Triton kernels for packed experts (``model/triton_experts.py``) against the host path, which
dequantises with the loader's arithmetic: each kernel on MXFP4 (byte scales) and FP8 (2-D block
scales) against ``PackedExperts.take`` then a matmul, and the MoE's fused path (taken whenever the
kernels are available) against the dequantising one on the same packed stacks, also split across
expert-parallel ranks.

On the host the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, in a child process:
the flag must be set before Triton loads), fp32, so only the order of sums differs. On a CUDA device
(the GPU check runs this file) they run compiled, in fp32 and bf16. Skipped, with the reason, where
Triton is not installed (CPU builds of torch do not bring it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed (CPU builds of torch do not bring it)")

ROOT = Path(__file__).resolve().parent.parent


def compare(device: str, dtype: torch.dtype) -> dict:
    """Largest differences, kernel vs host path, for both formats and the fused MoE (see the doc)."""
    from ds4serve.model import moe
    from ds4serve.model import triton_experts as te
    from ds4serve.model.packed import PackedExperts, PackedPart
    from test_weights import _quantize_fp8, _quantize_mxfp4

    dev = torch.device(device)
    assert te.available(dev)
    gen = torch.Generator().manual_seed(0)
    out = {}
    w = torch.randn(3, 40, 96, generator=gen)  # 40 rows: a partial tile of 32 columns
    x = torch.randn(7, 96, generator=gen)  # 7 rows: a partial tile of 16

    def part(ws, fmt):
        q = [_quantize_mxfp4(t) if fmt == "mxfp4" else _quantize_fp8(t, 16) for t in ws]
        codes = torch.stack([c.view(torch.uint8) if fmt == "mxfp4" else c for c, _ in q])
        return PackedPart(codes.to(dev), torch.stack([s for _, s in q]).to(dev))

    for fmt in ("mxfp4", "fp8"):
        packed = PackedExperts(fmt, [part(w, fmt)], (3, 40, 96), dtype, (16, 16))
        full = packed.take(torch.arange(3, device=dev)).float()
        xd = x.to(dev, dtype)
        out[fmt] = max(float((te.packed_matmul(xd, packed, e) - xd.float() @ full[e].T).abs().max()) for e in range(3))
    E, inter, D, T, K = 4, 32, 64, 6, 2
    wg, wu, wd = (torch.randn(E, inter, D, generator=gen), torch.randn(E, inter, D, generator=gen),
                  torch.randn(E, D, inter, generator=gen))
    gate_up = PackedExperts("mxfp4", [part(wg, "mxfp4"), part(wu, "mxfp4")], (E, 2 * inter, D), dtype)
    down = PackedExperts("mxfp4", [part(wd, "mxfp4")], (E, D, inter), dtype)
    xs = torch.randn(T, D, generator=gen).to(dev, dtype)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(dev)
    wts = torch.rand(T, K, generator=gen).to(dev)
    every = torch.arange(E, device=dev)
    host = moe._grouped_experts(xs, idx, wts, gate_up.take(every), down.take(every), 10.0).float()
    out["moe"] = float((moe.run_experts(xs, idx, wts, gate_up, down, 10.0).float() - host).abs().max())

    def rank(p, lo):
        return PackedExperts(p.fmt, [PackedPart(q.codes[lo:lo + 2], q.scales[lo:lo + 2]) for q in p.parts],
                             (2, *p.shape[1:]), p.dtype)

    halves = [moe.run_local_experts(xs, idx, wts, rank(gate_up, lo), rank(down, lo), 10.0, (lo, lo + 2))
              for lo in (0, 2)]
    out["ep"] = float((halves[0].float() + halves[1].float() - host).abs().max())
    out["scale"] = float(host.abs().max())
    return out


def _check(res: dict, tol: float) -> None:
    """Every difference below ``tol`` of the outputs' scale (the MoE's largest output, or 1)."""
    bound = tol * max(1.0, res["scale"])
    assert all(res[k] < bound for k in ("mxfp4", "fp8", "moe", "ep")), res


def test_triton_kernels_match_the_host_path_under_the_interpreter():
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 8):
        pytest.skip(f"Triton {triton.__version__}'s interpreter fails with numpy 2 (3.8 or newer works)")
    child = "import json, sys, torch; sys.path.insert(0, 'tests'); from test_triton_experts import compare; " \
            "print('RESULT ' + json.dumps(compare('cpu', torch.float32)))"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", child], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    _check(json.loads(lines[-1][len("RESULT "):]), 1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_kernels_on_cuda_match_the_host_path(dtype):
    _check(compare("cuda", dtype), 1e-4 if dtype == torch.float32 else 2e-2)  # bf16: products rounded to 8 bits
