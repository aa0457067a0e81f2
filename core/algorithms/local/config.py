"""LocalRL's settings, in groups: what a newcomer reads in its signature.

``LocalRL(model, *, seed, schedule, sampling, validation, update, trajectory, serving, compute,
checkpoints, warm_start, lora_adapters, prompt_search)``: each group is a model below (or its
fields as a dict, as ``train.yaml`` gives them); the update's is
:class:`~voltrl.algorithms.local.update_config.PolicyUpdateConfig`, the trajectories'
:class:`~voltrl.trajectory.TrajectoryConfig`. A run records them in this shape
(``LocalRL.config()``, ``algorithm:`` in its ``train.yaml``).

VoltRL 0.1 took every setting as a keyword of its own (``steps=``, ``val_every=``,
``engine=``...): :data:`FLAT` says where each went. Those keywords still work for one release,
with a ``DeprecationWarning`` (:func:`grouped`), and a run recorded in that shape resumes
(:func:`upgraded`).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

from pydantic import ConfigDict, Field, ValidationError, field_validator

from voltrl._dotted import section
from voltrl.models.toolcalls import checked_tool_parser
from voltrl.retry import GatewayRetry
from voltrl.types import Model


class Settings(Model):
    """A group of LocalRL's settings: checked when built, and not changed after (a run's
    recorded config stays what it ran with)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Schedule(Settings):
    """How much is trained, and in what order: ``steps`` policy updates, each on
    ``tasks_per_step`` tasks run ``group_size`` times (a GRPO group: advantages are
    normalised within it). With ``max_staleness=k > 0`` the rollouts of the next ``k`` steps
    are queued before a step trains, so they run during its update; a row then trains at most
    ``k`` updates after its sampler, with decoupled PPO (``update.old_logprobs``, unless set)."""

    steps: int = Field(20, ge=0)
    tasks_per_step: int = Field(8, ge=1)
    group_size: int = Field(4, ge=1)
    max_staleness: int = Field(0, ge=0)


class Validation(Settings):
    """Validation: every ``every`` steps (and before the first and after the last; 0: never),
    each validation task run ``n`` times (verl's ``val_kwargs.n``: the mean over several
    rollouts is a steadier figure). Its sampling is the training sampling, greedy
    (``temperature`` 0), with ``sampling`` on top."""

    every: int = Field(0, ge=0)
    n: int = Field(1, ge=1)
    sampling: dict[str, Any] = Field(default_factory=dict)


class Serving(Settings):
    """How the model is served to the agent while it trains.

    ``engine``: ``"local"`` (the built-in engine, any device) or ``"vllm"`` (vLLM in this
    process, its weights updated in place; docs/gpu.md), with ``engine_args`` (more
    ``vllm.EngineArgs`` fields). ``max_batch_size``: sequences decoded together.
    ``served_name``: the model name the agent's ``LLM`` carries. ``reasoning_split``: agents
    get the ``<think>...</think>`` the model writes as ``reasoning_content`` (training still
    sees every token). ``gateway_retry``: how the gateway retries engine calls (default: the
    trainer's). ``dtype``: the served weights' precision, when it is not the trained weights'
    (``compute.dtype``): ``"bfloat16"`` serves a float32 policy as vLLM serves an FSDP one,
    with the logprob mismatch ``update.rollout_correction`` corrects (docs/fidelity.md).
    ``tool_parser``: the format the model writes tool calls in, which the engine parses into
    OpenAI ``tool_calls`` (``"hermes"``, ``"json"``, ``"pythonic"`` or ``"auto"``:
    :mod:`voltrl.models.toolcalls`; None: the packaged model's, else ``"hermes"``)."""

    engine: str = "local"
    engine_args: dict[str, Any] | None = None
    dtype: str | None = None
    max_batch_size: int = Field(64, ge=1)
    served_name: str = "voltrl-local"
    reasoning_split: bool = False
    gateway_retry: GatewayRetry | None = None
    tool_parser: str | None = None

    @field_validator("tool_parser")
    @classmethod
    def _known_parser(cls, value: str | None) -> str | None:
        return None if value is None else checked_tool_parser(value)


class Compute(Settings):
    """Where and how fast: ``device`` (default: CUDA if available, else CPU); ``dtype``, the
    weights' precision (``"auto"``: bfloat16 on a CUDA device that supports it, else float32;
    ``"float32"``, ``"bfloat16"``; logprobs and the optimizer stay float32); ``threads``,
    torch's intra-op threads (default: ``$OMP_NUM_THREADS``, else the usable CPUs other
    processes leave free, decided at the start: :mod:`voltrl.models.threads`)."""

    device: str | None = None
    dtype: str = "auto"
    threads: int | None = Field(None, ge=1)


class Checkpoints(Settings):
    """A checkpoint every ``every`` steps (0: none on the way; one is also saved after the
    last step and when the run stops early: Ctrl-C, SIGTERM, an exception), the latest
    ``keep`` kept (None: all), and ``resume``: continue from the latest checkpoint in the run
    directory, if there is one."""

    every: int = Field(10, ge=0)
    keep: int | None = Field(3, ge=1)
    resume: bool = False


GROUPS: dict[str, type[Settings]] = {
    "schedule": Schedule,
    "validation": Validation,
    "serving": Serving,
    "compute": Compute,
    "checkpoints": Checkpoints,
}
"""LocalRL's keyword for each group above."""

FLAT: dict[str, tuple[str, str]] = {
    "steps": ("schedule", "steps"),
    "tasks_per_step": ("schedule", "tasks_per_step"),
    "group_size": ("schedule", "group_size"),
    "max_staleness": ("schedule", "max_staleness"),
    "val_every": ("validation", "every"),
    "val_n": ("validation", "n"),
    "val_sampling": ("validation", "sampling"),
    "engine": ("serving", "engine"),
    "engine_args": ("serving", "engine_args"),
    "max_batch_size": ("serving", "max_batch_size"),
    "served_name": ("serving", "served_name"),
    "reasoning_split": ("serving", "reasoning_split"),
    "gateway_retry": ("serving", "gateway_retry"),
    "device": ("compute", "device"),
    "dtype": ("compute", "dtype"),
    "threads": ("compute", "threads"),
    "checkpoint_every": ("checkpoints", "every"),
    "keep_checkpoints": ("checkpoints", "keep"),
    "resume": ("checkpoints", "resume"),
}
"""Each keyword of VoltRL 0.1's LocalRL that moved into a group: (group, field)."""


def group(name: str, value: Model | dict[str, Any] | None) -> Any:
    """The ``name`` group's settings from what LocalRL was given: its model, its fields as a
    dict (each checked, an unknown one named), or None for the defaults."""
    cls = GROUPS[name]
    if isinstance(value, cls):
        return value
    if value is None:
        return cls()
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a {cls.__name__} or a dict of its fields, not {value!r}")
    try:
        return cls.model_validate(value)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(map(str, (name, *error["loc"])))
        raise ValueError(f"{where}: {error['msg']}") from None


def grouped(
    groups: dict[str, Model | dict[str, Any] | None], flat: dict[str, Any]
) -> dict[str, Any]:
    """``groups`` with the 0.1 keywords in ``flat`` put into theirs (:func:`into_groups`; a
    ``DeprecationWarning`` names where each goes now). A keyword that is neither is a
    ``TypeError``, as Python's."""
    unknown = [k for k in flat if k not in FLAT]
    if unknown:
        raise TypeError(f"LocalRL() got an unexpected keyword argument {unknown[0]!r}")
    if flat:
        warnings.warn(
            "LocalRL's settings are grouped since VoltRL 0.2: "
            + ", ".join(f"{k}= is {FLAT[k][0]}={{{FLAT[k][1]!r}: ...}}" for k in flat)
            + " (the flat keywords go after 0.2)",
            DeprecationWarning,
            stacklevel=3,
        )
    return into_groups({**groups, **flat})


def into_groups(settings: dict[str, Any]) -> dict[str, Any]:
    """LocalRL's ``settings`` with each 0.1 flat one (:data:`FLAT`) moved into its group; a
    setting given both ways is a ``ValueError``."""
    out = {k: v for k, v in settings.items() if k not in FLAT}
    for key, value in settings.items():
        if key not in FLAT:
            continue
        name, field = FLAT[key]
        given = out.get(name)
        fields = (
            given.model_dump(exclude_unset=True) if isinstance(given, Model) else dict(given or {})
        )
        if field in fields:
            raise ValueError(f"{key} and {name}.{field} are the same setting: give one")
        out[name] = {**fields, field: value}
    return out


RESUMABLE: tuple[str, ...] = (
    "schedule.steps",
    "validation.every",
    "checkpoints",
    "compute",
    "serving.engine",
    "serving.engine_args",
    "serving.dtype",
    "serving.max_batch_size",
    "serving.gateway_retry",
    "trajectory.audit",
    "prompt_search.optimizer_llm.endpoint",
)
"""The settings (dotted paths in ``LocalRL.config()``) a resumed run may change: more steps,
how often to validate or checkpoint, where and how fast to compute, what the token-drift audit
does, where the prompt search's optimizer is served. None alters the data or the model."""

ADDED: dict[str, Any] = {
    "schedule.max_staleness": 0,
    "update.behaviour_weight_cap": 5.0,
    "update.behaviour_weight_mode": "tis",
    "update.rollout_correction": None,
    "update.rollout_correction_cap": 2.0,
    "serving.dtype": None,
    "serving.tool_parser": None,
    "trajectory.group_by_agent": None,
    "trajectory.audit": "warn",
    "prompt_search": None,
    "prompt_search.show_task": False,
    "prompt_search.answer_key": None,
    "prompt_search.repair": False,
}
"""Settings added after runs were first recorded, each with the value a run recorded before
it ran with: a resume compares them as if the run had recorded it. (A run before
``max_staleness`` was synchronous; the cap only acts with ``old_logprobs="decoupled"``, which
did not exist; there was no rollout correction; rows were grouped by task alone; tool calls
were Hermes tags, which None still means for every model that ran then; no prompt was
searched; a search quoted no task and repaired no rewrite.)"""

RENAMED_VALUES: dict[str, dict[Any, Any]] = {
    "update.behaviour_weight_mode": {"clamp": "tis", "mask": "mis"},
}
"""Values a setting has been given new names for (a run recorded ``clamp`` before the
decoupled weight's bounds took the rollout correction's names), each old value with its new."""


def upgraded(recorded: dict[str, Any]) -> dict[str, Any]:
    """A config LocalRL recorded (``Run.config``) in today's shape: the flat settings of a
    VoltRL 0.1 run moved into their groups, each of :data:`ADDED` it lacks set to the value it
    ran with, and each of :data:`RENAMED_VALUES` under its new name."""
    out = into_groups(copy.deepcopy(recorded))
    for dotted, value in ADDED.items():
        held, name = section(out, dotted, create=True)
        if held is not None and name not in held:
            held[name] = value
    for dotted, renamed in RENAMED_VALUES.items():
        held, name = section(out, dotted, create=False)
        if held is not None and held.get(name) in renamed:
            held[name] = renamed[held[name]]
    return out
