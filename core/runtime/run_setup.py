"""A run's set-up, and the check that resuming a run keeps it.

Every ``fit`` writes ``<run dir>/setup.json`` (:func:`write_setup`): the agent, the LLMs the
trainer was given, and a digest of its training and validation rows. Resuming the run
(``LocalRL(checkpoints={"resume": True})``, a sample's ``--resume``) compares the new ``fit``
with it and with the algorithm's settings the run recorded (its ``Run.config``) before
anything of the run changes (:func:`check_resume`): a difference that changes what is
trained, or on what, would mix two set-ups in one run, so it is refused, naming each
difference with both values.

What may change on resume is only what does not alter the data or the model: the algorithm's
``resumable_settings`` (LocalRL's: more steps, how often to validate or checkpoint, where and
how fast to compute), the LLMs' endpoints (a server restarted
elsewhere), and everything of the trainer but its LLMs (loggers, concurrency, runners,
timeouts). Everything else must match: the agent, every training and validation row, every
other setting of the algorithm (the model, its warm-up, the update's and the trajectories'
settings, the sampling, the seed) and the model and sampling of each LLM the trainer serves.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from voltrl._dotted import section
from voltrl._redact import without_secrets
from voltrl.errors import VoltRLError
from voltrl.resources import LLM, Resources
from voltrl.types import Task

if TYPE_CHECKING:
    from voltrl.runtime.trainer import Trainer

SETUP_FILE = "setup.json"
"""``<run dir>/setup.json``: the set-up a resume of the run must keep."""

_SHOWN = 160
"""How many characters of a value a refusal shows."""


def jsonl_text(tasks: Sequence[Task]) -> str:
    """The tasks' inputs as JSONL, one row a line: what ``train.yaml`` writes beside it for a
    dataset given as objects, and what :func:`run_setup` digests."""
    return "".join(json.dumps(t.input, default=repr) + "\n" for t in tasks)


def run_setup(
    trainer: Trainer, agent_spec: str, train: Sequence[Task], val: Sequence[Task] | None
) -> dict[str, Any]:
    """What :func:`write_setup` records of a ``fit`` and :func:`check_resume` compares."""
    resources = trainer.resources
    items = resources.items if isinstance(resources, Resources) else dict(resources or {})
    return {
        "agent": agent_spec,
        "llms": {  # as the run's files may hold them: no secrets (an extra header's key)
            name: without_secrets(
                json.loads(
                    json.dumps(
                        {"model": item.model, "sampling_parameters": item.sampling_parameters},
                        default=repr,
                    )
                )
            )
            for name, item in sorted(items.items())
            if isinstance(item, LLM)
        },
        "data": {"train": _digest(train), "val": None if val is None else _digest(val)},
    }


def write_setup(run_dir: Path, setup: dict[str, Any]) -> None:
    """Record ``setup`` (:func:`run_setup`) in ``run_dir`` (whole or not at all)."""
    partial = run_dir / f".{SETUP_FILE}.partial"
    partial.write_text(json.dumps(setup, indent=1) + "\n")
    os.replace(partial, run_dir / SETUP_FILE)


def check_resume(
    name: str,
    run_dir: Path,
    recorded_config: dict[str, Any],
    config: dict[str, Any],
    setup: dict[str, Any],
    tasks: dict[str, Sequence[Task] | None],
    resumable: Sequence[str] = (),
) -> None:
    """Raise :class:`VoltRLError` when resuming run ``name`` (in ``run_dir``; its algorithm
    recorded ``recorded_config``, in today's shape: ``Algorithm.upgraded_config``) with the
    algorithm's ``config`` and ``setup`` (of the ``train`` and ``val`` ``tasks``) would change
    its data or its model; the message names each difference with both values. The
    ``resumable`` settings (dotted paths) may change. A run recorded before ``setup.json``
    existed is checked on the algorithm's settings alone."""
    changes = _differences(
        "algorithm", _without(recorded_config, resumable), _without(config, resumable)
    )
    path = run_dir / SETUP_FILE
    try:
        recorded = json.loads(path.read_text()) if path.exists() else None
        if recorded is not None and not {"agent", "llms", "data"} <= set(recorded):
            raise ValueError("a field is missing")
    except ValueError as exc:
        raise VoltRLError(
            f"cannot resume run {name!r}: {path} is damaged ({exc}); restore it or start a new "
            "run under another name"
        ) from None
    if recorded is not None:
        if recorded["agent"] != setup["agent"]:
            changes.append(("agent", recorded["agent"], setup["agent"]))
        changes += _differences("trainer LLM", recorded["llms"], setup["llms"])
        for split in ("train", "val"):
            then, now = recorded["data"][split], setup["data"][split]
            if (then and then["sha256"]) != (now and now["sha256"]):
                changes += _data_differences(run_dir, split, then, now, tasks[split] or [])
    if changes:
        said = "; ".join(
            f"{what} is {_shown(now)} (the run's: {_shown(then)})" for what, then, now in changes
        )
        may = f"{', '.join(resumable[:3])} and how it runs" if resumable else "how it runs"
        raise VoltRLError(
            f"cannot resume run {name!r} with a different set-up: {said}. Resume it with the "
            f"options it was started with (only {may} may change), or start a new run under "
            "another name"
        )


def _digest(tasks: Sequence[Task]) -> dict[str, Any]:
    return {
        "rows": len(tasks),
        "sha256": hashlib.sha256(jsonl_text(tasks).encode()).hexdigest(),
        "first": json.loads(json.dumps(tasks[0].input, default=repr)) if tasks else None,
    }


def _data_differences(
    run_dir: Path,
    split: str,
    then: dict[str, Any] | None,
    now: dict[str, Any] | None,
    tasks: Sequence[Task],
) -> list[tuple[str, Any, Any]]:
    """How the ``split`` rows differ: field by field in the first row that differs when the
    run's rows are at hand (the ``<split>.jsonl`` that ``train.yaml`` wrote beside it), else
    the first row of each, else the count and digest of each."""
    what = f"{split} data"
    if then is None or now is None:
        return [(what, _rows(then), _rows(now))]
    file = run_dir / f"{split}.jsonl"
    if file.exists() and hashlib.sha256(file.read_bytes()).hexdigest() == then["sha256"]:
        rows = [json.loads(line) for line in file.read_text().splitlines()]
        return _row_differences(what, rows, tasks)
    if then["first"] != now["first"]:
        return _differences(f"{what} row 1", then["first"], now["first"])
    return [(what, _rows(then), _rows(now))]


def _row_differences(what: str, then: list[Any], now: Sequence[Task]) -> list[tuple[str, Any, Any]]:
    """The fields of the first row that differs, else the numbers of rows."""
    for i, (a, task) in enumerate(zip(then, now, strict=False), start=1):
        if a != (b := json.loads(json.dumps(task.input, default=repr))):
            return _differences(f"{what} row {i}", a, b)
    return [(what, _Said(_count(len(then))), _Said(_count(len(now))))]


def _without(config: dict[str, Any], paths: Sequence[str]) -> dict[str, Any]:
    """``config`` without the settings at ``paths`` (dotted: ``schedule.steps``)."""
    out = copy.deepcopy(config)
    for dotted in paths:
        held, name = section(out, dotted)
        if held is not None:
            held.pop(name, None)
    return out


def _differences(path: str, then: Any, now: Any) -> list[tuple[str, Any, Any]]:
    """Each place where ``then`` and ``now`` differ, as ``(dotted path, then, now)``."""
    if isinstance(then, dict) and isinstance(now, dict):
        out = []
        for key in [*then, *(k for k in now if k not in then)]:
            if then.get(key) != now.get(key):
                out += _differences(f"{path}.{key}", then.get(key), now.get(key))
        return out
    return [] if then == now else [(path, then, now)]


class _Said(str):
    """A description of a value (``12 rows``), shown as it is rather than as a value."""


def _count(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def _rows(digest: dict[str, Any] | None) -> _Said:
    """Rows by their number and digest (``none`` for no rows at all)."""
    if digest is None:
        return _Said("none")
    return _Said(f"{_count(digest['rows'])} (sha256 {digest['sha256'][:12]})")


def _shown(value: Any) -> str:
    text = value if isinstance(value, _Said) else json.dumps(value, default=repr)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 1] + "…"
