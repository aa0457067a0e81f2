"""Datasets: a list of dicts, a JSONL/JSON/Parquet path, or anything indexable, as Tasks.

Every row must be a mapping with string keys whose values survive a JSON round trip (the
store keeps them as JSON); anything else is a :class:`~voltrl.errors.DatasetError` naming the
row, raised before a single rollout is queued.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from voltrl.errors import DatasetError
from voltrl.types import Task

Dataset = Sequence[Mapping[str, Any]] | str | Path | Any


def load_rows(data: Dataset) -> list[dict[str, Any]]:
    """The dataset's rows as plain dicts, validated."""
    if isinstance(data, str | Path):
        rows: Sequence[Any] = _read_file(Path(data))
    elif hasattr(data, "to_dict") and hasattr(data, "columns"):  # a pandas DataFrame
        rows = data.to_dict("records")
    elif hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        rows = [data[i] for i in range(len(data))]
    else:
        raise DatasetError(
            f"a dataset must be a list of dicts, a .jsonl/.json/.parquet path, or an object with "
            f"__len__ and __getitem__; got {type(data).__name__}"
        )
    return [_check_row(row, i) for i, row in enumerate(rows)]


def load_tasks(data: Dataset, *, split: str = "train") -> list[Task]:
    """One :class:`Task` per row. Task ids are ``{split}-{row index}``, stable across runs."""
    return [
        Task(task_id=f"{split}-{i}", input=row, index=i) for i, row in enumerate(load_rows(data))
    ]


def _read_file(path: Path) -> list[Any]:
    if not path.exists():
        raise DatasetError(f"dataset file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError("reading Parquet needs pyarrow: pip install pyarrow") from None
        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}: not valid JSON: {exc}") from None
        if not isinstance(data, list):
            raise DatasetError(f"{path}: a JSON dataset must be a list of objects")
        return data
    if suffix in (".jsonl", ".ndjson"):
        rows = []
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}, line {n}: not valid JSON: {exc}") from None
        return rows
    raise DatasetError(f"{path}: unknown dataset format {suffix!r}; use .jsonl, .json or .parquet")


def _check_row(row: Any, index: int) -> dict[str, Any]:
    if not isinstance(row, Mapping):
        raise DatasetError(f"row {index} is a {type(row).__name__}, not a dict: {row!r:.80}")
    bad = [k for k in row if not isinstance(k, str)]
    if bad:
        raise DatasetError(f"row {index} has non-string keys {bad!r:.80}")
    try:
        return json.loads(json.dumps(dict(row), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise DatasetError(f"row {index} cannot be stored as JSON: {exc}") from None
