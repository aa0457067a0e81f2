"""The CPU learning recipe of the Agent Framework + MCP calculator agent (see
``samples/recipe_runner.py``).

The agent, Agent Framework, the MCP server and the adapter run exactly as in ``run.py``; the
task set is the sample's own. Each rollout starts its own MCP server process (about a second of
CPU), so this recipe uses fewer teacher tasks and smaller steps than the AutoGen one.
Trajectory mode merges an episode's calls (Agent Framework resends the whole history) and every
token shares the final reward (``credit="final"``): the reward says only whether the last
number was right, and every step of a short episode decides it.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from agent import calc_agent  # noqa: E402
from data import make_problems  # noqa: E402
from recipe_runner import Recipe, Rows  # noqa: E402


def tasks(seed: int) -> tuple[Rows, Rows, Rows]:
    """Teacher tasks (fixed), training tasks (by seed) and 64 held-out tasks (fixed), the
    held-out questions in neither of the others."""
    val = make_problems(64, seed=999_999)
    held_out = {row["question"] for row in val}
    teacher = [r for r in make_problems(300, seed=777) if r["question"] not in held_out]
    train = [r for r in make_problems(2000, seed=seed) if r["question"] not in held_out]
    return teacher, train, val


SAMPLING = {"temperature": 1.0, "max_tokens": 48}

RECIPE = Recipe(
    sample="calc_mcp",
    framework="Agent Framework 1.23 + MCP",
    agent=calc_agent,
    tasks=tasks,
    sft={"steps": 1000, "batch_size": 32, "lr": 3e-3, "warmup_steps": 20, "threads": 2},
    rl={
        "steps": 10,
        "tasks_per_step": 6,
        "group_size": 8,
        "sampling": SAMPLING,
        "val_sampling": SAMPLING,
        "val_every": 5,
        "update": {"lr": 2e-4, "micro_batch_size": 32, "clip_eps": 0.2},
        "trajectory": {"mode": "trajectory"},
    },
    credit="final: the reward only says whether the last number was right",
    concurrency=16,
)
