"""The package map holds: imports go down the layers, no private name crosses a package, no
module grows past ~600 lines without saying why, and ``voltrl.__all__`` is the public API.

The layers, top to bottom (``../shared/STYLE.md``; a module may import its own package and any
lower layer; imports under ``if TYPE_CHECKING:`` are type-only and free):

    cli                  everything
    algorithms           everything below (the runtime through TrainContext, type-only)
    runtime              algorithms.base and Baseline, everything below
    observability        trajectory, store and below (the dashboard: algorithms.local, lazily)
    gateway, trajectory  store and below (not each other)
    store                the vocabulary and the agent side
    vocabulary           types, errors, resources, retry, tracing, agent, otel, _redact,
                         _console, _http
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import voltrl as vl

CORE = Path(__file__).resolve().parents[1] / "core"
ADAPTERS = Path(__file__).resolve().parents[1] / "adapters"

RANK = {
    "vocabulary": 0,
    "store": 1,
    "gateway": 2,
    "trajectory": 2,
    "observability": 3,
    "runtime": 4,
    "algorithms": 5,
    "cli": 6,
}
# What a layer may import from a higher one: (importer prefix, imported prefix, only lazily).
ALLOWED_UP = [
    ("voltrl.runtime", "voltrl.algorithms.base", False),
    ("voltrl.runtime", "voltrl.algorithms.baseline", False),
    ("voltrl.observability.dashboard", "voltrl.algorithms.local", True),
]
# The public API gathers every layer; the old tracker path re-exports the new one.
EXEMPT = {"voltrl", "voltrl.loggers"}
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = ["voltrl", *path.relative_to(CORE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANK else "vocabulary"


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
            mine, theirs = layer(me), layer(target)
            if mine == theirs or RANK[theirs] < RANK[mine]:
                continue
            if any(
                me.startswith(a) and target.startswith(b) and (lazy or not only_lazy)
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


def test_no_module_is_over_600_lines_unless_its_docstring_says_why() -> None:
    long = []
    for path in sources(CORE) + sources(ADAPTERS):
        lines = path.read_text().splitlines()
        doc = ast.get_docstring(ast.parse("\n".join(lines))) or ""
        if len(lines) > MAX_LINES and "one file is clearer" not in doc:
            long.append(f"{path}: {len(lines)} lines")
    assert long == []


def test_voltrl_all_is_exactly_the_public_names() -> None:
    public = {n for n in dir(vl) if not n.startswith("_")}
    modules = {n for n in public if inspect.ismodule(getattr(vl, n))}
    assert sorted(public - modules) == sorted(vl.__all__)
