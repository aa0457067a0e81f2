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

With ``max_staleness=k > 0`` the rollouts of the next ``k`` steps are queued before a step
trains, so they run while it updates (:mod:`.schedule`): no row trains on weights more than
``k`` updates older than its sampler's, and the update uses the decoupled PPO objective.

With ``PolicyUpdateConfig(use_lora=True)`` only LoRA adapters train; the engine serves a plain
copy of the model with the adapters merged in (at start and after every update).

Checkpoints (:mod:`.checkpoints`): every ``checkpoint_every`` steps, after the last, and on an
early stop (Ctrl-C, SIGTERM, an exception) unless the weights are half-updated (see
:meth:`LocalRL.train`); ``resume=True`` continues from the latest. The final model goes to
``<run dir>/final``; the tokenizer to ``<run dir>/tokenizer`` at setup (the dashboard decodes
the ids of a run still training with it).

**A LoRA adapter per agent role** (``lora_adapters=``, :mod:`.lora_adapters`): one base
model, one adapter per name, served at once; each step trains each adapter on its own rows
only (its own GRPO groups and optimizer), and metrics are logged per adapter.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
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
from voltrl.algorithms.local.reports import (
    adapters_summary,
    draw_reward_curve,
    same_reward_warning,
    step_line,
    stopped_line,
    untrained_warning,
)
from voltrl.algorithms.local.schedule import QueuedStep, WeightVersions, step_tasks
from voltrl.errors import VoltRLError
from voltrl.models.lora import LoraAdapters, trainer_parts
from voltrl.models.precision import checked_dtype
from voltrl.observability.metrics import summarize
from voltrl.resources import LLM
from voltrl.serving.choice import checked_engine
from voltrl.trajectory import TrainingBatch, TrajectoryConfig, collate, trajectories_from_store
from voltrl.types import Rollout, Task

if TYPE_CHECKING:
    from voltrl.algorithms.local.sft import SFT
    from voltrl.algorithms.local.update import PolicyTrainer, PolicyUpdateConfig
    from voltrl.gateway import Gateway
    from voltrl.retry import GatewayRetry
    from voltrl.runtime import TrainContext
    from voltrl.serving.engine import Engine
    from voltrl.serving.engine.vllm import VLLMEngine


LOCAL_EXTRA = ("torch", "transformers", "tokenizers", "peft")
"""What the ``[local]`` extra installs for LocalRL."""
TOKENIZER_DIR = "tokenizer"
"""``<run dir>/tokenizer``: the run's tokenizer, saved at setup for tools that decode its ids."""


class LocalRL(Algorithm):
    """Train a Hugging Face causal LM with RL on this machine.

    Args:
        model: a model path or hub name (as ``from_pretrained`` takes it), ``"tiny"`` (the
            built-in tiny model and tokenizer: random weights, to try the loop, not to learn),
            or a loaded ``PreTrainedModel`` (then pass ``tokenizer``).
        tokenizer: the tokenizer, when ``model`` is an object.
        steps: policy updates to run. tasks_per_step, group_size: each step runs
            ``tasks_per_step`` tasks ``group_size`` times each (advantages are normalised
            within a task's group).
        sampling: sampling parameters of training rollouts (``temperature``, ``max_tokens``...).
        val_sampling: sampling parameters of validation rollouts: ``sampling``'s, greedy
            (``temperature`` 0), with these on top.
        val_every: validate every this many steps (and before the first and after the last).
        val_n: rollouts of each validation task (verl's ``val_kwargs.n``): with sampling, the
            mean over several rollouts a task is a steadier figure than one.
        update: the policy update's settings (learning rate, clip, KL, LoRA, micro-batches):
            a ``PolicyUpdateConfig`` or its fields as a dict.
        trajectory: how calls become training rows (transition or trajectory mode, credit):
            a ``TrajectoryConfig`` or its fields as a dict.
        served_name: the model name the engine serves and the agent's ``LLM`` carries.
        checkpoint_every: save a checkpoint every this many steps (0: none on the way). One
            is also saved after the last step and when the run stops early (Ctrl-C, SIGTERM, an
            exception), so this bounds what a killed process (``kill -9``, the machine) loses.
        keep_checkpoints: the latest checkpoints kept (older ones are removed after each
            save; None keeps all): a long run's disk stays bounded.
        resume: continue from the latest checkpoint in the run directory, if there is one.
        device: where to train and serve (default: CUDA if available, else CPU).
        dtype: the weights' precision: ``"auto"`` (bfloat16 on a CUDA device that supports
            it, else float32), ``"float32"``, ``"bfloat16"`` or ``"float16"``; logprobs and
            the optimizer stay float32 (``precision.py``).
        threads: torch intra-op threads (default: ``$OMP_NUM_THREADS``, else half the usable
            CPUs, so that a busy core does not stall every kernel; see ``threads.py``).
        seed: task order and sampling seed.
        max_batch_size: sequences the engine decodes together.
        engine: ``"local"`` (the built-in engine) or ``"vllm"`` (vLLM in this process,
            its weights updated in place: ``engine/vllm.py``, docs/gpu.md).
        engine_args: with ``engine="vllm"``, more ``vllm.EngineArgs`` fields.
        gateway_retry: how the gateway retries engine calls (default: the trainer's).
        reasoning_split: agents get the ``<think>...</think>`` the model writes as
            ``reasoning_content`` (:mod:`voltrl.gateway.reasoning`); training still sees every
            token.
        warm_start: a :class:`~voltrl.SFT` (without ``model``) that fine-tunes the model on
            recorded rollouts (a teacher's) before it is served; the first validation then
            measures the student after warm-up. It trains every weight, LoRA or not (the KL
            reference is then the warmed model). A resumed run skips it: a full checkpoint has
            the warmed weights; with LoRA they are kept in ``<run dir>/warm_start``.
        lora_adapters: a LoRA adapter per agent role, ``{adapter name: agent-name regex}``: a
            call is served by, and trains, the first adapter whose regex fully matches its
            agent name; calls matching none are served by the base model and not trained
            (end with ``".*"`` for a catch-all adapter). Implies LoRA (``update``'s
            ``lora_*`` settings apply to each adapter).
        max_staleness: queue the rollouts of this many later steps before a step trains, so
            they run during its update (0: none). A row then trains at most this many updates
            after its sampler, with decoupled PPO (``update.old_logprobs``, unless set).
    """

    name = "local_rl"
    publishes = ("main_llm",)
    resumable = True

    def __init__(
        self,
        model: Any,
        *,
        tokenizer: Any = None,
        steps: int = 20,
        tasks_per_step: int = 8,
        group_size: int = 4,
        sampling: dict[str, Any] | None = None,
        val_sampling: dict[str, Any] | None = None,
        val_every: int = 0,
        val_n: int = 1,
        update: PolicyUpdateConfig | dict[str, Any] | None = None,
        trajectory: TrajectoryConfig | dict[str, Any] | None = None,
        served_name: str = "voltrl-local",
        checkpoint_every: int = 10,
        keep_checkpoints: int | None = 3,
        resume: bool = False,
        device: str | None = None,
        dtype: str = "auto",
        threads: int | None = None,
        seed: int = 0,
        max_batch_size: int = 64,
        engine: str = "local",
        engine_args: dict[str, Any] | None = None,
        gateway_retry: GatewayRetry | dict[str, Any] | None = None,
        reasoning_split: bool = False,
        warm_start: SFT | None = None,
        lora_adapters: dict[str, str] | None = None,
        max_staleness: int = 0,
    ) -> None:
        try:
            from voltrl.algorithms.local.update_config import implied_update
            from voltrl.models.threads import decide_threads
        except ModuleNotFoundError as exc:
            if exc.name not in LOCAL_EXTRA:
                raise
            raise VoltRLError(
                f"LocalRL needs {exc.name}, which is not installed: pip install 'voltrl[local]'"
            ) from None

        if steps < 0 or tasks_per_step < 1 or group_size < 1 or val_n < 1 or max_staleness < 0:
            raise ValueError(
                "steps >= 0, tasks_per_step >= 1, group_size >= 1, val_n >= 1 and "
                "max_staleness >= 0 are required"
            )
        if keep_checkpoints is not None and keep_checkpoints < 1:
            raise ValueError("keep_checkpoints must be at least 1 (None keeps them all)")
        self.model = model
        self.tokenizer = tokenizer
        self.steps = steps
        self.tasks_per_step = tasks_per_step
        self.group_size = group_size
        self.sampling = {"temperature": 1.0, **(sampling or {})}
        self.val_sampling = {**self.sampling, "temperature": 0.0, **(val_sampling or {})}
        self.val_every = val_every
        self.val_n = val_n
        self.adapters = (
            None
            if lora_adapters is None
            else LoraAdapters.parse(lora_adapters, served_name=served_name)
        )
        self.update = implied_update(update, seed, self.adapters is not None, max_staleness)
        self.max_staleness = max_staleness
        if isinstance(trajectory, dict):
            trajectory = TrajectoryConfig.model_validate(trajectory)
        self.trajectory = trajectory or TrajectoryConfig()
        self.served_name = served_name
        self.checkpoint_every, self.keep_checkpoints = checkpoint_every, keep_checkpoints
        self.resume = resume
        self.device = device
        self.dtype = checked_dtype(dtype, training=True)
        self.threads = decide_threads(threads)
        self.seed = seed
        self.max_batch_size = max_batch_size
        self.engine = checked_engine(engine, engine_args, lora_adapters is not None)
        self.engine_args = engine_args
        from voltrl.retry import GatewayRetry

        self.gateway_retry = (
            GatewayRetry.model_validate(gateway_retry) if gateway_retry is not None else None
        )
        self.reasoning_split = reasoning_split
        if warm_start is not None and warm_start.model is not None:
            raise ValueError("warm_start=SFT(...) trains LocalRL's model: leave its model out")
        self.warm_start = warm_start
        self.history: list[dict[str, Any]] = []
        self._warned_same_reward = False
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

    def config(self) -> dict[str, object]:
        """The settings recorded with the run: every argument but ``tokenizer``, as
        ``voltrl train``'s ``algorithm:`` section takes them (a local model directory as its
        absolute path; a model object by its class name, which no config can load)."""
        from voltrl.models.loading import model_name

        return {
            "model": model_name(self.model),
            "steps": self.steps,
            "tasks_per_step": self.tasks_per_step,
            "group_size": self.group_size,
            "sampling": self.sampling,
            "val_sampling": self.val_sampling,
            "val_every": self.val_every,
            "val_n": self.val_n,
            "update": self.update.model_dump(),
            "trajectory": self.trajectory.model_dump(exclude={"retokenizer"}),
            "served_name": self.served_name,
            "checkpoint_every": self.checkpoint_every,
            "keep_checkpoints": self.keep_checkpoints,
            "resume": self.resume,
            "device": self.device,
            "dtype": self.dtype,
            "threads": self.threads,
            "seed": self.seed,
            "max_batch_size": self.max_batch_size,
            "engine": self.engine,
            "engine_args": self.engine_args,
            "gateway_retry": self.gateway_retry and self.gateway_retry.model_dump(),
            "reasoning_split": self.reasoning_split,
            "warm_start": self.warm_start and self.warm_start.config(),
            "lora_adapters": self.adapters and self.adapters.config(),
            "max_staleness": self.max_staleness,
        }

    # ---- setup: model, engine, gateway, resources ---------------------------------------
    def _load(self) -> tuple[Any, Any]:
        from voltrl.models.loading import load_model

        return load_model(
            self.model, self.tokenizer, device=self.device, seed=self.seed, dtype=self.dtype
        )

    async def setup(self, ctx: TrainContext) -> None:
        """Load the model, start the engine and a gateway in front of it, publish the LLM."""
        from voltrl.algorithms.local.memory import check_memory
        from voltrl.algorithms.local.update import PolicyTrainer
        from voltrl.models.threads import use_threads
        from voltrl.serving.engine import start_engine
        from voltrl.serving.openai_api import serve_engine

        use_threads(self.threads, report=ctx.progress)
        model, tokenizer = await asyncio.to_thread(self._load)
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
                threads=self.threads,
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
        self._engine = await asyncio.to_thread(
            start_engine,
            self.engine,
            served,
            tokenizer,
            ctx.run_dir / "engine_model",
            max_batch_size=self.max_batch_size,
            seed=self.seed,
            lora_adapters=self.adapters is not None,
            engine_args=self.engine_args,
            report=ctx.progress,
        )
        self.tokenizer = tokenizer
        engine_url, stop_engine = await serve_engine(
            self._engine, model_name=self.served_name, logprobs_mode="raw"
        )
        self._stops.append(stop_engine)
        adapters = self.adapters
        served_gateway = await ctx.serve_gateway(
            [f"{engine_url}/v1"],
            model=self.served_name,
            model_for_agent=None if adapters is None else adapters.adapter_for,
            retry=self.gateway_retry,
            reasoning_split=self.reasoning_split,
            sampling_for=lambda mode: self.val_sampling if mode == "val" else self.sampling,
        )
        self._gateway = served_gateway.gateway
        self._versions.current = self._start_step
        self._llm = LLM(
            endpoint=served_gateway.url,
            model=self.served_name,
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
        """Run ``steps`` policy updates, validating every ``val_every`` steps; checkpoint every
        ``checkpoint_every`` steps and after the last.

        A run that stops early keeps what it learned: the weights of the last completed update
        are checkpointed with its step (whose line is in ``metrics.jsonl``) and ``resume=True``
        continues from there. Ctrl-C or SIGTERM during an update ends it at its next
        micro-batch if no optimizer step has run (:attr:`PolicyTrainer.stop`: the run exits
        within one forward and backward pass with the previous step's weights), else lets it
        finish. An update that fails after it began changing the weights (an optimizer step
        ran, or raised) leaves weights no step produced: they are not saved, and the last
        checkpoint stays the latest. Nothing goes to
        ``final/``. The rollouts of steps queued ahead (``max_staleness``) are cancelled or left
        untrained: a resumed run queues those steps again, so no rollout trains twice.
        """
        assert self._policies and self._engine is not None
        stream = step_tasks(
            train, per_step=self.tasks_per_step, group_size=self.group_size, seed=self.seed
        )
        for _ in range(self._start_step):
            next(stream)  # a resumed run continues the same task order
        self._steps_done = self._start_step
        ahead: list[QueuedStep] = []  # queued, not yet trained: at most max_staleness + 1
        try:
            if val and self.val_every:
                await self.validate(ctx, val, self._start_step)
            for step in range(self._start_step, self.steps):
                last = min(step + self.max_staleness, self.steps - 1)
                for queued in range(ahead[-1].step + 1 if ahead else step, last + 1):
                    tasks = next(stream)
                    ahead.append(await self._versions.queue_step(ctx, self._llm, tasks, queued))
                record = await self.train_step(ctx, ahead.pop(0))
                self._steps_done = step + 1
                self.history.append(record)
                if self.checkpoint_every and (step + 1) % self.checkpoint_every == 0:
                    await asyncio.to_thread(self._checkpoint, ctx.run_dir)
                if val and self.val_every and (step + 1) % self.val_every == 0:
                    await self.validate(ctx, val, step + 1)
            if val and self.val_every and self.steps % self.val_every:
                await self.validate(ctx, val, self.steps)
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
        ``keep_checkpoints``; returns where. One already saved is kept. ``None``, and nothing
        saved, when the weights belong to no step (an update failed after it had begun to
        change them: :attr:`PolicyTrainer.mid_update`), or, for a ``stopped`` run, when
        neither an update nor a warm-up changed the model as loaded (a resumed run loads it
        again)."""
        with self._policy_lock:
            if self._weights_torn():
                return None
            if stopped and self._steps_done == 0 and self.warm_start is None:
                return None
            keep = self.keep_checkpoints
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
        rollouts = await ctx.wait(queued.rollouts, desc=f"step {step + 1}/{self.steps}")
        t1 = time.perf_counter()
        trajectories = await trajectories_from_store(ctx.store, rollouts, self.trajectory)
        weights = self._versions.current  # what this step's update starts from
        trajectories, staleness = self._versions.drop_stale(trajectories, self.max_staleness)
        batch = collate(trajectories, self.trajectory)
        parts, untrained = trainer_parts(self.adapters, batch)
        stats = summarize(rollouts)
        trained: dict[str | None, dict[str, Any]] = {}
        if parts and stats.succeeded:  # rows of failed rollouts alone teach nothing
            trained = await asyncio.to_thread(self._update, parts, step)
        t2 = time.perf_counter()
        metrics = {
            f"update/{k}" if key is None else f"update/{key}/{k}": v
            for key, m in trained.items()
            for k, v in m.items()
        }
        if self.adapters is not None:
            metrics.update(
                {f"lora_adapter/{k}/version": v for k, v in self._adapter_versions().items()}
            )
            metrics["batch/rows_no_adapter"] = len(untrained)
        record = ctx.log(
            step + 1,
            **stats.flat("train/"),
            **metrics,
            **{f"batch/{k}": v for k, v in batch.stats.items()},
            **staleness,
            rollout_s=t1 - t0,
            update_s=t2 - t1,
            resources_version=queued.version,
            weights_version=weights,
        )  # logged before the swap: a run stopped during it has the line of the step it saves
        if trained:
            await self._serve_new_weights(ctx, list(trained))
        if ctx.progress:
            shown = staleness if self.max_staleness else None
            print(step_line(step, self.steps, stats, trained, t1 - t0, t2 - t1, shown), flush=True)
            self._warn_untrained(batch, untrained, step)
        adv_tokens = sum(m["adv_tokens"] for m in trained.values())
        if trained and not adv_tokens and not self._warned_same_reward:
            self._warned_same_reward = True
            print(same_reward_warning(step), flush=True)
        return record

    async def validate(self, ctx: TrainContext, tasks: list[Task], step: int) -> list[Rollout]:
        """Run every validation task ``val_n`` times with ``val_sampling``; logs ``val/*``
        metrics (over all of those rollouts)."""
        assert self._llm is not None
        await self._versions.publish(
            ctx, self._llm.model_copy(update={"sampling_parameters": self.val_sampling})
        )
        # every task, then every task again: the first rollouts logged are different tasks
        repeated = [t for _ in range(self.val_n) for t in tasks]
        rollouts = await ctx.run_rollouts(repeated, mode="val", desc=f"validate @ {step}")
        await self._versions.publish(ctx, self._llm)
        stats = summarize(rollouts)
        record = ctx.log(step, **stats.flat("val/"))
        self.history.append(record)
        await ctx.log_rollouts(step, rollouts)
        if ctx.progress:
            print(f"validation @ {step}: reward {stats.reward_mean or 0:.3f}", flush=True)
        return rollouts
