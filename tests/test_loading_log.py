"""Model loading reports what it did: a byte-counting progress bar on a terminal, and one summary
log line ("loaded N tensors, X GiB in Y s") that stays in a log file where no bar is drawn."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from ds4serve.config import ModelConfig
from ds4serve.model import weights
from ds4serve.model.loader import expected_tensors
from ds4serve.model.vision import expected_vision_tensors

SUMMARY = re.compile(r"loaded (\d+) tensors, ([0-9.e+-]+) GiB in ([0-9.]+) s")


class _Bar:
    """Stands in for tqdm: records how it was built and what it counted."""

    made: list[_Bar] = []

    def __init__(self, *args, **kwargs):
        self.kwargs, self.counted = kwargs, 0
        _Bar.made.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n):
        self.counted += n


def _load(path, progress: bool):
    cfg = ModelConfig.from_file(path)
    expected = expected_tensors(cfg) | expected_vision_tensors(cfg)
    return weights.load_state_dict(path, expected, dtype=torch.float32, device="cpu", progress=progress)


@pytest.mark.parametrize("progress", [True, False])
def test_progress_counts_bytes_and_a_summary_line_is_logged(random_ckpt, monkeypatch, caplog, progress):
    _Bar.made.clear()
    monkeypatch.setattr(weights, "tqdm", _Bar)
    with caplog.at_level(logging.INFO, logger="ds4serve.model.weights"):
        sd = _load(random_ckpt, progress)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    (bar,) = _Bar.made
    assert bar.kwargs["unit"] == "B" and bar.kwargs["unit_scale"] is True
    assert bar.kwargs["total"] == bar.counted == nbytes  # the planned total is what was loaded
    assert bar.kwargs["disable"] is (None if progress else True)  # None: drawn only on a terminal
    lines = [m for r in caplog.records if (m := SUMMARY.search(r.getMessage()))]
    assert len(lines) == 1
    n, gib, seconds = lines[0].groups()
    assert int(n) == len(sd) and float(gib) == pytest.approx(nbytes / 2**30, rel=5e-3) and float(seconds) >= 0


def test_start_up_is_logged_per_phase(caplog):
    """Time to healthy is the sum of phases a user can act on (load, engine, self-check, warm-up,
    calibration): the log names each with its seconds, and they add up to the total it gives."""
    from ds4serve.runtime.assemble import load_core
    from ds4serve.settings import EngineSettings
    from ds4serve.tiny.random_model import BUNDLED

    with caplog.at_level(logging.INFO, logger="ds4serve.runtime.assemble"):
        core = load_core(BUNDLED, settings=EngineSettings(max_seqs=2, max_stall=2.0))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up took"))
    phases = dict(re.findall(r"([a-z-]+) ([0-9.]+) s", line.split(":", 1)[1]))
    assert list(phases) == ["load", "engine", "self-check", "warm-up", "calibration"], line
    total = float(re.match(r"start-up took ([0-9.]+) s", line).group(1))
    assert abs(sum(map(float, phases.values())) - total) <= 0.1 * len(phases), line
    assert set(core.startup) == set(phases)
    core.close()
