"""Reward statistics and the metrics log (JSONL in the run directory, a console summary)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from pydantic import BaseModel

from voltrl.store.browse import RolloutCount
from voltrl.types import Rollout, Run


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


@dataclass(frozen=True)
class Outcome:
    """What a run came to: the mean reward of one set of its rollouts, and what that mean
    leaves out. The one figure the console's summary, ``voltrl runs`` and the dashboard give
    for a run (:func:`run_outcome`)."""

    of: str
    """Which rollouts: ``"the last validation"``, ``"the best validation"`` (a prompt search),
    ``"the dev rollouts"``, ``"the last step"`` (of a training run without a validation after
    its last step) or ``"every rollout"``."""
    rollouts: int
    rewarded: int
    """Those with a reward: succeeded and rewarded (the mean is theirs)."""
    failed: int
    cancelled: int
    running: int
    """Queued or running still (a run in progress)."""
    reward_mean: float | None

    @property
    def unrewarded(self) -> int:
        """Succeeded rollouts without a final reward (the agent returned None and emitted none
        for the whole rollout)."""
        return self.rollouts - self.rewarded - self.failed - self.cancelled - self.running

    def left_out(self) -> str:
        """What the mean does not count, e.g. ``"6 of 8 rewarded: 2 failed"``; empty when it
        counts every rollout of the set."""
        if self.rewarded == self.rollouts:
            return ""
        why = [
            f"{n} {what}"
            for n, what in (
                (self.failed, "failed"),
                (self.cancelled, "cancelled"),
                (self.running, "still running"),
                (self.unrewarded, "without a final reward"),
            )
            if n > 0
        ]
        return f"{self.rewarded} of {self.rollouts} rewarded: {', '.join(why)}"

    def line(self) -> str:
        """``result: reward 0.950 at the last validation (40 rollouts)``, with what the mean
        leaves out in place of the count."""
        mean = "-" if self.reward_mean is None else f"{self.reward_mean:.3f}"
        where = "over" if self.of in ("the dev rollouts", "every rollout") else "at"
        counted = self.left_out() or f"{self.rollouts} rollout{'s' * (self.rollouts != 1)}"
        return f"result: reward {mean} {where} {self.of} ({counted})"


_UNFINISHED = ("queued", "running", "cancelled")


def run_outcome(counts: Iterable[RolloutCount], *, best: bool = False) -> Outcome | None:
    """The :class:`Outcome` of a run from its rollout counts: its last validation, unless it
    trained after it (then its last step); else its dev rollouts; else its last training
    step. ``best``: the best validation instead of the last (a prompt search's, whose last
    validation is its last candidate's). A validation or step still running, or cut short by
    an interrupt, is passed over for the last whole one before it. None without rollouts."""
    counts = list(counts)
    if not counts:
        return None
    val = _by_version([c for c in counts if c.mode == "val"])
    train = _by_version([c for c in counts if c.mode == "train"])
    if val and best:
        whole = {v: cells for v, cells in val.items() if _whole(cells)} or val
        top = max(whole, key=lambda v: (_outcome("", whole[v]).reward_mean or 0.0, v))
        return _outcome("the best validation", whole[top])
    if val and (not train or _last(val) >= max(train)):
        return _outcome("the last validation", val[_last(val)])
    if dev := [c for c in counts if c.mode == "dev"]:
        return _outcome("the dev rollouts", dev)
    if train:
        return _outcome("the last step", train[_last(train)])
    return _outcome("every rollout", counts)


def outcome_of(run: Run, counts: Iterable[RolloutCount]) -> Outcome | None:
    """:func:`run_outcome` of ``run``: its best validation for a prompt search (APO), else
    the last."""
    return run_outcome(counts, best=run.algorithm == "apo")


def _by_version(cells: list[RolloutCount]) -> dict[int, list[RolloutCount]]:
    versions: dict[int, list[RolloutCount]] = {}
    for c in cells:
        versions.setdefault(-1 if c.resources_version is None else c.resources_version, []).append(
            c
        )
    return versions


def _whole(cells: list[RolloutCount]) -> bool:
    """Whether every rollout of these cells has finished, and none was cancelled."""
    return not any(c.status in _UNFINISHED for c in cells)


def _last(versions: dict[int, list[RolloutCount]]) -> int:
    """The latest version whose rollouts are whole (else the latest)."""
    return max([v for v, cells in versions.items() if _whole(cells)] or versions)


def _outcome(of: str, cells: list[RolloutCount]) -> Outcome:
    rewarded = sum(c.rewarded for c in cells)
    return Outcome(
        of=of,
        rollouts=sum(c.count for c in cells),
        rewarded=rewarded,
        failed=sum(c.count for c in cells if c.status == "failed"),
        cancelled=sum(c.count for c in cells if c.status == "cancelled"),
        running=sum(c.count for c in cells if c.status in ("queued", "running")),
        reward_mean=sum(c.reward_sum for c in cells) / rewarded if rewarded else None,
    )


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl``; keeps the records in memory.
    Each line carries ``run_id`` when one is given (a resumed run appends to its own file).
    ``on_log(step, metrics)`` is called with each line's metrics once it is written: the run's
    other loggers (:class:`~voltrl.observability.trackers.Trackers`) get them so. It runs on
    the caller's thread (the event loop's) and must return at once: ``Trackers`` only queues
    the line for its own thread."""

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
        return read_metrics(self.path, self.run_id)

    def close(self) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: Path, run_id: str | None = None) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (of ``run_id`` when given: lines of other runs are
    skipped, lines without a run id kept); a line cut short by a crash is skipped."""
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        if run_id is None or record.get("run_id") in (None, run_id):
            records.append(record)
    return records


VAL_VERSION = "val/resources_version"
"""A validation's line of ``metrics.jsonl`` names the resources version its rollouts ran at
(the dashboard says which version was which validation); not a metric to chart."""

FIRST_METRICS = (
    "train/reward_mean",
    "val/reward_mean",
    "dev/reward_mean",
    "train/reward_std",
    "mismatch/logprob_abs_mean",
    "mismatch/logprob_abs_max",
    "mismatch/kl",
    "mismatch/tokens_over",
    "mismatch/truncated",
    "mismatch/masked",
    "update/loss",
    "update/approx_kl",
    "update/kl",
    "update/entropy",
    "update/clip_frac",
    "update/grad_norm",
    "update/tokens_per_s",
    "rollout_s",
    "update_s",
    "sft/loss",
)
"""The metrics shown first (the dashboard's charts, ``voltrl show``'s sparklines), in order: the
rewards, then how far the engine's logprobs are from the trainer's (``mismatch/``), then the
update's."""

METRIC_NOTES: dict[str, str] = {
    "mismatch/logprob_abs_mean": "mean |engine - trainer| logprob of a sampled token (nats), "
    "over the rows the weights being updated sampled: 0 when the engine computes as the trainer",
    "mismatch/logprob_abs_max": "the largest |engine - trainer| logprob of a token (nats)",
    "mismatch/kl": "KL(engine ‖ trainer) per token, k3 estimate (nats)",
    "mismatch/tokens_over": "share of tokens whose two logprobs differ by more than 0.1",
    "mismatch/truncated": "share of tokens whose weight update.rollout_correction truncated",
    "mismatch/masked": "share of tokens update.rollout_correction dropped with their sequence",
}
"""A line under a metric's chart saying what it measures, in what unit (docs/fidelity.md)."""


Series = list[tuple[str, list[int], list[float]]]


def metric_series(records: Iterable[dict[str, Any]]) -> Series:
    """Every numeric metric as ``(name, steps, values)`` over the steps that logged it
    (several records of one step: the last wins), :data:`FIRST_METRICS` first (each LoRA
    adapter's ``update/<adapter>/<metric>`` beside its ``update/<metric>``, its
    ``mismatch/<adapter>/<metric>`` beside ``mismatch/<metric>``, its rows' ``reward_mean``
    beside the training reward), then by name."""
    by_name: dict[str, dict[int, float]] = {}
    for record in records:
        step = record.get("step")
        if not isinstance(step, int):
            continue
        for name, value in record.items():
            if name in ("step", "time", "run_id", VAL_VERSION) or isinstance(value, bool):
                continue
            if isinstance(value, int | float) and math.isfinite(value):
                by_name.setdefault(name, {})[step] = float(value)
    first = {name: i for i, name in enumerate(FIRST_METRICS)}

    def rank(name: str) -> tuple[int, str]:
        parts = name.split("/")
        if len(parts) == 3 and parts[0] in ("update", "mismatch"):  # an adapter's: update/a/loss
            base = "train/reward_mean" if parts[2] == "reward_mean" else f"{parts[0]}/{parts[2]}"
            return first.get(base, len(first)), name
        return first.get(name, len(first)), name

    order = sorted(by_name, key=rank)
    return [(n, sorted(by_name[n]), [by_name[n][k] for k in sorted(by_name[n])]) for n in order]


def summary_rows(rollouts: Iterable[Rollout]) -> dict[str, RewardStats]:
    """A run's rollout table: a row per mode (``train``, ``val``, ``dev``, ``optimizer``) with
    rollouts. A run that validated more than once gets rows for its first and last validation
    and one for all of them (``val, all 3``), so no mean over every validation passes for the
    result."""
    rows: dict[str, RewardStats] = {}
    by_mode: dict[str, list[Rollout]] = {}
    for r in rollouts:
        by_mode.setdefault(r.mode, []).append(r)
    for mode in ("train", "val", "dev", "optimizer"):
        mine = by_mode.get(mode, [])
        validations: dict[int, list[Rollout]] = {}
        for r in mine if mode == "val" else []:
            version = -1 if r.resources_version is None else r.resources_version
            validations.setdefault(version, []).append(r)
        if len(validations) > 1:
            rows["val, first"] = summarize(validations[min(validations)])
            rows["val, last"] = summarize(validations[max(validations)])
            rows[f"val, all {len(validations)}"] = summarize(mine)
        elif mine:
            rows[mode] = summarize(mine)
    return rows


def format_stats_table(title: Any, rows: dict[str, RewardStats]) -> Any:
    """A rich table of reward statistics, one row per name (``title``: a string or rich Text):
    rollouts, how many failed and were cancelled (the rest succeeded, or are still running),
    and the rewards of the succeeded ones. It fits 80 columns."""
    from rich.table import Table

    table = Table(title=title)
    columns = (
        "",
        "rollouts",
        "failed",
        "cancelled",
        "reward mean",
        "std",
        "min",
        "max",
    )
    for col in columns:
        table.add_column(col, justify="left" if not col else "right")

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    for name, s in rows.items():
        table.add_row(
            name,
            str(s.rollouts),
            str(s.failed),
            str(s.cancelled),
            f(s.reward_mean),
            f(s.reward_std),
            f(s.reward_min),
            f(s.reward_max),
        )
    return table
