"""verl's extension points, filled in by VoltRL (verl 0.9, its v1 trainer in ``sync`` mode).

verl's v1 trainer samples prompts from a dataset, hands them to an agent-loop manager, and
trains on what the manager puts into TransferQueue. VoltRL plugs in at three documented
points:

- :class:`VoltTaskDataset` (``data.custom_cls``): the tasks of ``Trainer.fit`` as verl's
  dataset; each item carries its VoltRL task id.
- :class:`VoltAgentLoopManager` (``actor_rollout_ref.rollout.agent.agent_loop_manager_class``,
  whose contract is "implement ``generate_sequences``; put the outputs into TransferQueue"):
  for each prompt (one task, verl's GRPO group ``uid``) it queues ``rollout.n`` rollouts in
  VoltRL's store, where the runners run the agent through the gateway in front of verl's vLLM
  replicas; when the group has finished it builds each rollout's rows with the trajectory
  builder and puts them into TransferQueue (keys ``{uid}_{session}_{i}``, as verl's own agent
  loops do), then marks the group finished.
- :class:`VoltPPOTrainer`, a subclass of verl's ``PPOTrainerSync`` using its hooks: the gateway
  pauses (drains) before the replicas sleep for training and resumes once the new weights are
  loaded, with a new resources version; rows are rounded down to the mini-batch multiple by
  dropping zero-variance groups first (:func:`~.batch.rows_to_drop`); optional per-rollout
  normalisation scales the advantages; VoltRL's counts join verl's metrics.

verl's trainer runs in a worker thread of the driver; the store, gateway and runners live on
the driver's event loop. :class:`LoopBridge` runs coroutines on that loop from verl's thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import Counter
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.utils.data import Dataset
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from voltrl.algorithms.local.loss import rollout_weights, weight_advantages
from voltrl.algorithms.verl.batch import DATA_SOURCE, rollout_records, rows_to_drop, session_of
from voltrl.trajectory import TrajectoryConfig, trajectories_from_store
from voltrl.types import Rollout, Task

if TYPE_CHECKING:
    from voltrl.runtime import TrainContext

T = TypeVar("T")
logger = logging.getLogger(__name__)


class LoopBridge:
    """Runs coroutines on the driver's event loop from verl's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result (from another thread only)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Schedule ``coro`` on the loop; returns its ``concurrent.futures.Future``."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)


# ---- the dataset -----------------------------------------------------------------------------


def write_tasks(tasks: list[Task], path: Path) -> Path:
    """Write tasks as the JSONL :class:`VoltTaskDataset` reads (task id and index only: the
    tasks themselves stay in VoltRL's store)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i, task in enumerate(tasks):
            f.write(json.dumps({"voltrl_task_id": task.task_id, "index": i}) + "\n")
    return path


class VoltTaskDataset(Dataset):
    """verl's dataset over VoltRL tasks (``data.custom_cls``), built by verl as any dataset
    class: ``(data_files, tokenizer, processor, config, max_samples)``. ``data_files`` are
    JSONL files written by :func:`write_tasks`. Items have ``raw_prompt`` (a placeholder:
    VoltRL's agent builds its own prompts), ``voltrl_task_id``, ``index`` and ``data_source``.
    """

    def __init__(
        self,
        data_files: Any,
        tokenizer: Any = None,
        processor: Any = None,
        config: Any = None,
        max_samples: int = -1,
    ) -> None:
        files = [data_files] if isinstance(data_files, str | Path) else list(data_files)
        self.rows: list[dict[str, Any]] = []
        for name in files:
            with Path(name).expanduser().open() as f:
                self.rows += [json.loads(line) for line in f if line.strip()]
        if max_samples is not None and max_samples > 0:
            self.rows = self.rows[:max_samples]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self.rows[i]
        return {
            "raw_prompt": [{"role": "user", "content": f"voltrl task {row['voltrl_task_id']}"}],
            "voltrl_task_id": row["voltrl_task_id"],
            "index": row["index"],
            "data_source": DATA_SOURCE,
            "reward_model": {"style": "voltrl", "ground_truth": None},
        }


# ---- the agent-loop manager -----------------------------------------------------------------


def _rows_of(prompts: Any) -> list[dict[str, Any]]:
    """The rows of verl's prompt batch (a TensorDict with tensors and non-tensor data)."""
    from tensordict import NonTensorData, NonTensorStack

    rows: list[dict[str, Any]] = [{} for _ in range(len(prompts))]
    for key, value in prompts.items():
        for i, row in enumerate(rows):
            if isinstance(value, torch.Tensor):
                row[key] = value[i]
            elif isinstance(value, NonTensorStack):
                row[key] = value[i].data
            elif isinstance(value, NonTensorData):
                row[key] = value.data
    return rows


class VoltAgentLoopManager:
    """verl's agent-loop manager for agents run by VoltRL (see the module docstring).

    Args:
        ctx: the run's :class:`~voltrl.runtime.trainer.TrainContext` (store, resources, metrics).
        bridge: runs coroutines on ``ctx``'s event loop.
        tasks: every train and validation task, by id.
        trajectory: how rollouts become rows.
        n, val_n: rollouts per task in training (``rollout.n``) and validation
            (``rollout.val_kwargs.n``).
        resources: ``(train, val)`` resources to publish before queuing each kind.
        put_rows: writes ``(keys, fields, tags, partition)`` into TransferQueue (default
            :func:`tq_put_rows`); put_tag: sets a group's ``(uid, tag, partition)`` status
            (default :func:`tq_put_tag`).
        max_wait_s: longest a group may run; its unfinished rollouts then count as failed.
    """

    def __init__(
        self,
        ctx: TrainContext,
        bridge: LoopBridge,
        tasks: dict[str, Task],
        trajectory: TrajectoryConfig,
        *,
        n: int,
        val_n: int = 1,
        resources: tuple[dict[str, Any], dict[str, Any]] | None = None,
        put_rows: Callable[..., None] | None = None,
        put_tag: Callable[..., None] | None = None,
        max_wait_s: float | None = None,
    ) -> None:
        self.ctx, self.bridge, self.tasks, self.trajectory = ctx, bridge, tasks, trajectory
        self.n, self.val_n = n, val_n
        self.resources = resources
        self.put_rows = put_rows or tq_put_rows
        self.put_tag = put_tag or tq_put_tag
        self.max_wait_s = max_wait_s
        self.stats: Counter[str] = Counter()
        self.val_rollouts: list[Rollout] = []
        self.pending: list[Any] = []
        self._lock = threading.Lock()
        self._published: str | None = None
        self._publish_lock: asyncio.Lock | None = None

    def generate_sequences(self, prompts: Any) -> None:
        """verl's entry point: start every prompt's group and return at once; each group's
        rows reach TransferQueue when it has finished."""
        for row in _rows_of(prompts):
            validate = bool(row.get("validate", False))
            uid = str(row["uid"])
            steps = int(row.get("global_steps", 0))
            future = self.bridge.submit(self.run_group(row, uid, steps, validate))
            future.add_done_callback(_log_group_error)
            self.pending.append(future)
        self.pending = [f for f in self.pending if not f.done()]

    def new_policy(self) -> None:
        """The replicas serve new weights: the next group publishes its resources again, so
        its rollouts record a new resources version."""
        self._published = None

    async def _publish(self, validate: bool) -> None:
        if self.resources is None:
            return
        if self._publish_lock is None:
            self._publish_lock = asyncio.Lock()
        kind = "val" if validate else "train"
        async with self._publish_lock:
            if self._published != kind:
                await self.ctx.publish(self.resources[1 if validate else 0])
                self._published = kind

    async def run_group(self, row: dict[str, Any], uid: str, steps: int, validate: bool) -> None:
        """Run one task's group and put its rows into TransferQueue (partition ``val`` or
        ``train``); the group's tag becomes ``finished`` (``failure`` when no row remains)."""
        partition = "val" if validate else "train"
        prompt_tag = {"is_prompt": True, "global_steps": steps}
        status = "failure"
        try:
            task = self.tasks[str(row["voltrl_task_id"])]
            await asyncio.to_thread(
                self.put_tag, uid, {**prompt_tag, "status": "running"}, partition
            )
            await self._publish(validate)
            n = self.val_n if validate else self.n
            rollouts = await self.ctx.enqueue([task] * n, "val" if validate else "train")
            done = await self._wait(rollouts)
            trajectories = await trajectories_from_store(self.ctx.store, done, self.trajectory)
            fields_of_row = {
                k: row[k]
                for k in ("index", "data_source", "reward_model", "raw_prompt", "agent_name")
                if k in row
            }
            fields_of_row.update(voltrl_task_id=task.task_id, global_steps=steps)
            rows = 0
            for session, trajectory in enumerate(trajectories):
                keys, fields, tags = rollout_records(
                    trajectory,
                    uid=uid,
                    session_id=session,
                    global_steps=steps,
                    prompt_fields=fields_of_row,
                )
                if keys:
                    await asyncio.to_thread(self.put_rows, keys, fields, tags, partition)
                    rows += len(keys)
            with self._lock:
                for trajectory in trajectories:
                    self.stats.update(trajectory.stats)
                self.stats["rows"] += rows
                self.stats["rollouts"] += len(done)
                if validate:
                    self.val_rollouts += done
            status = "finished" if rows else "failure"
        except Exception:
            with self._lock:
                self.stats["group_errors"] += 1
            raise
        finally:
            await asyncio.to_thread(self.put_tag, uid, {**prompt_tag, "status": status}, partition)

    async def _wait(self, rollouts: list[Rollout]) -> list[Rollout]:
        """Wait for the group's rollouts (each rollout's own timeout and retries apply)."""
        ids = [r.rollout_id for r in rollouts]
        waited = 0.0
        while True:
            done = await self.ctx.store.wait_for_rollouts(ids, timeout_s=5.0)
            if len(done) == len(ids):
                return done
            waited += 5.0
            if self.max_wait_s is not None and waited >= self.max_wait_s:
                finished = {r.rollout_id for r in done}
                with self._lock:
                    self.stats["dropped/timed_out"] += len(ids) - len(finished)
                return done
            if not self.ctx.workers_alive():
                raise RuntimeError("every VoltRL worker has died; see the worker logs")

    def take_stats(self) -> dict[str, float]:
        """The counts since the last call (``rows``, ``rollouts``, ``dropped/*``...)."""
        with self._lock:
            out = {k: float(v) for k, v in self.stats.items()}
            self.stats.clear()
        return out

    def take_val_rollouts(self) -> list[Rollout]:
        """The validation rollouts finished since the last call."""
        with self._lock:
            out, self.val_rollouts = self.val_rollouts, []
        return out


def _is_val(key: str) -> bool:
    return key.startswith(("val-", "val/", "voltrl/val/"))


def _log_group_error(future: Any) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.error("a GRPO group failed; it is marked 'failure'", exc_info=future.exception())


def tq_put_rows(
    keys: list[str], fields: list[dict[str, Any]], tags: list[dict], partition: str
) -> None:
    """Write rows into TransferQueue, as verl's agent loops do."""
    import transfer_queue as tq
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    tq.kv_batch_put(
        keys=keys, partition_id=partition, fields=list_of_dict_to_tensordict(fields), tags=tags
    )


def tq_put_tag(key: str, tag: dict[str, Any], partition: str) -> None:
    """Set a group's status tag in TransferQueue."""
    import transfer_queue as tq

    tq.kv_put(key=key, partition_id=partition, tag=tag)


# ---- the trainer ---------------------------------------------------------------------------


def scale_advantages_per_rollout(
    keys: list[str], tags: list[dict[str, Any]], advantages: Any
) -> Any:
    """Per-rollout normalisation of a TransferQueue batch's advantages (nested or padded,
    one row per key): each rollout's rows share its weight (``1/k`` for ``k`` rows, scaled
    to mean 1 over the real rows, :func:`~voltrl.algorithms.local.loss.weight_advantages`);
    verl's padding rows keep theirs (their advantages are 0)."""
    real = [i for i, tag in enumerate(tags) if not tag.get("is_padding", False)]
    scale = torch.ones(len(keys))
    if real:
        w = rollout_weights([session_of(keys[i]) for i in real])
        scale[real] = weight_advantages(torch.ones(len(real)), w)
    if getattr(advantages, "is_nested", False):
        rows = [row * s for row, s in zip(advantages.unbind(), scale.tolist(), strict=True)]
        return torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    return advantages * scale.to(advantages).unsqueeze(-1)


class VoltPPOTrainer(PPOTrainerSync):
    """verl's synchronous PPO trainer with VoltRL's gateway, rounding and weighting.

    Args:
        config: the composed verl config.
        before_sleep: called (in verl's thread) before the replicas sleep for training: pauses
            and drains the gateway.
        after_update: called with the new ``global_steps`` once the replicas serve the new
            weights: publishes a resources version and resumes the gateway.
        rounding: ``"drop_zero_variance"`` or ``"pad"`` (see
            :class:`~voltrl.algorithms.verl.config.VoltrlSection`).
        rollout_weighting: per-rollout normalisation of advantages.
        manager_stats: returns VoltRL's counts since the last step (logged as ``voltrl/*``).
        on_metrics: receives each step's metrics after verl computed them, and each
            validation's (``_validate``).
        val_stats: VoltRL's statistics of the validation rollouts just run (all of them,
            also those that left no training row), merged into the validation metrics.
    """

    def __init__(
        self,
        config: Any,
        *,
        before_sleep: Callable[[], None] = lambda: None,
        after_update: Callable[[int], None] = lambda step: None,
        rounding: str = "drop_zero_variance",
        rollout_weighting: bool = False,
        manager_stats: Callable[[], dict[str, float]] = dict,
        on_metrics: Callable[[int, dict[str, Any]], None] = lambda step, m: None,
        val_stats: Callable[[], dict[str, float]] = dict,
    ) -> None:
        super().__init__(config)
        self.before_sleep, self.after_update = before_sleep, after_update
        self.rounding, self.rollout_weighting = rounding, rollout_weighting
        self.manager_stats, self.on_metrics, self.val_stats = manager_stats, on_metrics, val_stats

    # hooks of PPOTrainerSync: sleep after sampling, update weights at the end of a step
    def on_sample_end(self) -> None:
        self.before_sleep()
        super().on_sample_end()

    def on_step_end(self) -> None:
        super().on_step_end()
        self.after_update(self.global_steps)

    def _dp_size(self) -> int:
        wg = self.actor_rollout_wg
        if "actor" not in wg._dispatch_info:
            wg._dispatch_info["actor"] = wg._query_dispatch_info("actor")
        return max(wg._dispatch_info["actor"]) + 1

    def _balance_batch(
        self,
        batch: Any,
        metrics: dict,
        logging_prefix: str = "global_seqlen",
        keep_minibatch: bool = False,
    ) -> Any:
        if self.rounding == "drop_zero_variance":
            batch = self.round_down(
                batch, self._get_required_batch_multiple(self._dp_size()), metrics
            )
        return super()._balance_batch(batch, metrics, logging_prefix, keep_minibatch)

    @staticmethod
    def round_down(batch: Any, multiple: int, metrics: dict) -> Any:
        """Drop zero-variance groups' rows (TransferQueue keys) so the batch size comes
        closer to a multiple of ``multiple``; verl pads whatever remains."""
        import transfer_queue as tq
        from transfer_queue.metadata import KVBatchMeta

        drop = rows_to_drop(
            [key.split("_")[0] for key in batch.keys],
            [tag.get("reward", 0.0) for tag in batch.tags],
            len(batch) % multiple,
        )
        metrics["voltrl/dropped/rounding"] = len(drop)
        if not drop:
            return batch
        gone = set(drop)
        tq.kv_clear(keys=[batch.keys[i] for i in drop], partition_id=batch.partition_id)
        keep = [i for i in range(len(batch)) if i not in gone]
        return KVBatchMeta(
            partition_id=batch.partition_id,
            keys=[batch.keys[i] for i in keep],
            tags=[batch.tags[i] for i in keep],
            extra_info=batch.extra_info,
        )

    def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
        batch = super()._compute_advantage(batch, metrics)
        if self.rollout_weighting:
            import transfer_queue as tq
            from tensordict import TensorDict

            data = tq.kv_batch_get(
                keys=batch.keys,
                partition_id=batch.partition_id,
                select_fields=["advantages", "returns"],
            )
            scaled = {
                name: scale_advantages_per_rollout(batch.keys, batch.tags, data[name])
                for name in ("advantages", "returns")
            }
            batch = tq.kv_batch_put(
                keys=batch.keys,
                partition_id=batch.partition_id,
                fields=TensorDict(scaled, batch_size=len(batch)),
            )
        return batch

    def _validate(self) -> dict[str, float]:
        metrics = super()._validate()
        metrics.update(self.val_stats())
        self.on_metrics(self.global_steps, metrics)
        return metrics

    def _compute_metrics(
        self, batch: Any, metrics: dict, timing_raw: dict, global_steps: int, epoch: int
    ) -> None:
        super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
        metrics.update({f"voltrl/{k}": v for k, v in self.manager_stats().items()})
        # validation metrics were passed on by _validate already
        self.on_metrics(global_steps, {k: v for k, v in metrics.items() if not _is_val(k)})
