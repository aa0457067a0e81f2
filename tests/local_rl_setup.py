"""LocalRL on a fresh tiny model, and what a run stored: what the LocalRL, resume, threads and
checkpoint tests build on."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import voltrl as vl
from voltrl.algorithms.local.config import GROUPS
from voltrl.algorithms.local.update import PolicyUpdateConfig
from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from voltrl.store.sql import SQLStore
from voltrl.trajectory import TrajectoryConfig


def make_algorithm(**overrides: Any) -> vl.LocalRL:
    """A LocalRL on a fresh tiny model: 2 steps of 2 tasks x 2, validating at the end,
    checkpointing each step. An override is a keyword of LocalRL; a group given as a dict is
    merged into the one here (``schedule={"steps": 3}`` keeps 2 tasks x 2)."""
    tok = build_tiny_tokenizer()
    options: dict[str, Any] = dict(
        tokenizer=tok,
        schedule={"steps": 2, "tasks_per_step": 2, "group_size": 2},
        validation={"every": 2, "sampling": {"max_tokens": 6}},
        checkpoints={"every": 1},
        sampling={"temperature": 1.0, "max_tokens": 6},
        update=PolicyUpdateConfig(lr=1e-3, micro_batch_size=4),
        trajectory=TrajectoryConfig(mode="trajectory"),
    )
    for key, value in overrides.items():
        given = options.get(key)
        merge = key in GROUPS and isinstance(given, dict) and isinstance(value, dict)
        options[key] = {**given, **value} if merge else value
    return vl.LocalRL(build_tiny_model(tok, seed=0), **options)


async def stored_async(path: Path):
    store = SQLStore(path)
    try:
        rollouts = await store.query_rollouts()
        calls = {r.rollout_id: await store.get_llm_calls(r.rollout_id) for r in rollouts}
        return rollouts, calls
    finally:
        await store.close()


def stored(path: Path):
    return asyncio.run(stored_async(path))
