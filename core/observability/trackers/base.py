"""What a tracker is: the :class:`Logger` interface a run's metrics are handed to.

A tracker (TensorBoard, W&B, MLflow, or one of your own) is a pydantic model whose fields are
its options. It gets :meth:`Logger.start` (the run's config), :meth:`Logger.log_metrics` (each
metrics line's numbers), :meth:`Logger.log_rollouts` (a few rollouts after each validation),
:meth:`Logger.finish` (the run's summary) and :meth:`Logger.close`, all on the trackers' one
background thread (:class:`~voltrl.observability.trackers.Trackers`), never on the event loop.
"""

from __future__ import annotations

import importlib
import importlib.util
import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from voltrl.errors import VoltRLError
from voltrl.types import Run


class RolloutRow(BaseModel):
    """One sample rollout for :meth:`Logger.log_rollouts`: ``input`` is the task's input as
    JSON, ``response`` the text of the last model reply of its final attempt (if any)."""

    rollout_id: str
    mode: str
    status: str
    reward: float | None
    input: str
    response: str | None
    error: str | None = None


class Logger(BaseModel):
    """A tracker the run's metrics go to. Subclasses give ``name`` a literal default, set
    ``module``/``extra`` (the package they import, the pip extra installing it) and implement
    the hooks; ``start`` runs first, ``close`` last (even when ``start`` raised). The hooks
    run on the trackers' thread, one at a time, in order; they may block."""

    model_config = ConfigDict(extra="forbid")
    name: str
    module: ClassVar[str | None] = None
    extra: ClassVar[str] = ""

    @model_validator(mode="after")
    def _installed(self) -> Logger:
        if self.module and importlib.util.find_spec(self.module) is None:
            raise _missing(self.name, self.extra, f"no module named {self.module!r}")
        return self

    def _import(self, module: str | None = None) -> ModuleType:
        """``module`` (default: the logger's package); if missing, a :class:`VoltRLError`."""
        try:
            return importlib.import_module(module or self.module or "")
        except ImportError as exc:
            raise _missing(self.name, self.extra, str(exc)) from exc

    def start(self, run: Run, run_dir: Path, config: Mapping[str, Any]) -> None:
        """Open the tracker for ``run``; ``config`` is the run's configuration (nested)."""

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record one line of the metrics log (numbers only) at ``step``."""

    def rollouts_wanted(self) -> int:
        """How many sample rollouts :meth:`log_rollouts` wants per validation (0: none)."""
        return 0

    def log_rollouts(self, step: int, rows: Sequence[RolloutRow]) -> None:
        """Record a few rollouts of a validation at ``step`` (ignored by default)."""

    def finish(self, summary: Mapping[str, Any]) -> None:
        """Record the run's summary: ``summary/status`` (``finished``, ``interrupted``,
        ``failed``), ``summary/duration_s`` and reward statistics by mode."""

    def close(self) -> None:
        """Release the tracker (flush files, end the remote run)."""


def _missing(name: str, extra: str, why: str) -> VoltRLError:
    return VoltRLError(
        f"logger {name!r} needs the {extra!r} extra ({why}): pip install 'voltrl[{extra}]'"
    )


def numeric(values: Mapping[str, Any]) -> dict[str, float]:
    """The entries that are numbers (booleans as 0/1), as floats; the rest are left out."""
    return {k: float(v) for k, v in values.items() if isinstance(v, numbers.Real)}
