"""Loading the agent a command names as ``MODULE:AGENT`` (a dotted module or a ``.py`` path)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from voltrl.errors import AgentLoadError


def load_agent(spec: str) -> Any:
    """Import ``MODULE:OBJECT`` (a dotted module or a ``.py`` path) and return the agent."""
    from voltrl.agent import LitAgent, rollout
    from voltrl.runtime.script_guard import ScriptStopped, loading_agent_from

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise AgentLoadError(f"expected MODULE:AGENT (e.g. my_pkg.agents:math_agent), got {spec!r}")
    if module_name.endswith(".py") or "/" in module_name:
        path = Path(module_name)
        if not path.exists():
            raise AgentLoadError(f"agent file {path} does not exist")
        sys.path.insert(0, str(path.parent.resolve()))
        mod_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert mod_spec is not None and mod_spec.loader is not None
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[path.stem] = module
        try:
            with loading_agent_from(spec):
                mod_spec.loader.exec_module(module)
        except ScriptStopped:  # the script's own fit or dev: the command's run is the one
            print(
                f"note: {path} starts a run of its own when run as a script; loading its agent, "
                "that run (and what follows it in the script) was left out",
                file=sys.stderr,
            )
        except Exception as exc:
            raise AgentLoadError(f"importing {path} failed: {type(exc).__name__}: {exc}") from exc
    else:
        sys.path.insert(0, str(Path.cwd()))
        try:
            with loading_agent_from(spec):
                module = importlib.import_module(module_name)
        except ScriptStopped:
            raise AgentLoadError(
                f"importing {module_name!r} starts a run of its own (Trainer.fit or dev at its "
                "top level): put that under if __name__ == '__main__':"
            ) from None
        except ModuleNotFoundError as exc:
            raise AgentLoadError(f"cannot import module {module_name!r}: {exc}") from exc
        except Exception as exc:
            raise AgentLoadError(
                f"importing {module_name!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise AgentLoadError(f"module {module_name!r} has no attribute {attr!r}") from None
    if isinstance(obj, type) and issubclass(obj, LitAgent):
        obj = obj()
    if isinstance(obj, LitAgent):
        return obj
    if callable(obj):
        try:
            return rollout(obj)
        except TypeError as exc:
            raise AgentLoadError(str(exc)) from None
    raise AgentLoadError(f"{spec} is a {type(obj).__name__}, not a LitAgent or a function")
