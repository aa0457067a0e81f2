"""The CPU learning recipe of the LangGraph SQL agent (see ``samples/recipe_runner.py``).

The graph (write → execute → check → rewrite), LangChain, the adapter and the reward
(execution match) run exactly as in ``run.py``. The task set is simplified for a tiny model
trained from scratch, which must copy the question's numbers into its query:

- 2,083 templated questions over the shop's prices instead of the 30 hand-written ones
  (:data:`teacher.POOL`: which products, how many and their total price between two prices;
  which products cost more or less than one): too many to fit by heart, as the calculator
  samples' thousands of problems; 64 of them held out;
- each task's prompts show only the ``products`` table (``"tables": ["products"]``, the
  agent's schema pruning): 238 prompt tokens for ``write`` instead of 616 with the four tables,
  the length that kept the student from copying at all (see README.md).

Every node sends a fresh conversation (its own system prompt, the question, the query and
result so far), so no call's prompt extends another's: rows are one call each
(``mode="transition"``), and trajectory mode would only count merge failures. All three roles
learn the teacher's replies in the warm-up (the student plays the reviewer too); RL trains only
``write`` and ``rewrite`` (the sample's agent filter), every call credited with the episode's
execution match (``credit="final"``): a query is right or wrong only by its result.

:data:`SMOLLM2` is the same recipe for a pretrained model, SmolLM2-135M-Instruct (``python
benchmarks/learning.py sql_agent --model smollm2-135m-instruct``): the same tasks, teacher
(one recording of it, not two) and credit, a short warm-up of every weight on the teacher's
rollouts (tens of steps, not a thousand: the model already reads and writes SQL, and copies
numbers from its prompt), then LocalRL training a LoRA adapter; replies sampled up to 48
tokens, and each held-out task validated once, to keep a seed within 30 minutes.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from agent import AGENT_FILTER, sql_agent  # noqa: E402
from recipe_runner import Recipe, Rows  # noqa: E402
from teacher import POOL  # noqa: E402


def tasks(seed: int) -> tuple[Rows, Rows, Rows]:
    """Teacher and training questions (the same 2,019) and 64 held out, drawn once (the same
    for every seed); every task's prompts show the ``products`` table only."""
    pool = [pair for pairs in POOL.values() for pair in pairs]
    random.Random(0).shuffle(pool)
    rows = [{"question": q, "gold_sql": sql, "tables": ["products"]} for q, sql in pool]
    val = [{**r, "split": "val"} for r in rows[:64]]
    train = [{**r, "split": "train"} for r in rows[64:]]
    return train, train, val


# 96: the longest reply (a ``total`` query in its ```sql block) is 68 tokens with the tiny
# tokenizer; a student that rambles stops there.
SAMPLING = {"temperature": 1.0, "max_tokens": 96}

RECIPE = Recipe(
    sample="sql_agent",
    framework="LangGraph 1.x",
    agent=sql_agent,
    tasks=tasks,
    teacher_seeds=(0, 1),
    sft={
        "steps": 1000,
        "batch_size": 16,
        "lr": 3e-3,
        "warmup_steps": 20,
        "threads": 2,
        "trajectory": {"mode": "transition"},
    },
    rl={
        "schedule": {"steps": 12, "tasks_per_step": 6, "group_size": 8},
        "validation": {"sampling": SAMPLING, "every": 12, "n": 2},
        "sampling": SAMPLING,
        "update": {"lr": 2e-4, "micro_batch_size": 32, "clip_eps": 0.2},
        "trajectory": {"mode": "transition", "agent_filter": AGENT_FILTER},
    },
    credit="final: a query is right or wrong only by its result (execution match)",
    simplified="2,083 templated questions over prices, the prompts showing one table of four",
    # Eight heads of 16 rather than four of 32 (same parameters), as the other samples' students.
    model={"hidden": 128, "layers": 2, "heads": 8, "kv_heads": 4},
)

# 48: with SmolLM2's tokenizer the teacher's longest reply is 27 tokens (a query in its ```sql
# block, <|im_end|> included; a review is at most 19), against 68 with the tiny tokenizer. A
# reply that rambles stops at 48 rather than 96 and, quoted in the next prompts (check,
# rewrite), makes them shorter too.
SMOLLM2_SAMPLING = {"temperature": 1.0, "max_tokens": 48}

SMOLLM2 = dataclasses.replace(
    RECIPE,
    model="smollm2-135m-instruct",
    # 24 steps of 16 calls, as the calculator's recipe: with 16, the same rows warmed the
    # student up to 74%, 48% and 39% by seed, and the weakest made the longest episodes
    # (every wrong query is checked and rewritten): 43 minutes for seed 2 against 29-30
    sft={**RECIPE.sft, "steps": 24, "lr": 1e-4, "warmup_steps": 4},
    rl={
        **RECIPE.rl,
        # the 64 held-out tasks once each (not twice): validation took 7.3-11.1 of a seed's
        # minutes; the figure moves by about ±6 points rather than ±4.5
        "validation": {"sampling": SMOLLM2_SAMPLING, "every": 12, "n": 1},
        "sampling": SMOLLM2_SAMPLING,
        "compute": {"threads": 2},
        "update": {**RECIPE.rl["update"], "use_lora": True},
    },
    teacher_seeds=(0,),
    # a validation's 64 episodes at once (the engine decodes up to 64 sequences together)
    concurrency=64,
)

RECIPES = {"smollm2-135m-instruct": SMOLLM2}
"""This sample's recipes for other models than the tiny one (``RECIPE``)."""
