"""DESIGN §2 / §8: imports point downward, and the model path never syncs with the host."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "ds4serve"

# Every module of ds4serve, as a unit (a package, or a top-level module), and the units it may import.
# Layers point downward (server -> runtime -> scheduler -> engine -> cache -> model); multimodal, chat
# and config are leaves that import nothing else of ds4serve; settings (the engine's knobs) sits on config
# alone (its errors are ConfigError); llm, cli, bench and tiny sit on top. The server's one door below it
# is runtime (plus the leaves and settings). One table, so a new edge is a visible change here (DESIGN §2).
LEAVES = {"config", "environment", "multimodal", "chat"}
ALLOWED = {
    "config": set(), "environment": set(), "multimodal": set(), "chat": set(),
    "settings": {"config"},  # EngineSettings, parse_budget; read by runtime and above
    "native_build": {"config", "environment"},  # compiling the C parts (model/native.py, model/host_forward.py, cache/native_view.py)
    "model": {"config", "environment", "native_build"},
    "cache": {"config", "environment", "model", "multimodal", "native_build"},  # model/batch.py only (checked below); image records
    "engine": {"config", "environment", "cache", "model", "multimodal", "chat"},  # chat: grammar masks in the sampler
    "scheduler": {"config", "engine", "cache", "model", "multimodal"},
    "runtime": {"config", "settings", "scheduler", "engine", "cache", "model", "multimodal"},
    "server": {"config", "settings", "runtime", "multimodal", "chat"},
    "llm": {"config", "settings", "runtime", "scheduler", "engine", "cache", "model", "multimodal", "chat"},
    "tiny": {"config", "environment", "llm", "runtime", "scheduler", "engine", "cache", "model", "multimodal", "chat"},
    "bench": {"config", "llm", "server", "runtime", "scheduler", "engine", "cache", "model", "multimodal", "chat",
              "tiny"},
    "cli": {"config", "settings", "llm", "server", "bench", "tiny", "runtime", "scheduler", "engine", "cache",
            "model", "multimodal", "chat", "cli_inspect", "cli_tiny"},
    "cli_inspect": {"config", "settings", "runtime", "cache", "model"},  # info / plan: read a config, never serve
    "cli_tiny": {"tiny", "llm"},  # tiny train / eval
    "__init__": {"llm", "config", "environment"},
}


def _unit(path: Path) -> str:
    rel = path.relative_to(PKG).parts
    return rel[0] if len(rel) > 1 else rel[0][:-3]


def _imports(path: Path, text: str | None = None) -> set[str]:
    """Dotted ``ds4serve`` modules that ``path`` (or ``text`` read as if it were there) imports, relative
    imports resolved, at any depth and under ``if TYPE_CHECKING:`` too (an annotation-only import is
    still a dependency a reader follows)."""
    here = ["ds4serve", *path.relative_to(PKG).with_suffix("").parts][:-1]  # the file's package
    tree = ast.parse(path.read_text() if text is None else text)
    out = set()
    for node in ast.walk(tree):
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


# modules and functions allowed past the limits below, each with its written reason (none today)
LONG_MODULES: dict[str, str] = {}
LONG_FUNCTIONS: dict[str, str] = {}


def test_files_and_functions_stay_small():
    """No module over 500 lines and no function over 60 without a written reason (``LONG_*`` above)."""
    big, long = [], []
    for f in PKG.rglob("*.py"):
        src, name = f.read_text(), str(f.relative_to(PKG))
        if len(src.splitlines()) > 500 and name not in LONG_MODULES:
            big.append((name, len(src.splitlines())))
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    node.end_lineno - node.lineno >= 60 and f"{name}:{node.name}" not in LONG_FUNCTIONS:
                long.append((f"{name}:{node.name}", node.end_lineno - node.lineno + 1))
    assert not big and not long, (big, long)


def _circles(imports: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of a graph of modules (each found once, from its first module in sorted order)."""
    def target(name: str) -> str | None:  # a module, or the module a name is imported from
        return name if name in imports else name.rsplit(".", 1)[0] if name.rsplit(".", 1)[0] in imports else None

    graph = {m: {t for i in names if (t := target(i)) and t != m} for m, names in imports.items()}
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
    return circles


def test_no_import_circles():
    """Module A imports B (at any depth of a function, not only at the top, and under ``if
    TYPE_CHECKING:`` too) and B imports A: neither can be read, tested or moved alone. The model's
    number formats used to sit in the checkpoint reader with the packed stacks importing them back
    (now model/quant.py, below both); ``runtime/warmup.py`` and ``calibrate.py`` used to annotate with
    the ``EngineCore`` whose constructor ran them (now they take ``runtime/parts.EngineParts``, and
    ``runtime/assemble.py`` runs them before it constructs the core)."""
    modules = {".".join(("ds4serve", *f.relative_to(PKG).with_suffix("").parts)).removesuffix(".__init__"): f
               for f in PKG.rglob("*.py")}
    circles = _circles({m: _imports(f) for m, f in modules.items()})
    assert not circles, circles


def test_a_type_checking_import_closes_a_circle():
    """The shape the circle rule exists for: the constructor's module imports the start-up module,
    which imports the constructor's class back for its annotations only."""
    old_warmup = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .core import EngineCore\n"
    imports = {"ds4serve.runtime.core": _imports(PKG / "runtime" / "core.py", "from .warmup import warm_up\n"),
               "ds4serve.runtime.warmup": _imports(PKG / "runtime" / "warmup.py", old_warmup)}
    assert _circles(imports) == [["ds4serve.runtime.core", "ds4serve.runtime.warmup", "ds4serve.runtime.core"]]


# ---- the server reaches the engine only through EngineLoop's named methods -----------------------
ENGINE_OBJECTS = {"core", "scheduler", "cache", "engine"}  # names the engine's objects go by
ENGINE_CLASSES = {"EngineCore", "EngineParts", "Scheduler", "CacheManager", "PrefixCache", "Engine"}


def _links(node: ast.expr) -> list[str]:
    """The names an attribute chain goes through, root first: ``state.loop.core`` -> state, loop, core;
    a call is looked through (``f(x).y`` -> f, y); any other root is ``?``."""
    links = []
    while True:
        if isinstance(node, ast.Attribute):
            links.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        else:
            links.append(node.id if isinstance(node, ast.Name) else "?")
            return links[::-1]


def _engine_reach(text: str) -> list[str]:
    """Where a server module touches the engine behind ``EngineLoop`` (empty: nowhere). The rule, on
    every attribute access ``x.a`` of the module (``x`` any chain of names, calls looked through):

    * ``x`` ends in a name the engine's objects go by (``core``, ``scheduler``, ``cache``, ``engine``):
      an attribute of an engine object is touched (``core.scheduler``, ``cache.state``, ``core.prefix_stats``);
    * ``a`` is one of those names: an engine object is taken out of something (``state.loop.core``),
      unless ``x`` is a module the file imports (``functools.cache`` is not an engine object);
    * ``a`` is ``call`` on a chain ending in ``loop``: ``EngineLoop.call`` runs any function of the core
      (tests and probes use it; the server names what it asks for: ``reset_prefix_cache``, ...).

    Importing an engine class (``EngineCore``, ``Scheduler``, ``CacheManager``, ...) is reach too.
    Names are the signal because the server gets engine objects only by duck typing: a server-side
    object called ``cache`` (say, of HTTP responses) must take another name here, which is cheap."""
    tree = ast.parse(text)
    modules = {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found += [f"{node.lineno}: imports {a.name}" for a in node.names if a.name in ENGINE_CLASSES]
        if not isinstance(node, ast.Attribute):
            continue
        base = _links(node.value)
        where = f"{node.lineno}: {'.'.join(base)}.{node.attr}"
        if base[-1] in ENGINE_OBJECTS:
            found.append(f"{where} (an attribute of an engine object)")
        elif node.attr in ENGINE_OBJECTS and not (len(base) == 1 and base[0] in modules):
            found.append(f"{where} (an engine object taken out)")
        elif node.attr == "call" and base[-1] == "loop":
            found.append(f"{where} (any function of the core)")
    return found


def test_the_server_reaches_the_engine_only_through_named_loop_methods():
    """No module under server/ touches an attribute of a core, scheduler or cache object (see
    ``_engine_reach``): what the server reads comes from ``EngineLoop`` (``stats``: the core's
    published ``EngineStats``; ``limits``, ``model_config``, ...), what it asks for is a named
    ``EngineLoop`` method (``submit``, ``abort``, ``reset_prefix_cache``, ``on_rank_lost``, ...)."""
    problems = [f"{f.relative_to(PKG)}:{p}" for f in sorted((PKG / "server").rglob("*.py"))
                for p in _engine_reach(f.read_text())]
    assert not problems, "\n".join(problems)


def test_the_reach_rule_sees_the_shapes_it_forbids():
    """The shapes the server used before the rule (metrics, prefix reset, rank loss), and what it may do."""
    old = '''
def snapshot(core):
    c = core.scheduler.counts()
    return c, core.cache.state.pages.used_pages, dict(core.prefix_stats())

async def reset(state):
    return await state.run_blocking(state.loop.call, _reset)

def lost(state):
    state.loop.core.parallel.on_lost = lambda why: state.loop.begin_shutdown(why)

from ..runtime import EngineCore
'''
    found = "\n".join(_engine_reach(old))
    for shape in ("core.scheduler", "core.cache", "core.prefix_stats", "state.loop.call", "state.loop.core",
                  "imports EngineCore"):
        assert shape in found, (shape, found)
    allowed = '''
import functools

@functools.cache
def f(state, salt):
    return state.loop.stats.pages_in_use, state.loop.reset_prefix_cache(), salt.cache_salt
'''
    assert _engine_reach(allowed) == []
