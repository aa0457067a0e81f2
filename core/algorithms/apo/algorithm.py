"""APO: automatic prompt optimisation of the ``PromptTemplate`` an agent renders.

A beam search over templates, each round:

1. run every template in the beam on a batch of training tasks (normal rollouts, mode
   ``train``, each with the resources version holding its template);
2. ask the optimizer LLM for a critique of each from its worst and best runs (the "textual
   gradient"), then for ``branch_factor`` rewrites that answer it;
3. refuse rewrites that would break the agent (:func:`~voltrl.algorithms.apo.templates.refusal`),
   publish the others and score them on the validation tasks (mode ``val``);
4. keep the ``beam_width`` best of the beam and the new templates (a tie keeps the older), and
   publish the best as the newest resources version.

It stops after ``rounds``, or once ``patience`` rounds in a row found nothing better. The run
directory gets ``prompt_search.json`` (every candidate, its score and fate; what ``voltrl
show`` and the dashboard show), ``prompt_search.png`` and ``final/prompt_template.json``.

As ``LocalRL(prompt_search=APO(...))`` it runs before LocalRL's steps, on the model being
trained (:mod:`voltrl.algorithms.local.prompt_phase`); without ``optimizer_llm`` that model
writes the rewrites too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from voltrl._console import printable
from voltrl.algorithms.apo.optimizer import Optimizer, OptimizerError
from voltrl.algorithms.apo.templates import (
    CRITIQUE,
    INDUCE,
    REWRITE,
    example_block,
    extract,
    pair_block,
    refusal,
    same_rewards,
    variable_list,
    variables,
    with_placeholders,
)
from voltrl.algorithms.base import Algorithm
from voltrl.errors import VoltRLError
from voltrl.observability.plots import prompt_search_curve
from voltrl.observability.prompt_search import Candidate, PromptSearch, template_diff
from voltrl.resources import LLM, ApiKeys, PromptTemplate
from voltrl.types import Rollout, Task

if TYPE_CHECKING:
    from voltrl.runtime import TrainContext

FINAL = Path("final") / "prompt_template.json"

NO_OPTIMIZER = (
    "APO needs optimizer_llm=vl.LLM(...), the model that rewrites the prompt; it may be left "
    "out only as LocalRL(prompt_search=APO(...)), where the model being trained writes them"
)


class APO(Algorithm):
    """Improves the prompt template an agent receives, with an optimizer LLM.

    Args:
        prompt: the starting template (a string is an f-string template), published as the
            resource ``resource``; the agent takes it as ``prompt_template`` (``@vl.rollout``)
            or reads it from its resources.
        optimizer_llm: the model that critiques and rewrites: any OpenAI-compatible endpoint
            (its key as for any :class:`~voltrl.LLM`: ``api_key`` or ``api_key_env``). Its calls
            go through a gateway of the run, recorded in rollouts of mode ``optimizer`` under
            the agent name ``apo-optimizer``, and retried on backend errors like any call.
            None only as ``LocalRL(prompt_search=APO(...))``: the model being trained then
            writes the rewrites, through LocalRL's gateway.
        resource: the name the template is published under.
        rounds: rounds of critique and rewrite at most.
        beam_width: templates kept from round to round.
        branch_factor: rewrites asked for per template in the beam, per round.
        train_batch_size: training tasks each beam template runs on per round (the runs its
            critique quotes).
        val_batch_size: validation tasks every candidate is scored on (the same ones all run
            long); None: all of them. Without a validation set, the training tasks are used.
        patience: rounds in a row without a better template before the search stops.
        examples: runs quoted per critique: the worst half and the best half of the batch.
        example_chars: characters at most per quoted run.
        show_task: whether a quoted run starts with its task's input (JSON): the optimizer
            then sees what each task asked for, and a known answer in it (a label, an expected
            result) shows it what a right reply looks like. False for inputs it must not see.
        answer_key: the task field holding the answer a task expects (``"label"``), if any.
            Then ``{examples}`` are the whole training batch as input and expected-output
            pairs (``examples`` does not apply; each pair at most ``example_chars``), not
            transcripts, and the default critique is instruction induction
            (:data:`~voltrl.algorithms.apo.templates.INDUCE`): the optimizer names the
            instruction that maps the inputs to their answers, which small optimizers manage
            where a critique of transcripts fails (``docs/apo.md``). Every beam template then
            gets the same question (its batch's pairs): the rewrites differ by sampling and by
            the template they rewrite. Every training task must have the field.
        repair: whether a rewrite that leaves out placeholders of the starting template gets
            the start's lines that hold them appended (the candidate's ``repaired`` says so)
            instead of being refused: small optimizers often write a good instruction and
            drop the input's placeholder. A rewrite of fewer than 3 words is not repaired.
        critique_prompt: the critique request, with ``{examples}`` and optionally
            ``{template}`` and ``{variables}`` (default
            :data:`~voltrl.algorithms.apo.templates.CRITIQUE`, or ``INDUCE`` with
            ``answer_key``).
        rewrite_prompt: the rewrite request, with ``{template}``, ``{variables}`` and
            ``{critique}``; the answer's template is read between ``<prompt>`` tags, else after
            an opening tag never closed (an answer cut off), else from a fenced block, else the
            whole answer (default ``REWRITE``).
        optimizer_sampling: sampling parameters of the optimizer's calls (over the LLM's own).
        optimizer_timeout_s: longest one optimizer call may take.
        failed_reward: what a failed rollout (the agent raised, timed out) counts as in a
            score: set it to the lowest reward your agent gives when that is below 0, so that
            a template that breaks the agent never outscores one that works.
        seed: the batches' sampling.

    A candidate that drops a variable of the starting template (unless repaired), adds one,
    has broken syntax or repeats an earlier one is refused before it runs (``apo/rejected``).
    A score is the mean validation reward, a failed rollout counting ``failed_reward``.
    """

    name = "apo"
    needs_token_ids = False  # trains no weights; hosted APIs reject the field

    def __init__(
        self,
        prompt: PromptTemplate | str,
        *,
        optimizer_llm: LLM | None = None,
        resource: str = "prompt_template",
        rounds: int = 3,
        beam_width: int = 2,
        branch_factor: int = 2,
        train_batch_size: int = 8,
        val_batch_size: int | None = None,
        patience: int = 2,
        examples: int = 4,
        example_chars: int = 2000,
        show_task: bool = True,
        answer_key: str | None = None,
        repair: bool = True,
        critique_prompt: PromptTemplate | str | None = None,
        rewrite_prompt: PromptTemplate | str = REWRITE,
        optimizer_sampling: Mapping[str, Any] | None = None,
        optimizer_timeout_s: float = 600.0,
        failed_reward: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.prompt = _template(prompt)
        for name, value in (
            ("rounds", rounds),
            ("beam_width", beam_width),
            ("branch_factor", branch_factor),
            ("train_batch_size", train_batch_size),
            ("patience", patience),
            ("examples", examples),
        ):
            if value < 1:
                raise ValueError(f"APO: {name} must be at least 1, got {value}")
        if val_batch_size is not None and val_batch_size < 1:
            raise ValueError(
                f"APO: val_batch_size must be at least 1 or None, got {val_batch_size}"
            )
        if optimizer_llm is not None and optimizer_llm.gateway:
            raise ValueError(
                "APO: optimizer_llm must be the model's own endpoint, not a VoltRL gateway (APO "
                "records its calls through a gateway of its own)"
            )
        try:
            variables(self.prompt.template, self.prompt.engine)
        except ValueError as exc:
            raise VoltRLError(
                f"APO: the starting template is not a valid template: {exc}"
            ) from None
        if critique_prompt is None:
            critique_prompt = INDUCE if answer_key is not None else CRITIQUE
        self.critique_prompt = _request(critique_prompt, "critique_prompt", {"examples"})
        self.rewrite_prompt = _request(rewrite_prompt, "rewrite_prompt", {"template", "critique"})
        self.optimizer_llm = optimizer_llm
        self.resource = resource
        self.publishes = (resource,)
        self.rounds, self.beam_width, self.branch_factor = rounds, beam_width, branch_factor
        self.train_batch_size, self.val_batch_size = train_batch_size, val_batch_size
        self.patience, self.examples, self.example_chars = patience, examples, example_chars
        self.show_task, self.answer_key, self.repair = show_task, answer_key, repair
        self.optimizer_sampling = dict(
            optimizer_sampling or {"temperature": 1.0, "max_tokens": 1024}
        )
        self.optimizer_timeout_s = optimizer_timeout_s
        self.failed_reward = failed_reward
        self.seed = seed
        self._optimizer: Optimizer | None = None
        self._search: PromptSearch | None = None

    def config(self) -> dict[str, object]:
        """The settings to record with the run (the optimizer's key never)."""
        config = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        config.pop("publishes")
        for key in ("prompt", "critique_prompt", "rewrite_prompt"):
            config[key] = config[key].model_dump(exclude={"kind"})
        llm = self.optimizer_llm
        config["optimizer_llm"] = llm and llm.model_dump(exclude={"kind"})
        return config

    # ---- the algorithm interface ----------------------------------------------------------
    async def setup(self, ctx: TrainContext) -> None:
        """Publish the starting template; serve a gateway in front of the optimizer LLM."""
        if self.optimizer_llm is None:
            raise VoltRLError(NO_OPTIMIZER)
        await ctx.publish({self.resource: self.prompt})
        await self.start_optimizer(ctx)

    async def start_optimizer(self, ctx: TrainContext, policy: LLM | None = None) -> None:
        """Get ready to call the optimizer: ``optimizer_llm`` behind a gateway of the run
        served here, or without one ``policy``, a run gateway's LLM (LocalRL's: the model
        it trains writes the rewrites)."""
        if self.optimizer_llm is None:
            if policy is None or not policy.gateway:
                raise VoltRLError(NO_OPTIMIZER)
            url, model, sampling = policy.endpoint, policy.model, dict(self.optimizer_sampling)
        else:
            llm = ApiKeys().fill("optimizer_llm", self.optimizer_llm)
            served = await ctx.serve_gateway(
                [llm.endpoint],
                backend_api_key=None if llm.api_key == "EMPTY" else llm.api_key,
                request_token_ids=False,  # never trained; hosted APIs reject the field
            )
            url, model = served.url, llm.model
            sampling = {**llm.sampling_parameters, **self.optimizer_sampling}
        self._optimizer = Optimizer(
            ctx.store,
            ctx.run.run_id,
            url,
            model,
            ctx.token,
            sampling,
            self.optimizer_timeout_s,
        )

    async def train(self, ctx: TrainContext, train: list[Task], val: list[Task] | None) -> None:
        """The beam search (see the module docstring)."""
        if not train:
            raise VoltRLError("APO needs training tasks: the critiques quote their runs")
        if self.answer_key is not None:
            lacking = [t.task_id for t in train if self.answer_key not in t.input]
            if lacking:
                shown = ", ".join(lacking[:5]) + (
                    f" and {len(lacking) - 5} more" if len(lacking) > 5 else ""
                )
                raise VoltRLError(
                    f"APO: answer_key {self.answer_key!r} is not a field of {len(lacking)} "
                    f"training task(s): {shown}"
                )
        rng = random.Random(self.seed)
        scored_on = list(val or train)
        if self.val_batch_size is not None and self.val_batch_size < len(scored_on):
            scored_on = rng.sample(scored_on, self.val_batch_size)
        start = Candidate(
            round=0,
            template=self.prompt.template,
            status="kept",
            version=ctx.resources_version,
        )
        search = PromptSearch(resource=self.resource, engine=self.prompt.engine, candidates=[start])
        self._search = search
        try:
            await self._score(ctx, [start], scored_on, "round 0: the starting template")
            search.best_version, search.best_score = start.version, start.score
            self._log(ctx, 0, search, [start], [])
            print(f"round 0: the starting template scores {start.score:.3f}", flush=True)
            beam, stale, order = [start], 0, _cycle(train, rng)
            for r in range(1, self.rounds + 1):
                beam = await self._round(
                    ctx, r, beam, [next(order) for _ in range(self.train_batch_size)], scored_on
                )
                if beam[0].version != search.best_version:
                    search.best_version, search.best_score, stale = (
                        beam[0].version,
                        beam[0].score,
                        0,
                    )
                else:
                    stale += 1
                await ctx.publish({self.resource: self._template(beam[0].template)})
                search.rounds_done = r
                search.save(ctx.run_dir)
                if stale >= self.patience and r < self.rounds:
                    search.stopped = f"no better template for {stale} round(s)"
                    break
            else:
                search.stopped = f"{self.rounds} round(s) done"
            search.finished = True
        except BaseException as exc:
            stopped = isinstance(exc, KeyboardInterrupt | asyncio.CancelledError | SystemExit)
            search.stopped = "interrupted" if stopped else f"failed: {exc}"
            raise
        finally:
            self._finish(ctx.run_dir, search)

    # ---- one round ------------------------------------------------------------------------
    async def _round(
        self, ctx: TrainContext, r: int, beam: list[Candidate], batch: list[Task], val: list[Task]
    ) -> list[Candidate]:
        search = self._search
        assert search is not None
        runs = await self._run(ctx, beam, batch, "train", f"round {r}: the beam on training tasks")
        for parent in beam:
            parent.train_score = self._score_of(runs[parent.version])
        try:
            async with asyncio.TaskGroup() as group:  # one failing stops the others' calls
                asked = [
                    group.create_task(self._expand(ctx, r, parent, runs[parent.version]))
                    for parent in beam
                ]
        except BaseExceptionGroup as errors:
            raise errors.exceptions[0] from None
        children = [c for task in asked for c in task.result()]
        for c in children:  # checked in turn: a rewrite repeating a sibling's is refused too
            if c.status == "pending":
                if self.repair:
                    c.template, c.repaired = with_placeholders(c.template, self.prompt)
                tried = [t.template for t in search.candidates if t.status != "failed"]
                if reason := refusal(c.template, self.prompt, tried):
                    c.status, c.reason = "rejected", reason
            search.candidates.append(c)
        if children and all(c.status == "failed" for c in children):
            raise VoltRLError(
                f"APO round {r}: every call to the optimizer LLM failed; the first: "
                f"{children[0].reason}"
            )
        fresh = [c for c in children if c.status == "pending"]
        for c in fresh:
            c.version = (await ctx.publish({self.resource: self._template(c.template)})).version
        await self._score(ctx, fresh, val, f"round {r}: {len(fresh)} new template(s)")
        pool = sorted(beam + fresh, key=lambda c: (-(c.score or 0.0), c.version or 0))
        for i, c in enumerate(pool):
            c.status = "kept" if i < self.beam_width else "dropped"
        ran, beam = beam, pool[: self.beam_width]
        self._log(ctx, r, search, beam, children, ran)
        refused = [c for c in children if c.status in ("rejected", "failed")]
        reasons = "; ".join(dict.fromkeys(str(c.reason) for c in refused))
        note = f", {len(refused)} refused ({reasons})" if refused else ""
        if fixed := sum(1 for c in children if c.repaired):
            note += f", {fixed} repaired (placeholders appended)"
        line = f"round {r}: {len(fresh)} new template(s){note}; best {beam[0].score:.3f} "
        print(printable(line + f"(v{beam[0].version}, round {beam[0].round})"), flush=True)
        return beam

    async def _expand(
        self, ctx: TrainContext, r: int, parent: Candidate, runs: list[Rollout]
    ) -> list[Candidate]:
        """A critique of ``parent`` from its runs, then ``branch_factor`` rewrites: a
        ``pending`` candidate per rewrite (``failed`` for a call that failed), recorded in an
        optimizer rollout of their own."""
        assert self._optimizer is not None
        opt = self._optimizer
        task = Task(
            task_id=f"apo-round{r}-v{parent.version}",
            input={"round": r, "parent_version": parent.version, "template": parent.template},
        )
        claim = await opt.start(task, parent.version)
        rollout_id = claim.rollout.rollout_id
        values = {"template": parent.template, "variables": variable_list(self.prompt)}
        try:
            examples = await self._examples(ctx, runs)
            critique = await opt.ask(
                claim, self.critique_prompt.format(**values, examples=examples)
            )
            rewrite = self.rewrite_prompt.format(**values, critique=critique)
            answers = await asyncio.gather(
                *(opt.ask(claim, rewrite) for _ in range(self.branch_factor)),
                return_exceptions=True,
            )
            if unexpected := [
                a
                for a in answers
                if isinstance(a, BaseException) and not isinstance(a, OptimizerError)
            ]:
                raise unexpected[0]
        except BaseException as exc:
            with contextlib.suppress(Exception):  # the run may have cancelled it already
                await opt.finish(claim, str(exc) or repr(exc))
            if isinstance(exc, OptimizerError):
                return [self._failed(r, parent, rollout_id, str(exc))]
            raise
        errors = [str(a) for a in answers if isinstance(a, BaseException)]
        await opt.finish(claim, errors[0] if errors else None)
        return [
            self._failed(r, parent, rollout_id, str(answer))
            if isinstance(answer, BaseException)
            else Candidate(
                round=r,
                template=extract(answer),
                status="pending",
                parent=parent.version,
                critique=critique,
                optimizer_rollout=rollout_id,
            )
            for answer in answers
        ]

    # ---- helpers --------------------------------------------------------------------------
    async def _run(
        self, ctx: TrainContext, cands: Sequence[Candidate], tasks: list[Task], mode: str, desc: str
    ) -> dict[int | None, list[Rollout]]:
        """Each candidate's rollouts of ``tasks``, all queued at once."""
        queued = [
            await ctx.enqueue(tasks, mode, resources_version=c.version)  # type: ignore[arg-type]
            for c in cands
        ]
        done = await ctx.wait([r for rs in queued for r in rs], desc=desc)
        by_id = {r.rollout_id: r for r in done}
        return {
            c.version: [by_id[r.rollout_id] for r in rs]
            for c, rs in zip(cands, queued, strict=True)
        }

    async def _score(
        self, ctx: TrainContext, cands: Sequence[Candidate], val: list[Task], desc: str
    ) -> None:
        if not cands:
            return
        runs = await self._run(ctx, cands, val, "val", desc)
        for c in cands:
            c.score = self._score_of(runs[c.version])

    def _score_of(self, rollouts: Sequence[Rollout]) -> float:
        """Mean reward of ``rollouts``: a failed one counts ``failed_reward``, a succeeded
        one without a reward 0."""
        if not rollouts:
            return 0.0
        rewards = [
            (r.reward or 0.0) if r.status == "succeeded" else self.failed_reward for r in rollouts
        ]
        return sum(rewards) / len(rewards)

    async def _examples(self, ctx: TrainContext, runs: list[Rollout]) -> str:
        """The worst and the best of ``runs`` as the critique quotes them; with
        ``answer_key``, every run's task as an input and expected-output pair."""
        if self.answer_key is not None:
            limit = self.example_chars // 2
            return "\n\n".join(pair_block(r.task.input, self.answer_key, limit) for r in runs)
        ranked = sorted(runs, key=lambda r: r.reward if r.reward is not None else float("-inf"))
        worst = ranked[: (self.examples + 1) // 2]
        best = [r for r in ranked[::-1][: self.examples // 2] if r not in worst]
        blocks = []
        for i, rollout in enumerate(worst + best, 1):
            calls = []
            if rollout.final_attempt_id or rollout.attempt_count:
                calls = await ctx.store.get_llm_calls(rollout.rollout_id, rollout.final_attempt_id)
            task = rollout.task.input if self.show_task else None
            blocks.append(example_block(i, rollout.reward, calls, self.example_chars, task))
        if same := same_rewards([r.reward for r in worst + best]):
            blocks.append(same)
        return "\n\n".join(blocks)

    def _failed(self, r: int, parent: Candidate, rollout_id: str, error: str) -> Candidate:
        print(
            printable(f"round {r}: the optimizer failed on v{parent.version}: {error}"), flush=True
        )
        return Candidate(
            round=r,
            template="",
            status="failed",
            parent=parent.version,
            reason=error,
            optimizer_rollout=rollout_id,
        )

    def _template(self, text: str) -> PromptTemplate:
        return PromptTemplate(template=text, engine=self.prompt.engine)

    def _log(
        self,
        ctx: TrainContext,
        r: int,
        search: PromptSearch,
        beam: list[Candidate],
        new: list[Candidate],
        ran: Sequence[Candidate] = (),
    ) -> None:
        """Round ``r``'s metrics: the new beam, the ``new`` candidates, and the mean training
        reward of the templates that ``ran`` on the round's batch."""
        scored = [c.score for c in new if c.score is not None]
        trained = [c.train_score for c in ran if c.train_score is not None]
        ctx.log(
            r,
            **{
                "val/reward_mean": beam[0].score,
                "train/reward_mean": sum(trained) / len(trained) if trained else None,
                "apo/best_score": max(beam[0].score or 0.0, search.best_score or 0.0),
                "apo/round_best_score": max(scored) if scored else None,
                "apo/candidates": sum(c.status != "failed" for c in new),
                "apo/rejected": sum(c.status == "rejected" for c in new),
                "apo/optimizer_failures": sum(c.status == "failed" for c in new),
            },
        )

    def _finish(self, run_dir: Path, search: PromptSearch) -> None:
        """Save the search, its plot and the best template; say what was found."""
        search.save(run_dir)
        prompt_search_curve(search, run_dir / "prompt_search.png")
        best, start = search.best, search.start
        if best is None or best.score is None:
            return
        final = run_dir / FINAL
        final.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "resource": self.resource,
            "template": best.template,
            "engine": search.engine,
            "score": best.score,
            "start_score": start.score,
            "version": best.version,
            "round": best.round,
        }
        final.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
        why = "failed" if (search.stopped or "").startswith("failed") else search.stopped
        if best is start:
            print(f"APO ({why}): no template beat the start ({start.score:.3f})", flush=True)
            return
        print(
            f"APO ({why}): best template v{best.version} (round {best.round}) scores "
            f"{best.score:.3f}, the start {start.score or 0:.3f}; saved in {final}",
            flush=True,
        )
        print(printable("\n".join(template_diff(start.template, best.template))), flush=True)


def best_template(run_dir: str | Path) -> PromptTemplate:
    """The best template an APO run found (its ``final/prompt_template.json``), ready to give
    an agent: ``best_template(trainer.fit(...).run_dir)``. Raises :class:`VoltRLError` when
    the run saved none (it is not an APO run, or stopped before scoring its start)."""
    path = Path(run_dir) / FINAL
    if not path.is_file():
        raise VoltRLError(f"no best template in {run_dir}: {path} does not exist")
    record = json.loads(path.read_text())
    return PromptTemplate(template=record["template"], engine=record["engine"])


def _template(prompt: PromptTemplate | str) -> PromptTemplate:
    return prompt if isinstance(prompt, PromptTemplate) else PromptTemplate(template=prompt)


def _request(prompt: PromptTemplate | str, name: str, needed: set[str]) -> PromptTemplate:
    """An optimizer prompt, checked for the placeholders APO fills in."""
    template = _template(prompt)
    try:
        found = variables(template.template, template.engine)
    except ValueError as exc:
        raise VoltRLError(f"APO: {name} is not a valid template: {exc}") from None
    if missing := sorted(needed - found):
        raise VoltRLError(f"APO: {name} must use {', '.join('{' + m + '}' for m in missing)}")
    if extra := sorted(found - needed - {"template", "variables"}):
        raise VoltRLError(f"APO: {name} uses {extra}, which APO does not fill in")
    return template


def _cycle(tasks: list[Task], rng: random.Random) -> Any:
    """The training tasks in a fresh shuffled order each pass, forever."""
    while True:
        order = list(tasks)
        rng.shuffle(order)
        yield from order
