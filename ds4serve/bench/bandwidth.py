"""How fast this machine streams memory: the denominator of a decode roofline.

A single stream's decode step reads every weight it multiplies once, so on a model that does not fit in
the caches its best rate is (read bandwidth) / (bytes per token) (``model.footprint``). The probe sums
a buffer several times larger than any cache with torch's vectorised, multi-threaded reduction (read
traffic only, as a decode step's weight reads are) and keeps the best of a few passes.
"""

from __future__ import annotations

import time

import torch


def read_bandwidth(mib: int = 256, passes: int = 5) -> float:
    """Bytes per second one pass over a ``mib`` MiB fp32 buffer reads, best of ``passes`` (torch's threads)."""
    buf = torch.ones(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        float(buf.sum())
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best
