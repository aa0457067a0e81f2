"""The MLflow tracker: an MLflow run per run, the config as params, metrics and a final status."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import PrivateAttr

from voltrl.observability.trackers.base import Logger, numeric
from voltrl.types import Run


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
