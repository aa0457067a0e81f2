"""VoltRL: train any AI agent with reinforcement learning.

Agents keep their framework and code; they get an OpenAI-compatible endpoint, every call is
recorded with the exact sampled token ids and rewards, and an algorithm improves the model.

    import voltrl as vl

    @vl.rollout
    async def agent(task, llm):
        ...                      # any client, any framework, pointed at llm.endpoint
        return reward

    vl.Trainer(resources={"main_llm": vl.LLM(endpoint=..., model=...)}).dev(agent, rows)
"""

import importlib as _importlib
import typing as _typing

from voltrl import _moved
from voltrl.agent import LitAgent, rollout
from voltrl.errors import (
    AgentLoadError,
    DatasetError,
    EndpointUnreachableError,
    InvalidRewardError,
    InvalidRolloutResultError,
    MissingTokenIdsError,
    NoActiveRolloutError,
    NotFoundError,
    PromptTemplateError,
    RolloutError,
    StaleAttemptError,
    StoreError,
    TokenDriftError,
    TooManyFailuresError,
    UnknownResourceError,
    VoltRLError,
)
from voltrl.observability.metrics import RewardStats
from voltrl.resources import LLM, PromptTemplate, Resources
from voltrl.tracing import (
    RolloutContext,
    current_rollout,
    emit_event,
    emit_reward,
    find_rollout,
    rollout_headers,
    span,
)
from voltrl.types import (
    Attempt,
    LLMCall,
    Reward,
    Rollout,
    Run,
    Span,
    Task,
    Trajectory,
    Transition,
)

__version__ = "0.2.0"

_moved.install()  # the old paths of moved modules, for one release

_LAZY = {
    "APO": "voltrl.algorithms.apo",
    "Algorithm": "voltrl.algorithms.base",
    "Baseline": "voltrl.algorithms.baseline",
    "LocalRL": "voltrl.algorithms.local",
    "SFT": "voltrl.algorithms.local",
    "VERL": "voltrl.algorithms.verl",
    "RayRunners": "voltrl.runtime",
    "RunResult": "voltrl.runtime",
    "TrainContext": "voltrl.runtime",
    "Trainer": "voltrl.runtime",
}
"""The public names of the layers above the vocabulary, imported when first used: a process
that only serves a model, runs an agent or reads a store (``voltrl model serve``, a runner)
loads no algorithm and no trainer."""

if _typing.TYPE_CHECKING:
    from voltrl.algorithms.apo import APO
    from voltrl.algorithms.base import Algorithm
    from voltrl.algorithms.baseline import Baseline
    from voltrl.algorithms.local import SFT, LocalRL
    from voltrl.algorithms.verl import VERL
    from voltrl.runtime import RayRunners, RunResult, TrainContext, Trainer


def __getattr__(name: str) -> _typing.Any:
    """``voltrl.Trainer``, ``voltrl.LocalRL``...: :data:`_LAZY`'s names, imported on first use."""
    if name not in _LAZY:
        raise AttributeError(f"module 'voltrl' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "APO",
    "LLM",
    "SFT",
    "VERL",
    "AgentLoadError",
    "Algorithm",
    "Attempt",
    "Baseline",
    "DatasetError",
    "EndpointUnreachableError",
    "InvalidRewardError",
    "InvalidRolloutResultError",
    "LLMCall",
    "LitAgent",
    "LocalRL",
    "MissingTokenIdsError",
    "NoActiveRolloutError",
    "NotFoundError",
    "PromptTemplate",
    "PromptTemplateError",
    "RayRunners",
    "Resources",
    "Reward",
    "RewardStats",
    "Rollout",
    "RolloutContext",
    "RolloutError",
    "Run",
    "RunResult",
    "Span",
    "StaleAttemptError",
    "StoreError",
    "Task",
    "TokenDriftError",
    "TooManyFailuresError",
    "TrainContext",
    "Trainer",
    "Trajectory",
    "Transition",
    "UnknownResourceError",
    "VoltRLError",
    "current_rollout",
    "emit_event",
    "emit_reward",
    "find_rollout",
    "rollout",
    "rollout_headers",
    "span",
]
