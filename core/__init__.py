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

from voltrl import _moved
from voltrl.agent import LitAgent, rollout
from voltrl.algorithms.apo import APO
from voltrl.algorithms.base import Algorithm
from voltrl.algorithms.baseline import Baseline
from voltrl.algorithms.local import SFT, LocalRL
from voltrl.algorithms.verl import VERL
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
    TooManyFailuresError,
    UnknownResourceError,
    VoltRLError,
)
from voltrl.observability.metrics import RewardStats
from voltrl.resources import LLM, PromptTemplate, Resources
from voltrl.runtime import RunResult, TrainContext, Trainer
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

__version__ = "0.1.0"

_moved.install()  # the old paths of moved modules, for one release

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
