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

Checkpoints go to ``<run dir>/checkpoints``; with ``resume=True`` a run with the same name
continues from its latest one. The final model is saved to ``<run dir>/final``.
"""

from __future__ import annotations

import asyncio
import copy
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from voltrl.algorithms.base import Algorithm
from voltrl.metrics import summarize
from voltrl.resources import LLM
from voltrl.trajectory import TrajectoryConfig, collate, trajectories_from_store
from voltrl.types import Rollout, Task

if TYPE_CHECKING:
    from voltrl.algorithms.local.engine import Engine
    from voltrl.algorithms.local.update import PolicyTrainer, PolicyUpdateConfig
    from voltrl.gateway import Gateway
    from voltrl.trainer import TrainContext


class LocalRL(Algorithm):
    """Train a Hugging Face causal LM with RL on this machine.

    Args:
        model: a model path or hub name (as ``from_pretrained`` takes it), or a loaded
            ``PreTrainedModel`` (then pass ``tokenizer``).
        tokenizer: the tokenizer, when ``model`` is an object.
        steps: policy updates to run. tasks_per_step, group_size: each step runs
            ``tasks_per_step`` tasks ``group_size`` times each (advantages are normalised
            within a task's group).
        sampling: sampling parameters of training rollouts (``temperature``, ``max_tokens``...).
        val_sampling: sampling parameters of validation rollouts (default greedy).
        val_every: validate every this many steps (and before the first and after the last).
        update: the policy update's settings (learning rate, clip, KL, LoRA, micro-batches).
        trajectory: how calls become training rows (transition or trajectory mode, credit).
        served_name: the model name the engine serves and the agent's ``LLM`` carries.
        checkpoint_every: save a checkpoint every this many steps (0: only at the end).
        resume: continue from the latest checkpoint in the run directory, if there is one.
        device: where to train and serve (default: CUDA if available, else CPU).
        seed: task order and sampling seed.
    """

    name = "local_rl"

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
        update: PolicyUpdateConfig | None = None,
        trajectory: TrajectoryConfig | None = None,
        served_name: str = "voltrl-local",
        checkpoint_every: int = 0,
        resume: bool = False,
        device: str | None = None,
        seed: int = 0,
        max_batch_size: int = 64,
    ) -> None:
        from voltrl.algorithms.local.update import PolicyUpdateConfig

        if steps < 0 or tasks_per_step < 1 or group_size < 1:
            raise ValueError("steps >= 0, tasks_per_step >= 1 and group_size >= 1 are required")
        self.model = model
        self.tokenizer = tokenizer
        self.steps = steps
        self.tasks_per_step = tasks_per_step
        self.group_size = group_size
        self.sampling = {"temperature": 1.0, **(sampling or {})}
        self.val_sampling = {"temperature": 0.0, **(val_sampling or {})}
        self.val_every = val_every
        self.update = update or PolicyUpdateConfig(seed=seed)
        self.trajectory = trajectory or TrajectoryConfig()
        self.served_name = served_name
        self.checkpoint_every = checkpoint_every
        self.resume = resume
        self.device = device
        self.seed = seed
        self.max_batch_size = max_batch_size
        self.history: list[dict[str, Any]] = []
        self._engine: Engine | None = None
        self._gateway: Gateway | None = None
        self._policy: PolicyTrainer | None = None
        self._llm: LLM | None = None
        self._stops: list[Any] = []

    def config(self) -> dict[str, object]:
        """The settings recorded with the run."""
        return {
            "model": self.model
            if isinstance(self.model, str | Path)
            else type(self.model).__name__,
            "steps": self.steps,
            "tasks_per_step": self.tasks_per_step,
            "group_size": self.group_size,
            "sampling": self.sampling,
            "val_sampling": self.val_sampling,
            "update": self.update.model_dump(),
            "trajectory": self.trajectory.model_dump(),
            "seed": self.seed,
        }

    # ---- setup: model, engine, gateway, resources ---------------------------------------
    def _load(self) -> tuple[Any, Any]:
        import torch

        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if isinstance(self.model, str | Path):
            from transformers import AutoModelForCausalLM, AutoTokenizer

            model = AutoModelForCausalLM.from_pretrained(str(self.model), dtype=torch.float32)
            tokenizer = self.tokenizer or AutoTokenizer.from_pretrained(str(self.model))
        else:
            if self.tokenizer is None:
                raise ValueError("pass tokenizer= with a model object")
            model, tokenizer = self.model, self.tokenizer
        return model.to(device), tokenizer

    async def setup(self, ctx: TrainContext) -> None:
        """Load the model, start the engine and a gateway in front of it, publish the LLM."""
        from voltrl.algorithms.local.engine import Engine
        from voltrl.algorithms.local.server import serve_engine
        from voltrl.algorithms.local.update import PolicyTrainer, latest_checkpoint
        from voltrl.gateway import Gateway
        from voltrl.server import serve

        model, tokenizer = await asyncio.to_thread(self._load)
        self._policy = PolicyTrainer(model, self.update)
        self._start_step = 0
        if self.resume and (ckpt := latest_checkpoint(ctx.run_dir / "checkpoints")) is not None:
            self._start_step = self._policy.load_checkpoint(ckpt)
        served = copy.deepcopy(model)
        served.load_state_dict(self._policy.merged_state_dict())
        self._engine = Engine(served, tokenizer, max_batch_size=self.max_batch_size, seed=self.seed)
        self.tokenizer = tokenizer
        engine_url, stop_engine = await serve_engine(
            self._engine, model_name=self.served_name, logprobs_mode="raw"
        )
        self._stops.append(stop_engine)
        self._gateway = Gateway(
            ctx.store,
            [f"{engine_url}/v1"],
            model=self.served_name,
            resources_version=lambda: ctx.resources_version,
        )
        gateway_url, stop_gateway = await serve(self._gateway.app)
        self._stops.append(stop_gateway)
        self._llm = LLM(
            endpoint=f"{gateway_url}/v1",
            model=self.served_name,
            gateway=True,
            sampling_parameters=self.sampling,
        )
        await ctx.publish({"main_llm": self._llm})

    async def teardown(self, ctx: TrainContext) -> None:
        """Stop the gateway and the engine."""
        for stop in reversed(self._stops):
            await stop()
        self._stops.clear()
        if self._gateway is not None:
            await self._gateway.aclose()
        if self._engine is not None:
            await asyncio.to_thread(self._engine.close)

    # ---- the loop -----------------------------------------------------------------------
    def _task_stream(self, tasks: list[Task]) -> Iterator[Task]:
        """Tasks in a fresh shuffled order each epoch."""
        rng = random.Random(self.seed)
        while True:
            order = list(tasks)
            rng.shuffle(order)
            yield from order

    async def train(self, ctx: TrainContext, train: list[Task], val: list[Task] | None) -> None:
        """Run ``steps`` policy updates, validating every ``val_every`` steps."""
        assert self._policy is not None and self._engine is not None
        stream = self._task_stream(train)
        for _ in range(self._start_step * self.tasks_per_step):
            next(stream)  # a resumed run continues the same task order
        if val and self.val_every:
            await self.validate(ctx, val, self._start_step)
        for step in range(self._start_step, self.steps):
            chosen = [next(stream) for _ in range(self.tasks_per_step)]
            record = await self.train_step(
                ctx, [t for t in chosen for _ in range(self.group_size)], step
            )
            self.history.append(record)
            if self.checkpoint_every and (step + 1) % self.checkpoint_every == 0:
                await asyncio.to_thread(
                    self._policy.save_checkpoint, ctx.run_dir / "checkpoints", step + 1
                )
            if val and self.val_every and (step + 1) % self.val_every == 0:
                await self.validate(ctx, val, step + 1)
        if val and self.val_every and self.steps % self.val_every:
            await self.validate(ctx, val, self.steps)
        await asyncio.to_thread(self._save_final, ctx.run_dir / "final")

    async def train_step(self, ctx: TrainContext, tasks: list[Task], step: int) -> dict[str, Any]:
        """Roll out, build the batch, update the policy, serve the new weights."""
        assert self._policy is not None and self._engine is not None and self._gateway is not None
        t0 = time.perf_counter()
        rollouts = await ctx.run_rollouts(tasks, mode="train", desc=f"step {step + 1}/{self.steps}")
        t1 = time.perf_counter()
        trajectories = await trajectories_from_store(ctx.store, rollouts, self.trajectory)
        batch = collate(trajectories, self.trajectory)
        metrics: dict[str, Any] = {}
        if len(batch):
            metrics = await asyncio.to_thread(self._policy.step, batch)
            weights = await asyncio.to_thread(self._policy.merged_state_dict)
            async with self._gateway.paused():
                await self._engine.aupdate_weights(weights)
                await ctx.publish({"main_llm": self._llm})
        t2 = time.perf_counter()
        stats = summarize(rollouts)
        record = ctx.log(
            step + 1,
            **stats.flat("train/"),
            **{f"update/{k}": v for k, v in metrics.items()},
            **{f"batch/{k}": v for k, v in batch.stats.items()},
            rollout_s=t1 - t0,
            update_s=t2 - t1,
            resources_version=ctx.resources_version,
        )
        if ctx.progress:
            print(
                f"step {step + 1}/{self.steps}  reward {stats.reward_mean or 0:.3f}"
                f"  loss {metrics.get('loss', float('nan')):.4f}"
                f"  entropy {metrics.get('entropy', float('nan')):.3f}"
                f"  trained {metrics.get('tokens', 0):.0f} tok"
                f" ({metrics.get('tokens_per_s', 0):.0f}/s)"
                f"  rollouts {t1 - t0:.1f}s  update {t2 - t1:.1f}s",
                flush=True,
            )
        return record

    async def validate(self, ctx: TrainContext, tasks: list[Task], step: int) -> list[Rollout]:
        """Run every validation task once with ``val_sampling``; logs ``val/*`` metrics."""
        assert self._llm is not None
        await ctx.publish(
            {"main_llm": self._llm.model_copy(update={"sampling_parameters": self.val_sampling})}
        )
        rollouts = await ctx.run_rollouts(tasks, mode="val", desc=f"validate @ {step}")
        await ctx.publish({"main_llm": self._llm})
        stats = summarize(rollouts)
        record = ctx.log(step, **stats.flat("val/"))
        self.history.append(record)
        if ctx.progress:
            print(f"validation @ {step}: reward {stats.reward_mean or 0:.3f}", flush=True)
        return rollouts

    def _save_final(self, directory: Path) -> None:
        assert self._engine is not None
        self._engine.model.save_pretrained(directory)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(directory)
