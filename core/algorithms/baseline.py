"""Baseline: evaluate the agent with the current resources; learns nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from voltrl.algorithms.base import Algorithm
from voltrl.observability.metrics import summarize
from voltrl.types import Task

if TYPE_CHECKING:
    from voltrl.runtime import TrainContext


class Baseline(Algorithm):
    """Runs every task ``n_repeats`` times (train split, then validation) and logs reward
    statistics. Use it to measure an agent before training, or as a template."""

    name = "baseline"

    def __init__(self, n_repeats: int = 1) -> None:
        if n_repeats < 1:
            raise ValueError("n_repeats must be at least 1")
        self.n_repeats = n_repeats

    async def train(self, ctx: TrainContext, train: list[Task], val: list[Task] | None) -> None:
        """Evaluate on ``train`` (mode ``train``) and ``val`` (mode ``val``)."""
        for split, tasks in (("train", train), ("val", val or [])):
            if not tasks:
                continue
            rollouts = await ctx.run_rollouts(tasks * self.n_repeats, mode=split, desc=split)
            ctx.log(0, **summarize(rollouts).flat(f"{split}/"))
            if split == "val":
                await ctx.log_rollouts(0, rollouts)
