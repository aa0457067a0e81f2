"""Typed errors. Each names the rollout (when there is one) and the problem."""

from __future__ import annotations


class VoltRLError(Exception):
    """Base class of every error VoltRL raises on purpose."""


class RolloutError(VoltRLError):
    """A problem tied to one rollout; ``rollout_id`` says which."""

    def __init__(self, message: str, rollout_id: str | None = None) -> None:
        self.rollout_id = rollout_id
        super().__init__(f"rollout {rollout_id}: {message}" if rollout_id else message)


class InvalidRolloutResultError(RolloutError):
    """An agent returned something that is not a reward, None, or a list of transitions."""


class InvalidRewardError(RolloutError):
    """A reward that is not a finite number (NaN, infinity, a string...)."""


class MissingTokenIdsError(RolloutError):
    """An LLM call was recorded without token ids and the trajectory builder was told to
    raise (``missing_token_ids="error"``) rather than drop or re-tokenize it."""


class TokenDriftError(RolloutError):
    """A row the trajectory builder would train is not the tokens that were sampled (a call
    re-tokenized, an explicit transition whose generated tokens no call sampled) and it was
    told to raise (``TrajectoryConfig(audit="error")``); the message names each call or
    transition and the position (``docs/fidelity.md``)."""


class UnknownResourceError(VoltRLError, KeyError):
    """An agent asked for a resource name that the published resources do not have."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DatasetError(VoltRLError):
    """A dataset that cannot be read, or a row that is not a JSON-serialisable dict."""


class StoreError(VoltRLError):
    """A store operation that cannot be applied."""


class NotFoundError(StoreError, KeyError):
    """No record with that id."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StaleAttemptError(StoreError):
    """A report from an attempt that no longer owns its rollout (lease expired, superseded,
    already finished, or the rollout was cancelled). Its results are rejected, never applied."""


class NoActiveRolloutError(VoltRLError):
    """``emit_reward`` and friends were called where no rollout is: outside any, in a thread
    not given its rollout's context, or after that rollout finished."""


class TooManyFailuresError(VoltRLError):
    """A run stopped because too many of its rollouts failed (``Trainer(stop_at_failure_rate=
    ...)``). Each distinct error was printed as it first occurred, then a summary."""


class AgentLoadError(VoltRLError):
    """``MODULE:OBJECT`` could not be imported or is not an agent."""


class EndpointUnreachableError(VoltRLError):
    """An OpenAI-compatible endpoint did not answer."""


class PromptTemplateError(VoltRLError, ValueError):
    """A prompt template could not be rendered: jinja2 is missing, or a jinja template reaches
    for Python internals, which the sandbox refuses."""
