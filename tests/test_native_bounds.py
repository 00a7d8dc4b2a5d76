"""Native code that no view or checkpoint table can drive out of bounds.

Built with ``DS4SERVE_NATIVE_CHECK=1`` (``-DDS4_CHECK``), the host forward checks every index it
gathers or scatters with against the size of the ring, pool, snapshot arena or table it indexes (the
sizes come with the descriptors, ``host_forward._Layer``), and stops with the index's name, value and
range. Each test runs in a fresh process (the build is chosen when the library is first loaded, and a
failed check aborts the process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ds4serve.model import host_forward
from ds4serve.tiny.random_model import BUNDLED

HERE = Path(__file__).resolve().parent
pytestmark = [pytest.mark.skipif(host_forward.library() is None, reason="no C compiler: no native forward here"),
              pytest.mark.skipif(not (BUNDLED / "model.safetensors").exists(), reason="bundled model not present")]


def _checked(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DS4SERVE_NATIVE_CHECK="1")
    return subprocess.run([sys.executable, str(HERE / "native_checked.py"), *args], env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.timeout(600)
def test_a_checked_build_serves_prefill_decode_images_prefix_hits_and_preemption():
    done = _checked("serve")
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["images"] > 0 and got["prefix_hits"] > 0 and got["suspend"] + got["drop"] > 0, got
    assert got["same_as_large_pool"] and got["leaks"] == "", got
    assert got["correct"] >= 0.8 * got["n"], got


@pytest.mark.timeout(300)
@pytest.mark.parametrize("what, message", [
    ("swa_dst", "ring row written"),
    ("swa_keys", "ring row = "),
    ("emit_rows", "compressed pool row written"),
    ("visible", "compressed pool row attended"),
    ("indexer", "indexer pool row"),
    ("tid2eid", "tid2eid expert id"),
    ("capture", "ring row written"),
])
def test_an_index_out_of_range_stops_a_checked_build_with_its_name(what, message):
    done = _checked("corrupt", what)
    assert done.returncode != 0 and "the forward ran to the end" not in done.stdout, done.stdout[-2000:]
    assert f"ds4 native bounds check failed: {message}" in done.stderr, done.stderr[-3000:]
    assert "is outside [0, " in done.stderr
