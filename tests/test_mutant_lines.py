"""The mutation probe (``scripts/mutants.py``) stays pointed at the code: each mutant's line occurs exactly
once in its file. A refactor that moves or rewrites a guarded line leaves its mutant matching nothing, and
the probe then reports it "not applied" instead of saying whether the behaviour is still guarded (one
such mutant, c1, went unnoticed for sessions)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_mutant_line_occurs_once_in_its_file():
    spec = importlib.util.spec_from_file_location("mutants", ROOT / "scripts" / "mutants.py")
    mutants = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mutants", mutants)  # its dataclasses look their module up there
    spec.loader.exec_module(mutants)
    assert len(mutants.MUTANTS) > 50
    counts = {m.key: (ROOT / m.path).read_text().count(m.old) for m in mutants.MUTANTS}
    assert {k: n for k, n in counts.items() if n != 1} == {}
    assert len({m.key for m in mutants.MUTANTS}) == len(mutants.MUTANTS)  # keys name one mutant each
