"""The ``loggers=`` option: the built-in trackers by name, and parsing what a run was given."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from voltrl.errors import VoltRLError
from voltrl.observability.trackers.base import Logger
from voltrl.observability.trackers.mlflow import MlflowLogger
from voltrl.observability.trackers.tensorboard import TensorBoardLogger
from voltrl.observability.trackers.wandb import WandbLogger

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
