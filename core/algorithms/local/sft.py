"""SFT: supervised fine-tuning on recorded rollouts, as a run or as LocalRL's warm start.

Distillation and rejection-sampling fine-tuning.
Run the agent against a teacher endpoint with ``dev``: the gateway records every call with
the prompt the framework rendered. ``SFT(source=RUN_DIR, min_reward=1.0)`` then trains the
student on the assistant turns of the rollouts it selects, through the same trajectory
builder and :class:`~voltrl.trajectory.TrainingBatch` as RL::

    rows      = trajectory builder(selected rollouts)        # mode, agent filter, lengths
    loss      = - sum_t m_t * log pi(y_t | y_<t) / sum_t m_t  # m: the response (loss) mask

so only generated tokens train (tool results and the next user turn inside a merged row have
mask 0), exactly the teacher's response tokens, or, for a teacher that returned no token ids
(a hosted API), their re-tokenisation with the student's chat template when ``retokenize``
is set (:func:`~voltrl.algorithms.local.conversations.chat_retokenizer`; such rows carry
``metadata["retokenized"]``). Alone, ``SFT`` trains and saves the model to
``<run dir>/final``; as ``LocalRL(..., warm_start=SFT(...))`` it trains LocalRL's model before
the engine serves it, so the first validation measures the student after warm-up.

It trains in the supervised loop, :func:`~voltrl.algorithms.local.supervised.fit_rows`,
which also trains on written conversations
(:func:`~voltrl.algorithms.local.supervised.supervised_warmup`). The functions that moved out
of this module keep their old path here for one release (``__all__``).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from voltrl.algorithms.base import Algorithm
from voltrl.algorithms.local.conversations import conversation_batch, tokenize_conversation
from voltrl.algorithms.local.memory import check_activations
from voltrl.algorithms.local.supervised import cosine_schedule, fit_rows, supervised_warmup
from voltrl.errors import VoltRLError
from voltrl.models.precision import checked_dtype
from voltrl.models.threads import use_threads
from voltrl.models.toolcalls import checked_tool_parser
from voltrl.store import open_store
from voltrl.store.spec import absolute_spec
from voltrl.trajectory import (
    Retokenizer,
    TrainingBatch,
    TrajectoryConfig,
    collate,
    trajectories_from_store,
)
from voltrl.types import LLMCall, Rollout, Task

__all__ = [  # the functions that moved keep their old path here for one release
    "SFT",
    "conversation_batch",
    "cosine_schedule",
    "fit_rows",
    "supervised_warmup",
    "tokenize_conversation",
]

if TYPE_CHECKING:
    import torch

    from voltrl.runtime import TrainContext
    from voltrl.store.base import Store


class SFT(Algorithm):
    """Supervised fine-tuning on the recorded assistant turns of selected rollouts.

    Args:
        model: what to train, as :class:`~voltrl.LocalRL` takes it (a path or hub name,
            ``"tiny"``, or a loaded model with ``tokenizer``). Leave it out under
            ``LocalRL(warm_start=...)``, which trains its own model.
        source: where the rollouts are: a run directory (``runs/teacher``), a store file or
            URL; or a list of them.
        tokenizer: the tokenizer, when ``model`` is an object.
        runs: only rollouts of these runs (names, every run of that name, or ids; default:
            every run in the sources).
        modes: only rollouts of these modes (default ``train`` and ``dev``: an RL run's
            validation rollouts, on held-out tasks, are left out).
        min_reward: only rollouts whose reward (as the trajectory builder credits it) is at
            least this (rejection sampling; default: every succeeded rollout).
        agents: only calls whose agent name this regex fully matches (``"write|rewrite"``).
        retokenize: calls recorded without token ids (a hosted API) are re-tokenised with the
            student's chat template; without it they are an error, never silently dropped.
        tool_parser: the tool-call parser the student will be served with
            (:mod:`voltrl.models.toolcalls`; under ``LocalRL(warm_start=...)``, LocalRL's
            ``serving.tool_parser`` unless given). With ``retokenize``, each re-tokenised call
            with tool calls is checked: its rendered answer, parsed by it, gives the recorded
            calls; else an error names the call and the parser that would read it, since the
            student would learn to write calls its engine leaves as text. None (alone): no
            check. Recorded token ids are trained as they are, whatever their format.
        trajectory: the builder's settings (default ``mode="trajectory"``: a multi-turn agent's
            calls merge into one row); ``agents`` and ``retokenize`` override its filter and
            ``missing_token_ids``.
        steps, batch_size, lr, warmup_steps: optimizer steps of ``batch_size`` rows (the rows
            in a fresh shuffled order each epoch), AdamW at ``lr`` with linear warm-up and
            cosine decay to a tenth.
        micro_batch_size: most rows per forward pass (gradients accumulate; default all).
        seed, device, threads, dtype: as LocalRL's (``dtype`` when SFT loads the model
            itself; as ``LocalRL(warm_start=...)`` it trains LocalRL's model, in LocalRL's).

    After :meth:`run`, ``losses`` holds the loss per step and ``summary`` what was trained on.
    """

    name = "sft"

    def __init__(
        self,
        model: Any = None,
        *,
        source: str | Path | Sequence[str | Path],
        tokenizer: Any = None,
        runs: Sequence[str] | str | None = None,
        modes: Sequence[str] = ("train", "dev"),
        min_reward: float | None = None,
        agents: str | None = None,
        retokenize: bool = False,
        tool_parser: str | None = None,
        trajectory: TrajectoryConfig | dict[str, Any] | None = None,
        steps: int = 200,
        batch_size: int = 16,
        micro_batch_size: int | None = None,
        lr: float = 1e-4,
        warmup_steps: int = 10,
        seed: int = 0,
        device: str | None = None,
        threads: int | None = None,
        dtype: str = "auto",
    ) -> None:
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        except ModuleNotFoundError as exc:
            raise VoltRLError(
                f"SFT needs {exc.name}, which is not installed: pip install 'voltrl[local]'"
            ) from None
        if steps < 1 or batch_size < 1 or (micro_batch_size is not None and micro_batch_size < 1):
            raise ValueError("steps, batch_size and micro_batch_size must be at least 1")
        self.model = model
        self.tokenizer = tokenizer
        sources = [source] if isinstance(source, str | Path) else list(source)
        # absolute: the run's train.yaml names them from any directory
        self.sources = [absolute_spec(s) for s in sources]
        if not self.sources:
            raise ValueError("SFT needs a source: a run directory or a store")
        self.runs = [runs] if isinstance(runs, str) else list(runs) if runs is not None else None
        self.modes = tuple(modes)
        self.min_reward = min_reward
        self.agents = agents
        self.retokenize = retokenize
        self.tool_parser = None if tool_parser is None else checked_tool_parser(tool_parser)
        base = (
            TrajectoryConfig.model_validate(trajectory)
            if isinstance(trajectory, dict)
            else trajectory or TrajectoryConfig(mode="trajectory")
        )
        if agents is not None:  # validated: a bad regex fails here
            base = TrajectoryConfig.model_validate(
                {**dict(base), "agent_filter": agents, "retokenizer": base.retokenizer}
            )
        self.trajectory = base
        self.steps = steps
        self.batch_size = batch_size
        self.micro_batch_size = micro_batch_size or batch_size
        self.lr = lr
        self.warmup_steps = warmup_steps
        self.seed = seed
        self.device = device
        self.threads = threads
        self.dtype = checked_dtype(dtype, training=True)
        self.losses: list[float] = []
        self.summary: dict[str, Any] = {}
        self._model: Any = None
        self._stop = threading.Event()  # set when the run is cancelled (Ctrl-C)

    def config(self) -> dict[str, object]:
        """The settings recorded with the run (a model object by its class name)."""
        return {
            "model": self.model
            if self.model is None or isinstance(self.model, str | Path)
            else type(self.model).__name__,
            "source": [str(s) for s in self.sources],
            "runs": self.runs,
            "modes": list(self.modes),
            "min_reward": self.min_reward,
            "agents": self.agents,
            "retokenize": self.retokenize,
            # only when set: a run recorded before the setting resumes as it was
            **({"tool_parser": self.tool_parser} if self.tool_parser is not None else {}),
            "trajectory": self.trajectory.model_dump(),
            "steps": self.steps,
            "batch_size": self.batch_size,
            "micro_batch_size": self.micro_batch_size,
            "lr": self.lr,
            "warmup_steps": self.warmup_steps,
            "seed": self.seed,
            "dtype": self.dtype,
        }

    # ---- data: the same builder and batch as RL ---------------------------------------------
    async def _run_ids(self, stores: list[Store]) -> list[set[str]]:
        """Per store, the ids of the runs to use: all of them, or those ``runs`` names (every
        run of that name) or ids; a name or id found in no store is an error."""
        listed = [await store.list_runs() for store in stores]
        if self.runs is None:
            return [{r.run_id for r in runs} for runs in listed]
        wanted = set(self.runs)
        chosen = [{r.run_id for r in runs if wanted & {r.name, r.run_id}} for runs in listed]
        found = {key for runs in listed for r in runs for key in (r.name, r.run_id)}
        missing = [r for r in self.runs if r not in found]
        if missing:
            known = ", ".join(sorted({r.name for runs in listed for r in runs})) or "none"
            raise VoltRLError(f"SFT: no run {missing} in the sources (runs there: {known})")
        return chosen

    async def select(self, store: Store, run_ids: set[str]) -> list[Rollout]:
        """The succeeded rollouts of ``run_ids`` in ``store`` whose mode is in ``modes``,
        oldest first (``min_reward`` applies to the built trajectories' rewards)."""
        chosen: list[Rollout] = []
        for run_id in sorted(run_ids):
            rollouts = await store.query_rollouts(run_id=run_id, status="succeeded")
            chosen += [r for r in rollouts if r.mode in self.modes]
        return chosen

    async def build_batch(self, tokenizer: Any) -> TrainingBatch:
        """Select the rollouts of every source and build their rows into one batch."""
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        update: dict[str, Any] = {"pad_token_id": pad}
        if self.retokenize:
            from voltrl.algorithms.local.conversations import chat_retokenizer

            update["missing_token_ids"] = "retokenize"
            update["retokenizer"] = chat_retokenizer(tokenizer)
            if self.tool_parser is not None:
                update["retokenizer"] = _reads_back(
                    update["retokenizer"], tokenizer, self.tool_parser
                )
            if self.trajectory.audit == "warn":  # re-tokenized rows are what it asks for
                update["audit"] = "off"
        config = self.trajectory.model_copy(update=update)
        trajectories, selected = [], 0
        stores: list[Store] = []
        try:
            for source in self.sources:  # a run directory or a store spec that must exist
                stores.append(open_store(source, existing=True, read_only=True))
            for store, run_ids in zip(stores, await self._run_ids(stores), strict=True):
                rollouts = await self.select(store, run_ids)
                selected += len(rollouts)
                trajectories += await trajectories_from_store(store, rollouts, config)
        finally:
            for store in stores:
                await store.close()
        if self.min_reward is not None:  # the reward the builder credits (returned or emitted)
            trajectories = [
                t for t in trajectories if t.reward is not None and t.reward >= self.min_reward
            ]
        batch = collate(trajectories, config)
        missing = batch.stats.get("dropped/missing_token_ids", 0)
        if missing and not self.retokenize:
            raise VoltRLError(
                f"SFT: {missing} calls of the selected rollouts were recorded without token ids "
                "(a hosted API or a server asked with --no-token-ids): pass retokenize=True to "
                "re-tokenise them with the student's chat template"
            )
        if not len(batch) or not any(1 in m for m in batch.response_mask):
            raise VoltRLError(
                f"SFT: nothing to train on: {selected} rollouts selected from "
                f"{', '.join(map(str, self.sources))} (runs={self.runs}, modes={self.modes}, "
                f"min_reward={self.min_reward}, agents={self.agents!r}); batch stats "
                f"{batch.stats}"
            )
        return batch

    # ---- the loop ------------------------------------------------------------------------------
    def fit_batch(
        self,
        model: torch.nn.Module,
        batch: TrainingBatch,
        log: Callable[[int, dict[str, float]], None] | None = None,
    ) -> list[float]:
        """Train ``model`` on ``batch``'s masked response tokens with these settings
        (:func:`fit_rows`); the loss per step. Ends between steps once the run is cancelled."""
        return fit_rows(
            model,
            batch,
            steps=self.steps,
            batch_size=self.batch_size,
            micro_batch_size=self.micro_batch_size,
            lr=self.lr,
            warmup_steps=self.warmup_steps,
            seed=self.seed,
            threads=self.threads,
            log=log,
            stop=self._stop,
        )

    async def run(self, ctx: TrainContext, model: Any, tokenizer: Any) -> list[float]:
        """Build the batch from the sources and train ``model`` on it; logs ``sft/loss``,
        ``sft/tokens`` and ``sft/lr`` per step and draws ``sft_loss.png`` in the run
        directory."""
        started = time.perf_counter()
        batch = await self.build_batch(tokenizer)
        trained = sum(sum(m) for m in batch.response_mask)
        self.summary = {
            "rows": len(batch),
            "rollouts": batch.stats.get("rollouts_with_rows", 0),
            "tokens": trained,
            "retokenized_calls": batch.stats.get("retokenized", 0),
            "merge_failures": batch.stats.get("merge_failures", 0),
            "agents": sorted({a or "" for a in batch.agent_names}),
        }
        if ctx.progress:
            named = ", ".join(a for a in self.summary["agents"] if a)  # unnamed: a plain client
            print(
                f"SFT: {self.summary['rows']} rows from {self.summary['rollouts']} rollouts "
                f"({trained} trained tokens, {self.summary['retokenized_calls']} calls "
                f"re-tokenised, {self.summary['merge_failures']} merge failures"
                f"{f'; agents {named}' if named else ''})",
                flush=True,
            )
        activations = check_activations(model, batch, self.micro_batch_size, what="SFT")
        if ctx.progress or activations.startswith("warning"):
            print(activations, flush=True)
        every = max(1, self.steps // 10)

        def log(step: int, values: dict[str, float]) -> None:
            ctx.log(step + 1, **{f"sft/{k}": v for k, v in values.items()})
            if ctx.progress and (step % every == 0 or step == self.steps - 1):
                print(
                    f"SFT step {step + 1}/{self.steps}  loss {values['loss']:.4f}  "
                    f"{time.perf_counter() - started:.0f} s",
                    flush=True,
                )

        self._stop.clear()
        try:
            self.losses = await asyncio.to_thread(self.fit_batch, model, batch, log)
        except asyncio.CancelledError:  # Ctrl-C: the training thread ends after its step
            self._stop.set()
            raise
        self.summary |= {"first_loss": self.losses[0], "last_loss": self.losses[-1]}
        ctx.log(self.steps, **{f"sft/summary/{k}": v for k, v in self.summary.items()})
        self._draw(ctx)
        return self.losses

    def _draw(self, ctx: TrainContext) -> None:
        from voltrl.observability.plots import loss_curve

        try:
            loss_curve(self.losses, ctx.run_dir / "sft_loss.png", f"{ctx.run.name}: SFT")
        except Exception as exc:  # a failure to draw must not end the run
            print(f"warning: sft_loss.png not drawn: {type(exc).__name__}: {exc}", flush=True)

    # ---- under LocalRL: before the engine serves the model -------------------------------------
    async def warm_up(
        self,
        ctx: TrainContext,
        model: Any,
        tokenizer: Any,
        *,
        resumed: bool,
        keep_base: bool,
        threads: int,
        tool_parser: str | None = None,
    ) -> None:
        """Warm up LocalRL's ``model`` (every weight) with :meth:`run`, unless the run resumes:
        a full checkpoint holds the warmed weights; LoRA checkpoints (``keep_base``) hold the
        adapters only, so the warmed model is kept in ``<run dir>/warm_start`` (with its
        tokenizer: a model directory that serves and loads on its own) and loaded again.
        ``threads``, ``tool_parser``: LocalRL's, used unless this SFT was given its own."""
        from voltrl.models.loading import quiet_transformers

        warmed = ctx.run_dir / "warm_start"
        if not resumed:
            if self.threads is None:
                self.threads = threads
            if self.tool_parser is None and tool_parser is not None:
                self.tool_parser = checked_tool_parser(tool_parser)
            await self.run(ctx, model, tokenizer)
            if keep_base:  # a model directory of its own: `voltrl model serve` serves it
                with quiet_transformers():
                    await asyncio.to_thread(model.save_pretrained, warmed)
                    await asyncio.to_thread(tokenizer.save_pretrained, warmed)
        elif keep_base:
            if not (warmed / "config.json").exists():
                raise VoltRLError(
                    f"cannot resume: the LoRA checkpoints sit on the warm-started model, which "
                    f"is not in {warmed}"
                )
            with quiet_transformers():
                state = await asyncio.to_thread(
                    lambda: type(model).from_pretrained(warmed, dtype=model.dtype).state_dict()
                )
            model.load_state_dict(state)

    # ---- alone: load, train, save -------------------------------------------------------------
    async def setup(self, ctx: TrainContext) -> None:
        """Load the model (``model`` is required when SFT runs alone)."""
        from voltrl.models.loading import load_model

        if self.model is None:
            raise VoltRLError("SFT alone needs model=...; under LocalRL(warm_start=...) it trains")
        use_threads(self.threads, report=ctx.progress)
        self._model, self.tokenizer = await asyncio.to_thread(
            load_model,
            self.model,
            self.tokenizer,
            device=self.device,
            seed=self.seed,
            dtype=self.dtype,
        )

    async def train(self, ctx: TrainContext, train: list[Task], val: list[Task] | None) -> None:
        """Train on the selected rollouts and save the model to ``<run dir>/final``
        (``from_pretrained`` loads it). The datasets are not used: no rollout runs."""
        from voltrl.models.loading import quiet_transformers

        await self.run(ctx, self._model, self.tokenizer)
        final = ctx.run_dir / "final"
        with quiet_transformers():
            await asyncio.to_thread(self._model.save_pretrained, final)
        await asyncio.to_thread(self.tokenizer.save_pretrained, final)
        if ctx.progress:
            print(f"SFT: model saved to {final}", flush=True)


def _reads_back(retokenize: Retokenizer, tokenizer: Any, parser: str) -> Retokenizer:
    """``retokenize``, refusing a call whose re-rendered tool calls ``parser`` does not read
    back as the recorded ones (names and arguments): the student would learn a format its
    engine leaves as text."""
    from voltrl.models.toolcalls import AUTO_ORDER, parse_tool_calls
    from voltrl.trajectory import assistant_message

    def same(calls: Any, wanted: list[tuple[str, Any]]) -> bool:
        return [(c["function"]["name"], _arguments(c)) for c in calls] == wanted

    def checked(call: LLMCall) -> tuple[list[int], list[int]]:
        prompt, response = retokenize(call)
        recorded = assistant_message(call).get("tool_calls") or []
        if not recorded:
            return prompt, response
        wanted = [(c["function"]["name"], _arguments(c)) for c in recorded]
        text = tokenizer.decode(response, skip_special_tokens=True)  # as the engine decodes
        tools = call.request.get("tools")
        if same(parse_tool_calls(text, parser, tools)[1], wanted):
            return prompt, response
        readers = [p for p in AUTO_ORDER if same(parse_tool_calls(text, p, tools)[1], wanted)]
        hint = f"the {readers[0]!r} parser reads it" if readers else "no parser reads it"
        raise VoltRLError(
            f"SFT: call {call.call_id}'s tool calls, rendered with the student's chat template "
            f"as {text[:200]!r}, are not read back by tool parser {parser!r} ({hint}): the "
            "student would learn to write calls its engine leaves as text; serve it with the "
            "parser its template writes (tool_parser=, serving.tool_parser, --tool-parser)"
        )

    return checked


def _arguments(call: dict[str, Any]) -> Any:
    """A call's arguments as a value (OpenAI gives a JSON string; a teacher may give a dict)."""
    args = call["function"].get("arguments")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args
