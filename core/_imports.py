"""Importing what a command names as ``MODULE:NAME``: a dotted module (imported with the
current directory on ``sys.path``) or a ``path/to/file.py`` (its folder on ``sys.path``, so it
imports the files beside it). ``voltrl train``/``dev``/``runner`` load agents this way, ``voltrl
teacher serve`` a teacher policy.

A script a command loads its agent from does not run its own training. A script written to be
run (no ``if __name__ == "__main__":`` guard, as the quick start has it) calls ``Trainer.fit``
at its top level: imported, it would start a run of its own before the command's. While a
command imports it (:func:`loading_agent_from`), ``Trainer.fit`` and ``Trainer.dev`` raise
:class:`ScriptStopped` (:func:`stop_if_loading`) instead, which ends the import there: what the
script defined above the call (the agent) is loaded, and the command's run is the only one.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from types import ModuleType
from typing import Any

from voltrl.errors import VoltRLError

_LOADING: ContextVar[str | None] = ContextVar("voltrl_loading_agent", default=None)


class ScriptStopped(BaseException):
    """A script's own ``fit`` or ``dev``, stopped while a command loads its agent (a
    ``BaseException``: a script's ``except Exception`` does not swallow it)."""


@contextlib.contextmanager
def loading_agent_from(where: str) -> Iterator[None]:
    """Within the block, ``Trainer.fit`` and ``Trainer.dev`` raise :class:`ScriptStopped`."""
    token = _LOADING.set(where)
    try:
        yield
    finally:
        _LOADING.reset(token)


def stop_if_loading() -> None:
    """Raise :class:`ScriptStopped` when a command is importing the caller's script."""
    if (where := _LOADING.get()) is not None:
        raise ScriptStopped(where)


def import_named(
    target: str,
    *,
    kind: str,
    noun: str,
    example: str,
    error: type[VoltRLError] = VoltRLError,
    own_module_name: bool = False,
    script_guard: bool = False,
) -> Any:
    """The object ``target`` (``MODULE:NAME`` or ``FILE.py:NAME``) names.

    ``kind`` names what is loaded in errors (``"agent"``: "agent file x.py does not exist");
    when the separator is missing, the error shows ``MODULE:<noun>`` and ``example``. A file is
    imported as a module named after its stem (so worker processes that import it by that name
    get the same module), or, with ``own_module_name``, under a name of its own (two
    ``teacher.py`` files load side by side). With ``script_guard``, a script that starts a run
    of its own at its top level (``Trainer.fit``) is stopped there
    (:func:`stop_if_loading`): a file keeps what it defined above the call, a
    dotted module is refused. Raises ``error`` saying what is wrong.
    """
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise error(f"expected MODULE:{noun} or FILE.py:{noun} (e.g. {example}), got {target!r}")
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        module = _import_file(module_name, kind, error, own_module_name, script_guard, target)
        where = module_name
    else:
        module = _import_module(module_name, error, script_guard, target)
        where = f"module {module_name!r}"
    try:
        return getattr(module, attr)
    except AttributeError:
        raise error(f"{where} has no attribute {attr!r}") from None


def _guarded(script_guard: bool, target: str) -> contextlib.AbstractContextManager[None]:
    return loading_agent_from(target) if script_guard else contextlib.nullcontext()


def _import_file(
    name: str,
    kind: str,
    error: type[VoltRLError],
    own_module_name: bool,
    script_guard: bool,
    target: str,
) -> ModuleType:
    path = Path(name).resolve()
    if not path.is_file():
        raise error(f"{kind} file {name} does not exist")
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    module_name = path.stem
    if own_module_name:
        digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
        module_name = f"voltrl_{kind}_{digest}_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickle look their module up there
    try:
        with _guarded(script_guard, target):
            spec.loader.exec_module(module)
    except ScriptStopped:  # the script's own fit or dev: the command's run is the one
        print(
            f"note: {name} starts a run of its own when run as a script; loading its {kind}, "
            "that run (and what follows it in the script) was left out",
            file=sys.stderr,
        )
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise error(f"importing {name} failed: {type(exc).__name__}: {exc}") from exc
    return module


def _import_module(
    name: str, error: type[VoltRLError], script_guard: bool, target: str
) -> ModuleType:
    if str(Path.cwd()) not in sys.path:  # by its path, not "": Ray's workers drop ""
        sys.path.insert(0, str(Path.cwd()))
    try:
        with _guarded(script_guard, target):
            return importlib.import_module(name)
    except ScriptStopped:
        raise error(
            f"importing {name!r} starts a run of its own (Trainer.fit or dev at its top "
            "level): put that under if __name__ == '__main__':"
        ) from None
    except ModuleNotFoundError as exc:
        raise error(f"cannot import module {name!r}: {exc}") from exc
    except Exception as exc:
        raise error(f"importing {name!r} failed: {type(exc).__name__}: {exc}") from exc
