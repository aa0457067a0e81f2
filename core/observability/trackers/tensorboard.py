"""The TensorBoard tracker: a run's metrics, config and summary as TensorBoard event files."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import PrivateAttr

from voltrl.observability.trackers.base import Logger, numeric
from voltrl.types import Run


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
