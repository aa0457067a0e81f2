"""VERL: train with verl's distributed PPO/GRPO trainer while agents run through VoltRL.

::

    algo = vl.VERL(
        {"actor_rollout_ref": {"model": {"path": "Qwen/Qwen2.5-1.5B-Instruct"}},
         "trainer": {"total_training_steps": 200, "test_freq": 10, "save_freq": 50},
         "voltrl": {"trajectory": {"mode": "trajectory"}, "rollout_weighting": True}},
        preset="1gpu-40gb",
    )
    vl.Trainer(algorithm=algo, n_runners=8, max_concurrency=32).fit(agent, train, val)

What ``train`` does, top to bottom:

1. write the tasks as verl's dataset (:class:`~.driver.VoltTaskDataset`), point ``data.*_files``
   at them, checkpoints at ``<run dir>/checkpoints`` and the experiment name at the run's;
2. join (or start) Ray and TransferQueue, build :class:`~.driver.VoltPPOTrainer` and run its
   ``init`` (FSDP workers, vLLM replicas, checkpoint resume) in a worker thread;
3. put a VoltRL :class:`~voltrl.gateway.proxy.Gateway` in front of the replicas' OpenAI-compatible
   addresses (sticky per rollout, token ids and logprobs recorded) and publish its ``LLM``:
   the agent's code is the same as under LocalRL;
4. run verl's ``fit`` with :class:`~.driver.VoltAgentLoopManager`: each step verl picks tasks,
   the manager queues ``rollout.n`` rollouts per task, the runners run them through the
   gateway, the trajectory builder's rows go to verl, verl trains; the gateway pauses while
   the replicas sleep and load the new weights, then a new resources version is published.

verl's trainer needs GPUs, NCCL and vLLM; see ``docs/verl.md`` for what runs where.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from voltrl.algorithms.base import Algorithm
from voltrl.algorithms.verl.config import (
    ADAPTERS_REFUSED,
    ConfigSource,
    VoltrlSection,
    compose_config,
)
from voltrl.errors import VoltRLError
from voltrl.observability.metrics import summarize
from voltrl.resources import LLM
from voltrl.types import Task

if TYPE_CHECKING:
    from voltrl.runtime import TrainContext


MISMATCH_NAMES = {
    "rollout_corr/k3_kl": "mismatch/kl",
    "rollout_corr/rollout_is_ratio_fraction_high": "mismatch/truncated",
    "rollout_corr/rollout_rs_masked_fraction": "mismatch/masked",
}
"""verl's rollout-correction metrics (``algorithm.rollout_correction``) that are LocalRL's
``mismatch/*`` (:func:`~voltrl.algorithms.local.loss.mismatch_metrics`, and the correction's
shares), each under LocalRL's name too: one dashboard curve for both. verl measures no mean or
largest logprob gap per token (``training/rollout_probs_diff_*`` are of probabilities), so
``mismatch/logprob_abs_*`` and ``mismatch/tokens_over`` are LocalRL's alone."""


def mismatch_metrics(verl_metrics: dict[str, float]) -> dict[str, float]:
    """The metrics of :data:`MISMATCH_NAMES` among a verl step's, under LocalRL's names."""
    return {
        ours: verl_metrics[theirs]
        for theirs, ours in MISMATCH_NAMES.items()
        if theirs in verl_metrics
    }


class VERL(Algorithm):
    """Distributed RL with verl (FSDP on Ray, vLLM rollout) for agents run by VoltRL.

    Args:
        config: verl's config as a dict, a YAML path or a ``DictConfig``; a ``voltrl`` key
            holds :class:`~voltrl.algorithms.verl.config.VoltrlSection`.
        overrides: Hydra-style ``key=value`` overrides applied last (``voltrl.*`` included).
        preset: ``"1gpu-40gb"`` or ``"8gpu"`` (:data:`~.config.PRESETS`), applied first.
        sampling: extra sampling parameters for training rollouts' ``LLM`` (verl's
            ``rollout.temperature`` and ``top_p`` are the defaults).
        val_sampling: the same for validation (verl's ``rollout.val_kwargs``).
        lora_adapters: refused: per-role LoRA adapters are LocalRL's (verl trains one model).

    The config is composed and validated here, so a bad key fails before anything starts.
    """

    name = "verl"
    publishes = ("main_llm",)

    def __init__(
        self,
        config: ConfigSource | None = None,
        *,
        overrides: Sequence[str] = (),
        preset: str | None = None,
        sampling: dict[str, Any] | None = None,
        val_sampling: dict[str, Any] | None = None,
        lora_adapters: Any = None,
    ) -> None:
        if lora_adapters is not None:
            raise VoltRLError(ADAPTERS_REFUSED)
        self.verl_config, self.voltrl = compose_config(config, overrides, preset=preset)
        self.trajectory = self.voltrl.trajectory_config(self.verl_config)
        rollout = self.verl_config.actor_rollout_ref.rollout
        self.sampling = {
            "temperature": rollout.temperature,
            "top_p": rollout.top_p,
            **(sampling or {}),
        }
        self.val_sampling = {
            "temperature": rollout.val_kwargs.temperature,
            "top_p": rollout.val_kwargs.top_p,
            **(val_sampling or {}),
        }
        self.history: list[dict[str, Any]] = []
        self._gateway: Any = None
        self._trainer: Any = None
        self._started_ray = False
        self._tq = False

    def config(self) -> dict[str, object]:
        """The settings recorded with the run: verl's config (unresolved) and ours."""
        from omegaconf import OmegaConf

        return {
            "verl": OmegaConf.to_container(self.verl_config, resolve=False),
            "voltrl": self.voltrl.model_dump(),
            "trajectory": self.trajectory.model_dump(),
        }

    def run_config(self, ctx: TrainContext, train: list[Task], val: list[Task] | None) -> Any:
        """The verl config of this run: tasks as data files, checkpoints and experiment name
        in the run directory (unless set by the user), validation off without ``val``."""
        from omegaconf import OmegaConf, open_dict

        from voltrl.algorithms.verl.driver import write_tasks

        cfg = copy.deepcopy(self.verl_config)
        root = ctx.run_dir / "verl"
        raw = OmegaConf.to_container(cfg.trainer, resolve=False)
        with open_dict(cfg):
            cfg.data.train_files = str(write_tasks(train, root / "train.jsonl"))
            cfg.data.val_files = str(write_tasks(val or train[:1], root / "val.jsonl"))
            if raw["experiment_name"] == "gsm8k":  # verl's example default
                cfg.trainer.experiment_name = ctx.run.name
            if str(raw["default_local_dir"]).startswith("checkpoints/${trainer.project_name}"):
                cfg.trainer.default_local_dir = str(ctx.run_dir / "checkpoints")
            if not val:
                cfg.trainer.val_before_train = False
                cfg.trainer.test_freq = -1
            cfg.transfer_queue.enable = True
        OmegaConf.resolve(cfg)
        return cfg

    # ---- lifecycle ------------------------------------------------------------------------------
    async def setup(self, ctx: TrainContext) -> None:
        """Nothing starts before ``train``: verl builds its workers around the dataset. VERL
        only trains; ``Trainer.dev`` is for an endpoint you serve (``resources=...``)."""
        from voltrl._http.serving import require_token_off_loopback

        if ctx.run.kind != "fit":
            raise VoltRLError(
                "VERL only trains (Trainer.fit); to run an agent without training, use "
                "Trainer(resources={'main_llm': vl.LLM(endpoint=..., model=...)}).dev(...)"
            )
        # Refuse an exposed gateway now, not after Ray and verl's workers have started.
        require_token_off_loopback(self.voltrl.gateway_host or ctx.host, ctx.token)

    async def train(self, ctx: TrainContext, train: list[Task], val: list[Task] | None) -> None:
        """Run verl's trainer on ``train`` (validating on ``val``) with VoltRL's rollouts."""
        from voltrl.algorithms.verl.driver import LoopBridge, VoltAgentLoopManager, VoltPPOTrainer

        if not train:
            raise ValueError("VERL needs at least one training task")
        cfg = self.run_config(ctx, train, val)
        await asyncio.to_thread(self._start_ray_and_tq, cfg)
        bridge = LoopBridge(asyncio.get_running_loop())
        tasks = {t.task_id: t for t in [*train, *(val or [])]}
        manager: VoltAgentLoopManager | None = None

        def before_sleep() -> None:
            bridge.call(self._gateway.pause())

        def after_update(step: int) -> None:
            async def publish_and_resume() -> None:
                assert manager is not None
                manager.new_policy()
                self._gateway.resume()

            bridge.call(publish_and_resume())

        def on_metrics(step: int, metrics: dict[str, Any]) -> None:
            scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
            self.history.append(ctx.log(step, **scalars, **mismatch_metrics(scalars)))

        def val_stats() -> dict[str, float]:
            assert manager is not None
            return summarize(manager.take_val_rollouts()).flat("voltrl/val/")

        self._trainer = VoltPPOTrainer(
            cfg,
            before_sleep=before_sleep,
            after_update=after_update,
            rounding=self.voltrl.rounding,
            rollout_weighting=self.voltrl.rollout_weighting,
            manager_stats=lambda: manager.take_stats() if manager else {},
            on_metrics=on_metrics,
            val_stats=val_stats,
        )
        await asyncio.to_thread(self._trainer.init)
        llm = await self._serve_gateway(ctx, self._trainer.llm_server_manager.get_addresses())
        rollout = cfg.actor_rollout_ref.rollout
        manager = VoltAgentLoopManager(
            ctx,
            bridge,
            tasks,
            self.trajectory,
            n=int(rollout.n),
            val_n=int(rollout.val_kwargs.n),
            resources=(
                {"main_llm": llm},
                {"main_llm": llm.model_copy(update={"sampling_parameters": self.val_sampling})},
            ),
            max_wait_s=self.voltrl.max_wait_s,
        )
        await ctx.publish({"main_llm": llm})
        await asyncio.to_thread(self._trainer.fit, manager)

    async def _serve_gateway(self, ctx: TrainContext, addresses: list[str]) -> LLM:
        """A gateway of the run (:meth:`TrainContext.serve_gateway`: its token, a reachable
        URL) in front of verl's vLLM replicas (``host:port`` addresses of their
        OpenAI-compatible servers), bound to ``voltrl.gateway_host`` (default: the trainer's
        host); returns the ``LLM`` agents get. vLLM serves the model under verl's local copy's
        path, so the name is read from ``/v1/models``."""
        import aiohttp

        if not addresses:
            raise RuntimeError("verl started no rollout replicas (actor_rollout_ref.rollout)")
        backends = [a if a.startswith("http") else f"http://{a}" for a in addresses]
        backends = [f"{b.rstrip('/')}/v1" for b in backends]
        timeout = aiohttp.ClientTimeout(total=60.0)
        async with (
            aiohttp.ClientSession(timeout=timeout) as client,
            client.get(f"{backends[0]}/models") as response,
        ):
            response.raise_for_status()
            served = (await response.json())["data"][0]["id"]
        gateway = await ctx.serve_gateway(
            backends,
            model=served,
            retry=self.voltrl.gateway_retry,
            host=self.voltrl.gateway_host,
            reasoning_split=self.voltrl.reasoning_split,
        )
        self._gateway = gateway.gateway
        return LLM(
            endpoint=gateway.url,
            model=self.voltrl.served_model_name or served,
            gateway=True,
            sampling_parameters=self.sampling,
        )

    def ray_init_kwargs(self) -> dict[str, Any]:
        """``ray.init``'s arguments for verl: ``ray_kwargs.ray_init``, verl's PPO
        ``runtime_env`` under the one given there, and ``voltrl.ray_address``. Ray runners
        (``Trainer(runners=RayRunners(...))``) start or join Ray with them, before verl."""
        from omegaconf import OmegaConf
        from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

        cfg = self.verl_config
        kwargs = OmegaConf.to_container(cfg.ray_kwargs.get("ray_init", {}), resolve=True)
        runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(cfg), kwargs.pop("runtime_env", {}))
        kwargs["runtime_env"] = OmegaConf.to_container(runtime_env)
        if self.voltrl.ray_address is not None:
            kwargs["address"] = self.voltrl.ray_address
        return kwargs

    def _start_ray_and_tq(self, cfg: Any) -> None:
        import ray
        import transfer_queue as tq

        if not ray.is_initialized():  # Ray runners started or joined it already otherwise
            ray.init(**self.ray_init_kwargs())
            self._started_ray = True
        tq.init(cfg.transfer_queue)
        self._tq = True

    async def teardown(self, ctx: TrainContext) -> None:
        """Close TransferQueue and shut Ray down if we started it (the run stops the
        gateway)."""
        if self._tq:
            import transfer_queue as tq

            await asyncio.to_thread(tq.close)
            self._tq = False
        if self._started_ray:
            import ray

            await asyncio.to_thread(ray.shutdown)
            self._started_ray = False


__all__ = ["VERL", "VoltrlSection"]
