"""The run directory: the name a run gets, ``runs/<name>/``, and the ``train.yaml`` written there
that runs it again.

A run's name is the one asked for unless its directory holds another run (:data:`RUN_FILES`)
that this one does not resume; then it is ``NAME-2``, ``NAME-3``... (:func:`free_run_name`).
``train.yaml`` is the ``voltrl train`` config of a ``fit``: the agent, the data, the
algorithm's config and the trainer's arguments (:func:`trainer_section`, also what the run's
experiment trackers get as its config), never a secret. It names the model as the run was
given it (a local path made absolute); a model object, or an agent that cannot be built again
from its name, leaves ``null`` or ``MODULE:AGENT`` there, with a line saying what to fill in,
and ``voltrl train`` refuses the file, naming the field, until it is filled in.

One process at a time trains in a run directory: :func:`locked_run_dir` holds an exclusive
lock on ``runs/<name>/.lock`` for the whole run (the operating system drops it when the
process dies, ``kill -9`` included), so a second process resuming the same run is refused
instead of writing the same checkpoints.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from voltrl._dotted import section
from voltrl._redact import without_secrets
from voltrl.agent import FunctionAgent, LitAgent
from voltrl.errors import VoltRLError
from voltrl.observability.trackers import LOGGERS
from voltrl.resources import LLM, Resources
from voltrl.runtime.dataset import Dataset
from voltrl.runtime.run_setup import jsonl_text
from voltrl.store.spec import absolute_spec
from voltrl.types import Run, Task

if TYPE_CHECKING:
    from voltrl.algorithms.base import Algorithm
    from voltrl.runtime.trainer import Trainer

RUN_FILES = ("store.sqlite", "metrics.jsonl")
"""Files whose presence means a run directory holds a run (other files, such as the data a
script wrote there first, do not)."""

TRAIN_YAML_ALGORITHMS = ("local_rl", "sft", "apo", "baseline")
"""The algorithms ``voltrl train`` builds, so the only ones a ``train.yaml`` can run again."""


LOCK_FILE = ".lock"
"""``runs/<name>/.lock``: held by the process running the run (its pid in ``.lock.pid``)."""


@contextlib.contextmanager
def locked_run_dir(run_dir: Path) -> Iterator[None]:
    """Hold the run directory's lock for the block; :class:`VoltRLError` at once, naming the
    holder's pid, when another process holds it."""
    from filelock import FileLock, Timeout

    lock, owner = FileLock(run_dir / LOCK_FILE), run_dir / f"{LOCK_FILE}.pid"
    try:
        lock.acquire(timeout=0)
    except Timeout:
        try:
            holder = owner.read_text().strip() or "unknown"
        except OSError:
            holder = "unknown"
        raise VoltRLError(
            f"run {run_dir.name!r} is in use by another process (pid {holder}): two "
            f"processes in {run_dir} would write the same checkpoints; stop that one, or "
            "give this run another name"
        ) from None
    try:
        owner.write_text(str(os.getpid()))
        yield
    finally:
        owner.unlink(missing_ok=True)
        lock.release()


def free_run_name(run_dir: str | Path, name: str) -> str:
    """The name a new run called ``name`` gets in ``run_dir``: ``name`` itself unless its
    directory holds a run (:data:`RUN_FILES`), else the first of ``name-2``, ``name-3``...
    that has no directory yet. A script that starts something beside the run (a server
    writing its log into the run directory) picks the name with it first."""
    run_dir = Path(run_dir)
    if not any((run_dir / name / f).exists() for f in RUN_FILES):
        return name
    n = 2
    while (run_dir / f"{name}-{n}").exists():
        n += 1
    return f"{name}-{n}"


def run_name(run_dir: Path, name: str | None, kind: str, resume: bool) -> str:
    """A run's name in ``run_dir``: ``name``, unless its directory holds another run and this
    one does not resume it (then ``NAME-2``, ``NAME-3``..., said on the console); with no
    ``name``, ``KIND-DATE-TIME-XXXX``."""
    if name is None:
        return f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    free = free_run_name(run_dir, name)
    if resume or free == name:
        return name
    print(
        f"run {name!r} exists in {run_dir}; this run is {free!r} "
        "(to continue that run instead, resume it: e.g. LocalRL(checkpoints={'resume': True}))",
        flush=True,
    )
    return free


def write_train_yaml(
    trainer: Trainer,
    run_dir: Path,
    agent: LitAgent,
    train: tuple[Dataset, list[Task]],
    val: tuple[Dataset, list[Task] | None],
) -> Path | None:
    """Write ``run_dir/train.yaml``, the ``voltrl train`` config that runs ``trainer``'s
    ``fit`` of ``agent`` again (datasets given as objects are written beside it as JSONL),
    when its algorithm is one ``voltrl train`` builds (:data:`TRAIN_YAML_ALGORITHMS`).
    Returns its path."""
    import yaml

    algo = trainer.algorithm
    if algo.name not in TRAIN_YAML_ALGORITHMS:
        return None

    def data_file(source: Dataset, tasks: list[Task], split: str) -> str:
        if isinstance(source, str | Path):
            return str(Path(source).resolve())
        path = run_dir / f"{split}.jsonl"
        path.write_text(jsonl_text(tasks))
        return str(path.resolve())

    data = {"train": data_file(*train, "train")}
    if val[1] is not None:
        data["val"] = data_file(val[0], val[1], "val")
    algorithm = {"name": algo.name, **algorithm_config(algo)}
    notes = []
    model = getattr(algo, "model", None)
    if algo.name in ("local_rl", "sft") and not isinstance(model, str | Path):
        algorithm["model"] = None
        notes.append(
            "# This run was given a model object: set algorithm.model to its path or hub name."
        )
    elif isinstance(model, str | Path) and model != "tiny" and Path(model).expanduser().exists():
        algorithm["model"] = str(Path(model).expanduser().resolve())  # from any directory
    held, key = section(algorithm, algo.resume_setting)
    resumes = held is not None and key in held
    if resumes:  # a new run of this training; a resumed one's file says so too
        held[key] = False
    spec = agent_spec(agent)
    if spec == "MODULE:AGENT":
        notes.append(
            "# The agent is not importable by name (or was built with arguments): set agent "
            "to MODULE:AGENT."
        )
    config = {
        "agent": spec,
        "data": data,
        "algorithm": algorithm,
        "trainer": trainer_section(trainer, run_dir),
    }
    path = run_dir / "train.yaml"
    if notes:
        header = "# Runs this training again once the fields named below are set: voltrl train "
    else:
        header = "# Runs this training again: voltrl train "
    # in the order given: mappings such as lora_adapters route by their order
    body = yaml.safe_dump(config, sort_keys=False)
    resume = (
        f"# (algorithm.{algo.resume_setting}: true continues this run from its last checkpoint "
        "instead)\n"
    )
    text = header + str(path) + "\n" + (resume if resumes else "")
    path.write_text(text + "".join(n + "\n" for n in notes) + body)
    return path


def trainer_section(trainer: Trainer, run_dir: Path) -> dict[str, Any]:
    """``trainer``'s arguments as ``voltrl train``'s ``trainer:`` section for the run in
    ``run_dir`` (the token is left out: it is a secret; API keys never serialize)."""
    config: dict[str, Any] = {
        "n_runners": trainer.n_runners,
        "run_dir": str(run_dir.parent.resolve()),
        "name": run_dir.name,
        "max_concurrency": trainer.runner_config.max_concurrency,
        "max_attempts": trainer.max_attempts,
        "retry_agent_errors": trainer.retry_agent_errors,
        "stop_at_failure_rate": trainer.stop_at_failure_rate,
        "rollout_timeout_s": trainer.rollout_timeout_s,
        "lease_s": trainer.runner_config.lease_s,
        "record_calls": trainer.record_calls,
        "request_token_ids": trainer.request_token_ids,
        "host": trainer.host,
        "port": trainer.port,
    }
    if isinstance(trainer.store, str | Path):
        config["store"] = absolute_spec(trainer.store)  # the same store from any directory
    if trainer.runners is not None:
        config["runners"] = {"ray": trainer.runners.config()}
    if trainer.gateway_retry is not None:
        config["gateway_retry"] = trainer.gateway_retry.model_dump()
    if loggers := [lg for lg in trainer.loggers if type(lg) is LOGGERS.get(lg.name)]:
        # with the options given (an offline W&B stays offline); one's own are left out
        config["loggers"] = [
            {"name": lg.name, **lg.model_dump(exclude_defaults=True)} for lg in loggers
        ]
    if trainer.resources is not None:
        resources = trainer.resources
        items = resources.items if isinstance(resources, Resources) else resources
        config["resources"] = {
            name: item.model_dump(exclude={"kind"})
            for name, item in items.items()
            if isinstance(item, LLM)
        }
    return without_secrets(config)


def tracked_config(trainer: Trainer, run: Run, run_dir: Path) -> dict[str, Any]:
    """What the run's experiment trackers get as its config: the run, the algorithm's config
    and the trainer's arguments (as in ``train.yaml``)."""
    return without_secrets(
        {
            "run": {"name": run.name, "kind": run.kind, "run_id": run.run_id},
            "algorithm": {"name": run.algorithm, **run.config},
            "trainer": trainer_section(trainer, run_dir),
        }
    )


def agent_spec(agent: LitAgent) -> str:
    """``MODULE:NAME`` that imports ``agent`` in ``voltrl runner`` and ``voltrl train``, or
    ``FILE.py:NAME`` for a script or a top-level module (found from any directory):
    the module-level name bound to the agent itself when there is one (``calc_agent =
    calc_agent_at(None)``), else its function's or class's name; ``MODULE:AGENT`` when it has
    no importable name, or is an instance of a class built with arguments (importing the
    class would build another agent)."""
    target: Any = agent.fn if isinstance(agent, FunctionAgent) else type(agent)
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
    loaded = sys.modules.get(module or "")
    bound = [k for k, v in vars(loaded).items() if v is agent] if loaded is not None else []
    if bound:
        name = bound[0]
    elif not isinstance(agent, FunctionAgent) and not _built_without_arguments(agent):
        return "MODULE:AGENT"
    if not module or "<" in name:
        return "MODULE:AGENT"
    if "." not in module:
        path = getattr(loaded, "__file__", None)
        if path and path.endswith(".py"):
            return f"{Path(path).resolve()}:{name}"
        if module == "__main__":
            return "MODULE:AGENT"
    return f"{module}:{name}"


def _built_without_arguments(agent: LitAgent) -> bool:
    """Whether importing ``agent``'s class builds the same agent: its constructor needs no
    argument (``voltrl train`` and ``voltrl runner`` call it so)."""
    try:
        parameters = inspect.signature(type(agent)).parameters.values()
    except (TypeError, ValueError):
        return False
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    needed = [p for p in parameters if p.kind not in variadic]
    return all(p.default is not inspect.Parameter.empty for p in needed)


def algorithm_config(algorithm: Algorithm) -> dict[str, Any]:
    """The algorithm's settings as the run records them (its ``Run.config``, ``train.yaml``'s
    ``algorithm:`` section, the trackers' config): plain JSON data without secrets (a source
    database's password, an API key; :func:`voltrl._redact.without_secrets`)."""
    return without_secrets(jsonable(algorithm.config()))


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON data (what JSON cannot hold becomes its ``repr``)."""
    return json.loads(json.dumps(value, default=repr))
