"""Browsing a store: one page of rollouts by any filter and sort, and a run's rollout counts.

What the dashboard and other readers ask of a store that may hold 100,000 rollouts and
1,000,000 LLM calls. :class:`RolloutQuery` says which rollouts, in which order, which page;
:class:`RolloutPage` answers with that page and how many matched (counted up to
:data:`COUNT_CAP`, so a page costs the same on any store size). :class:`RolloutCount` is one
cell of a run's rollouts by mode, resources version and status, for its curves.

The meaning of each filter is written once here, in :func:`matches`, and the SQL store
translates it to SQL (:mod:`voltrl.store.sql.statements`); the tests check that both agree.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from pydantic import Field

from voltrl.types import Model, Rollout, RolloutMode, RolloutStatus

COUNT_CAP = 10_000
"""Matches counted at most; a page over more says ``total_capped``."""

MAX_PAGE = 500
"""Most rollouts on one page."""

SortKey = Literal["created_at", "reward", "attempts", "duration", "resources_version", "status"]


class RolloutQuery(Model):
    """Which rollouts (every given filter holds), in which order, and which page of them."""

    run_id: str | None = None
    status: list[RolloutStatus] = Field(default_factory=list)
    """Any of these statuses (empty: any)."""
    mode: RolloutMode | None = None
    reward_min: float | None = None
    """Only rollouts with a reward ``>=`` this (rollouts without a reward are left out)."""
    reward_max: float | None = None
    resources_version: int | None = None
    task_id: str | None = None
    agent: str | None = None
    """Only rollouts with an LLM call recorded under this agent name."""
    min_attempts: int | None = None
    text: str | None = None
    """Substring of the task (its id, input and metadata as JSON), ASCII letters in any case."""
    sort: SortKey = "created_at"
    descending: bool = True
    offset: int = Field(default=0, ge=0, le=2**53)
    limit: int = Field(default=50, ge=1, le=MAX_PAGE)


class RolloutPage(Model):
    """One page of rollouts and how many matched in all."""

    rollouts: list[Rollout]
    total: int
    """Rollouts matching the filters, counted up to :data:`COUNT_CAP`."""
    total_capped: bool = False
    """True when more than :data:`COUNT_CAP` matched (``total`` is then the cap)."""


class RolloutCount(Model):
    """A run's rollouts of one mode, resources version and status, and their rewards."""

    mode: RolloutMode
    resources_version: int | None
    status: RolloutStatus
    count: int
    rewarded: int = 0
    reward_sum: float = 0.0
    reward_sq_sum: float = 0.0

    @property
    def reward_mean(self) -> float | None:
        """Mean reward of the rewarded ones, or None."""
        return self.reward_sum / self.rewarded if self.rewarded else None

    @property
    def reward_std(self) -> float | None:
        """Population standard deviation of the rewards, or None."""
        if not self.rewarded:
            return None
        mean = self.reward_sum / self.rewarded
        return math.sqrt(max(0.0, self.reward_sq_sum / self.rewarded - mean * mean))


def task_text(rollout: Rollout) -> str:
    """The text :attr:`RolloutQuery.text` searches: the task as compact JSON, as stored."""
    return rollout.task.model_dump_json()


def duration(rollout: Rollout) -> float | None:
    """Seconds from the first start to the end, once finished."""
    if rollout.started_at is None or rollout.finished_at is None:
        return None
    return rollout.finished_at - rollout.started_at


def matches(rollout: Rollout, query: RolloutQuery, agents: Iterable[str | None] = ()) -> bool:
    """Whether ``rollout`` passes every filter of ``query``; ``agents`` are the agent names of
    its LLM calls (only read when the query filters by agent)."""
    reward = rollout.reward
    return (
        (query.run_id is None or rollout.run_id == query.run_id)
        and (not query.status or rollout.status in query.status)
        and (query.mode is None or rollout.mode == query.mode)
        and (query.reward_min is None or (reward is not None and reward >= query.reward_min))
        and (query.reward_max is None or (reward is not None and reward <= query.reward_max))
        and (
            query.resources_version is None or rollout.resources_version == query.resources_version
        )
        and (query.task_id is None or rollout.task.task_id == query.task_id)
        and (query.min_attempts is None or rollout.attempt_count >= query.min_attempts)
        and (not query.text or _fold(query.text) in _fold(task_text(rollout)))
        and (query.agent is None or query.agent in set(agents))
    )


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def _fold(text: str) -> str:
    """Lower case for ASCII letters only, as SQLite's LIKE compares (PostgreSQL's ILIKE
    folds other letters too)."""
    return text.translate(_ASCII_LOWER)


def sort_value(rollout: Rollout, key: SortKey) -> Any:
    """The value a page is sorted on (None sorts last either way)."""
    if key == "attempts":
        return rollout.attempt_count
    if key == "duration":
        return duration(rollout)
    return getattr(rollout, key)


def page_of(rollouts: Sequence[Rollout], query: RolloutQuery) -> RolloutPage:
    """The page ``query`` asks for, out of the rollouts that matched it (any order): sorted
    on ``query.sort``, ties by creation time then id, all in the query's direction; rollouts
    without a value (no reward yet, not finished) come last either way."""
    key = query.sort
    present = [r for r in rollouts if sort_value(r, key) is not None]
    absent = [r for r in rollouts if sort_value(r, key) is None]
    present.sort(key=lambda r: (sort_value(r, key), r.created_at, r.rollout_id))
    absent.sort(key=lambda r: (r.created_at, r.rollout_id))
    if query.descending:
        present.reverse()
        absent.reverse()
    ordered = present + absent
    return RolloutPage(
        rollouts=ordered[query.offset : query.offset + query.limit],
        total=min(len(ordered), COUNT_CAP),
        total_capped=len(ordered) > COUNT_CAP,
    )


def counts_of(rollouts: Iterable[Rollout]) -> list[RolloutCount]:
    """Rollouts counted by mode, resources version and status, with their rewards (of
    succeeded rollouts only, as :func:`voltrl.observability.metrics.summarize` counts them),
    ordered by mode, version (None first) and status."""
    cells: dict[tuple[str, int | None, str], RolloutCount] = {}
    for r in rollouts:
        key = (r.mode, r.resources_version, r.status)
        cell = cells.get(key)
        if cell is None:
            cell = cells[key] = RolloutCount(
                mode=r.mode, resources_version=r.resources_version, status=r.status, count=0
            )
        cell.count += 1
        if r.status == "succeeded" and r.reward is not None:
            cell.rewarded += 1
            cell.reward_sum += r.reward
            cell.reward_sq_sum += r.reward * r.reward
    return sorted(cells.values(), key=count_order)


def count_order(count: RolloutCount) -> tuple[Any, ...]:
    """The order of :meth:`Store.rollout_counts`: mode, version (None first), status."""
    version = count.resources_version
    return (count.mode, version is not None, version or 0, count.status)
