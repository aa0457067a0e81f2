"""The Weights & Biases tracker: a W&B run per run, its metrics by step and rollout tables."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import PrivateAttr

from voltrl.observability.trackers.base import Logger, RolloutRow
from voltrl.types import Run


class WandbLogger(Logger):
    """Weights & Biases: a W&B run named after the run, with the config; metrics plotted
    against ``step`` (a run's steps may start over: an SFT warm-up's, then RL's); the summary
    in the run's summary; a ``wandb.Table`` of sample rollouts (``<mode>/rollouts``) after each
    validation. ``mode="offline"`` (or ``WANDB_MODE=offline``) writes the run locally only
    (``wandb sync`` uploads it later). The W&B run's exit code is 0 when the run finished."""

    name: Literal["wandb"] = "wandb"
    project: str | None = None
    """Default: ``$WANDB_PROJECT``, else ``voltrl``."""
    entity: str | None = None
    group: str | None = None
    tags: list[str] = []
    mode: Literal["online", "offline", "disabled"] | None = None
    """Default: ``$WANDB_MODE``, else online."""
    dir: str | None = None
    """Where W&B writes its files (default: ``$WANDB_DIR``, else the run directory)."""
    rollouts: int = 8
    """Rollouts in the table of each validation (0: no table)."""
    module: ClassVar[str | None] = "wandb"
    extra: ClassVar[str] = "wandb"
    _run: Any = PrivateAttr(None)
    _exit_code: int = PrivateAttr(1)

    def start(self, run: Run, run_dir: Path, config: Mapping[str, Any]) -> None:
        wandb = self._import()
        self._run = wandb.init(
            project=self.project or os.environ.get("WANDB_PROJECT") or "voltrl",
            entity=self.entity,
            group=self.group,
            tags=self.tags or None,
            mode=self.mode,
            dir=self.dir or os.environ.get("WANDB_DIR") or str(run_dir),
            name=run.name,
            config=dict(config),
        )
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log({**metrics, "step": step})

    def rollouts_wanted(self) -> int:
        return self.rollouts

    def log_rollouts(self, step: int, rows: Sequence[RolloutRow]) -> None:
        import wandb

        columns = ["step", *RolloutRow.model_fields]
        data = [[step, *row.model_dump().values()] for row in rows]
        if rows:
            self._run.log({f"{rows[0].mode}/rollouts": wandb.Table(columns, data), "step": step})

    def finish(self, summary: Mapping[str, Any]) -> None:
        self._run.summary.update(dict(summary))
        self._exit_code = 0 if summary.get("summary/status") == "finished" else 1

    def close(self) -> None:
        if self._run is not None:
            self._run.finish(exit_code=self._exit_code)
            self._run = None
