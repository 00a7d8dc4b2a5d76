"""DESIGN §2 / §8: imports point downward, and the model path never syncs with the host."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "ds4serve"

# package -> internal packages it may import (besides itself and config)
ALLOWED = {
    "model": set(),
    "cache": {"model"},
    "engine": {"cache", "model", "multimodal"},
    "scheduler": {"engine", "cache", "model", "multimodal"},
    "server": {"scheduler", "engine", "cache", "model", "multimodal", "chat", "tiny"},
    "multimodal": set(),
    "chat": set(),
}


def _internal_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    rel_pkg = path.relative_to(PKG).parts[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and node.module.startswith("ds4serve."):
                out.add(node.module.split(".")[1])
            elif node.level == 1:
                out.add(rel_pkg)
            elif node.level == 2:
                out.add((node.module or "").split(".")[0] or rel_pkg)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("ds4serve."):
                    out.add(a.name.split(".")[1])
    return out


def test_imports_point_downward():
    problems = []
    for pkg, allowed in ALLOWED.items():
        for f in (PKG / pkg).glob("*.py"):
            bad = _internal_imports(f) - allowed - {pkg, "config", ""}
            if bad:
                problems.append(f"{f.relative_to(PKG)} imports {sorted(bad)}")
    assert not problems, "\n".join(problems)


# calls that wait for the device (or print): none on the per-step path of the model and of decode steps
SYNCS = ("item", "tolist", "cpu", "print", "unique", "nonzero", "bincount")
DECODE_PATH = [PKG / "cache" / "static_view.py", PKG / "engine" / "decode_graphs.py"]


def test_model_and_decode_path_have_no_host_syncs_or_prints():
    """No .item()/.tolist()/.cpu()/unique/nonzero/bincount/print in model/ or the fixed-shape decode
    path (cache/static_view, engine/decode_graphs), except lines marked sync-ok (first-use checks)."""
    problems = []
    files = [f for f in (PKG / "model").glob("*.py") if f.name not in ("weights.py", "loader.py")]  # load time
    for f in files + DECODE_PATH:
        lines = f.read_text().splitlines()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                if name in SYNCS and "sync-ok" not in lines[node.lineno - 1]:
                    problems.append(f"{f.relative_to(PKG)}:{node.lineno}: {name}()")
    assert not problems, problems


def test_files_stay_small():
    """No module over ~600 lines without a reason."""
    big = [(f.relative_to(PKG), n) for f in PKG.rglob("*.py") if (n := len(f.read_text().splitlines())) > 600]
    assert not big, big
