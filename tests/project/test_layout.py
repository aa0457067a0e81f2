"""The package map holds: imports go down the layers, no private name crosses a package, no
import cycle is left (voltrl, the samples, the benchmarks), the old paths of moved modules are
used by no one, and ``voltrl.__all__`` is the public API. The
largest modules are listed in the test output (``-rP``), a nudge to cut them by job.

The layers, top to bottom (``../shared/STYLE.md``; a module may import its own package and any
lower layer; imports under ``if TYPE_CHECKING:`` are type-only and free):

    cli                      everything
    algorithms               everything below (the runtime through TrainContext, type-only)
    runtime                  algorithms.base and Baseline, everything below
    observability            trajectory, store and below (the dashboard: LocalRL's advantage
                             function, lazily, to show each row's advantage as the update
                             computed it)
    gateway, trajectory,     store, models and below (not each other; serving: models)
    serving
    store, models            the vocabulary and the agent side
    vocabulary               types, errors, resources, retry, tracing, agent, otel, _redact,
                             _console, _http, _moved, _dotted, _imports
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

import voltrl as vl
from voltrl._moved import MOVED

CORE = ROOT / "core"
ADAPTERS = ROOT / "adapters"

RANK = {
    "vocabulary": 0,
    "store": 1,
    "models": 1,
    "gateway": 2,
    "trajectory": 2,
    "serving": 2,
    "observability": 3,
    "runtime": 4,
    "algorithms": 5,
    "cli": 6,
}
# What a layer may import from a higher one: (importer prefix, imported prefix, only lazily).
# The runtime runs an Algorithm (Baseline when given none); the dashboard shows a LocalRL row's
# advantage with the update's own function, so the page and the update cannot disagree.
ALLOWED_UP = [
    ("voltrl.runtime", "voltrl.algorithms.base", False),
    ("voltrl.runtime", "voltrl.algorithms.baseline", False),
    ("voltrl.observability.dashboard", "voltrl.algorithms.local.update", True),
]
# The public API gathers every layer.
EXEMPT = {"voltrl"}
LARGEST_SHOWN = 12


def module_name(path: Path) -> str:
    parts = ["voltrl", *path.relative_to(CORE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANK else "vocabulary"


def within(module: str, package: str) -> bool:
    """Whether ``module`` is ``package`` or inside it (a dot boundary: ``a.update`` is not
    inside ``a.up``)."""
    return module == package or module.startswith(package + ".")


def voltrl_imports(tree: ast.Module) -> list[tuple[int, str, list[str], bool]]:
    """``(line, module, names, lazy)`` of each import of voltrl outside TYPE_CHECKING."""
    type_only = {
        n.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
        if hasattr(n, "lineno")
    }
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom) or node.lineno in type_only:
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("voltrl"):
            names = [a.name for a in node.names]
            found.append((node.lineno, node.module or "", names, id(node) not in top))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("voltrl"):
                    found.append((node.lineno, alias.name, [], id(node) not in top))
    return found


def sources(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def test_imports_go_down_the_layers() -> None:
    wrong = []
    for path in sources(CORE):
        me = module_name(path)
        if me in EXEMPT:
            continue
        for line, target, _, lazy in voltrl_imports(ast.parse(path.read_text())):
            if target == "voltrl":  # the public API gathers every layer: no layer imports it
                wrong.append(f"{path.relative_to(CORE)}:{line}: {layer(me)} imports voltrl")
                continue
            mine, theirs = layer(me), layer(target)
            if mine == theirs or RANK[theirs] < RANK[mine]:
                continue
            if any(
                within(me, a) and within(target, b) and (lazy or not only_lazy)
                for a, b, only_lazy in ALLOWED_UP
            ):
                continue
            wrong.append(f"{path.relative_to(CORE)}:{line}: {mine} imports {target} ({theirs})")
    assert wrong == []


def test_adapters_use_only_the_agent_side_and_the_vocabulary() -> None:
    wrong = [
        f"{path.relative_to(ADAPTERS)}:{line}: {target}"
        for path in sources(ADAPTERS)
        for line, target, _, _ in voltrl_imports(ast.parse(path.read_text()))
        if layer(target) != "vocabulary" and not target.startswith("voltrl.adapters")
    ]
    assert wrong == []


def test_no_private_name_is_imported_across_packages() -> None:
    wrong = []
    for path in sources(CORE):
        me = module_name(path)
        for line, target, names, _ in voltrl_imports(ast.parse(path.read_text())):
            home = target.split(".")[1] if "." in target else ""
            if home == (me.split(".")[1] if "." in me else ""):
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            wrong += [f"{path.relative_to(CORE)}:{line}: {target}.{n}" for n in private]
    assert wrong == []


def test_the_largest_modules_are_listed() -> None:
    """Not a cap: the largest modules, printed (``pytest -rP``), for whoever cuts the next one
    by job. A module that passes 1,000 lines without its docstring saying why fails."""
    sizes = sorted(
        ((len(p.read_text().splitlines()), p) for p in sources(CORE) + sources(ADAPTERS)),
        key=lambda s: s[0],
        reverse=True,
    )
    print("largest modules:")
    for lines, path in sizes[:LARGEST_SHOWN]:
        print(f"  {lines:5d}  {path.relative_to(CORE.parent)}")
    unexplained = [
        f"{path}: {lines} lines"
        for lines, path in sizes
        if lines > 1000
        and "one file is clearer" not in (ast.get_docstring(ast.parse(path.read_text())) or "")
    ]
    assert unexplained == []


def imported_closure(module: str) -> set[str]:
    """The voltrl modules ``module`` imports, directly or through others (type-only imports
    aside; a package's ``__init__`` counts where it is imported, ``voltrl``'s own aside)."""
    paths = {module_name(p): p for p in sources(CORE)}
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen or name not in paths:
            continue
        seen.add(name)
        for _, target, names, _ in voltrl_imports(ast.parse(paths[name].read_text())):
            todo += [target, *(f"{target}.{n}" for n in names)]
    return seen - {"voltrl"}


def test_serving_and_fetching_a_model_import_no_algorithm() -> None:
    """Neither in the code (every import ``voltrl model`` reaches) nor when it runs."""
    assert [m for m in imported_closure("voltrl.cli.model") if layer(m) == "algorithms"] == []
    code = (
        "import sys; from voltrl.cli.main import main; main(['model', 'list']); "
        "print([m for m in sys.modules if m.startswith(('voltrl.algorithms', 'voltrl.runtime'))])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "[]"


def test_no_module_imports_an_old_path() -> None:
    wrong = [
        f"{path.relative_to(CORE.parent)}:{line}: {target}"
        for path in sources(CORE) + sources(ADAPTERS)
        for line, target, _, _ in voltrl_imports(ast.parse(path.read_text()))
        if target in MOVED
    ]
    assert wrong == []


def test_old_paths_import_the_moved_modules_with_a_warning() -> None:
    for old in sorted(MOVED, key=lambda name: name.count(".")):  # a package before its modules
        targets = MOVED[old]
        if any(importlib.util.find_spec(t.rsplit(".", 1)[0]) is None for t in targets):
            continue
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=re.escape(old) + " moved to"):
            module = importlib.import_module(old)
        new = importlib.import_module(targets[0])
        public = [
            n for n in dir(new) if not n.startswith("_") and not inspect.ismodule(getattr(new, n))
        ]
        assert public, new
        assert all(getattr(module, n) is getattr(new, n) for n in public), old
    star: dict[str, object] = {}
    sys.modules.pop("voltrl.loggers", None)
    with pytest.warns(DeprecationWarning):
        exec("from voltrl.loggers import *", star)  # 0.1's voltrl.loggers had an __all__
    assert {"Logger", "TensorBoardLogger", "WandbLogger", "MlflowLogger"} <= set(star)


def module_edges() -> dict[Path, set[Path]]:
    """Each Python file of voltrl, the samples and the benchmarks, and the files of the
    repository it imports when it is imported: at module level, outside ``TYPE_CHECKING``
    (``voltrl.x.y`` is ``core/x/y.py``; a bare name, a file beside the importer or in the
    folder above, as a sample's or benchmark's ``sys.path`` has them)."""
    files = sources(CORE) + sources(ROOT / "samples") + sources(ROOT / "benchmarks")

    def voltrl_file(name: str, near: Path) -> Path | None:
        base = CORE.joinpath(*name.split(".")[1:])
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
        return None

    def bare_file(name: str, near: Path) -> Path | None:
        for folder in (near.parent, near.parent.parent):
            path = folder.joinpath(*name.split(".")).with_suffix(".py")
            if path.is_file():
                return path
        return None

    edges: dict[Path, set[Path]] = {}
    for path in files:
        tree = ast.parse(path.read_text())
        type_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        targets: set[Path | None] = set()
        for node in tree.body:  # module level only: lazy imports run after the module loaded
            if id(node) in type_only:
                continue
            if isinstance(node, ast.Import):
                pairs = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                pairs = [(node.module, a.name) for a in node.names]
            else:
                continue
            for module, name in pairs:  # from M import N: module M.N if there is one, else M
                find = voltrl_file if module.split(".")[0] == "voltrl" else bare_file
                whole = name and find(f"{module}.{name}", path)
                targets.add(whole or find(module, path))
        edges[path] = {t for t in targets if t is not None and t != path}
    return edges


def test_no_import_cycle_in_the_repository() -> None:
    edges = module_edges()
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    cycles: list[list[str]] = []

    def visit(node: Path) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while (top := stack.pop()) != node:
                group.append(top)
            group.append(node)
            if len(group) > 1:
                cycles.append(sorted(str(p.relative_to(ROOT)) for p in group))

    for node in edges:
        if node not in index:
            visit(node)
    assert cycles == []


def test_voltrl_all_is_exactly_the_public_names() -> None:
    public = {n for n in dir(vl) if not n.startswith("_")}
    modules = {n for n in public if inspect.ismodule(getattr(vl, n))}
    assert sorted(public - modules) == sorted(vl.__all__)
