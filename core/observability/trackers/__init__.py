"""Experiment trackers: where a run's metrics go besides ``metrics.jsonl``.

``Trainer(loggers=[...])`` (YAML: ``trainer: {loggers: [...]}``) takes names, option mappings
or logger objects, e.g. ``["tensorboard", {"name": "wandb", "project": "x"}]``. ``jsonl``
(:class:`~voltrl.observability.metrics.MetricsLog`: ``<run dir>/metrics.jsonl``) is always on,
since other tools read it; every line logged there is handed on to the other loggers. Each of
them gets :meth:`Logger.start` (the run's config), :meth:`Logger.log_metrics` (each line's numbers),
:meth:`Logger.log_rollouts` (a few rollouts after each validation), :meth:`Logger.finish` (the
run's summary) and :meth:`Logger.close`, whatever the run's end, Ctrl-C and failures included.
Each package is imported only by the logger that uses it (see ``docs/trackers.md``).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import numbers
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError, model_validator

from voltrl.errors import VoltRLError
from voltrl.observability.metrics import summarize
from voltrl.types import Rollout, Run

if TYPE_CHECKING:
    from voltrl.store.base import Store


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
    the hooks; ``start`` runs first, ``close`` last (even when ``start`` raised)."""

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


class TensorBoardLogger(Logger):
    """TensorBoard event files (``tensorboard --logdir <log_dir>``): a scalar per metric, the
    summary's numbers as scalars at the last step, the config and the summary as text."""

    name: Literal["tensorboard"] = "tensorboard"
    log_dir: str | None = None
    """Where the event files go (default ``<run dir>/tensorboard``)."""
    module: ClassVar[str | None] = "tensorboard"
    extra: ClassVar[str] = "tensorboard"
    _writer: Any = PrivateAttr(None)
    _step: int = PrivateAttr(0)

    def start(self, run: Run, run_dir: Path, config: Mapping[str, Any]) -> None:
        writer = self._import("tensorboard.summary.writer.event_file_writer")
        self._writer = writer.EventFileWriter(self.log_dir or str(run_dir / "tensorboard"))
        self._text("config", config, 0)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._step = max(self._step, step)
        self._add(step, [Summary.Value(tag=k, simple_value=v) for k, v in metrics.items()])

    def finish(self, summary: Mapping[str, Any]) -> None:
        self.log_metrics(self._step, numeric(summary))
        self._text("summary", summary, self._step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _text(self, tag: str, value: Mapping[str, Any], step: int) -> None:
        from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2
        from tensorboard.plugins.text.metadata import create_summary_metadata

        text = "```\n" + json.dumps(value, indent=2, default=str) + "\n```"  # markdown
        shape = tensor_shape_pb2.TensorShapeProto(dim=[{"size": 1}])
        tensor = tensor_pb2.TensorProto(dtype="DT_STRING", string_val=[text.encode()])
        tensor.tensor_shape.CopyFrom(shape)
        meta = create_summary_metadata(display_name=tag, description="")
        self._add(step, [summary_pb2.Summary.Value(tag=tag, metadata=meta, tensor=tensor)])

    def _add(self, step: int, values: list[Any]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        summary = summary_pb2.Summary(value=values)
        self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))


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


class MlflowLogger(Logger):
    """MLflow: a run named after the run in ``experiment``, the config as params (flattened:
    ``algorithm.update.lr``), metrics by step, the summary's numbers as metrics at the last
    step and its strings as tags; the MLflow run ends FINISHED, KILLED (interrupted) or
    FAILED. A ``file:`` store needs ``MLFLOW_ALLOW_FILE_STORE=true`` on MLflow 3: this logger
    sets it (unless set) when it uses one."""

    name: Literal["mlflow"] = "mlflow"
    tracking_uri: str | None = None
    """Default: ``$MLFLOW_TRACKING_URI``, else ``file:`` ``mlruns`` beside the run directory."""
    experiment: str = "voltrl"
    tags: dict[str, str] = {}
    module: ClassVar[str | None] = "mlflow"
    extra: ClassVar[str] = "mlflow"
    _client: Any = PrivateAttr(None)
    _run_id: str | None = PrivateAttr(None)
    _step: int = PrivateAttr(0)
    _status: str = PrivateAttr("FAILED")

    def start(self, run: Run, run_dir: Path, config: Mapping[str, Any]) -> None:
        tracking = self._import("mlflow.tracking")
        from mlflow.entities import Param

        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        uri = uri or (run_dir.parent / "mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = client = tracking.MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(self.experiment)
        experiment = found.experiment_id if found else client.create_experiment(self.experiment)
        tags = {"voltrl.run_id": run.run_id, "voltrl.kind": run.kind, **self.tags}
        self._run_id = client.create_run(experiment, run_name=run.name, tags=tags).info.run_id
        params = [Param(_key(k)[:250], str(v)[:500]) for k, v in _flat(config).items()]
        client.log_batch(self._run_id, params=params)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        self._step = max(self._step, step)
        ms = int(time.time() * 1000)
        batch = [Metric(_key(k), v, ms, step) for k, v in metrics.items()]
        if batch:
            self._client.log_batch(self._run_id, metrics=batch)

    def finish(self, summary: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        self.log_metrics(self._step, numeric(summary))
        tags = [RunTag(_key(k), v[:5000]) for k, v in summary.items() if isinstance(v, str)]
        self._client.log_batch(self._run_id, tags=tags)
        status = str(summary.get("summary/status"))
        self._status = {"finished": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED")

    def close(self) -> None:
        if self._run_id is not None:
            self._client.set_terminated(self._run_id, self._status)
            self._run_id = None


LOGGERS: dict[str, type[Logger]] = {
    "tensorboard": TensorBoardLogger,
    "wandb": WandbLogger,
    "mlflow": MlflowLogger,
}
LOGGER_NAMES = ("jsonl", *LOGGERS)  # jsonl: the MetricsLog, always on


def parse_loggers(value: Any) -> list[Logger]:
    """The loggers besides ``jsonl`` from what ``Trainer(loggers=...)`` was given: a name, a
    mapping ``{"name": ..., **options}``, a :class:`Logger`, or a list of them. Raises
    :class:`VoltRLError` for an unknown name, a bad option, a name given twice or a missing
    package."""
    items = [value] if isinstance(value, str | Mapping | Logger) else list(value or [])
    loggers: list[Logger] = []
    for item in items:
        if isinstance(item, Logger):
            loggers.append(item)
            continue
        if not isinstance(item, str | Mapping):
            raise VoltRLError(f"a logger is a name, a mapping with a 'name' or a Logger: {item!r}")
        options = {"name": item} if isinstance(item, str) else dict(item)
        name = options.pop("name", None)
        if name == "jsonl" and options:
            raise VoltRLError(f"logger 'jsonl' takes no options: {sorted(options)}")
        if name == "jsonl":
            continue  # always on
        if name not in LOGGERS:
            raise VoltRLError(f"unknown logger {name!r}: choose from {', '.join(LOGGER_NAMES)}")
        try:
            loggers.append(LOGGERS[name](**options))
        except ValidationError as exc:
            errors = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise VoltRLError(f"logger {name!r}: {errors}") from None
    names = [logger.name for logger in loggers]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise VoltRLError(f"loggers {twice} given more than once")
    return loggers


class Trackers:
    """The run's loggers besides ``jsonl``, called together. ``start`` errors stop the run
    (a tracker asked for should not be silently missing); later errors of a logger are
    printed once and do not stop the run, nor hide why it ended."""

    def __init__(self, loggers: Sequence[Logger] = ()) -> None:
        self.loggers = [logger.model_copy(deep=True) for logger in loggers]  # fresh state
        self._started: list[Logger] = []
        self._warned: set[str] = set()

    def start(self, run: Run, run_dir: Path, config: Mapping[str, Any]) -> None:
        """Start each logger, in order (one that fails is closed, and its error raised)."""
        for logger in self.loggers:
            try:
                logger.start(run, run_dir, config)
            except BaseException:
                with contextlib.suppress(Exception):
                    logger.close()
                raise
            self._started.append(logger)

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Hand the numbers of one metrics line to each logger."""
        values = numeric(metrics)
        self._each("log_metrics", lambda logger: logger.log_metrics(step, values))

    async def log_rollouts(self, step: int, rollouts: Sequence[Rollout], store: Store) -> None:
        """Hand the first few ``rollouts`` to the loggers that want sample rollouts."""
        wanted = max((logger.rollouts_wanted() for logger in self._started), default=0)
        if not wanted:
            return
        try:
            rows = [await _row(store, r) for r in rollouts[:wanted]]
        except Exception as exc:  # the loggers' trouble never stops the run
            self._warn("log_rollouts", f"no sample rollouts: {type(exc).__name__}: {exc}")
            return
        self._each(
            "log_rollouts",
            lambda logger: logger.log_rollouts(step, rows[: logger.rollouts_wanted()]),
        )

    async def end(self, store: Store, run: Run) -> None:
        """Give each started logger the run's summary, then close it (run.status is final)."""
        if not self._started:
            return
        summary: dict[str, Any] = {"summary/status": run.status}
        if run.error:
            summary["summary/error"] = run.error
        summary["summary/duration_s"] = time.time() - run.created_at
        try:
            rollouts = await store.query_rollouts(run_id=run.run_id)
            for mode in sorted({r.mode for r in rollouts}):
                stats = summarize(r for r in rollouts if r.mode == mode)
                summary.update(numeric(stats.flat(f"summary/{mode}/")))
        except Exception as exc:  # the store may be why the run failed
            self._warn("finish", f"no reward statistics: {type(exc).__name__}: {exc}")
        self._each("finish", lambda logger: logger.finish(summary))
        self._each("close", lambda logger: logger.close())
        self._started = []

    def _each(self, hook: str, call: Callable[[Logger], None]) -> None:
        for logger in self._started:
            try:
                call(logger)
            except Exception as exc:
                self._warn(f"{logger.name} {hook}", f"{type(exc).__name__}: {exc}")

    def _warn(self, where: str, message: str) -> None:
        if where not in self._warned:
            self._warned.add(where)
            print(f"warning: logger {where}: {message}", file=sys.stderr, flush=True)


def numeric(values: Mapping[str, Any]) -> dict[str, float]:
    """The entries that are numbers (booleans as 0/1), as floats; the rest are left out."""
    return {k: float(v) for k, v in values.items() if isinstance(v, numbers.Real)}


async def _row(store: Store, rollout: Rollout) -> RolloutRow:
    from voltrl.trajectory.builder import assistant_message

    response = None
    if rollout.final_attempt_id is not None:
        calls = await store.get_llm_calls(rollout.rollout_id, rollout.final_attempt_id)
        if calls:
            content = assistant_message(calls[-1]).get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            response = None if content is None else str(content)
    return RolloutRow(
        rollout_id=rollout.rollout_id,
        mode=rollout.mode,
        status=rollout.status,
        reward=rollout.reward,
        input=json.dumps(rollout.task.input, default=str),
        response=response,
        error=rollout.error,
    )


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level with dotted keys."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, list) else value
    return out


def _key(key: str) -> str:
    """An MLflow metric, param or tag name: other characters become ``_``."""
    return re.sub(r"[^\w./\- :]", "_", key)
