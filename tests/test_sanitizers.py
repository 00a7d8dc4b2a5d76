"""The native forward's tests under AddressSanitizer and UndefinedBehaviorSanitizer, in CI.

``scripts/sanitize.sh`` rebuilds every C part with ``-fsanitize=address,undefined`` and runs tests in a
Python that preloads the ASan runtime; any invalid access or undefined behaviour fails the run with a
report. The whole default set takes ~4 minutes on 2 cores, so CI runs the files that drive the C most
directly (every view form, packed experts, the small kernels and the view builder).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = ["tests/test_host_forward.py", "tests/test_host_packed.py", "tests/test_native_kernels.py",
         "tests/test_native_view.py"]


def _asan() -> Path | None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    out = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return Path(out) if out and Path(out).is_file() else None


@pytest.mark.timeout(900)
@pytest.mark.skipif(_asan() is None, reason="no C compiler with AddressSanitizer's runtime (libasan)")
def test_native_tests_are_clean_under_the_sanitizers(tmp_path):
    done = subprocess.run(["bash", "scripts/sanitize.sh", *FILES], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "DS4SERVE_CACHE": str(tmp_path)})
    assert done.returncode == 0, f"{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
    assert "sanitizers: clean" in done.stdout and " passed" in done.stdout and " failed" not in done.stdout
