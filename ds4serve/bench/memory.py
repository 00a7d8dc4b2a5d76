"""Peak resident memory of a process, for the benchmarks' reports (Linux; None elsewhere).

Memory is a target like speed (a server that needs 6x the RAM of a peer is not better), so the
bench commands print the high-water mark of the process they measured.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path


def peak_rss_mib(pid: int | None = None) -> float | None:
    """``VmHWM`` of ``pid`` (default: this process) in MiB, or ``None`` if it cannot be read."""
    status = Path(f"/proc/{pid or 'self'}/status")
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    if pid is None and sys.platform == "darwin":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # bytes on macOS
    return None


def describe(label: str, pid: int | None = None) -> str:
    mib = peak_rss_mib(pid)
    return f"{label}: peak RSS {mib:.0f} MiB" if mib is not None else f"{label}: peak RSS unknown"
