"""Loading the agent a command names as ``MODULE:AGENT`` (a dotted module or a ``.py`` path)."""

from __future__ import annotations

from typing import Any

from voltrl._imports import import_named
from voltrl.errors import AgentLoadError


def load_agent(spec: str) -> Any:
    """Import ``MODULE:OBJECT`` (a dotted module or a ``.py`` path) and return the agent: a
    :class:`LitAgent` (a subclass is instantiated) or a rollout function."""
    from voltrl.agent import LitAgent, rollout

    obj = import_named(
        spec,
        kind="agent",
        noun="AGENT",
        example="my_pkg.agents:math_agent",
        error=AgentLoadError,
        script_guard=True,
    )
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
