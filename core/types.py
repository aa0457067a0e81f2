"""The data model: what the store holds and what travels over HTTP.

Every record is a pydantic v2 model; the HTTP API serialises them as-is. Times are float
seconds since the epoch (``time.time()``), ids are short prefixed hex strings.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

RolloutStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
AttemptStatus = Literal["running", "succeeded", "failed", "timeout", "expired", "cancelled"]
RolloutMode = Literal["train", "val", "dev", "optimizer"]
"""What a rollout is for: training, validation, a ``dev`` run, or an algorithm's own model calls
(``optimizer``: APO's critiques and rewrites, recorded by the algorithm, never queued)."""

FINISHED_ROLLOUT: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})
"""Rollout statuses that never change again."""


def new_id(prefix: str) -> str:
    """A fresh id such as ``ro-3f9a1c0b2d4e5f60``."""
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def now() -> float:
    """Wall-clock time in seconds; the one clock every record uses."""
    return time.time()


class Model(BaseModel):
    """Base for every record: strict about unknown fields, so typos fail loudly."""

    model_config = ConfigDict(extra="forbid")


class Task(Model):
    """One dataset row to run: its input, where it came from, and how to group its rollouts.

    ``task_id`` groups rollouts of the same task (GRPO groups); it defaults to a fresh id.
    """

    task_id: str = Field(default_factory=lambda: new_id("task"))
    input: dict[str, Any]
    index: int | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


RunStatus = Literal["running", "finished", "interrupted", "failed"]


class Run(Model):
    """A trainer session (``fit`` or ``dev``) that rollouts belong to.

    ``status`` is ``running`` until the session ends: ``finished``, ``interrupted`` (Ctrl-C;
    a resumed run is ``running`` again) or ``failed`` (``error`` says why, setup failures
    included). ``add_run`` with the same ``run_id`` updates the record."""

    run_id: str = Field(default_factory=lambda: new_id("run"))
    name: str
    kind: Literal["fit", "dev"]
    algorithm: str = ""
    created_at: float = Field(default_factory=now)
    config: dict[str, Any] = Field(default_factory=dict)
    status: RunStatus = "running"
    finished_at: float | None = None
    error: str | None = None


class Rollout(Model):
    """One execution of a task, retried as new attempts until one finishes it."""

    rollout_id: str = Field(default_factory=lambda: new_id("ro"))
    run_id: str | None = None
    task: Task
    mode: RolloutMode = "train"
    status: RolloutStatus = "queued"
    resources_version: int | None = None
    max_attempts: int = 3
    retry_agent_errors: bool = True
    """Whether an attempt failed by the agent's own code (``AttemptResult.agent_error``) is
    retried like any other failure; False ends the rollout at the first such failure."""
    timeout_s: float | None = None
    attempt_count: int = 0
    created_at: float = Field(default_factory=now)
    started_at: float | None = None
    finished_at: float | None = None
    reward: float | None = None
    final_attempt_id: str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        """True once the status can no longer change."""
        return self.status in FINISHED_ROLLOUT


class Reward(Model):
    """A reward emitted during a rollout (``emit_reward``) or returned at its end."""

    rollout_id: str
    attempt_id: str
    value: float
    name: str = "reward"
    step: int | None = None
    source: Literal["return", "emit", "air", "span"] = "emit"
    timestamp: float = Field(default_factory=now)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @property
    def agents(self) -> str | None:
        """The agents this reward is the final reward of (metadata ``agents``: a regex fully
        matching their names), or None for a reward of the whole rollout. A pattern that is
        not a string or not a valid regex counts as None."""
        pattern = self.metadata.get("agents")
        if not isinstance(pattern, str):
            return None
        try:
            re.compile(pattern)
        except re.error:
            return None
        return pattern

    @field_validator("value")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"reward must be a finite number, got {v!r}")
        return v


REFUSED_SPAN = "gateway.refused"
"""The name of the span the gateway records for a call the backend refused with a 4xx (the
trajectory builder reads it)."""

ABANDONED_SPAN = "gateway.abandoned"
"""The name of the span the gateway records for a call it cut off before the backend finished
it (its ``voltrl.cut_reason``: the client disconnected, a pause's deadline, the run ending)."""

ABANDONED = "abandoned"
"""The ``finish_reason`` recorded for a choice that never finished (a stream cut off or broken
off): what was sampled is kept for the record and never trained on."""


class Span(Model):
    """An OpenTelemetry-shaped span, tagged with the rollout and attempt it belongs to."""

    rollout_id: str
    attempt_id: str
    trace_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    span_id: str = Field(default_factory=lambda: uuid.uuid4().hex[:16])
    parent_id: str | None = None
    name: str
    start_time: float = Field(default_factory=now)
    end_time: float | None = None
    attributes: dict[str, Any] = Field(default_factory=dict)
    events: list[dict[str, Any]] = Field(default_factory=list)
    status: Literal["unset", "ok", "error"] = "unset"
    sequence_id: int | None = None


class LLMCall(Model):
    """One choice of one model call made through the gateway, with the exact sampled tokens.

    ``prompt_token_ids``/``response_token_ids`` are ``None`` when the backend returned none
    (a hosted API, say): the call is still recorded, and ``has_token_ids`` says so.
    """

    call_id: str = Field(default_factory=lambda: new_id("call"))
    rollout_id: str
    attempt_id: str
    sequence_id: int | None = None
    agent_name: str | None = None
    request: dict[str, Any] = Field(default_factory=dict)
    response: dict[str, Any] = Field(default_factory=dict)
    choice_index: int = 0
    prompt_token_ids: list[int] | None = None
    response_token_ids: list[int] | None = None
    response_logprobs: list[float] | None = None
    finish_reason: str | None = None
    backend: str | None = None
    model: str | None = None
    resources_version: int | None = None
    started_at: float = Field(default_factory=now)
    ended_at: float | None = None

    @property
    def has_token_ids(self) -> bool:
        """Whether the backend returned the sampled token ids (trainable as recorded)."""
        return self.prompt_token_ids is not None and self.response_token_ids is not None

    @property
    def latency_s(self) -> float | None:
        """Seconds from request to response, when finished."""
        return None if self.ended_at is None else self.ended_at - self.started_at


class Transition(Model):
    """One training sample: a prompt, the generated tokens, and the reward credited to them.

    ``response_mask`` marks generated tokens (1) versus tokens that were fed in, such as tool
    results inside a merged multi-turn sequence (0); ``None`` means every response token counts.
    """

    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float] | None = None
    response_mask: list[int] | None = None
    reward: float | None = None
    agent_name: str | None = None
    model: str | None = None
    """The model that sampled it, as its calls recorded it (with per-role LoRA adapters:
    the adapter's name, which the row trains)."""
    metadata: dict[str, Any] = Field(default_factory=dict)


class Trajectory(Model):
    """The training data of one rollout: its transitions, in order, and its final reward.

    ``stats`` holds the trajectory builder's counts (``merge_failures``, ``truncated/...``,
    ``dropped/<reason>``...); a dropped rollout has no transitions and its reason there.
    """

    rollout_id: str
    task_id: str
    transitions: list[Transition]
    reward: float | None = None
    merge_failures: int = 0
    stats: dict[str, int] = Field(default_factory=dict)


class Attempt(Model):
    """One try of a rollout by one worker, holding a lease it must renew by heartbeats."""

    attempt_id: str = Field(default_factory=lambda: new_id("at"))
    rollout_id: str
    index: int
    worker_id: str
    status: AttemptStatus = "running"
    started_at: float = Field(default_factory=now)
    heartbeat_at: float = Field(default_factory=now)
    lease_expires_at: float
    finished_at: float | None = None
    reward: float | None = None
    error: str | None = None
    traceback: str | None = None
    transitions: list[Transition] | None = None


class Claim(Model):
    """What a worker gets from the queue: the rollout and its fresh attempt."""

    rollout: Rollout
    attempt: Attempt


class AttemptResult(Model):
    """Everything a worker reports when an attempt ends, applied by the store atomically."""

    status: Literal["succeeded", "failed", "timeout", "cancelled"]
    reward: float | None = None
    error: str | None = None
    traceback: str | None = None
    agent_error: bool = False
    """True when the agent's own code failed the attempt (it raised, or returned something
    that is not a result): deterministic, unlike a lost worker, an expired lease or a
    timeout, so a rollout enqueued with ``retry_agent_errors=False`` is not retried."""
    rewards: list[Reward] = Field(default_factory=list)
    spans: list[Span] = Field(default_factory=list)
    transitions: list[Transition] | None = None

    @field_validator("reward")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError(f"reward must be a finite number, got {v!r}")
        return v
