"""The CPU learning recipe of the calculator agent on a pretrained model (see
``samples/recipe_runner.py``): SmolLM2-135M-Instruct, the first real model VoltRL trains here.

The agent (``agent.py``: a bare OpenAI client, one tool) runs exactly as in ``demo.py``, with
the model's own chat template (ChatML; tools described Hermes-style in the system prompt, calls
as ``<tool_call>{json}</tool_call>``, see ``voltrl model list``). Out of the box the model never
calls the tool (0 of 64 sampled answers) and gets 2-5% of the questions right by mental
arithmetic, so the recipe warms it up on the scripted teacher's rollouts (``teacher.py``, right
about 62% of the time; every weight trained, a few hundred episodes), then trains a LoRA
adapter with LocalRL. Trajectory mode merges an episode's two calls into one row (the second
call's prompt extends the first's prompt and answer) and every token shares the final reward:
whether the answer's last number was right.

    python benchmarks/learning.py calculator --model smollm2-135m-instruct --seeds 0 1 2
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from agent import calculator_agent  # noqa: E402
from data import make_tasks  # noqa: E402
from recipe_runner import Recipe, Rows  # noqa: E402


def tasks(seed: int) -> tuple[Rows, Rows, Rows]:
    """Teacher tasks (fixed), training tasks (by seed) and 128 held-out tasks (fixed), the
    held-out questions in neither of the others."""
    val = make_tasks(128, seed=999)
    held_out = {t["question"] for t in val}
    teacher = [t for t in make_tasks(640, seed=777) if t["question"] not in held_out]
    train = [t for t in make_tasks(2000, seed=2000 + seed) if t["question"] not in held_out]
    return teacher, train, val


# The tool call is 25-30 tokens and the answer under 10; a reply that rambles stops at 64.
SAMPLING = {"temperature": 1.0, "max_tokens": 64}

SMOLLM2 = Recipe(
    sample="calculator",
    framework="OpenAI client",
    agent=calculator_agent,
    tasks=tasks,
    model="smollm2-135m-instruct",
    sft={"steps": 24, "batch_size": 16, "lr": 1e-4, "warmup_steps": 4, "threads": 2},
    rl={
        "schedule": {"steps": 12, "tasks_per_step": 8, "group_size": 8},
        "validation": {"sampling": SAMPLING, "every": 12, "n": 1},
        "compute": {"threads": 2},
        "sampling": SAMPLING,
        "update": {
            "use_lora": True,
            "lr": 2e-4,
            "micro_batch_size": 16,
            "clip_eps": 0.2,
        },
        "trajectory": {"mode": "trajectory"},
    },
    credit="final: the reward only says whether the last number was right",
    concurrency=64,
)

RECIPES = {"smollm2-135m-instruct": SMOLLM2}
"""This sample's recipes by model (``make demo`` is its tiny-model recipe)."""
