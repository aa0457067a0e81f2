"""The CPU learning recipe of the OpenAI Agents SDK unit converter, running as its own service
(see ``samples/recipe_runner.py``).

The service, the SDK, the adapter and the trainer-side ``ServiceAgent`` run exactly as in
``run.py``: the recipe starts ``service.py`` as a process for each run and only posts tasks to
it. The task set is the sample's own. Trajectory mode merges an episode's calls (the SDK
resends the whole history) and every token shares the final reward (``credit="final"``): the
reward says only whether the answer's number was within 1%, and both steps (the tool call's
arguments, then copying its result) decide it.

:data:`SMOLLM2` is the recipe for a pretrained model, SmolLM2-135M-Instruct (``python
benchmarks/learning.py agent_service --model smollm2-135m-instruct``), as the calculator
sample's: the same task set, a short warm-up of every weight on 640 of the teacher's episodes,
then LocalRL training a LoRA adapter.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from client import ServiceAgent  # noqa: E402
from recipe_runner import Recipe, Rows, smollm2  # noqa: E402
from run import service_process  # noqa: E402
from units import make_tasks  # noqa: E402


def tasks(seed: int, n_teacher: int = 1500) -> tuple[Rows, Rows, Rows]:
    """``n_teacher`` teacher tasks (fixed), training tasks (by seed) and 128 held-out tasks
    (fixed), the held-out questions in neither of the others."""
    val = make_tasks(128, seed=999_999)
    held_out = {row["question"] for row in val}
    teacher = [r for r in make_tasks(n_teacher, seed=777) if r["question"] not in held_out]
    train = [r for r in make_tasks(2000, seed=seed) if r["question"] not in held_out]
    return teacher, train, val


@contextlib.contextmanager
def service_agent(run_dir: Path) -> Iterator[ServiceAgent]:
    """The agent service as a process of its own, and the trainer-side agent posting to it."""
    gateway_file = run_dir.parent / f"{run_dir.name}.gateway.json"
    with service_process(gateway_file) as url:
        yield ServiceAgent(url, gateway_file)


SAMPLING = {"temperature": 1.0, "max_tokens": 64}

RECIPE = Recipe(
    sample="agent_service",
    framework="OpenAI Agents SDK (service)",
    agent=None,
    agent_in=service_agent,
    tasks=tasks,
    sft={"steps": 700, "batch_size": 32, "lr": 3e-3, "warmup_steps": 20, "threads": 2},
    rl={
        "schedule": {"steps": 40, "tasks_per_step": 8, "group_size": 8},
        # each held-out task twice (see recipe_runner.py); every 20 steps keeps a seed in
        # 10 minutes in the machine's slower hours
        "validation": {"sampling": SAMPLING, "every": 20, "n": 2},
        "sampling": SAMPLING,
        "update": {"lr": 2e-4, "micro_batch_size": 32, "clip_eps": 0.2},
        "trajectory": {"mode": "trajectory"},
    },
    credit="final: the reward only says whether the answer was within 1%",
    # Eight heads of 16 rather than four of 32 (same parameters): see autogen_calc's recipe.
    model={"hidden": 128, "layers": 2, "heads": 8, "kv_heads": 4},
)


def smollm2_tasks(seed: int) -> tuple[Rows, Rows, Rows]:
    """The same task sets with 640 teacher tasks: the warm-up reads a few hundred."""
    return tasks(seed, n_teacher=640)


# The tool call is about 40 tokens with SmolLM2's tokenizer and the answer ("5.2 inches is
# 0.433333 feet.") under 20; a reply that rambles stops at 64.
SMOLLM2 = smollm2(RECIPE, smollm2_tasks)

RECIPES = {"smollm2-135m-instruct": SMOLLM2}
"""This sample's recipes for other models than the tiny one (``RECIPE``)."""
