"""Shared fixtures of the verl tests: the composed config (Hydra composition takes seconds, so
it is done once) and small hand-made trajectories. These tests need the real verl package
(``make test-verl`` installs it in ``.venv-verl``); nothing here runs on a GPU."""

from __future__ import annotations

import pytest

from voltrl.types import Trajectory, Transition


@pytest.fixture(scope="session")
def composed():
    """verl's composed config and our section, with the 1-GPU preset."""
    from voltrl.algorithms.verl.config import compose_config

    return compose_config(
        {"actor_rollout_ref": {"model": {"path": "/nonexistent/model"}}}, preset="1gpu-40gb"
    )


def rollout(rollout_id: str, task_id: str, rewards: list[float], length: int = 3) -> Trajectory:
    """A rollout with one row per reward: prompts of varied length, responses whose middle
    token is context (mask 0), logprobs -0.1 * position."""
    rows = []
    for i, r in enumerate(rewards):
        n = length + i
        prompt = list(range(10 + i, 12 + i + len(rollout_id) % 3))
        response = list(range(100, 100 + n))
        mask = [1] * n
        if n >= 3:
            mask[1] = 0
        rows.append(
            Transition(
                prompt_token_ids=prompt,
                response_token_ids=response,
                response_logprobs=[-0.1 * (k + 1) for k in range(n)],
                response_mask=mask,
                reward=r,
                metadata={"turns": [i]},
            )
        )
    return Trajectory(rollout_id=rollout_id, task_id=task_id, transitions=rows, reward=rewards[-1])
