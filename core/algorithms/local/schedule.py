"""LocalRL's schedule: the tasks each step runs, the steps queued ahead of the update
(``schedule.max_staleness``), which weights sampled each row, and how stale it is when it
trains.

With ``k = 0`` a step queues its rollouts, waits for them, updates and serves the new weights:
nothing overlaps. With ``k > 0`` the rollouts of steps ``t+1 ... t+k`` are queued before step
``t`` trains, so the runners keep working (on the slow tail of step ``t``'s group, then on the
next steps') while the update runs, and a rollout can span a weight update. Versions:

- every resources version LocalRL publishes carries the **weights version** its engine serves
  (``LLM.weights_version``: updates loaded so far), and each step's rollouts are queued with a
  version of their own (the dashboard's step is the train rollouts of one version);
- every recorded call has the resources version that was current when it was admitted by the
  gateway, which holds new calls while the engine loads new weights and lets the calls in flight
  finish on the old ones first: a call is sampled by exactly one version's weights;
- a row's **staleness** is the updates between the oldest weights that sampled one of its calls
  and the weights it trains: ``current - min(weights of its calls)``. Step ``s`` is queued once
  the update of step ``s - k - 1`` is served, so its calls are at most ``k`` updates old; a
  rollout staler than ``k`` would be dropped and counted (``dropped/stale``) rather than
  trained. A row whose sampler is not recorded (an explicit transition, a call of a gateway
  LocalRL did not publish for) is trained as before: its age is unknown, not too old.

Each token keeps the logprob its own call sampled it with, so a multi-turn row whose calls span
an update trains against each token's own behaviour policy (the decoupled PPO objective of
:func:`~voltrl.algorithms.local.loss.policy_loss`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from voltrl.types import Rollout, Task, Trajectory

if TYPE_CHECKING:
    from voltrl.resources import LLM
    from voltrl.runtime import TrainContext


def step_tasks(
    tasks: Sequence[Task], *, per_step: int, group_size: int, seed: int
) -> Iterator[list[Task]]:
    """Each step's tasks: ``per_step`` tasks, each ``group_size`` times in a row (a GRPO
    group), drawn in a fresh shuffled order each epoch."""
    rng = random.Random(seed)

    def stream() -> Iterator[Task]:
        while True:
            order = list(tasks)
            rng.shuffle(order)
            yield from order

    one = stream()
    while True:
        chosen = [next(one) for _ in range(per_step)]
        yield [t for t in chosen for _ in range(group_size)]


@dataclass
class QueuedStep:
    """A step's rollouts, queued (possibly ahead of the update that trains them)."""

    step: int
    """The step that trains them (0-based)."""
    version: int | None
    """The resources version they were queued with: their step's own."""
    rollouts: list[Rollout]


@dataclass
class WeightVersions:
    """Which weights each resources version LocalRL published serves, and which versions
    hold a step's rollouts."""

    current: int = 0
    """The weights version the engine serves: updates loaded so far."""
    of: dict[int, int] = field(default_factory=dict)
    """Resources version -> the weights version it was published with."""
    queued: set[int | None] = field(default_factory=set)
    """The resources versions a step's rollouts were queued with."""

    async def publish(self, ctx: TrainContext, llm: LLM) -> int:
        """Publish ``llm`` as ``main_llm`` with the current weights version; returns the
        resources version."""
        llm = llm.model_copy(update={"weights_version": self.current})
        saved = await ctx.publish({"main_llm": llm})
        self.of[saved.version] = self.current
        return saved.version

    async def queue_step(
        self, ctx: TrainContext, llm: LLM, tasks: Sequence[Task], step: int
    ) -> QueuedStep:
        """Queue ``step``'s training rollouts under a resources version of their own
        (``llm`` is published again when the latest version already holds a step's: steps
        queued ahead of an update)."""
        if ctx.resources_version in self.queued:
            await self.publish(ctx, llm)
        version = ctx.resources_version
        self.queued.add(version)
        rollouts = await ctx.enqueue(tasks, mode="train")
        return QueuedStep(step, version, rollouts)

    def drop_stale(
        self, trajectories: Sequence[Trajectory], max_staleness: int
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """:func:`drop_stale` against the weights served now (those the update starts from)."""
        return drop_stale(trajectories, self.of, self.current, max_staleness)


def row_staleness(
    versions: Sequence[int | None], weights_of: Mapping[int, int], current: int
) -> int | None:
    """Updates between the oldest weights that sampled one of a row's calls (``versions``: the
    calls' resources versions) and ``current``; None when its sampler is unknown: a version
    is not one of ``weights_of``, or the row has no calls (an explicit transition)."""
    if not versions:
        return None
    if any(v is None or v not in weights_of for v in versions):
        return None
    return current - min(weights_of[v] for v in versions)  # type: ignore[index]


def drop_stale(
    trajectories: Sequence[Trajectory],
    weights_of: Mapping[int, int],
    current: int,
    max_staleness: int,
) -> tuple[list[Trajectory], dict[str, float]]:
    """``trajectories`` with those that have a row staler than ``max_staleness`` updates
    emptied: dropped whole, with ``dropped/stale`` in their stats, so the batch's counts say
    why (their group's advantages are then computed without them). Each row kept gets its
    age as ``metadata["staleness"]`` (None: unknown), which the update reads: a row sampled by
    the weights it trains needs no proximal forward pass. Returns them and the metrics
    ``staleness/mean``, ``staleness/max`` (over the rows kept whose age is known; 0 with none)
    and ``dropped/stale`` (rollouts dropped)."""
    kept: list[Trajectory] = []
    ages: list[int] = []
    dropped = 0
    for trajectory in trajectories:
        rows = [
            row_staleness(t.metadata.get("resources_versions") or [], weights_of, current)
            for t in trajectory.transitions
        ]
        if any(age is not None and age > max_staleness for age in rows):
            dropped += 1
            stats = {**trajectory.stats, "dropped/stale": 1}
            kept.append(trajectory.model_copy(update={"transitions": [], "stats": stats}))
            continue
        ages += [age for age in rows if age is not None]
        aged = [
            t.model_copy(update={"metadata": {**t.metadata, "staleness": age}})
            for t, age in zip(trajectory.transitions, rows, strict=True)
        ]
        kept.append(trajectory.model_copy(update={"transitions": aged}))
    metrics = {
        "staleness/mean": sum(ages) / len(ages) if ages else 0.0,
        "staleness/max": float(max(ages, default=0)),
        "dropped/stale": float(dropped),
    }
    return kept, metrics
