"""Runs you can tell apart: unique names (a taken name gets a new one, said on the console,
unless the run resumes), run ids on every metrics line, a status per run (failed setups
included), ``voltrl runs`` with status, full names and filters, and every LocalRL run's
``reward_curve.png`` and the ``train.yaml`` that runs it again."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fake_openai_backend import FakeBackend
from helpers import TESTS

import voltrl as vl
from voltrl.algorithms.local.update import PolicyUpdateConfig
from voltrl.cli import build_from_config
from voltrl.store.sql import SQLStore

AGENTS = TESTS / "serving_agents.py"


def runs_in(path: Path) -> list[vl.Run]:
    async def read() -> list[vl.Run]:
        store = SQLStore(path)
        try:
            return await store.list_runs()
        finally:
            await store.close()

    return asyncio.run(read())


def voltrl_runs(run_dir: Path, *args: str) -> str:
    env = {**os.environ, "COLUMNS": "80"}
    out = subprocess.run(
        [sys.executable, "-m", "voltrl.cli", "runs", "--run-dir", str(run_dir), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


async def test_a_taken_name_gets_a_new_one_and_metrics_lines_carry_the_run_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from serving_agents import calls_once

    async with FakeBackend() as backend:
        llm = vl.LLM(endpoint=backend.url, model="m")
        options = {"run_dir": tmp_path, "name": "exp", "inline": True, "progress": False}
        first = await vl.Trainer(resources={"main_llm": llm}, **options).dev_async(
            calls_once, [{"q": 1}]
        )
        second = await vl.Trainer(resources={"main_llm": llm}, **options).dev_async(
            calls_once, [{"q": 1}]
        )
    assert (first.run.name, second.run.name) == ("exp", "exp-2")
    assert first.run.status == second.run.status == "finished"  # the result's run is final
    assert second.run_dir == tmp_path / "exp-2" and first.run.run_id != second.run.run_id
    assert "run 'exp' exists" in capsys.readouterr().out
    for result in (first, second):
        lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["run_id"] for line in lines] == [result.run.run_id]
        store = SQLStore(result.run_dir / "store.sqlite")
        assert [r.status for r in await store.list_runs()] == ["finished"]
        await store.close()


@pytest.mark.slow
def test_a_run_whose_setup_failed_is_marked_failed(tmp_path: Path) -> None:
    trainer = vl.Trainer(vl.LocalRL(str(tmp_path / "no-such-model")), run_dir=tmp_path, name="bad")
    with pytest.raises(Exception, match="no-such-model"):
        trainer.fit(lambda task, llm: 1.0, [{"q": 1}])
    [run] = runs_in(tmp_path / "bad" / "store.sqlite")
    assert run.status == "failed" and "no-such-model" in (run.error or "")
    wide = voltrl_runs(tmp_path, "--status", "failed", "--wide")
    assert "failed" in wide and run.run_id in wide and "no-such-model" in wide
    assert "no runs found" in voltrl_runs(tmp_path, "--status", "finished")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_local_rl_run_leaves_its_curve_and_the_config_that_runs_it_again(tmp_path: Path) -> None:
    from serving_agents import calls_once

    name = "a-rather-long-run-name-that-does-not-fit-in-a-narrow-column-of-eighty"
    algo = vl.LocalRL(
        "tiny",
        schedule={"steps": 2, "tasks_per_step": 2, "group_size": 2},
        sampling={"temperature": 1.0, "max_tokens": 4},
        update=PolicyUpdateConfig(lr=1e-3, micro_batch_size=4, entropy_coef=0.01),
    )
    trainer = vl.Trainer(algo, run_dir=tmp_path, name=name, progress=False)
    result = trainer.fit(calls_once, [{"q": i} for i in range(4)])
    assert (result.run_dir / "reward_curve.png").stat().st_size > 0

    config = yaml.safe_load((result.run_dir / "train.yaml").read_text())
    assert config["agent"] == f"{AGENTS}:calls_once"
    assert [json.loads(x) for x in Path(config["data"]["train"]).read_text().splitlines()] == [
        {"q": i} for i in range(4)
    ]
    again, agent, train, val = build_from_config(config)
    assert again.algorithm.config() == algo.config() and val is None
    assert agent.fn.__code__.co_filename == calls_once.fn.__code__.co_filename
    assert agent.fn.__name__ == "calls_once" and train == config["data"]["train"]
    assert again.name == name and again.runner_config == trainer.runner_config

    listed = voltrl_runs(tmp_path)  # at 80 columns: the long name folds, whole
    rows = [line.split("│")[1:3] for line in listed.splitlines() if line.startswith("│")]
    assert "".join(cell.strip() for cell, _ in rows) == name
    assert rows[0][1].strip() == "finished"
    assert name not in voltrl_runs(tmp_path, "--kind", "dev")


@pytest.mark.slow
def test_cancelled_rollouts_are_counted_in_voltrl_runs_and_voltrl_show(tmp_path: Path) -> None:
    """A run stopped early: one rollout succeeded, one failed, two cancelled."""
    from voltrl.types import AttemptResult, Run, Task

    async def record() -> None:
        store = SQLStore(tmp_path / "stopped" / "store.sqlite")
        try:
            run = await store.add_run(Run(name="stopped", kind="dev", status="interrupted"))
            tasks = [Task(input={"q": i}) for i in range(4)]
            rollouts = await store.enqueue(
                tasks, mode="dev", run_id=run.run_id, retry_agent_errors=False
            )
            for result in (
                AttemptResult(status="succeeded", reward=1.0),
                AttemptResult(status="failed", error="ValueError: x", agent_error=True),
            ):
                claim = await store.claim("w")
                assert claim is not None
                await store.complete(claim.attempt.attempt_id, result)
            for rollout in rollouts[2:]:
                await store.cancel(rollout.rollout_id)
        finally:
            await store.close()

    (tmp_path / "stopped").mkdir()
    asyncio.run(record())
    listed = voltrl_runs(tmp_path, "--wide")  # not wrapped
    assert "4 (1 failed, 2 cancelled)" in listed, listed
    assert "1.000 (1/4) the dev rollouts" in listed, listed  # what the mean leaves out, beside
    out = subprocess.run(
        [sys.executable, "-m", "voltrl.cli", "show", "stopped", "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"},
        timeout=120,
    )
    header = next(x for x in out.stdout.splitlines() if "┃ rollouts ┃" in x)
    assert [c.strip() for c in header.split("┃")[2:5]] == ["rollouts", "failed", "cancelled"]
    row = next(x for x in out.stdout.splitlines() if x.startswith("│ dev"))
    assert [c.strip() for c in row.split("│")[2:6]] == ["4", "1", "2", "1.000"], out.stdout
    result = "result: reward 1.000 over the dev rollouts (1 of 4 rewarded: 1 failed, 2 cancelled)"
    assert result in out.stdout
