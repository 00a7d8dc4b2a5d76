"""DESIGN §2 / §8: imports point downward, and the model path never syncs with the host."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "ds4serve"

# Every module of ds4serve, as a unit (a package, or a top-level module), and the units it may import.
# Layers point downward (server -> runtime -> scheduler -> engine -> cache -> model); multimodal, chat
# and config are leaves that import nothing else of ds4serve; llm, cli, bench and tiny sit on top. The
# server's one door below it is runtime (plus the leaves). One table, so a new edge is a visible change
# here (DESIGN §2).
LEAVES = {"config", "environment", "multimodal", "chat"}
ALLOWED = {
    "config": set(), "environment": set(), "multimodal": set(), "chat": set(),
    "native_build": {"config", "environment"},  # compiling the C parts (model/native.py, model/host_decode.py, cache/native_view.py)
    "model": {"config", "environment", "native_build"},
    "cache": {"config", "environment", "model", "multimodal", "native_build"},  # model/batch.py only (checked below); image records
    "engine": {"config", "environment", "cache", "model", "multimodal", "chat"},  # chat: grammar masks in the sampler
    "scheduler": {"config", "engine", "cache", "model", "multimodal"},
    "runtime": {"config", "scheduler", "engine", "cache", "model", "multimodal"},
    "server": {"config", "runtime", "multimodal", "chat"},
    "llm": {"config", "runtime", "scheduler", "engine", "cache", "model", "multimodal", "chat"},
    "tiny": {"config", "environment", "llm", "runtime", "scheduler", "engine", "cache", "model", "multimodal", "chat"},
    "bench": {"config", "llm", "server", "runtime", "scheduler", "engine", "cache", "model", "multimodal", "chat",
              "tiny"},
    "cli": {"config", "llm", "server", "bench", "tiny", "runtime", "scheduler", "engine", "cache", "model",
            "multimodal", "chat", "cli_inspect", "cli_tiny"},
    "cli_inspect": {"config", "runtime", "cache", "model"},  # info / plan: read a config, never serve
    "cli_tiny": {"tiny", "llm"},  # tiny train / eval
    "__init__": {"llm", "config", "environment"},
}


def _unit(path: Path) -> str:
    rel = path.relative_to(PKG).parts
    return rel[0] if len(rel) > 1 else rel[0][:-3]


def _imports(path: Path, runtime_only: bool = False) -> set[str]:
    """Dotted ``ds4serve`` modules that ``path`` imports (relative imports resolved); ``runtime_only``
    leaves out those under ``if TYPE_CHECKING:`` (annotations only, never executed)."""
    here = ["ds4serve", *path.relative_to(PKG).with_suffix("").parts][:-1]  # the file's package
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if runtime_only and isinstance(node, ast.If)
                   and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING" for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            names = [mod + "." + a.name for a in node.names] if not node.module else [mod]
            out.update(n for n in names if n.startswith("ds4serve"))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("ds4serve"))
    return out


def _internal_imports(path: Path) -> set[str]:
    """Units of ds4serve that ``path`` imports, other than its own."""
    units = {m.split(".")[1] for m in _imports(path) if m.count(".") >= 1}
    return units - {_unit(path)}


def test_every_module_is_in_the_table():
    units = {_unit(f) for f in PKG.rglob("*.py")}
    assert units == set(ALLOWED), f"units missing from ALLOWED: {units - set(ALLOWED)}, stale: {set(ALLOWED) - units}"


def test_imports_point_downward():
    problems = []
    for f in sorted(PKG.rglob("*.py")):
        bad = _internal_imports(f) - ALLOWED[_unit(f)]
        if bad:
            problems.append(f"{f.relative_to(PKG)} imports {sorted(bad)}")
        if _unit(f) == "cache":
            reach = {m for m in _imports(f) if m.startswith("ds4serve.model")} - {"ds4serve.model.batch"}
            if reach:
                problems.append(f"{f.relative_to(PKG)} reaches into model beyond model/batch.py: {sorted(reach)}")
    assert not problems, "\n".join(problems)


def test_environment_is_read_only_in_environment_and_the_cli():
    readers = sorted(str(f.relative_to(PKG)) for f in PKG.rglob("*.py")
                     if "os.environ" in f.read_text() or "os.getenv" in f.read_text())
    assert readers == ["cli.py", "environment.py"], readers


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


def test_no_import_circles():
    """Module A imports B (at any depth of a function, not only at the top) and B imports A: neither
    can be read, tested or moved alone. The model's number formats used to sit in the checkpoint
    reader with the packed stacks importing them back (now model/quant.py, below both)."""
    modules = {".".join(("ds4serve", *f.relative_to(PKG).with_suffix("").parts)).removesuffix(".__init__"): f
               for f in PKG.rglob("*.py")}
    def target(name: str) -> str | None:  # a module, or the module a name is imported from
        return name if name in modules else name.rsplit(".", 1)[0] if name.rsplit(".", 1)[0] in modules else None

    graph = {m: {t for i in _imports(f, runtime_only=True) if (t := target(i)) and t != m} for m, f in modules.items()}
    circles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                circles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, circles
