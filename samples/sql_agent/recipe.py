"""The CPU learning recipe of the LangGraph SQL agent (see ``samples/recipe_runner.py``).

The graph (write → execute → check → rewrite), LangChain, the adapter and the reward
(execution match) run exactly as in ``run.py``. The task set is simplified for a tiny model:
:func:`teacher.recipe_questions`'s 134 templated questions over the same database (seven
templates whose SQL differs only by an entity or a number copied from the question) instead of
the 30 hand-written ones; about a fifth of each template's questions are held out.

Every node sends a fresh conversation (its own system prompt, the question, the query and
result so far), so no call's prompt extends another's: rows are one call each
(``mode="transition"``), and trajectory mode would only count merge failures. All three roles
learn the teacher's replies in the warm-up (the student plays the reviewer too); RL trains only
``write`` and ``rewrite`` (the sample's agent filter), every call credited with the episode's
execution match (``credit="final"``): a query is right or wrong only by its result.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from agent import AGENT_FILTER, sql_agent  # noqa: E402
from recipe_runner import Recipe, Rows  # noqa: E402
from teacher import POOL  # noqa: E402


def tasks(seed: int) -> tuple[Rows, Rows, Rows]:
    """Teacher and training questions (the same ~107) and the ~27 held out: every fifth
    question of each template's list."""
    train, val = [], []
    for questions in POOL.values():
        for k, (question, sql) in enumerate(questions):
            row = {"question": question, "gold_sql": sql, "split": "val" if k % 5 == 2 else "train"}
            (val if row["split"] == "val" else train).append(row)
    return train, train, val


# 128: the longest gold query (``sold``) is 108 tokens with the tiny tokenizer; at 64 the
# student's ``orders`` and ``sold`` queries were cut off, and could never be right.
SAMPLING = {"temperature": 1.0, "max_tokens": 128}

RECIPE = Recipe(
    sample="sql_agent",
    framework="LangGraph 1.x",
    agent=sql_agent,
    tasks=tasks,
    teacher_seeds=(0, 1, 2, 3),
    sft={
        "steps": 600,
        "batch_size": 32,
        "lr": 3e-3,
        "warmup_steps": 20,
        "threads": 2,
        "trajectory": {"mode": "transition"},
    },
    rl={
        "steps": 10,
        "tasks_per_step": 6,
        "group_size": 8,
        "sampling": SAMPLING,
        "val_sampling": SAMPLING,
        "val_every": 5,
        "update": {"lr": 2e-4, "micro_batch_size": 32, "clip_eps": 0.2},
        "trajectory": {"mode": "transition", "agent_filter": AGENT_FILTER},
    },
    credit="final: a query is right or wrong only by its result (execution match)",
    simplified="134 templated questions (seven templates) instead of the 30 hand-written ones",
    # Eight heads of 16 rather than four of 32 (same parameters), as the other samples' students.
    model={"hidden": 128, "layers": 2, "heads": 8, "kv_heads": 4},
)
