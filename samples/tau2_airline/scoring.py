"""The reward of an episode of the generated domain, scored the way tau2 scores the airline
domain (tau2's own domain is scored by tau2's evaluator: see ``tau2_domain.evaluate``).

- An episode that did not end with the user stopping (too many steps or tool errors, an
  empty message, a context overflow) scores 0.
- Otherwise the reward is the product of the components the task's ``reward_basis`` names:
  **DB**: the episode's write calls, replayed on a fresh copy of the database, reach the same
  state (hash) as the task's gold actions replayed on another copy, whatever path got there;
  **COMMUNICATE**: each ``communicate_info`` string appears in some assistant message
  (case-insensitive, commas removed); **ACTION**: each gold action was called with matching
  arguments (those in ``compare_args``, else all). ``NL_ASSERTION`` needs an LLM judge; it is
  not scored here and is listed in ``Score.unscored`` (a task with nothing else to score
  gets 0; the loader leaves such tasks out).
"""

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from airline_db import Action, AirlineTask, FlightDB
from airline_tools import WRITE_TOOLS, AirlineTools, db_copy
from tau2_domain import ENDINGS, SCORED_ENDINGS  # tau2's endings (no import of tau2 itself)

#: The components this module scores (``NL_ASSERTION`` needs an LLM judge).
SCORED_BASIS = ("DB", "COMMUNICATE", "ACTION")


@dataclass
class Score:
    """An episode's reward and what it was made of (None: not in the task's basis)."""

    reward: float
    termination: str
    db: float | None = None
    communicate: float | None = None
    action: float | None = None
    missing_info: list[str] = field(default_factory=list)
    unscored: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The score as plain data (for an event in the rollout)."""
        return asdict(self)


def replay(db: FlightDB, calls: Iterable[tuple[str, dict[str, Any]]]) -> FlightDB:
    """A fresh copy of ``db`` after the write calls among ``calls`` (refused ones change
    nothing, as they did in the episode)."""
    tools = AirlineTools(db_copy(db))
    for name, arguments in calls:
        if name in WRITE_TOOLS:
            tools.execute(name, arguments)
    return tools.db


def _normal(text: str) -> str:
    return text.lower().replace(",", "")


def missing_info(info: Sequence[str], assistant_texts: Sequence[str]) -> list[str]:
    """The ``communicate_info`` strings no assistant message contains."""
    said = [_normal(t) for t in assistant_texts]
    return [i for i in info if not any(_normal(i) in s for s in said)]


def _matches(gold: Action, name: str, arguments: dict[str, Any]) -> bool:
    if gold.name != name:
        return False
    keys = gold.compare_args if gold.compare_args is not None else list(gold.arguments)
    return all(arguments.get(k) == gold.arguments.get(k) for k in keys)


def evaluate(
    task: AirlineTask,
    db: FlightDB,
    tool_calls: Sequence[tuple[str, dict[str, Any]]],
    assistant_texts: Sequence[str],
    termination: str,
) -> Score:
    """Score an episode of ``task`` that started from ``db``: its tool calls in order
    ``(name, arguments)``, the assistant's messages, and how it ended."""
    if termination not in ENDINGS:
        raise ValueError(f"unknown ending {termination!r}: one of {', '.join(ENDINGS)}")
    criteria = task.evaluation_criteria
    score = Score(reward=0.0, termination=termination)
    if termination not in SCORED_ENDINGS:
        return score
    basis = set(criteria.reward_basis)
    parts = []
    if "DB" in basis:
        gold = replay(db, [(a.name, a.arguments) for a in criteria.actions])
        score.db = float(replay(db, tool_calls).digest() == gold.digest())
        parts.append(score.db)
    if "COMMUNICATE" in basis:
        score.missing_info = missing_info(criteria.communicate_info, assistant_texts)
        score.communicate = float(not score.missing_info)
        parts.append(score.communicate)
    if "ACTION" in basis:
        found = all(any(_matches(a, n, args) for n, args in tool_calls) for a in criteria.actions)
        score.action = float(found)
        parts.append(score.action)
    score.unscored = sorted(basis - set(SCORED_BASIS))
    score.reward = float(bool(parts) and all(p == 1.0 for p in parts))
    return score
