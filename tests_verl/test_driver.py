"""The driver logic, end to end on this CPU against real verl objects: VoltRL's Trainer, store
and (inline) runner run the rollouts; verl's own v1 trainer code (``VoltPPOTrainer`` built
from the composed config, without ``init``, which needs GPUs) loads our dataset class, submits
a batch of prompts to ``VoltAgentLoopManager``, samples the finished groups from a real
TransferQueue with its replay buffer, and computes advantages; rounding and per-rollout
normalisation apply. Only the GPU parts (FSDP workers, vLLM replicas, the update) are absent.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict

import pytest
import torch

import voltrl as vl
from voltrl.algorithms.base import Algorithm
from voltrl.algorithms.local.loss import grpo_advantages, rollout_weights, weight_advantages
from voltrl.algorithms.verl.batch import session_of

N = 3  # rollouts per task
REWARDS = {
    "t0": [1.0, 0.0, 0.0],
    "t1": [0.5, 0.5, 0.5],
    "t2": [1.0, 1.0, 0.0],
    "t3": [0.0, 1.0, 0.5],
}
_calls: dict[str, itertools.count] = defaultdict(itertools.count)


@vl.rollout
async def agent(task: dict, resources: vl.Resources) -> list[vl.Transition]:
    """k-th rollout of a task: k + 1 rows sharing the reward REWARDS[task][k] (no LLM)."""
    k = next(_calls[task["name"]]) % N
    reward = REWARDS[task["name"]][k]
    return [
        vl.Transition(
            prompt_token_ids=[1, 2, 3 + i],
            response_token_ids=[10 + k, 11, 12, 13][: 2 + i],
            response_logprobs=[-0.5] * (2 + i),
            reward=reward,
        )
        for i in range(k + 1)
    ]


def verl_settings(model_path: str, rounding: str) -> dict:
    return {
        "actor_rollout_ref": {
            "model": {"path": model_path},
            "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 1},
            "rollout": {"n": N, "log_prob_micro_batch_size_per_gpu": 1},
        },
        "data": {"train_batch_size": 4, "shuffle": False},
        # old logprobs = the sampling logprobs (no actor forward pass: no GPU here)
        "algorithm": {"rollout_correction": {"bypass_mode": True}},
        "trainer": {"n_gpus_per_node": 1, "total_training_steps": 1},
        "transfer_queue": {"backend": {"SimpleStorage": {"num_data_storage_units": 1}}},
        # TransferQueue's actors ask for CPUs; this machine has 2
        "ray_kwargs": {"ray_init": {"num_cpus": 8, "include_dashboard": False}},
        "reward": {"num_workers": 1},
        "voltrl": {"rollout_weighting": True, "rounding": rounding},
    }


class DriverProbe(Algorithm):
    """Runs one training step's driver logic with verl's classes and records what it saw.
    ``ray_runners``: the trainer's runners are Ray actors, which start Ray (with VERL's
    ``ray.init`` settings) before verl's driver code runs and joins it."""

    name = "driver_probe"

    def __init__(self, rounding: str, validate: bool = False, ray_runners: bool = False) -> None:
        self.rounding, self.validate, self.ray_runners = rounding, validate, ray_runners
        self.seen: dict = {}

    def ray_init_kwargs(self) -> dict:
        return vl.VERL(verl_settings("/nonexistent/model", self.rounding)).ray_init_kwargs()

    async def train(self, ctx, train, val):
        import ray
        import transfer_queue as tq
        from omegaconf import open_dict
        from verl.experimental.reward_loop import RewardLoopManager

        from voltrl.algorithms.verl.driver import LoopBridge, VoltAgentLoopManager, VoltPPOTrainer
        from voltrl.models.tiny import build_tiny_tokenizer
        from voltrl.observability.metrics import summarize

        tokenizer = build_tiny_tokenizer()
        tokenizer.save_pretrained(ctx.run_dir / "model")  # what verl's reward workers load
        algo = vl.VERL(verl_settings(str(ctx.run_dir / "model"), self.rounding))
        cfg = algo.run_config(ctx, train, val if self.validate else None)
        assert ray.is_initialized() == self.ray_runners  # the runners started it
        await asyncio.to_thread(algo._start_ray_and_tq, cfg)  # as VERL.train does
        self.verl_started_ray = algo._started_ray
        try:
            manager = VoltAgentLoopManager(
                ctx,
                LoopBridge(asyncio.get_running_loop()),
                {t.task_id: t for t in [*train, *(val or [])]},
                algo.trajectory,
                n=N,
                val_n=2,
            )
            trainer = VoltPPOTrainer(
                cfg,
                rounding=self.rounding,
                rollout_weighting=True,
                val_stats=lambda: summarize(manager.take_val_rollouts()).flat("voltrl/val/"),
            )
            # what PPOTrainer.init sets up without GPUs: the tokenizer (validation decodes
            # responses with it), the dataloaders, verl's reward-loop workers (Ray actors)
            trainer.tokenizer, trainer.processor = tokenizer, None
            trainer._init_dataloader()
            trainer.reward_loop_manager = RewardLoopManager(config=cfg, rm_resource_pool=None)
            trainer.agent_loop_manager = manager
            trainer.global_steps = 1
            self.seen = await asyncio.to_thread(self._step, trainer, tq)
            self.seen["stats"] = manager.take_stats()
            if self.validate:
                with open_dict(cfg):
                    cfg.actor_rollout_ref.rollout.val_kwargs.n = 2
                self.seen["val"] = await asyncio.to_thread(trainer._validate)
        finally:
            await algo.teardown(ctx)
        self.seen["ray_after_teardown"] = ray.is_initialized()

    @staticmethod
    def _step(trainer, tq) -> dict:
        trainer.prepare_step()  # verl: next dataloader batch -> TransferQueue -> our manager
        batch, _ = trainer.replay_buffer.sample(global_steps=1, partition_id="train", batch_size=4)
        metrics: dict = {}
        sampled = len(batch)
        if trainer.rounding == "drop_zero_variance":  # as _balance_batch does, multiple 5
            batch = trainer.round_down(batch, 5, metrics)
        batch = trainer._compute_old_log_prob(batch, metrics)
        batch = trainer._compute_advantage(batch, metrics)
        data = tq.kv_batch_get(
            keys=batch.keys,
            partition_id="train",
            select_fields=["advantages", "response_mask", "rm_scores", "voltrl_task_id"],
        )
        return {
            "sampled": sampled,
            "keys": list(batch.keys),
            "tags": list(batch.tags),
            "metrics": metrics,
            "advantages": data["advantages"].to_padded_tensor(0.0),
            "mask": data["response_mask"].to_padded_tensor(0),
            "scores": data["rm_scores"].to_padded_tensor(0.0),
            "tasks": list(data["voltrl_task_id"]),
        }


@pytest.mark.timeout(600)
@pytest.mark.parametrize("rounding", ["drop_zero_variance", "pad"])
def test_finished_rollouts_become_a_verl_training_step(tmp_path, rounding):
    """``pad`` also validates, and its rollouts run on a Ray actor (``RayRunners``) on the
    Ray that verl's code uses; ``drop_zero_variance``'s inline."""
    import ray

    from voltrl.store.memory import InMemoryStore

    _calls.clear()
    validate = ray_runners = rounding == "pad"
    probe = DriverProbe(rounding, validate=validate, ray_runners=ray_runners)
    rows = [{"name": name} for name in REWARDS]
    store = InMemoryStore()
    # one runner: the agent's rollout counter (_calls) lives in it, as inline in this process
    where = {"runners": vl.RayRunners(n=1)} if ray_runners else {"inline": True}
    trainer = vl.Trainer(probe, store=store, progress=False, run_dir=tmp_path, **where)
    result = trainer.fit(agent, rows, val_dataset=rows[:2])
    seen = probe.seen
    train_rollouts = [r for r in result.rollouts if r.mode == "train"]
    assert len(train_rollouts) == N * len(rows)
    assert all(r.status == "succeeded" for r in result.rollouts)
    workers = {
        a.worker_id for r in result.rollouts for a in asyncio.run(store.get_attempts(r.rollout_id))
    }
    assert all(w.startswith("ray-0@" if ray_runners else "inline-") for w in workers), workers
    # verl's code joined the runners' Ray (it started none); the run's end stopped it
    assert probe.verl_started_ray is not ray_runners
    assert not ray.is_initialized()
    if validate:
        # verl's _validate: our manager ran 2 rollouts per validation task through the
        # runner, verl's replay buffer sampled them from the "val" partition, verl decoded
        # and scored them; our statistics of every validation rollout are merged in
        val = seen["val"]
        assert sum(r.mode == "val" for r in result.rollouts) == 4
        assert val["voltrl/val/rollouts"] == 4
        assert any(k.startswith("val-core/voltrl/") for k in val), sorted(val)
    # every rollout's rows reached verl: 1 + 2 + 3 rows per task, 4 tasks
    assert seen["sampled"] == 24 and seen["stats"]["rows"] == 24
    assert seen["ray_after_teardown"] is ray_runners  # the runners' Ray ends with the run
    assert seen["stats"]["rollouts"] == 12
    t1 = next(r.task.task_id for r in train_rollouts if r.task.input["name"] == "t1")
    flat = [i for i, t in enumerate(seen["tasks"]) if t == t1]
    if rounding == "drop_zero_variance":
        # 24 % 5 == 4 rows dropped, all from the zero-variance group t1 (6 rows)
        assert seen["metrics"]["voltrl/dropped/rounding"] == 4
        assert len(seen["keys"]) == 20 and len(flat) == 2
    else:
        assert len(seen["keys"]) == 24 and len(flat) == 6
    keys, mask = seen["keys"], seen["mask"].float()
    rewards = seen["scores"].sum(-1)
    sessions = [session_of(k) for k in keys]
    groups = [k.split("_")[0] for k in keys]
    w = rollout_weights(sessions)
    expected = weight_advantages(grpo_advantages(rewards, groups, weights=w), w)
    torch.testing.assert_close(seen["advantages"], expected.unsqueeze(-1) * mask)
    # the flat group (t1: all 0.5) got exactly 0; a group's rows share one task id
    flat = [
        i
        for i, t in enumerate(seen["tasks"])
        if t == next(r.task.task_id for r in result.rollouts if r.task.input["name"] == "t1")
    ]
    assert flat and float(seen["advantages"][flat].abs().sum()) == 0.0
    for g in set(groups):
        assert len({seen["tasks"][i] for i, x in enumerate(groups) if x == g}) == 1


def test_round_down_drops_only_zero_variance_rows():
    from transfer_queue.metadata import KVBatchMeta

    from voltrl.algorithms.verl.driver import VoltPPOTrainer

    keys = ["a_0_0", "a_1_0", "b_0_0", "b_1_0", "b_1_1"]
    tags = [{"reward": r} for r in (1.0, 0.0, 0.5, 0.5, 0.5)]
    batch = KVBatchMeta(partition_id="train", keys=keys, tags=tags)
    metrics: dict = {}
    same = VoltPPOTrainer.round_down(batch, 5, metrics)
    assert same is batch and metrics["voltrl/dropped/rounding"] == 0
