"""The batch: trajectories' rows padded into :class:`TrainingBatch` lists by :func:`collate`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from voltrl.trajectory.config import TrajectoryConfig
from voltrl.types import Trajectory


@dataclass
class TrainingBatch:
    """Padded training rows as plain lists (``to_torch`` makes tensors).

    Prompts are left-padded, responses right-padded, with ``pad_token_id``.
    ``attention_mask`` and ``position_ids`` cover ``prompt + response``; positions count
    real tokens from 0 (padding gets 0), as verl computes them.
    """

    pad_token_id: int
    prompt_length: int
    response_length: int
    prompt_ids: list[list[int]] = field(default_factory=list)
    prompt_mask: list[list[int]] = field(default_factory=list)
    response_ids: list[list[int]] = field(default_factory=list)
    response_mask: list[list[int]] = field(default_factory=list)
    response_logprobs: list[list[float]] = field(default_factory=list)
    attention_mask: list[list[int]] = field(default_factory=list)
    position_ids: list[list[int]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    token_level_rewards: list[list[float]] = field(default_factory=list)
    group_ids: list[str] = field(default_factory=list)
    """Per row: its GRPO group, the task (:meth:`TrajectoryConfig.group_of`)."""
    rollout_ids: list[str] = field(default_factory=list)
    agent_names: list[str | None] = field(default_factory=list)
    models: list[str | None] = field(default_factory=list)
    staleness: list[int | None] = field(default_factory=list)
    """Per row: the updates between the weights that sampled it and those it trains, where
    asynchronous LocalRL recorded it (``metadata["staleness"]``), else None."""
    stats: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rewards)

    def select(self, rows: Sequence[int]) -> TrainingBatch:
        """A batch of these rows only, in this order, with the same widths and ``stats``
        (per-row lists left empty in this batch stay empty)."""
        per_row = [
            f.name
            for f in fields(self)
            if isinstance(getattr(self, f.name), list) and len(getattr(self, f.name)) == len(self)
        ]
        picked = {name: [getattr(self, name)[i] for i in rows] for name in per_row}
        return replace(self, **picked, stats=dict(self.stats))

    def to_torch(self, device: Any = None) -> dict[str, Any]:
        """The tensor fields as torch tensors (needs torch), plus ``input_ids`` =
        prompt + response. Ids, masks and positions are ``long``; the rest ``float32``."""
        import torch

        n, p, r = len(self), self.prompt_length, self.response_length

        def tensor(rows: list[Any], width: int, dtype: Any) -> Any:
            return torch.tensor(rows, dtype=dtype, device=device).reshape(n, width)

        long, flt = torch.long, torch.float32
        out = {
            "prompt_ids": tensor(self.prompt_ids, p, long),
            "prompt_mask": tensor(self.prompt_mask, p, long),
            "response_ids": tensor(self.response_ids, r, long),
            "response_mask": tensor(self.response_mask, r, long),
            "response_logprobs": tensor(self.response_logprobs, r, flt),
            "attention_mask": tensor(self.attention_mask, p + r, long),
            "position_ids": tensor(self.position_ids, p + r, long),
            "token_level_rewards": tensor(self.token_level_rewards, r, flt),
            "rewards": torch.tensor(self.rewards, dtype=flt, device=device),
        }
        out["input_ids"] = torch.cat([out["prompt_ids"], out["response_ids"]], dim=-1)
        return out


def collate(
    trajectories: Sequence[Trajectory], config: TrajectoryConfig | None = None
) -> TrainingBatch:
    """Pad every transition of every trajectory into one batch.

    Widths are the longest prompt/response in the batch, or the configured maximum lengths
    when ``pad_to_max_lengths`` is set. ``stats`` sums the trajectories' counts and adds
    ``rows``, ``groups`` (GRPO groups), ``rollouts`` and ``rollouts_with_rows``.
    """
    config = config or TrajectoryConfig()
    pad = config.pad_token_id
    rows = [(traj, tr) for traj in trajectories for tr in traj.transitions]
    p_len = max((len(tr.prompt_token_ids) for _, tr in rows), default=0)
    r_len = max((len(tr.response_token_ids) for _, tr in rows), default=0)
    if config.pad_to_max_lengths:
        p_len = max(p_len, config.max_prompt_length or 0)
        r_len = max(r_len, config.max_response_length or 0)

    stats: Counter[str] = Counter()
    for traj in trajectories:
        stats.update(traj.stats or {"merge_failures": traj.merge_failures})
    batch = TrainingBatch(pad_token_id=pad, prompt_length=p_len, response_length=r_len)
    for traj, tr in rows:
        prompt, response = tr.prompt_token_ids, tr.response_token_ids
        mask = tr.response_mask if tr.response_mask is not None else [1] * len(response)
        logprobs = tr.response_logprobs or [0.0] * len(response)
        if len(mask) != len(response) or len(logprobs) != len(response):
            raise ValueError(f"rollout {traj.rollout_id}: response mask/logprobs length mismatch")
        reward = tr.reward if tr.reward is not None else traj.reward
        if reward is None:
            raise ValueError(f"rollout {traj.rollout_id}: a transition has no reward")
        p_pad, r_pad = p_len - len(prompt), r_len - len(response)
        attention = [0] * p_pad + [1] * (len(prompt) + len(response)) + [0] * r_pad
        token_rewards = [0.0] * r_len
        if 1 in mask:
            token_rewards[len(mask) - 1 - mask[::-1].index(1)] = float(reward)
        batch.prompt_ids.append([pad] * p_pad + list(prompt))
        batch.prompt_mask.append(attention[:p_len])
        batch.response_ids.append(list(response) + [pad] * r_pad)
        batch.response_mask.append(list(mask) + [0] * r_pad)
        batch.response_logprobs.append(list(logprobs) + [0.0] * r_pad)
        batch.attention_mask.append(attention)
        batch.position_ids.append(_positions(attention))
        batch.rewards.append(float(reward))
        batch.token_level_rewards.append(token_rewards)
        batch.group_ids.append(config.group_of(traj.task_id, tr.agent_name))
        batch.rollout_ids.append(traj.rollout_id)
        batch.agent_names.append(tr.agent_name)
        batch.models.append(tr.model)
        batch.staleness.append(tr.metadata.get("staleness"))
    stats["rows"] = len(rows)
    stats["groups"] = len(set(batch.group_ids))
    stats["rollouts"] = len(trajectories)
    stats["rollouts_with_rows"] = sum(1 for t in trajectories if t.transitions)
    batch.stats = dict(stats)
    return batch


def _positions(attention: list[int]) -> list[int]:
    out, seen = [], 0
    for a in attention:
        seen += a
        out.append(max(seen - 1, 0))
    return out
