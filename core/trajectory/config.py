"""The trajectory builder's options: :class:`TrajectoryConfig` (``docs/trajectory.md``)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from voltrl.types import LLMCall, Model

Retokenizer = Callable[[LLMCall], tuple[list[int], list[int]]]
"""Turns a call recorded without token ids into ``(prompt_ids, response_ids)``."""


def default_tool_error(content: str) -> bool:
    """Whether a tool result reads as a failure: it starts with ``Error``, contains a Python
    traceback, or is a JSON object with a non-empty ``"error"`` field."""
    text = content.strip()
    if text.startswith("Error") or "Traceback (most recent call last)" in text:
        return True
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError:
            return False
        return isinstance(obj, dict) and obj.get("error") not in (None, False, "", {}, [])
    return False


class TrajectoryConfig(Model):
    """How rollouts become training rows; ``docs/trajectory.md`` explains each field."""

    mode: Literal["transition", "trajectory"] = "transition"
    credit: Literal["final", "discounted", "per_step"] = "final"
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    per_step_add_final: bool = False
    air: bool = False
    air_success_reward: float = 0.0
    air_failure_reward: float = -0.1
    air_is_error: Callable[[str], bool] = Field(default=default_tool_error, exclude=True)
    agent_filter: str | None = None
    group_by_agent: str | None = None
    max_transitions_per_rollout: int | None = Field(None, ge=1)
    max_prompt_length: int | None = Field(None, ge=1)
    max_response_length: int | None = Field(None, ge=1)
    length_policy: Literal["truncate", "drop"] = "truncate"
    failed_rollouts: Literal["drop", "fill"] = "drop"
    fill_reward: float = 0.0
    missing_token_ids: Literal["drop", "error", "retokenize"] = "drop"
    retokenizer: Retokenizer | None = Field(default=None, exclude=True)
    audit: Literal["off", "warn", "error"] = "warn"
    pad_token_id: int = 0
    pad_to_max_lengths: bool = False

    @field_validator("agent_filter", "group_by_agent")
    @classmethod
    def _valid_regex(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None:
            try:
                compiled = re.compile(v)
            except re.error as e:
                raise ValueError(f"{info.field_name} is not a valid regex: {e}") from None
            if info.field_name == "group_by_agent" and compiled.groups < 1:
                raise ValueError(
                    f"group_by_agent {v!r} has no capturing group: its first group names a "
                    "row's group within its task, e.g. r'[^/]+/([^/]+)/.*'"
                )
        return v

    @model_validator(mode="after")
    def _retokenizer_given(self) -> TrajectoryConfig:
        if self.missing_token_ids == "retokenize" and self.retokenizer is None:
            raise ValueError('missing_token_ids="retokenize" needs a retokenizer callable')
        return self

    def group_of(self, task_id: str, agent_name: str | None) -> str:
        """A row's GRPO group: its task, or with ``group_by_agent`` its task and what the
        regex's first group captures of its agent name (``"<task>/<captured>"``; the task
        alone when the name does not match)."""
        if self.group_by_agent is None:
            return task_id
        found = re.fullmatch(self.group_by_agent, agent_name or "")
        return task_id if found is None or found.group(1) is None else f"{task_id}/{found.group(1)}"

    def trains_agent(self, agent_name: str | None) -> bool:
        """Whether calls of this agent are trained on (``agent_filter`` fully matches)."""
        return (
            self.agent_filter is None
            or re.fullmatch(self.agent_filter, agent_name or "") is not None
        )
