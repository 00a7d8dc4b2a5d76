"""Microbenchmark of the products over stored weights (csrc/host_stored.c): FP8 e4m3 [K, N] with UE8M0
128 x 128 block scales (DS4-Flash's linears) and the bf16 [N, K] LM head, old build vs new, interleaved.

Why a separate script: the engine bench mixes these products with attention and the experts, and the
machine this runs on is shared, so a speed claim about one kernel needs the two builds timed in
alternation within the same minute (A, B, A, B, ...) and the ratio of each pair, not two runs minutes apart.

    python scripts/bench_stored.py --old /tmp/old_csrc            # old csrc dir vs the package's csrc
    python scripts/bench_stored.py --old /tmp/old_csrc --march znver3 --rows 8 --shapes 4096
    python scripts/bench_stored.py --rows 1 8 --head               # the new build alone, with the head
    python scripts/bench_stored.py --old ds4serve/model/csrc --old-fmt 1 --fmt 4   # FP8 on bf16 pairs vs fp32

Prints, per (shape, rows, threads): ms per product (wall), G weights/s (weights read per second, one pass over
the weight), GB/s (bytes of weights and scales read), GFLOP/s (2 M K N per second), GFLOP per CPU-second (all threads; the steadier figure on a shared machine,
--by cpu compares by it), and with --old the
ratio new/old of every interleaved pair and their median. Each build is compiled here (-O3,
-ffp-contract=off, the chosen -march), as ds4serve's own build does.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from ds4serve.model.host_abi import _Weight  # noqa: E402

FLAGS = ["-O3", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-fast-math"]
BLOCK = 128
HEAD = 129_280


def build(csrc: Path, march: str, out: Path, defines: list[str] = ()) -> ctypes.CDLL:
    """host.c from csrc compiled for -march into out (a fresh .so, so two builds can be loaded at once)."""
    done = subprocess.run(["cc", *FLAGS, *(f"-D{d}" for d in defines), f"-march={march}", f"-I{csrc}", str(csrc / "host.c"), "-o", str(out), "-lm"],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"build of {csrc} failed:\n{done.stderr[-2000:]}")
    lib = ctypes.CDLL(str(out))
    lib.ds4_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(_Weight),
                               ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.ds4_linear.restype = ctypes.c_int
    return lib


def fp8_weight(k: int, n: int, seed: int, codes: str = "checkpoint") -> tuple[_Weight, list[torch.Tensor], int]:
    """e4m3 codes stored [K, N] and power-of-two block scales [N / 128, K / 128].

    codes "checkpoint": N(0, 0.02) weights quantised as a checkpoint is (make_wide_ckpt.py: per 128 x 128
    block the smallest power-of-two scale with |w| / s <= 448, nearest e4m3), so subnormal codes are as
    rare as in a real one (~1e-4). "uniform": every finite code equally likely (~3% subnormal). Why it
    matters: an Intel core takes a microcode assist for a subnormal input to a multiply-add (AMD's do
    not), so uniform codes ran the 8-row product ~59x slower there, and even checkpoint-like ones cost
    ~1.2x against none."""
    g = torch.Generator().manual_seed(seed)
    if codes == "uniform":
        q = torch.randint(0, 256, (k, n), generator=g, dtype=torch.uint8)
        q[(q & 0x7F) == 0x7F] = 0x3F  # no NaN codes (refused at load)
        scales = torch.exp2(torch.randint(-12, -6, (n // BLOCK, k // BLOCK), generator=g).float())
    else:
        w = torch.randn(n, k, generator=g) * 0.02
        amax = w.reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK).abs().amax(dim=(1, 3))
        scales = torch.exp2(torch.ceil(torch.log2(amax / 448)))
        full = scales.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        q = (w / full).to(torch.float8_e4m3fn).view(torch.uint8).t()
    q, scales = q.contiguous(), scales.contiguous()
    w = _Weight(None, n, 1, 1, q.data_ptr(), scales.data_ptr(), BLOCK, BLOCK, scales.shape[1], scales.shape[0])
    return w, [q, scales], q.numel() + scales.numel() * 4


def bf16_weight(k: int, n: int, seed: int, fmt: int = 2) -> tuple[_Weight, list[torch.Tensor], int]:
    """The head as loaded; fmt 2 multiplies fp32 rows (host_stored.c), 3 bf16-rounded ones (host_pairs.c)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    return _Weight(None, k, 0, fmt, w.data_ptr(), None, 0, 0, 0, 0), [w], w.numel() * 2


def time_one(lib, x, w, n, y, threads: int, reps: int) -> tuple[float, float]:
    """The best of reps calls (one warm-up call first): wall seconds and CPU seconds of the whole process
    (all pool threads). On a shared machine the CPU time is the steadier figure: time slices lost to other
    jobs do not count in it (cache and memory contention still do)."""
    call = lambda: lib.ds4_linear(x.data_ptr(), x.shape[0], x.shape[1], ctypes.byref(w), n, y.data_ptr(), n, threads)  # noqa: E731
    call()
    wall = cpu = float("inf")
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        call()
        cpu = min(cpu, time.process_time() - c)
        wall = min(wall, time.perf_counter() - t)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path, help="a csrc directory to compare against (e.g. a copy taken before a change)")
    ap.add_argument("--new", type=Path, default=ROOT / "ds4serve" / "model" / "csrc")
    ap.add_argument("--march", default="native")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="a macro for the new build (tuning)")
    ap.add_argument("--old-D", dest="old_defines", action="append", default=[], help="a macro for the old build")
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--shapes", type=int, nargs="*", default=[1024, 4096, 16384, 32768], help="N of the FP8 products")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 512])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--codes", choices=["checkpoint", "uniform"], default="checkpoint",
                    help="FP8 codes as a quantised checkpoint has them (default) or uniformly random (fp8_weight)")
    ap.add_argument("--head", action="store_true", help="also the bf16 head (129,280 x K), rows <= 16")
    ap.add_argument("--head-pairs", action="store_true", help="also the bf16 head on bf16-rounded rows (fmt 3)")
    ap.add_argument("--pairs", type=int, default=3, help="old/new alternations per case")
    ap.add_argument("--max-flop", type=float, default=4e10, help="skip cases above this many FLOP a call")
    ap.add_argument("--fmt", type=int, choices=[1, 4], default=1,
                    help="the new build's FP8 kind: 1 on fp32 rows (host_stored.c), 4 on bf16 rows (host_f8pairs.c)")
    ap.add_argument("--old-fmt", type=int, choices=[1, 4], default=1, help="... the old build's")
    ap.add_argument("--by", choices=["wall", "cpu"], default="wall", help="the time the ratios compare")
    a = ap.parse_args()
    a.by = 0 if a.by == "wall" else 1
    tmp = Path(tempfile.mkdtemp(prefix="bench_stored_"))
    libs = {"new": build(a.new, a.march, tmp / "new.so", a.defines)}
    if a.old:
        libs["old"] = build(a.old, a.march, tmp / "old.so", a.old_defines)
    print(f"# {open('/proc/cpuinfo').read().split('model name')[1].split(':')[1].splitlines()[0].strip()}, "
          f"-march={a.march}, loadavg {os.getloadavg()[0]:.2f}")
    cases = ([("fp8", n) for n in a.shapes] + ([("bf16", HEAD)] if a.head else [])
             + ([("bf16x", HEAD)] if a.head_pairs else []))
    ratios = []
    for kind, n in cases:
        w, keep, nbytes = (fp8_weight(a.k, n, seed=n, codes=a.codes) if kind == "fp8" else
                           bf16_weight(a.k, n, seed=n, fmt=3 if kind == "bf16x" else 2))
        for m in a.rows:
            if 2.0 * m * a.k * n > a.max_flop or (kind != "fp8" and m > 16):
                continue
            x = torch.randn(m, a.k, generator=torch.Generator().manual_seed(m))
            y = torch.empty(m, n)
            for t in a.threads:
                reps = max(2, min(20, int(2e9 / (2.0 * m * a.k * n + 4 * nbytes))))
                got = {name: [] for name in libs}
                for _ in range(a.pairs if a.old else 1):
                    for name, lib in libs.items():
                        if kind == "fp8":
                            w.fmt = a.fmt if name == "new" else a.old_fmt
                        got[name].append(time_one(lib, x, w, n, y, t, reps))
                s = min(g[0] for g in got["new"])
                line = (f"{kind} K={a.k} N={n:6d} M={m:3d} T={t}: {s * 1e3:8.2f} ms  {a.k * n / s / 1e9:6.2f} Gw/s  "
                        f"{nbytes / s / 1e9:6.2f} GB/s  {2 * m * a.k * n / s / 1e9:7.1f} GFLOP/s  "
                        f"{2 * m * a.k * n / min(g[1] for g in got['new']) / 1e9:7.1f} GFLOP/cpu-s")
                if a.old:
                    pair = [o[a.by] / nw[a.by] for o, nw in zip(got["old"], got["new"])]
                    ratios.append(statistics.median(pair))
                    line += (f"  new/old speed ({'wall' if a.by == 0 else 'cpu'}) " + " ".join(f"{r:.2f}" for r in pair)
                             + f" (median {statistics.median(pair):.2f})")
                print(line, flush=True)
        del keep
    if ratios:
        print(f"# median of the cases' median speed-ups: {statistics.median(ratios):.2f}; loadavg {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
