"""LocalRL: the embedded RL algorithm. One process, a CPU or one GPU, any Hugging Face causal LM.

Each step reads top to bottom:

1. pick ``tasks_per_step`` tasks and queue each ``group_size`` times (a GRPO group);
2. the runners run the agent; its calls go through the gateway to our inference engine, which
   returns the sampled token ids and logprobs the gateway records;
3. the trajectory builder turns each rollout's calls and rewards into rows; ``collate`` pads
   them into a batch;
4. ``PolicyTrainer.step`` does the policy-gradient update (group-normalised advantages,
   PPO-clip against the sampling logprobs, optional KL to the reference);
5. the gateway pauses (in-flight calls finish), the engine loads the new weights, and a new
   resources version is published, so every later rollout records which policy sampled it.

With ``schedule.max_staleness=k > 0`` the rollouts of the next ``k`` steps are queued before a step
trains, so they run while it updates (:mod:`.schedule`): no row trains on weights more than
``k`` updates older than its sampler's, and the update uses the decoupled PPO objective.

With ``PolicyUpdateConfig(use_lora=True)`` only LoRA adapters train; the engine serves a plain
copy of the model with the adapters merged in (at start and after every update).

Checkpoints (:mod:`.checkpoints`): every ``checkpoints.every`` steps, after the last, and on an
early stop (Ctrl-C, SIGTERM, an exception) unless the weights are half-updated (see
:meth:`LocalRL.train`); ``checkpoints.resume`` continues from the latest. The final model goes to
``<run dir>/final``; the tokenizer to ``<run dir>/tokenizer`` at setup (the dashboard decodes
the ids of a run still training with it).

**A LoRA adapter per agent role** (``lora_adapters=``, :mod:`voltrl.models.lora`): one base
model, one adapter per name, served at once; each step trains each adapter on its own rows
only (its own GRPO groups and optimizer), and metrics are logged per adapter.

The module stays whole past 600 lines so that a step reads top to bottom in one place; what
each part does lives in its own module (config, schedule, update, checkpoints, memory, reports).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from voltrl.algorithms.base import Algorithm
from voltrl.algorithms.local.checkpoints import (
    checkpoint_dir,
    resume_step,
    save_checkpoints,
    save_final,
)
from voltrl.algorithms.local.config import (
    RESUMABLE,
    Checkpoints,
    Compute,
    Schedule,
    Serving,
    Validation,
    group,
    grouped,
    upgraded,
)
from voltrl.algorithms.local.memory import (
    check_memory,
    peak_memory,
    reset_peak,
    say_activations,
)
from voltrl.algorithms.local.prompt_phase import PromptPhase
from voltrl.algorithms.local.reports import (
    CUT_OFF_COUNTS,
    adapters_summary,
    cut_off_warning,
    draw_reward_curve,
    same_reward_warning,
    step_line,
    stopped_line,
    untrained_warning,
)
from voltrl.algorithms.local.schedule import QueuedStep, WeightVersions, step_tasks
from voltrl.errors import VoltRLError
from voltrl.models.lora import LoraAdapters, trainer_parts
from voltrl.models.precision import checked_dtype, resolve_dtype
from voltrl.observability.events import step_event_metrics
from voltrl.observability.metrics import VAL_VERSION, summarize
from voltrl.observability.tokenizers import TOKENIZER_DIR
from voltrl.resources import LLM
from voltrl.serving.choice import checked_engine
from voltrl.trajectory import TrainingBatch, TrajectoryConfig, collate, trajectories_from_store
from voltrl.types import Rollout, Task

if TYPE_CHECKING:
    from voltrl.algorithms.apo import APO
    from voltrl.algorithms.local.sft import SFT
    from voltrl.algorithms.local.update import PolicyTrainer, PolicyUpdateConfig
    from voltrl.gateway import Gateway
    from voltrl.models.threads import ThreadChoice
    from voltrl.retry import GatewayRetry
    from voltrl.runtime import TrainContext
    from voltrl.serving.engine import Engine
    from voltrl.serving.engine.vllm import VLLMEngine


LOCAL_EXTRA = ("torch", "transformers", "tokenizers", "peft")
"""What the ``[local]`` extra installs for LocalRL."""


def _metric_name(adapter: str | None, name: str) -> str:
    """How a metric of the update is logged: ``update/<name>``, and the engine's mismatch with
    the trainer under its own ``mismatch/``; with LoRA adapters, the adapter's name after it."""
    group, _, rest = name.rpartition("/") if name.startswith("mismatch/") else ("update", "", name)
    return f"{group}/{rest}" if adapter is None else f"{group}/{adapter}/{rest}"


class LocalRL(Algorithm):
    """Train a Hugging Face causal LM with RL on this machine.

    Args:
        model: a model path or hub name (as ``from_pretrained`` takes it), ``"tiny"`` (the
            built-in tiny model and tokenizer: random weights, to try the loop, not to learn),
            a packaged model (``voltrl model list``), or a loaded ``PreTrainedModel`` (then
            pass ``tokenizer``).
        tokenizer: the tokenizer, when ``model`` is an object.
        seed: task order, sampling and the update's seed.
        schedule: steps, tasks per step, the GRPO group size, staleness (:class:`Schedule`).
        sampling: sampling parameters of training rollouts (``temperature``, ``max_tokens``...).
        validation: how often, how many rollouts a task, with what sampling (:class:`Validation`).
        update: the policy update (learning rate, clip, KL, LoRA, micro-batches):
            :class:`~voltrl.algorithms.local.update_config.PolicyUpdateConfig`.
        trajectory: how calls become training rows (transition or trajectory mode, credit):
            :class:`~voltrl.trajectory.TrajectoryConfig`.
        serving: the engine (built-in or vLLM), its batch, the served name, the gateway's
            retries and reasoning split, the tool-call parser (:class:`Serving`).
        compute: device, dtype, torch threads (:class:`Compute`).
        checkpoints: how often, how many kept, resume (:class:`Checkpoints`).
        warm_start: a :class:`~voltrl.SFT` (without ``model``) that fine-tunes the model on
            recorded rollouts (a teacher's) before it is served; the first validation then
            measures the student after warm-up. It trains every weight, LoRA or not (the KL
            reference is then the warmed model). A resumed run skips it: a full checkpoint has
            the warmed weights; with LoRA they are kept in ``<run dir>/warm_start``.
        prompt_search: an :class:`~voltrl.APO` run before the first step, on this model: it
            chooses the agent's prompt template, which every version LocalRL publishes then
            carries (:mod:`.prompt_phase`; without ``optimizer_llm`` this model writes the
            rewrites). A resumed run whose search finished skips it.
        lora_adapters: a LoRA adapter per agent role, ``{adapter name: agent-name regex}``: a
            call is served by, and trains, the first adapter whose regex fully matches its
            agent name; calls matching none are served by the base model and not trained
            (end with ``".*"`` for a catch-all adapter). Implies LoRA (``update``'s
            ``lora_*`` settings apply to each adapter).

    Each group (but ``sampling``) is a settings model of :mod:`.config` or its fields as a
    dict: ``LocalRL("tiny", schedule={"steps": 20, "group_size": 4})``. VoltRL 0.1's flat
    keywords (``steps=``, ``val_every=``...) still work for one release, with a warning
    (:data:`.config.FLAT` says where each went).
    """

    name = "local_rl"
    publishes = ("main_llm",)
    resumable = True
    resume_setting = "checkpoints.resume"
    resumable_settings = RESUMABLE

    def __init__(
        self,
        model: Any,
        *,
        tokenizer: Any = None,
        seed: int = 0,
        schedule: Schedule | dict[str, Any] | None = None,
        sampling: dict[str, Any] | None = None,
        validation: Validation | dict[str, Any] | None = None,
        update: PolicyUpdateConfig | dict[str, Any] | None = None,
        trajectory: TrajectoryConfig | dict[str, Any] | None = None,
        serving: Serving | dict[str, Any] | None = None,
        compute: Compute | dict[str, Any] | None = None,
        checkpoints: Checkpoints | dict[str, Any] | None = None,
        warm_start: SFT | None = None,
        lora_adapters: dict[str, str] | None = None,
        prompt_search: APO | None = None,
        **flat: Any,
    ) -> None:
        try:
            from voltrl.algorithms.local.update_config import implied_update
            from voltrl.models.threads import choose_threads
        except ModuleNotFoundError as exc:
            if exc.name not in LOCAL_EXTRA:
                raise
            raise VoltRLError(
                f"LocalRL needs {exc.name}, which is not installed: pip install 'voltrl[local]'"
            ) from None

        given = grouped(
            {
                "schedule": schedule,
                "validation": validation,
                "serving": serving,
                "compute": compute,
                "checkpoints": checkpoints,
            },
            flat,
        )
        self.schedule: Schedule = group("schedule", given["schedule"])
        self.validation: Validation = group("validation", given["validation"])
        self.serving: Serving = group("serving", given["serving"])
        self.compute: Compute = group("compute", given["compute"])
        self.checkpoints: Checkpoints = group("checkpoints", given["checkpoints"])
        self.model = model
        self.tokenizer = tokenizer
        self.seed = seed
        self.sampling = {"temperature": 1.0, **(sampling or {})}
        self.val_sampling = {**self.sampling, "temperature": 0.0, **self.validation.sampling}
        """The validation rollouts' sampling: the training sampling, greedy, then
        ``validation.sampling``."""
        self.adapters = (
            None
            if lora_adapters is None
            else LoraAdapters.parse(lora_adapters, served_name=self.serving.served_name)
        )
        staleness = self.schedule.max_staleness
        self.update = implied_update(update, seed, self.adapters is not None, staleness)
        if isinstance(trajectory, dict):
            trajectory = TrajectoryConfig.model_validate(trajectory)
        self.trajectory = trajectory or TrajectoryConfig()
        checked_dtype(self.compute.dtype, training=True)
        if self.serving.dtype is not None:
            checked_dtype(self.serving.dtype)
        if self.compute.threads is not None:
            choose_threads(self.compute.threads)  # a bad count fails here, not at setup
        checked_engine(self.serving.engine, self.serving.engine_args, lora_adapters is not None)
        if warm_start is not None and warm_start.model is not None:
            raise ValueError("warm_start=SFT(...) trains LocalRL's model: leave its model out")
        self.warm_start = warm_start
        self.prompt_search = prompt_search
        self._prompt = None if prompt_search is None else PromptPhase(prompt_search)
        if prompt_search is not None:
            self.publishes = ("main_llm", prompt_search.resource)
        self.history: list[dict[str, Any]] = []
        self._warned_same_reward = False
        self._warned_cut_off = False
        self._said_activations = False
        self._warned_untrained = False
        self._policy_lock = threading.Lock()
        self._steps_done = 0
        self._torn_update = False  # some adapters' update stepped, others' failed: out of step
        self._engine: Engine | VLLMEngine | None = None
        self._gateway: Gateway | None = None
        self._policies: dict[str | None, PolicyTrainer] = {}
        """The trainers: one per adapter, or one under ``None`` (the model or its LoRA)."""
        self._llm: LLM | None = None
        self._stops: list[Any] = []
        self._versions = WeightVersions()

    @functools.cached_property
    def threads(self) -> ThreadChoice:
        """torch's threads and why: ``compute.threads``, else what the machine shows when
        first asked (the run's setup): every usable CPU unless other processes keep some busy."""
        from voltrl.models.threads import choose_threads

        return choose_threads(self.compute.threads)

    @property
    def resume(self) -> bool:
        """Whether this run continues from its latest checkpoint (``checkpoints.resume``)."""
        return self.checkpoints.resume

    @property
    def gateway_retry(self) -> GatewayRetry | None:
        """How the gateway retries engine calls (``serving.gateway_retry``; None: the
        trainer's)."""
        return self.serving.gateway_retry

    @property
    def tool_parser(self) -> str:
        """The format the engine parses the model's tool calls in (``serving.tool_parser``;
        None: the packaged model's, else ``"hermes"``)."""
        from voltrl.models.toolcalls import default_tool_parser

        return self.serving.tool_parser or default_tool_parser(self.model)

    def config(self) -> dict[str, object]:
        """The settings recorded with the run, in groups: every argument but ``tokenizer``, as
        ``voltrl train``'s ``algorithm:`` section takes them (a local model directory as its
        absolute path; a model object by its class name, which no config can load; torch's
        threads as given, None where the machine decides at the start, and the validation
        sampling as it is in effect)."""
        from voltrl.models.loading import model_name

        validation = {**self.validation.model_dump(), "sampling": self.val_sampling}
        return {
            "model": model_name(self.model),
            "seed": self.seed,
            "schedule": self.schedule.model_dump(),
            "sampling": self.sampling,
            "validation": validation,
            "update": self.update.model_dump(),
            "trajectory": self.trajectory.model_dump(exclude={"retokenizer"}),
            "serving": self.serving.model_dump(),
            "compute": self.compute.model_dump(),
            "checkpoints": self.checkpoints.model_dump(),
            "warm_start": self.warm_start and self.warm_start.config(),
            "lora_adapters": self.adapters and self.adapters.config(),
            "prompt_search": self.prompt_search and self.prompt_search.config(),
        }

    def upgraded_config(self, recorded: dict[str, Any]) -> dict[str, Any]:
        """A config a run of LocalRL recorded, in today's shape (:func:`.config.upgraded`)."""
        return upgraded(recorded)

    # ---- setup: model, engine, gateway, resources ---------------------------------------
    def _load(self) -> tuple[Any, Any]:
        from voltrl.models.loading import load_model

        return load_model(
            self.model,
            self.tokenizer,
            device=self.compute.device,
            seed=self.seed,
            dtype=self.compute.dtype,
        )

    async def setup(self, ctx: TrainContext) -> None:
        """Load the model, start the engine and a gateway in front of it, publish the LLM."""
        from voltrl.algorithms.local.update import PolicyTrainer
        from voltrl.models.threads import use_threads
        from voltrl.serving.engine import start_engine
        from voltrl.serving.openai_api import serve_engine

        if self._prompt is not None:  # every version carries the template
            ctx = self._prompt.view(ctx, self.resume)
        choice = await asyncio.to_thread(lambda: self.threads)  # measures 0.2 s: off the loop
        use_threads(choice, report=ctx.progress)
        model, tokenizer = await asyncio.to_thread(self._load)
        reset_peak(next(model.parameters()).device)  # memory/peak_gib: this run's
        check_memory(model, self, report=ctx.progress)
        # The dashboard and ``voltrl show`` decode the run's token ids with it.
        await asyncio.to_thread(tokenizer.save_pretrained, ctx.run_dir / TOKENIZER_DIR)
        resume_from = None
        if self.resume:
            names = self.adapters.names if self.adapters is not None else None
            resume_from = resume_step(checkpoint_dir(ctx.run_dir, None), names)
        if self.warm_start is not None:  # before LoRA wraps the model: it trains every weight
            await self.warm_start.warm_up(
                ctx,
                model,
                tokenizer,
                resumed=resume_from is not None,
                keep_base=self.update.use_lora,
                threads=self.threads.threads,
                tool_parser=self.tool_parser,
            )
        if self.adapters is None:
            served = copy.deepcopy(model)  # a plain copy: with LoRA, peft wraps ``model``
            self._policies = {None: PolicyTrainer(model, self.update)}
        else:  # one peft model holding every adapter, each with a trainer of its own
            for name in self.adapters.names:
                self._policies[name] = PolicyTrainer(model, self.update, adapter=name)
                model = self._policies[name].model
        self._start_step = 0
        if resume_from is not None:
            for key, policy in self._policies.items():
                ckpt = checkpoint_dir(ctx.run_dir, key, resume_from)
                self._start_step = policy.load_checkpoint(ckpt)
            if ctx.progress:
                where = checkpoint_dir(ctx.run_dir, None)
                print(f"resuming from the checkpoint of step {resume_from} in {where}", flush=True)
        if self.adapters is None:
            served.load_state_dict(self._policies[None].merged_state_dict())
        else:  # the engine's copy: the same base and adapters, unmerged, served by name
            served = copy.deepcopy(model).requires_grad_(False)
        if self.serving.dtype is not None:  # served in another precision than it trains in
            served.to(resolve_dtype(self.serving.dtype, next(model.parameters()).device))
        self._engine = await asyncio.to_thread(
            start_engine,
            self.serving.engine,
            served,
            tokenizer,
            ctx.run_dir / "engine_model",
            max_batch_size=self.serving.max_batch_size,
            seed=self.seed,
            lora_adapters=self.adapters is not None,
            engine_args=self.serving.engine_args,
            report=ctx.progress,
        )
        self.tokenizer = tokenizer
        engine_url, stop_engine = await serve_engine(
            self._engine,
            model_name=self.serving.served_name,
            logprobs_mode="raw",
            tool_parser=self.tool_parser,
        )
        self._stops.append(stop_engine)
        adapters = self.adapters
        served_gateway = await ctx.serve_gateway(
            [f"{engine_url}/v1"],
            model=self.serving.served_name,
            model_for_agent=None if adapters is None else adapters.adapter_for,
            retry=self.gateway_retry,
            reasoning_split=self.serving.reasoning_split,
            sampling_for=lambda mode: self.val_sampling if mode == "val" else self.sampling,
        )
        self._gateway = served_gateway.gateway
        self._versions.current = self._start_step
        self._llm = LLM(
            endpoint=served_gateway.url,
            model=self.serving.served_name,
            gateway=True,
            sampling_parameters=self.sampling,
            lora_adapters=self._adapter_versions(),
        )
        await self._versions.publish(ctx, self._llm)

    def _adapter_versions(self) -> dict[str, int]:
        """Each adapter's weights version: the updates it has had (resumed runs included)."""
        return {k: p.global_step for k, p in self._policies.items() if k is not None}

    async def teardown(self, ctx: TrainContext) -> None:
        """Stop the engine (the run stops its gateway). The gateway is closed first: calls
        in flight finish (up to 10 s), and the calls of rollouts still running (an
        interrupted run) get a 503 at once instead of failing against a stopped engine and
        being retried."""
        if self._gateway is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10.0):  # not wait_for: see Notifier.wait
                    await self._gateway.close()
        for stop in reversed(self._stops):
            await stop()
        self._stops.clear()
        if self._engine is not None:
            await asyncio.to_thread(self._engine.close)

    # ---- the loop -----------------------------------------------------------------------
    async def train(self, ctx: TrainContext, train: list[Task], val: list[Task] | None) -> None:
        """Run ``schedule.steps`` policy updates, validating every ``validation.every`` steps;
        checkpoint every ``checkpoints.every`` steps and after the last.

        A run that stops early keeps what it learned: the weights of the last completed update
        are checkpointed with its step (whose line is in ``metrics.jsonl``) and
        ``checkpoints.resume`` continues from there. Ctrl-C or SIGTERM during an update ends it
        at its next micro-batch if no optimizer step has run (:attr:`PolicyTrainer.stop`: the
        run exits within one forward and backward pass with the previous step's weights), else
        lets it finish. An update that fails after it began changing the weights (an optimizer
        step ran, or raised) leaves weights no step produced: they are not saved, and the last
        checkpoint stays the latest. Nothing goes to ``final/``. The rollouts of steps queued
        ahead (``schedule.max_staleness``) are cancelled or left untrained: a resumed run queues
        those steps again, so no rollout trains twice.
        """
        assert self._policies and self._engine is not None and self._llm is not None
        if self._prompt is not None:  # the prompt search first, on the model as it is
            ctx = self._prompt.view(ctx, self.resume)
            await self._prompt.run(ctx, self._llm, self.val_sampling, self._versions, train, val)
        stream = step_tasks(
            train,
            per_step=self.schedule.tasks_per_step,
            group_size=self.schedule.group_size,
            seed=self.seed,
        )
        for _ in range(self._start_step):
            next(stream)  # a resumed run continues the same task order
        self._steps_done = self._start_step
        ahead: list[QueuedStep] = []  # queued, not yet trained: at most max_staleness + 1
        try:
            if val and self.validation.every:
                await self.validate(ctx, val, self._start_step)
            for step in range(self._start_step, self.schedule.steps):
                last = min(step + self.schedule.max_staleness, self.schedule.steps - 1)
                for queued in range(ahead[-1].step + 1 if ahead else step, last + 1):
                    tasks = next(stream)
                    ahead.append(await self._versions.queue_step(ctx, self._llm, tasks, queued))
                record = await self.train_step(ctx, ahead.pop(0))
                self._steps_done = step + 1
                self.history.append(record)
                if self.checkpoints.every and (step + 1) % self.checkpoints.every == 0:
                    await asyncio.to_thread(self._checkpoint, ctx.run_dir)
                if val and self.validation.every and (step + 1) % self.validation.every == 0:
                    await self.validate(ctx, val, step + 1)
            if val and self.validation.every and self.schedule.steps % self.validation.every:
                await self.validate(ctx, val, self.schedule.steps)
            if self._steps_done > self._start_step:  # a finished run can go on with more steps
                await asyncio.to_thread(self._checkpoint, ctx.run_dir)
            names = self.adapters.names if self.adapters is not None else None
            final = ctx.run_dir / "final"
            model = self._engine.model
            await asyncio.to_thread(save_final, final, model, self.tokenizer, self._policies, names)
            if ctx.progress and names is not None:
                updates = {name: self._policies[name].global_step for name in names}
                print(adapters_summary(names, self.history, updates), flush=True)
        except BaseException as exc:  # Ctrl-C, SIGTERM or a failure: keep what was learned
            for policy in self._policies.values():
                policy.stop.set()  # an update under way ends at its next micro-batch
            await self._checkpoint_stopped(ctx, exc)
            raise
        finally:
            draw_reward_curve(ctx.metrics.history(), ctx.run_dir, ctx.run.name)

    async def _checkpoint_stopped(self, ctx: TrainContext, exc: BaseException) -> None:
        """Checkpoint a run that ``exc`` stopped before its end, if its weights are those of a
        step (see :meth:`train`), and say so. A failure to save is reported, not raised: it
        must not hide why the run stopped."""
        cancelled = isinstance(exc, asyncio.CancelledError)
        stopped = "interrupted" if cancelled else f"failed ({type(exc).__name__})"
        try:
            path = await asyncio.to_thread(self._checkpoint, ctx.run_dir, stopped=True)
        except Exception as error:
            print(
                f"{stopped}: warning: no checkpoint saved: {type(error).__name__}: {error}",
                flush=True,
            )
            return
        where = checkpoint_dir(ctx.run_dir, None)
        torn = self._weights_torn()
        print(stopped_line(stopped, path, self._steps_done, torn, where), flush=True)

    def _update(
        self, parts: dict[str | None, TrainingBatch], step: int
    ) -> dict[str | None, dict[str, Any]]:
        """The policy update of ``step``: each trainer on its part of the batch (on a worker
        thread; a checkpoint waits for it). Returns each trainer's metrics."""
        with self._policy_lock:
            metrics: dict[str | None, dict[str, Any]] = {}
            try:
                for key, part in parts.items():
                    self._policies[key].stoppable = not metrics  # none stepped yet
                    metrics[key] = self._policies[key].step(part)
            except BaseException:
                self._torn_update = bool(metrics)  # the adapters done are a step ahead
                raise
            self._steps_done = step + 1
            return metrics

    def _checkpoint(self, run_dir: Path, *, stopped: bool = False) -> Path | None:
        """Save a checkpoint of the steps done, once no update is running (with adapters,
        one per adapter, under ``checkpoints/<adapter>/``), keeping the latest
        ``checkpoints.keep``; returns where. One already saved is kept. ``None``, and nothing
        saved, when the weights belong to no step (an update failed after it had begun to
        change them: :attr:`PolicyTrainer.mid_update`), or, for a ``stopped`` run, when
        neither an update nor a warm-up changed the model as loaded (a resumed run loads it
        again)."""
        with self._policy_lock:
            if self._weights_torn():
                return None
            if stopped and self._steps_done == 0 and self.warm_start is None:
                return None
            keep = self.checkpoints.keep
            return save_checkpoints(run_dir, self._policies, self._steps_done, keep)

    def _weights_torn(self) -> bool:
        """Whether an update failed after it had begun to change the weights: some optimizer
        step ran (or raised) and the update did not complete, or with adapters some trainers
        stepped and others not. The weights then belong to no step."""
        return self._torn_update or any(p.mid_update for p in self._policies.values())

    def _warn_untrained(self, batch: TrainingBatch, untrained: list[int], step: int) -> None:
        """Say once which agents' rows matched no adapter (a typo in a pattern, say)."""
        if not untrained or self._warned_untrained or self.adapters is None:
            return
        self._warned_untrained = True
        print(untrained_warning(batch, untrained, step, self.adapters.config()), flush=True)

    async def _serve_new_weights(self, ctx: TrainContext, trained: list[str | None]) -> None:
        """Load the trained weights into the engine while the gateway is paused (calls in
        flight finish first), then publish a new resources version."""
        assert self._engine is not None and self._gateway is not None and self._llm is not None
        weights = {
            key: await asyncio.to_thread(
                self._policies[key].merged_state_dict
                if key is None
                else self._policies[key].adapter_state_dict
            )
            for key in trained
        }
        async with self._gateway.paused():
            for key, state in weights.items():
                await self._engine.aupdate_weights(state, adapter=key)
            self._versions.current += 1
            self._llm = self._llm.model_copy(update={"lora_adapters": self._adapter_versions()})
            await self._versions.publish(ctx, self._llm)

    async def train_step(self, ctx: TrainContext, queued: QueuedStep) -> dict[str, Any]:
        """Wait for a step's rollouts, build the batch (without rows staler than
        ``max_staleness``), update the policy (each adapter on its own rows), serve the new
        weights."""
        assert self._policies
        step = queued.step
        t0 = time.perf_counter()
        rollouts = await ctx.wait(queued.rollouts, desc=f"step {step + 1}/{self.schedule.steps}")
        t1 = time.perf_counter()
        trajectories = await trajectories_from_store(ctx.store, rollouts, self.trajectory)
        weights = self._versions.current  # what this step's update starts from
        trajectories, staleness = self._versions.drop_stale(
            trajectories, self.schedule.max_staleness
        )
        batch = collate(trajectories, self.trajectory)
        parts, untrained = trainer_parts(self.adapters, batch)
        stats = summarize(rollouts)
        events = await step_event_metrics(ctx.store, rollouts, "train")
        trained: dict[str | None, dict[str, Any]] = {}
        if parts and stats.succeeded:  # rows of failed rollouts alone teach nothing
            if not self._said_activations:  # the first update: its rows' lengths are known
                self._said_activations = True
                say_activations(self._policies, self.update, parts, ctx.progress)
            trained = await asyncio.to_thread(self._update, parts, step)
        t2 = time.perf_counter()
        metrics = {_metric_name(key, k): v for key, m in trained.items() for k, v in m.items()}
        if self.adapters is not None:
            metrics.update(
                {f"lora_adapter/{k}/version": v for k, v in self._adapter_versions().items()}
            )
            metrics["batch/rows_no_adapter"] = len(untrained)
        record = ctx.log(
            step + 1,
            **stats.flat("train/"),
            **events,
            **metrics,
            **{f"batch/{k}": v for k, v in {**CUT_OFF_COUNTS, **batch.stats}.items()},
            **staleness,
            rollout_s=t1 - t0,
            update_s=t2 - t1,
            resources_version=queued.version,
            weights_version=weights,
            **peak_memory(self._policies),
        )  # logged before the swap: a run stopped during it has the line of the step it saves
        if trained:
            await self._serve_new_weights(ctx, list(trained))
        if ctx.progress:
            shown = staleness if self.schedule.max_staleness else None
            print(
                step_line(step, self.schedule.steps, stats, trained, t1 - t0, t2 - t1, shown),
                flush=True,
            )
            self._warn_untrained(batch, untrained, step)
        adv_tokens = sum(m["adv_tokens"] for m in trained.values())
        if trained and not adv_tokens and not self._warned_same_reward:
            self._warned_same_reward = True
            print(same_reward_warning(step), flush=True)
        cap = self.sampling.get("max_tokens") or self.sampling.get("max_completion_tokens")
        if (cut := cut_off_warning(batch.stats, step, cap)) and not self._warned_cut_off:
            self._warned_cut_off = True
            print(cut, flush=True)
        return record

    async def validate(self, ctx: TrainContext, tasks: list[Task], step: int) -> list[Rollout]:
        """Run every validation task ``validation.n`` times with ``val_sampling``; logs ``val/*``
        metrics (over all of those rollouts), the events' among them
        (:func:`~voltrl.observability.events.step_event_metrics`)."""
        assert self._llm is not None
        version = await self._versions.publish(
            ctx, self._llm.model_copy(update={"sampling_parameters": self.val_sampling})
        )
        # every task, then every task again: the first rollouts logged are different tasks
        repeated = [t for _ in range(self.validation.n) for t in tasks]
        rollouts = await ctx.run_rollouts(repeated, mode="val", desc=f"validate @ {step}")
        await self._versions.publish(ctx, self._llm)
        stats = summarize(rollouts)
        events = await step_event_metrics(ctx.store, rollouts, "val")
        record = ctx.log(step, **stats.flat("val/"), **events, **{VAL_VERSION: version})
        self.history.append(record)
        await ctx.log_rollouts(step, rollouts)
        if ctx.progress:
            print(f"validation @ {step}: reward {stats.reward_mean or 0:.3f}", flush=True)
        return rollouts
