"""The CPU learning recipe of the AutoGen calculator agent (see ``samples/recipe_runner.py``).

The agent, AutoGen and the adapter run exactly as in ``run.py``; the task set is the sample's
own. Trajectory mode merges an episode's calls (AutoGen resends the whole history, so each
call's prompt extends the previous call's prompt + answer) and every token of the episode
shares its final reward (``credit="final"``): the reward says only whether the last number
was right, and every step of a short episode (expression, then answer) decides it.

:data:`SMOLLM2` is the recipe for a pretrained model, SmolLM2-135M-Instruct (``python
benchmarks/learning.py autogen_calc --model smollm2-135m-instruct``), as the calculator
sample's: the sample's own problems (numbers up to 200, not 20: the pretrained model copies
numbers from its prompt), a short warm-up of every weight on 640 of the teacher's episodes,
then LocalRL training a LoRA adapter.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from agent import autogen_calc_agent  # noqa: E402
from data import make_problems  # noqa: E402
from recipe_runner import Recipe, Rows, smollm2, word_problem_sets  # noqa: E402

MAX_NUMBER = 20
"""The problems' numbers go up to 20, not 200: what limits a 2-layer student is copying the
problem's numbers into its calculator call, and it copies short numbers more often (README.md)."""


def tasks(seed: int) -> tuple[Rows, Rows, Rows]:
    """Teacher tasks (fixed), training tasks (by seed) and 128 held-out tasks (fixed), the
    held-out questions in neither of the others."""
    return word_problem_sets(make_problems, seed, 1500, MAX_NUMBER)


SAMPLING = {"temperature": 1.0, "max_tokens": 48}

RECIPE = Recipe(
    sample="autogen_calc",
    framework="AutoGen 0.7",
    agent=autogen_calc_agent,
    tasks=tasks,
    sft={"steps": 1000, "batch_size": 32, "lr": 3e-3, "warmup_steps": 20, "threads": 2},
    rl={
        "schedule": {"steps": 40, "tasks_per_step": 8, "group_size": 8},
        # each held-out task twice: a steadier figure (see recipe_runner.py)
        "validation": {"sampling": SAMPLING, "every": 10, "n": 2},
        "sampling": SAMPLING,
        "update": {"lr": 2e-4, "micro_batch_size": 32, "clip_eps": 0.2},
        "trajectory": {"mode": "trajectory"},
    },
    credit="final: the reward only says whether the last number was right",
    # Eight heads of 16 rather than four of 32 (same parameters): the student learns to copy
    # the problem's numbers in its warm-up on every seed tried (see README.md).
    model={"hidden": 128, "layers": 2, "heads": 8, "kv_heads": 4},
)


def sample_tasks(seed: int) -> tuple[Rows, Rows, Rows]:
    """The sample's own problems (every number as ``data.py`` draws it): 640 teacher tasks
    (fixed), training tasks (by seed) and 128 held-out tasks (fixed)."""
    return word_problem_sets(make_problems, seed, 640, None)


# The tool call is about 30 tokens with SmolLM2's tokenizer and the answer (the number only)
# under 5; a reply that rambles stops at 64.
SMOLLM2 = smollm2(RECIPE, sample_tasks)

RECIPES = {"smollm2-135m-instruct": SMOLLM2}
"""This sample's recipes for other models than the tiny one (``RECIPE``)."""
