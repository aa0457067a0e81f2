"""LocalRL's prompt phase: ``LocalRL(prompt_search=APO(...))`` searches the agent's prompt template
on the model being trained, then trains the weights with the best template found.

One run, one run directory, one store, one ``metrics.jsonl``:

1. LocalRL's setup loads the model and serves it; its first resources version carries the
   starting template beside the LLM (a ``dev`` run gets both too).
2. APO's beam search (:class:`~voltrl.algorithms.apo.APO`) runs the agent against LocalRL's
   engine with its validation sampling (greedy by default), so the template is chosen for the
   model as LocalRL validates it. Its rewrites come from ``optimizer_llm``, or without one from
   the model being trained, through LocalRL's gateway. Its rewards are logged as
   ``apo/val_reward_mean`` and ``apo/train_reward_mean`` per round (LocalRL's ``val/`` and
   ``train/`` stay its own); ``prompt_search.json`` and ``final/prompt_template.json`` are
   APO's as ever.
3. LocalRL's steps follow, every version it publishes carrying the best template.

A resumed run (``checkpoints.resume``) whose search finished (``prompt_search.json`` says so)
does not search again: its rollouts get ``final/prompt_template.json``. One stopped during the
search searches again from the start (no weights had been trained).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from voltrl.algorithms.apo import APO, best_template
from voltrl.errors import VoltRLError
from voltrl.observability import prompt_search
from voltrl.resources import LLM, PromptTemplate, Resource, Resources

if TYPE_CHECKING:
    from voltrl.algorithms.local.schedule import WeightVersions
    from voltrl.runtime import TrainContext
    from voltrl.types import Task

RENAMED = {"val/reward_mean": "apo/val_reward_mean", "train/reward_mean": "apo/train_reward_mean"}
"""APO's reward metrics under the prompt phase: LocalRL's steps log ``val/`` and ``train/``."""


class Carrying:
    """A :class:`~voltrl.runtime.TrainContext` whose every publish carries, besides what is
    published, the latest value of each resource published through it before (LocalRL's LLM in
    APO's versions, the chosen template in LocalRL's), and whose metric names
    :attr:`renamed` maps. Everything else is the context's own."""

    def __init__(self, ctx: TrainContext, carried: Mapping[str, Resource]) -> None:
        self.ctx = ctx
        self.carried: dict[str, Resource] = dict(carried)
        self.renamed: dict[str, str] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ctx, name)

    async def publish(self, resources: Resources | Mapping[str, Resource]) -> Resources:
        """The context's publish of ``resources`` over the carried ones."""
        items = dict(resources.items if isinstance(resources, Resources) else resources)
        self.carried.update(items)
        return await self.ctx.publish(dict(self.carried))

    def log(self, step: int, **metrics: Any) -> dict[str, Any]:
        """The context's log, each name :attr:`renamed` maps under its new name."""
        return self.ctx.log(step, **{self.renamed.get(k, k): v for k, v in metrics.items()})


class PromptPhase:
    """APO before LocalRL's steps (see the module docstring)."""

    def __init__(self, apo: APO) -> None:
        if not isinstance(apo, APO):
            raise TypeError(f"prompt_search must be an APO(...), not {type(apo).__name__}")
        if apo.resource == "main_llm":
            raise ValueError("prompt_search=APO(resource='main_llm'): that name is LocalRL's LLM")
        self.apo = apo
        self.done = False
        """Whether the search finished in an earlier session of a resumed run."""
        self._view: Carrying | None = None

    def view(self, ctx: TrainContext, resume: bool) -> TrainContext:
        """``ctx`` as LocalRL uses it in this run: every version carries the template (the
        chosen one when a resumed run's search had finished, else the start). The same view
        for the setup and the steps."""
        if self._view is not None and (ctx is self._view or ctx is self._view.ctx):
            return cast("TrainContext", self._view)
        chosen = finished_template(ctx.run_dir) if resume else None
        self.done = chosen is not None
        if chosen is not None and ctx.progress:
            print(
                f"the prompt search finished before: the rollouts get its best template "
                f"({ctx.run_dir / 'final' / 'prompt_template.json'})",
                flush=True,
            )
        self._view = Carrying(ctx, {self.apo.resource: chosen or self.apo.prompt})
        return cast("TrainContext", self._view)

    async def run(
        self,
        ctx: TrainContext,
        llm: LLM,
        val_sampling: dict[str, Any],
        versions: WeightVersions,
        train: list[Task],
        val: list[Task] | None,
    ) -> None:
        """Search the template with APO on ``llm`` (LocalRL's, served with ``val_sampling``),
        then publish ``llm`` with the best template found (unless an earlier session did)."""
        view = self._view
        assert view is not None and ctx is view, "run() takes the context view() gave"
        if self.done:
            return
        apo = self.apo
        await versions.publish(ctx, llm.model_copy(update={"sampling_parameters": val_sampling}))
        await apo.start_optimizer(ctx, policy=llm)
        await ctx.publish({apo.resource: apo.prompt})
        if ctx.progress:
            print("prompt search (APO) on the model before training it", flush=True)
        view.renamed = RENAMED
        try:
            await apo.train(ctx, train, val)
        finally:
            view.renamed = {}
        try:
            chosen = best_template(ctx.run_dir)
        except VoltRLError as exc:
            raise VoltRLError(f"the prompt search chose no template: {exc}") from None
        view.carried[apo.resource] = chosen
        await versions.publish(ctx, llm)  # LocalRL's first steps: its sampling, the template
        if ctx.progress:
            print("LocalRL's validations and steps get the best template", flush=True)


def finished_template(run_dir: Path) -> PromptTemplate | None:
    """The best template of the prompt search a run finished (``prompt_search.json`` says it
    ended on its own), else None (none was run, or it stopped before its end)."""
    search = prompt_search.load(run_dir)
    if search is None or not search.finished:
        return None
    try:
        return best_template(run_dir)
    except VoltRLError:
        return None
