"""The trajectory builder's output in verl's shapes.

Two views of the same rows (one row = one :class:`~voltrl.types.Transition`):

- :func:`to_dataproto`: a whole :class:`~voltrl.trajectory.TrainingBatch` as verl's padded
  ``DataProto``, the batch ``compute_advantage`` and the policy losses work on;
- :func:`rollout_records`: one rollout's rows as the TransferQueue records verl's v1 trainer
  reads (what its own agent loops write: unpadded 1-D tensors, keys ``{uid}_{session}_{i}``,
  tags with lengths and policy versions).

Both put the row's reward on its last generated token (``rm_scores``), as verl's agent loops
do, so ``rm_scores.sum(-1)`` is the row reward. :func:`rows_to_drop` picks the rows a batch
loses when it is rounded down to verl's mini-batch multiple, preferring rows of GRPO groups
whose rewards are all equal.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from typing import Any

from voltrl.trajectory import TrainingBatch
from voltrl.types import Trajectory

DATA_SOURCE = "voltrl"


def to_dataproto(batch: TrainingBatch) -> Any:
    """``batch`` as a verl ``DataProto``.

    Tensors (``B`` rows, prompt width ``P``, response width ``R``): ``prompts`` (B, P)
    left-padded, ``responses``, ``response_mask``, ``rollout_log_probs``, ``rm_scores``,
    ``token_level_scores`` and ``token_level_rewards`` (B, R) right-padded, ``input_ids``,
    ``attention_mask`` and ``position_ids`` (B, P + R). Non-tensors: ``uid`` (the GRPO group:
    the task id), ``rollout_id``, ``agent_name``. ``meta_info["voltrl_stats"]`` carries the
    builder's counts (drops, truncations, merge failures).
    """
    import numpy as np
    import torch
    from verl.protocol import DataProto

    if not len(batch):
        raise ValueError("the batch has no rows")
    t = batch.to_torch()
    scores = t["token_level_rewards"]
    tensors = {
        "prompts": t["prompt_ids"],
        "responses": t["response_ids"],
        "response_mask": t["response_mask"],
        "input_ids": t["input_ids"],
        "attention_mask": t["attention_mask"],
        "position_ids": t["position_ids"],
        "rollout_log_probs": t["response_logprobs"],
        "rm_scores": scores,
        "token_level_scores": scores.clone(),
        "token_level_rewards": scores.clone(),
    }
    non_tensors = {
        "uid": np.array(batch.group_ids, dtype=object),
        "rollout_id": np.array(batch.rollout_ids, dtype=object),
        "agent_name": np.array(batch.agent_names, dtype=object),
    }
    return DataProto.from_dict(
        tensors={
            k: v.to(torch.float32) if v.is_floating_point() else v for k, v in tensors.items()
        },
        non_tensors=non_tensors,
        meta_info={"voltrl_stats": dict(batch.stats)},
    )


def rollout_records(
    trajectory: Trajectory,
    *,
    uid: str,
    session_id: int,
    global_steps: int,
    prompt_fields: dict[str, Any] | None = None,
) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
    """One rollout's rows as TransferQueue ``(keys, fields, tags)`` for verl's v1 trainer.

    ``uid`` is verl's id of the prompt (one task: the GRPO group), ``session_id`` the
    rollout's index in its group, ``global_steps`` the policy version it ran with.
    ``prompt_fields`` are the dataset row's fields (``data_source``, ``index``...), copied
    onto every record as verl's agent loops do. Each record holds unpadded 1-D tensors:
    ``prompts``, ``responses``, ``response_mask`` (= ``loss_mask``), ``rollout_log_probs``,
    ``rm_scores`` (the row's reward on its last generated token), ``input_ids``,
    ``attention_mask``, ``position_ids``; plus ``num_turns`` and ``extra_fields``.
    """
    import torch

    keys, fields, tags = [], [], []
    for i, tr in enumerate(trajectory.transitions):
        prompt, response = list(tr.prompt_token_ids), list(tr.response_token_ids)
        mask = list(tr.response_mask) if tr.response_mask is not None else [1] * len(response)
        logprobs = list(tr.response_logprobs or [0.0] * len(response))
        reward = tr.reward if tr.reward is not None else trajectory.reward
        if reward is None:
            raise ValueError(f"rollout {trajectory.rollout_id}: a row has no reward")
        scores = [0.0] * len(response)
        if 1 in mask:
            scores[len(mask) - 1 - mask[::-1].index(1)] = float(reward)
        input_ids = torch.tensor(prompt + response, dtype=torch.int64)
        response_mask = torch.tensor(mask, dtype=torch.int64)
        record: dict[str, Any] = {
            **(prompt_fields or {}),
            "uid": uid,
            "session_id": session_id,
            "prompts": torch.tensor(prompt, dtype=torch.int64),
            "responses": torch.tensor(response, dtype=torch.int64),
            "response_mask": response_mask,
            "loss_mask": response_mask.clone(),
            "rollout_log_probs": torch.tensor(logprobs, dtype=torch.float32),
            "rm_scores": torch.tensor(scores, dtype=torch.float32),
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "position_ids": torch.arange(len(input_ids), dtype=torch.int64),
            "multi_modal_inputs": {},
            "num_turns": len(tr.metadata.get("turns", [])) or 1,
            "extra_fields": {
                "voltrl_rollout_id": trajectory.rollout_id,
                "voltrl_task_id": trajectory.task_id,
                "agent_name": tr.agent_name,
                "min_global_steps": global_steps,
                "max_global_steps": global_steps,
            },
        }
        keys.append(f"{uid}_{session_id}_{i}")
        fields.append(record)
        tags.append(
            {
                "status": "success",
                "prompt_len": len(prompt),
                "response_len": len(response),
                "seq_len": len(prompt) + len(response),
                "global_steps": global_steps,
                "min_global_steps": global_steps,
                "max_global_steps": global_steps,
                "reward": float(reward),
                "rows_in_rollout": len(trajectory.transitions),
            }
        )
    return keys, fields, tags


def session_of(key: str) -> str:
    """The rollout (``{uid}_{session}``) of a TransferQueue row key ``{uid}_{session}_{i}``."""
    return key.rsplit("_", 1)[0]


def rows_to_drop(
    groups: Sequence[Hashable],
    rewards: Sequence[float],
    excess: int,
) -> list[int]:
    """Which ``excess`` rows to drop to round a batch down, preferring no-signal rows.

    Rows of GRPO groups whose rewards are all equal have advantage 0 and add nothing to the
    policy gradient, so only they are dropped: whole groups where a set of them adds up to
    ``excess`` (or comes closest below it), then single rows of the remaining flat groups.
    Rows with a learning signal are never dropped; when the flat rows are not enough, fewer
    than ``excess`` are returned and the caller pads the rest (as verl does). Returns row
    indices in ascending order.
    """
    if excess <= 0:
        return []
    members: dict[Hashable, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    flat = sorted(
        (rows for rows in members.values() if len({rewards[i] for i in rows}) == 1), key=len
    )
    # subset sum over whole flat groups: best[s] = the groups (indices into flat) summing to s
    best: dict[int, list[int]] = {0: []}
    for k, rows in enumerate(flat):
        for total, chosen in list(best.items()):
            new = total + len(rows)
            if new <= excess and new not in best:
                best[new] = [*chosen, k]
    chosen = best[max(best)]
    dropped = [i for k in chosen for i in flat[k]]
    for k, rows in enumerate(flat):
        if k not in chosen:
            dropped += rows[len(rows) - min(len(rows), excess - len(dropped)) :]
    return sorted(dropped[:excess])
