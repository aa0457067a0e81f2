"""samples/werewolf's ``run.py`` takes the trainer's options from the samples' shared parser,
as every sample's does (``tests/sample_options.py``; the werewolf sample needs
AgentScope, so its check runs here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import sample_options as options

RUN_PY = Path(__file__).resolve().parents[1] / "samples" / "werewolf" / "run.py"


@pytest.mark.timeout(300)
def test_the_werewolf_run_py_takes_the_trainers_options_from_the_shared_parser():
    defaults = {"--steps": "1", "--rules": "agentscope", "--lr": "1e-05", "--train": "village"}
    options.check_sample_options("werewolf", defaults, python=sys.executable)


@pytest.mark.parametrize(
    ("option", "value", "must"),
    [
        ("--invalid-penalty", "0.5", "finite and at most 0"),
        ("--invalid-penalty", "-inf", "finite and at most 0"),
        ("--choice-reward", "-0.5", "finite and at least 0"),
        ("--choice-reward", "inf", "finite and at least 0"),
    ],
)
def test_a_reward_option_out_of_its_range_is_a_usage_error(
    option: str, value: str, must: str
) -> None:
    done = subprocess.run(
        [sys.executable, str(RUN_PY), "train", f"{option}={value}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert f"{option} must be {must}, not {value}" in done.stderr


def test_the_reward_options_reach_the_games_rows(tmp_path: Path) -> None:
    """``dev --teacher --invalid-penalty -1.5 --choice-reward 0.5``: the game played is a row
    with that penalty and that reward."""
    import asyncio

    from voltrl.store.sql import SQLStore

    done = subprocess.run(
        [sys.executable, str(RUN_PY), "dev", "--teacher", "--games", "1", "--rules", "short",
         "--max-rounds", "1", "--invalid-penalty", "-1.5", "--choice-reward", "0.5",
         "--run-dir", str(tmp_path),
         "--name", "rewards"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    async def rows() -> list[dict]:
        store = SQLStore(tmp_path / "rewards" / "store.sqlite")
        try:
            return [r.task.input for r in await store.query_rollouts()]
        finally:
            await store.close()

    [row] = asyncio.run(rows())
    assert (row["invalid_penalty"], row["choice_reward"]) == (-1.5, 0.5)
