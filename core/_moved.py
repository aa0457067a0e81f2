"""Old import paths of modules that moved, kept for one release: each imports, with a
``DeprecationWarning`` naming the new path, as a module that looks its names up in the new ones.

``MOVED`` is the one list: old path -> the modules that now hold its names, searched in order.
Nothing in voltrl imports an old path (``tests/project/test_layout.py`` checks); a release after 0.2
deletes this module and its line in ``voltrl/__init__.py``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any

_LOCAL = "voltrl.algorithms.local"
_ENGINE = ["__init__", "batch", "core", "front", "sampling", "sequences", "vllm"]
_API = ["__init__", "app", "handlers", "logprobs", "params"]

MOVED: dict[str, tuple[str, ...]] = {
    # 0.2: serving and models left algorithms/local (the trackers left voltrl.loggers in 0.1)
    "voltrl.loggers": ("voltrl.observability.trackers",),
    f"{_LOCAL}.models": ("voltrl.models.loading",),
    f"{_LOCAL}.packaged": ("voltrl.models.packaged",),
    f"{_LOCAL}.tiny": ("voltrl.models.tiny",),
    f"{_LOCAL}.chat": ("voltrl.models.chat", f"{_LOCAL}.conversations"),
    f"{_LOCAL}.toolcalls": ("voltrl.models.toolcalls",),
    f"{_LOCAL}.precision": ("voltrl.models.precision", f"{_LOCAL}.master_weights"),
    f"{_LOCAL}.threads": ("voltrl.models.threads",),
    f"{_LOCAL}.lora_adapters": ("voltrl.models.lora",),
    f"{_LOCAL}.prefix_cache": (f"{_LOCAL}.shared_prefix", "voltrl.models.kv_cache"),
    f"{_LOCAL}.rows": (f"{_LOCAL}.token_rows",),
    f"{_LOCAL}.engine_choice": ("voltrl.serving.choice",),
    f"{_LOCAL}.engine.prefixes": ("voltrl.serving.engine.prefix_cache",),
    **{
        f"{_LOCAL}.engine" + ("" if m == "__init__" else f".{m}"): (
            "voltrl.serving.engine" + ("" if m == "__init__" else f".{m}"),
        )
        for m in _ENGINE
    },
    **{
        f"{_LOCAL}.openai_api" + ("" if m == "__init__" else f".{m}"): (
            "voltrl.serving.openai_api" + ("" if m == "__init__" else f".{m}"),
        )
        for m in _API
    },
}
"""Old module path -> the new modules its names are looked up in, in order."""

_PACKAGES = {f"{_LOCAL}.engine", f"{_LOCAL}.openai_api"}


class _Moved(types.ModuleType):
    """An old path: its attributes are the first of its new modules' that has the name."""

    def __init__(self, name: str, targets: tuple[str, ...]) -> None:
        super().__init__(name, f"Moved to {', '.join(targets)}.")
        self._targets = targets

    def __getattr__(self, attr: str) -> Any:
        if attr == "__all__":  # ``from old import *``: the new modules' public names
            return [n for t in self._targets for n in _public(importlib.import_module(t))]
        if attr.startswith("__"):
            raise AttributeError(attr)
        for target in self._targets:
            module = importlib.import_module(target)
            if hasattr(module, attr):
                return getattr(module, attr)
        raise AttributeError(
            f"module {self.__name__!r} (moved to {self._targets[0]}) has no {attr!r}"
        )


def _public(module: types.ModuleType) -> list[str]:
    """What ``from module import *`` takes: its ``__all__``, else its public names."""
    names = getattr(module, "__all__", None)
    return list(names) if names is not None else [n for n in vars(module) if n[0] != "_"]


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports the old paths in :data:`MOVED` (``sys.meta_path`` holds one, from ``import
    voltrl``)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=name in _PACKAGES)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        targets = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {' and '.join(targets)}: the old path goes after voltrl 0.2",
            DeprecationWarning,
            stacklevel=2,
        )
        module = _Moved(spec.name, targets)
        if spec.name in _PACKAGES:
            module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the names are looked up when asked for."""


def install() -> None:
    """Put one :class:`MovedFinder` first on ``sys.meta_path``: it answers only for the names in
    :data:`MOVED`, and an old package's folder left behind (its ``__pycache__``, after a ``git
    pull``) would otherwise import as an empty namespace package."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
