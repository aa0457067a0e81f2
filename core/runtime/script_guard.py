"""A script a command loads its agent from does not run its own training.

``voltrl train`` (a run's ``train.yaml`` too) and ``voltrl dev`` name an agent as
``script.py:agent`` and import the script to get it. A script written to be run (no
``if __name__ == "__main__":`` guard, as the quick start has it) calls ``Trainer.fit`` at its
top level: imported, it would start a run of its own before the command's. While a command
imports it (:func:`loading_agent_from`), ``Trainer.fit`` and ``Trainer.dev`` raise
:class:`ScriptStopped` instead, which ends the import there: what the script defined above the
call (the agent) is loaded, and the command's run is the only one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

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
