"""Each framework sample's CPU learning recipe, shrunk to a few tasks: the teacher's rollouts
recorded through the real framework and gateway, the SFT warm-up, one RL step. Plumbing, not
learning (``benchmarks/learning.py`` measures that): the rows trained in each phase came
from that framework's calls, with non-empty loss masks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT

from voltrl.algorithms.local.conversations import chat_retokenizer
from voltrl.models.tiny import build_tiny_tokenizer
from voltrl.store.sql import SQLStore
from voltrl.trajectory import TrajectoryConfig, trajectories_from_store


@pytest.fixture(autouse=True)
def _benchmarks_and_samples_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """``learning`` (benchmarks/) and ``recipe_runner`` (samples/), for this module's tests."""
    monkeypatch.syspath_prepend(str(ROOT / "samples"))
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))


# sample -> (the agent names of its SFT rows, of its RL rows, text its framework puts in
# every prompt)
FRAMEWORK_CALLS = {
    "autogen_calc": ({"solver"}, {"solver"}, "Use the calculator tool for every computation"),
    "calc_mcp": ({"solver"}, {"solver"}, "calculate"),
    "agent_service": ({"converter"}, {"converter"}, "convert"),
    "sql_agent": ({"write", "check", "rewrite"}, {"write", "rewrite"}, "SQL"),
    # the pretrained model's recipe, its plumbing run here on a tiny student (tests_real runs
    # it on the real model)
    "calculator": ({None}, {None}, "calculator"),
}
PRETRAINED_ONLY = {"calculator": "smollm2-135m-instruct"}


def shrunk(sample: str) -> Any:
    """The sample's recipe with 6 teacher tasks, 2 SFT steps, one RL step of 2 x 2 (a tiny
    student for a sample whose recipes are for a pretrained model)."""
    from learning import load_recipe

    recipe = load_recipe(sample, PRETRAINED_ONLY.get(sample, "tiny"))
    if sample in PRETRAINED_ONLY:
        recipe = dataclasses.replace(recipe, model={"hidden": 64, "layers": 1})
    tasks = recipe.tasks

    def few(seed: int) -> tuple[list, list, list]:
        teacher, train, val = tasks(seed)
        return teacher[:6], train[:4], val[:2]

    return dataclasses.replace(
        recipe,
        tasks=few,
        sft={**recipe.sft, "steps": 2, "min_reward": None},  # a 6-task teacher may solve none
        rl=recipe.rl
        | {
            "schedule": {"steps": 1, "tasks_per_step": 2, "group_size": 2},
            "validation": {**recipe.rl["validation"], "every": 1, "n": 1},
        },
        teacher_seeds=(0,),
        concurrency=4,
    )


async def _rows(run_dir: Path, mode: str, config: TrajectoryConfig) -> list[tuple[Any, Any]]:
    """Each trained row of the run's ``mode`` rollouts with the calls it was built from."""
    store = SQLStore(run_dir / "store.sqlite")
    try:
        rollouts = await store.query_rollouts(mode=mode)
        out = []
        for traj in await trajectories_from_store(store, rollouts, config):
            calls = {c.call_id: c for c in await store.get_llm_calls(traj.rollout_id)}
            out += [(t, [calls[i] for i in t.metadata["call_ids"]]) for t in traj.transitions]
        return out
    finally:
        await store.close()


@pytest.mark.slow
@pytest.mark.parametrize("sample", list(FRAMEWORK_CALLS))
def test_the_recipe_warms_up_on_the_framework_teachers_calls_then_takes_an_rl_step(
    sample, tmp_path
):
    from recipe_runner import run_recipe

    recipe = shrunk(sample)
    earlier = tmp_path / f"{sample}-recipe-seed0"  # an earlier run of the name: this is -2
    earlier.mkdir()
    (earlier / "metrics.jsonl").write_text("")
    row = run_recipe(recipe, 0, tmp_path)
    assert Path(row["run_dir"]).name == f"{sample}-recipe-seed0-2"
    assert row["model"] == "tiny"
    if sample == "calc_mcp":  # the server started beside the run logs into the run's directory
        assert (Path(row["run_dir"]) / "calculator_server.log").exists()
    sft_agents, rl_agents, marker = FRAMEWORK_CALLS[sample]

    assert row["sft_rows"] > 0 and row["sft_tokens"] > 0
    teacher_dir = next(p for p in tmp_path.glob(f"{sample}-teacher0-*") if p.is_dir())
    sft_config = TrajectoryConfig.model_validate(
        {
            **recipe.sft.get("trajectory", {"mode": "trajectory"}),
            "missing_token_ids": "retokenize",
            "retokenizer": chat_retokenizer(build_tiny_tokenizer()),
        }
    )
    teacher_rows = asyncio.run(_rows(teacher_dir, "dev", sft_config))
    assert teacher_rows and all(c.prompt_token_ids is None for _, cs in teacher_rows for c in cs)
    for transition, calls in teacher_rows:  # from the framework: its prompt, its agent names
        assert transition.metadata["retokenized"] and 1 in transition.response_mask
        assert all(c.agent_name in sft_agents for c in calls)
        assert all(marker in json.dumps(c.request) for c in calls)
    # ... and SFT trained on exactly these rows: every one, their masked tokens
    assert row["sft_rows"] == len(teacher_rows)
    assert row["sft_tokens"] == sum(int(sum(t.response_mask)) for t, _ in teacher_rows)

    metrics = [json.loads(x) for x in (Path(row["run_dir"]) / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics if "sft/loss" in m] == [1, 2]
    [step] = [m for m in metrics if "train/reward_mean" in m]
    assert step["batch/rows"] > 0
    rl_config = TrajectoryConfig.model_validate(recipe.rl["trajectory"])
    rl_rows = asyncio.run(_rows(Path(row["run_dir"]), "train", rl_config))
    assert len(rl_rows) == step["batch/rows"]
    for transition, calls in rl_rows:  # the student's own calls, through the same framework
        assert 1 in transition.response_mask
        assert all(c.prompt_token_ids is not None for c in calls)
        assert all(c.agent_name in rl_agents for c in calls)
        assert all(marker in json.dumps(c.request) for c in calls)
    assert row["after_sft"] is not None and row["after_rl"] is not None
    if sample in ("autogen_calc", "calc_mcp"):  # benchmarks/calculator_mistakes.py reads it
        from calculator_mistakes import kinds_by_validation

        counts = asyncio.run(kinds_by_validation(Path(row["run_dir"])))
        # the 2 held-out episodes of the validation before and of the one after the RL step
        assert [sum(c.values()) for c in counts.values()] == [2, 2]


def test_a_sample_without_a_recipe_for_a_model_says_which_it_has():
    from learning import load_recipe

    assert load_recipe("sql_agent", "smollm2-135m-instruct").model == "smollm2-135m-instruct"
    with pytest.raises(
        SystemExit,
        match=r"calculator has no recipe for the model 'tiny' "
        r"\(it has: smollm2-135m-instruct\)",
    ):
        load_recipe("calculator", "tiny")


def test_the_learning_table_has_a_row_per_seed_and_a_mean_per_sample():
    from learning import table_lines

    def row(seed: int, before: float | None, after: float | None) -> dict[str, Any]:
        return {
            "sample": "autogen_calc",
            "framework": "AutoGen",
            "seed": seed,
            "after_sft": before,
            "after_rl": after,
            "minutes": 8.0,
            "merge_rate": 1.0,
            "sft_tokens": 1000,
            "rl_tokens": 2000.0,
        }

    lines = table_lines([row(0, 0.25, 0.5), row(1, 0.5, 0.75), row(2, None, None)])
    assert "| autogen_calc | AutoGen | 0 | 25.0% | 50.0% | +25.0 pts | 8.0 | 100% |" in lines[2]
    assert "no validation" in lines[4]
    assert lines[5].startswith("| **autogen_calc** | mean of 2 | | 37.5% | 62.5% | **+25.0 pts**")
