"""Microbenchmark of the MXFP4 expert products (ds4serve/model/csrc/host_packed.c), old vs new interleaved.

    .venv/bin/python scripts/bench_mxfp4.py [--baseline REV] [--march native|znver3|x86-64-v2]
                                             [--rows 1,2,4,8,64] [--threads 1,2] [--rounds 3]

Why: the expert products are the largest single cost of a wide (DS4-Flash-shaped) decode step, and the
machine this runs on is shared, so a speed figure means something only beside the old kernel measured in
the same minute. Each kernel (this checkout's host_packed.c and the one at --baseline, HEAD by default) is
compiled into its own small library with the host forward's flags (-O3 -ffp-contract=off, the chosen
-march) around q_linear; for every (rows, threads) case the two alternate --rounds times and each pair is
printed with its ratio, then the median ratio. Both kernels get the same inputs, and their outputs are
compared bit for bit (the summation order is a promise: a changed bit is reported).

Shapes follow the wide checkpoint: K = 4096 inputs, N = 2048 outputs an expert (gate or up part), 12
experts (~50 MB of codes and scales, more than the L3), each product over the next expert so that the codes
come from memory as at decode. Rates are G weights/s: K x N weights of each expert product per second,
whatever the row count (so rows x rate is the multiply-add rate). One thread is timed by its CPU time,
two by the wall clock.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "ds4serve" / "model" / "csrc"
FLAGS = ["-O3", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-fast-math"]

HARNESS = r"""
#include "host.h"
#include "host_pool.c"
#define parallel pool_run /* the pool's entry point before it was renamed */
#include PACKED
/* y[r] = x[r] @ W_e^T over experts e = r % E for r in [0, reps): K inputs, N outputs, M rows */
void bench_q(const uint8_t *codes, const uint8_t *scales, int64_t E, int64_t N, int64_t K, const float *x,
             int64_t M, float *y, int threads, int64_t reps, int64_t first) {
    g_threads = threads;
    QStack q = {{codes, NULL}, {scales, NULL}, {N, 0}, 1, K};
    for (int64_t r = 0; r < reps; r++) q_linear(x, K, M, &q, (first + r) % E, N, y, N);
}
void bench_perm(float *x, int64_t M, int64_t K) { qperm_rows(x, M, K, K); }
"""


def build(packed: Path, march: str, out: Path, extra: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The harness around ``packed`` (a host_packed.c), compiled for ``march``."""
    src = out.with_suffix(".c")
    src.write_text(HARNESS.replace("PACKED", f'"{packed}"'))
    arch = ([] if march == "baseline" else [f"-march={march}"]) + ["-Wno-psabi"]
    subprocess.run(["gcc", *FLAGS, *arch, f"-I{CSRC}", *extra, "-o", str(out), str(src), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.bench_q.argtypes = [p, p, i64, i64, i64, p, i64, p, ctypes.c_int, i64, i64]
    lib.bench_perm.argtypes = [p, i64, i64]
    return lib


def baseline_source(rev: str, tmp: Path) -> Path:
    """host_packed.c as it was at git revision ``rev``."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:ds4serve/model/csrc/host_packed.c"],
                          check=True, capture_output=True, text=True).stdout
    path = tmp / "host_packed_base.c"
    path.write_text(text)
    return path


class Case:
    """Inputs for one row count: the same for both kernels."""

    def __init__(self, codes: np.ndarray, scales: np.ndarray, K: int, N: int, M: int, seed: int) -> None:
        self.codes, self.scales, self.K, self.N, self.M = codes, scales, K, N, M
        self.x = np.random.default_rng(seed).standard_normal((M, K), dtype=np.float32)
        self.y = np.zeros((M, N), np.float32)

    def run(self, lib: ctypes.CDLL, threads: int, reps: int, first: int = 0) -> float:
        """Seconds for ``reps`` expert products: wall time, or with one thread this thread's CPU time (the
        machine is shared: a thread that waits for a core is not the kernel's doing)."""
        ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
        clock = time.thread_time if threads == 1 else time.perf_counter
        t = clock()
        lib.bench_q(ptr(self.codes), ptr(self.scales), self.codes.shape[0], self.N, self.K, ptr(self.x), self.M,
                    ptr(self.y), threads, reps, first)
        return clock() - t


def reps_for(M: int) -> int:
    """Enough products for ~0.1-0.3 s at today's rates."""
    return max(4, int(240 / M))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="HEAD", help="git revision of the old host_packed.c (default HEAD)")
    ap.add_argument("--march", default="native", help="native, znver3, x86-64-v2 or baseline")
    ap.add_argument("--rows", default="1,2,4,8,64")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--K", type=int, default=4096)
    ap.add_argument("--N", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=12)
    ap.add_argument("--cflags", default="", help="extra compiler flags for the new kernel (e.g. -DQ_OUT=48)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    E, K, N = args.experts, args.K, args.N
    codes = rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8)
    scales = rng.integers(118, 128, (E, N, K // 32), dtype=np.uint8)  # weights ~2^-9 .. 6: realistic
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        old = build(baseline_source(args.baseline, tmp), args.march, tmp / "old.so")
        new = build(CSRC / "host_packed.c", args.march, tmp / "new.so", tuple(args.cflags.split()))
        print(f"CPU: {cpu_model()}  march={args.march}  K={K} N={N} experts={E}  load {load()}")
        worst = 0
        for M in map(int, args.rows.split(",")):
            case = Case(codes, scales, K, N, M, seed=M)
            for th in map(int, args.threads.split(",")):
                worst |= compare(case, old, new, th)
                ratios = []
                reps = reps_for(M)
                for r in range(args.rounds):
                    to = case.run(old, th, reps, first=r)
                    tn = case.run(new, th, reps, first=r)
                    rate = lambda t: reps * K * N / t / 1e9  # noqa: E731
                    ratios.append(to / tn)
                    print(f"M={M:4d} threads={th} round {r}: old {rate(to):6.2f}  new {rate(tn):6.2f} G weights/s"
                          f"  new/old {to / tn:5.2f}  load {load()}")
                print(f"M={M:4d} threads={th}: median new/old {statistics.median(ratios):.2f}")
        return worst


def compare(case: Case, old: ctypes.CDLL, new: ctypes.CDLL, threads: int) -> int:
    """1 (and a message) when the two kernels' outputs differ in any bit."""
    outs = []
    for lib in (old, new):
        case.y[:] = np.nan
        case.run(lib, threads, case.codes.shape[0])  # the last expert's product stays in y
        outs.append(case.y.copy())
    if outs[0].view(np.uint32).tobytes() != outs[1].view(np.uint32).tobytes():
        diff = int((outs[0].view(np.uint32) != outs[1].view(np.uint32)).sum())
        print(f"M={case.M} threads={threads}: {diff} outputs differ in their bits from the baseline's")
        return 1
    return 0


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


if __name__ == "__main__":
    sys.exit(main())
