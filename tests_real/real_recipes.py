"""The samples' SmolLM2 recipes, shrunk to one RL step for ``make test-real``."""

from __future__ import annotations

import sys
from pathlib import Path

MODEL = "smollm2-135m-instruct"


def one_step_recipe(sample: str, folder: Path) -> dict:
    """``samples/<sample>``'s SmolLM2 recipe shrunk to one RL step (16 teacher episodes, 2 SFT
    steps of 4 rows, 2 tasks x 2, validation before and after on 4 tasks), run in ``folder``;
    the row of its learning table."""
    import dataclasses

    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root / "samples"), str(root / "benchmarks")]
    from learning import load_recipe
    from recipe_runner import run_recipe

    recipe = load_recipe(sample, MODEL)
    tasks = recipe.tasks

    def few(seed: int) -> tuple[list, list, list]:
        teacher, train, val = tasks(seed)
        return teacher[:16], train[:8], val[:4]

    recipe = dataclasses.replace(
        recipe,
        tasks=few,
        sft={**recipe.sft, "steps": 2, "batch_size": 4},
        rl=recipe.rl
        | {
            "schedule": {"steps": 1, "tasks_per_step": 2, "group_size": 2},
            "validation": {**recipe.rl["validation"], "every": 1},
        },
        concurrency=4,
    )
    return run_recipe(recipe, 0, folder)
