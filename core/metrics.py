"""Reward statistics and the metrics log (JSONL in the run directory, a console summary)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TextIO

from pydantic import BaseModel

from voltrl.types import Rollout


class RewardStats(BaseModel):
    """Counts by status and reward statistics of finished rollouts."""

    rollouts: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    rewarded: int = 0
    reward_mean: float | None = None
    reward_std: float | None = None
    reward_min: float | None = None
    reward_max: float | None = None

    def flat(self, prefix: str = "") -> dict[str, Any]:
        """As a flat dict with prefixed keys, for the metrics log."""
        return {f"{prefix}{k}": v for k, v in self.model_dump().items()}


def summarize(rollouts: Iterable[Rollout]) -> RewardStats:
    """Statistics of these rollouts; rewards count only from succeeded ones."""
    rollouts = list(rollouts)
    rewards = [r.reward for r in rollouts if r.status == "succeeded" and r.reward is not None]
    stats = RewardStats(
        rollouts=len(rollouts),
        succeeded=sum(r.status == "succeeded" for r in rollouts),
        failed=sum(r.status == "failed" for r in rollouts),
        cancelled=sum(r.status == "cancelled" for r in rollouts),
        rewarded=len(rewards),
    )
    if rewards:
        mean = sum(rewards) / len(rewards)
        stats.reward_mean = mean
        stats.reward_std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards))
        stats.reward_min, stats.reward_max = min(rewards), max(rewards)
    return stats


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl``; keeps the records in memory.
    Each line carries ``run_id`` when one is given (a resumed run appends to its own file).
    ``on_log(step, metrics)`` is called with each line's metrics once it is written: the run's
    other loggers (:class:`~voltrl.loggers.Trackers`) get them so."""

    def __init__(
        self,
        path: Path | None,
        run_id: str | None = None,
        on_log: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> None:
        self.path = path
        self.run_id = run_id
        self.on_log = on_log
        self.records: list[dict[str, Any]] = []
        self._file: TextIO | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", encoding="utf-8")

    def log(self, step: int, **metrics: Any) -> dict[str, Any]:
        """Record metrics for a step (flushed at once, so a crash loses nothing logged)."""
        ids = {"run_id": self.run_id} if self.run_id else {}
        record = {**ids, "step": step, "time": time.time(), **metrics}
        self.records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record, default=str) + "\n")
            self._file.flush()
        if self.on_log is not None:
            self.on_log(step, metrics)
        return record

    def history(self) -> list[dict[str, Any]]:
        """This run's records: from the file, where a resumed run's earlier sessions are too
        (lines of other runs are skipped), else the ones logged here."""
        if self.path is None or not self.path.exists():
            return list(self.records)
        lines = (json.loads(line) for line in self.path.read_text().splitlines() if line)
        return [r for r in lines if self.run_id is None or r.get("run_id") == self.run_id]

    def close(self) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None


def format_stats_table(title: str, rows: dict[str, RewardStats]) -> Any:
    """A rich table of reward statistics, one row per name."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("", "rollouts", "succeeded", "failed", "reward mean", "std", "min", "max"):
        table.add_column(col, justify="left" if not col else "right")

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    for name, s in rows.items():
        table.add_row(
            name,
            str(s.rollouts),
            str(s.succeeded),
            str(s.failed),
            f(s.reward_mean),
            f(s.reward_std),
            f(s.reward_min),
            f(s.reward_max),
        )
    return table
