"""Experiment trackers: where a run's metrics go besides ``metrics.jsonl``.

``Trainer(loggers=[...])`` (YAML: ``trainer: {loggers: [...]}``) takes names, option mappings
or logger objects, e.g. ``["tensorboard", {"name": "wandb", "project": "x"}]``
(:func:`parse_loggers`). ``jsonl`` (:class:`~voltrl.observability.metrics.MetricsLog`:
``<run dir>/metrics.jsonl``) is always on, since other tools read it; every line logged there
is handed on to the other trackers, :class:`Logger` subclasses (``base.py``; one module per
tracker: ``tensorboard.py``, ``wandb.py``, ``mlflow.py``). :class:`Trackers` (``fanout.py``)
calls them on one background thread, so that a slow tracker never holds up the run. Each
package is imported only by the tracker that uses it (see ``docs/trackers.md``).
"""

from voltrl.observability.trackers.base import Logger, RolloutRow, numeric
from voltrl.observability.trackers.fanout import Trackers
from voltrl.observability.trackers.mlflow import MlflowLogger
from voltrl.observability.trackers.options import LOGGER_NAMES, LOGGERS, parse_loggers
from voltrl.observability.trackers.tensorboard import TensorBoardLogger
from voltrl.observability.trackers.wandb import WandbLogger

__all__ = [
    "LOGGERS",
    "LOGGER_NAMES",
    "Logger",
    "MlflowLogger",
    "RolloutRow",
    "TensorBoardLogger",
    "Trackers",
    "WandbLogger",
    "numeric",
    "parse_loggers",
]
