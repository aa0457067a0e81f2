"""Trainer.dev / Trainer.fit with Baseline, datasets, bad input, and worker processes."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

import voltrl as vl
from voltrl.runtime.dataset import load_tasks
from voltrl.store.sql import SQLStore

ROWS = [{"a": i, "b": i + 1} for i in range(6)]


class Adder(vl.LitAgent):
    """Reward 1 when the sum is even: a deterministic, LLM-free agent."""

    async def rollout(self, task, resources):
        return float((task["a"] + task["b"]) % 2 == 0)


@vl.rollout
def sync_agent(task, resources):
    vl.emit_reward(0.5)
    return None


def test_dev_runs_every_task_once_and_reports_statistics(tmp_path: Path):
    trainer = vl.Trainer(n_runners=2, inline=True, run_dir=tmp_path, name="d", progress=False)
    result = trainer.dev(Adder(), ROWS)
    assert len(result.rollouts) == 6
    assert {r.mode for r in result.rollouts} == {"dev"}
    assert result.stats.succeeded == 6 and result.stats.reward_mean == 0.0
    assert sorted(r.task.task_id for r in result.rollouts) == [f"dev-{i}" for i in range(6)]
    lines = (tmp_path / "d" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["dev/succeeded"] == 6


def test_fit_with_baseline_evaluates_train_and_val_and_keeps_the_store(tmp_path: Path):
    trainer = vl.Trainer(
        vl.Baseline(n_repeats=2),
        n_runners=1,
        inline=True,
        run_dir=tmp_path,
        name="f",
        progress=False,
    )
    result = trainer.fit(sync_agent, ROWS, val_dataset=ROWS[:2])
    assert result.by_mode["train"].rollouts == 12 and result.by_mode["val"].rollouts == 4
    assert result.stats.reward_mean == 0.5
    metrics = {k for rec in result.metrics for k in rec}
    assert {"train/reward_mean", "val/reward_mean"} <= metrics

    async def reopen():
        store = SQLStore(tmp_path / "f" / "store.sqlite")
        try:
            [run] = await store.list_runs()
            return run, await store.query_rollouts(run_id=run.run_id)
        finally:
            await store.close()

    import asyncio

    run, stored = asyncio.run(reopen())
    assert run.name == "f" and run.kind == "fit" and len(stored) == 16


def test_datasets_load_from_jsonl_json_parquet_and_indexables(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    js = tmp_path / "d.json"
    js.write_text(json.dumps(ROWS))
    pqf = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), pqf)

    class Indexable:
        def __len__(self):
            return len(ROWS)

        def __getitem__(self, i):
            return ROWS[i]

    for data in (jsonl, str(js), pqf, Indexable()):
        assert [t.input for t in load_tasks(data)] == ROWS


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"a": 1}, "oops"], "row 1 is a str"),
        ([{"a": {1, 2}}], "row 0 cannot be stored as JSON"),
        ([{"a": float("nan")}], "row 0 cannot be stored as JSON"),
        ([{1: "x"}], "row 0 has non-string keys"),
    ],
)
def test_bad_dataset_rows_raise_a_typed_error_before_anything_is_stored(tmp_path, rows, message):
    trainer = vl.Trainer(n_runners=1, inline=True, run_dir=tmp_path, name="bad", progress=False)
    with pytest.raises(vl.DatasetError, match=message):
        trainer.dev(Adder(), rows)
    assert not (tmp_path / "bad").exists()


def test_missing_dataset_file_is_a_typed_error(tmp_path):
    with pytest.raises(vl.DatasetError, match="does not exist"):
        load_tasks(tmp_path / "nope.jsonl")


def test_bad_results_and_unknown_resources_fail_their_rollout_with_a_clear_error(tmp_path):
    @vl.rollout
    def agent(task, resources):
        if task["kind"] == "junk":
            return {"reward": 1}
        if task["kind"] == "resource":
            return resources["judge"]
        return 1.0

    rows = [{"kind": "junk"}, {"kind": "resource"}, {"kind": "ok"}]
    trainer = vl.Trainer(
        n_runners=1,
        inline=True,
        run_dir=tmp_path,
        max_attempts=1,
        progress=False,
        resources={"main_llm": vl.LLM(endpoint="http://127.0.0.1:1/v1", model="m")},
    )
    result = trainer.dev(agent, rows)
    by_kind = {r.task.input["kind"]: r for r in result.rollouts}
    junk, res = by_kind["junk"], by_kind["resource"]
    assert junk.status == "failed" and "InvalidRolloutResultError" in junk.error
    assert junk.rollout_id in junk.error
    assert res.status == "failed" and "unknown resource 'judge'" in res.error
    assert res.rollout_id in res.error
    assert by_kind["ok"].status == "succeeded"


def parse_answer(task):
    raise ValueError(f"no answer in {task['kind']!r}")


@vl.rollout
def sometimes_failing(task, resources):
    if task["kind"] == "junk":
        return {"reward": 1}
    if task["kind"] == "ok":
        return 1.0
    return parse_answer(task)


def test_first_occurrence_of_each_error_is_printed_with_the_agents_frames_and_summarized(
    tmp_path, capsys
):
    rows = [{"kind": "raise"}, {"kind": "junk"}, {"kind": "raise"}, {"kind": "ok"}]
    trainer = vl.Trainer(n_runners=1, inline=True, run_dir=tmp_path, name="e", progress=False)
    result = trainer.dev(sometimes_failing, rows)
    assert result.stats.failed == 3
    out = capsys.readouterr().out
    first, summary = out.split("failures:")
    assert first.count("ValueError: no answer in 'raise'") == 1  # its first occurrence only
    assert "InvalidRolloutResultError" in first
    assert f'{__file__}", line' in first and "in parse_answer" in first  # the agent's frames
    assert "runner.py" not in first and "asyncio" not in first  # not voltrl's or asyncio's
    assert 'task dev-1 {"kind": "junk"}' in first  # which task failed
    assert 'task dev-0 {"kind": "raise"}' in first or 'task dev-2 {"kind": "raise"}' in first
    raised = [r for r in result.rollouts if r.task.input["kind"] == "raise"]
    assert "3 of 4 rollouts failed" in summary
    assert "2x ValueError: no answer in 'raise'" in summary
    assert any(r.rollout_id in summary for r in raised)  # an example rollout
    assert "1x InvalidRolloutResultError" in summary


def test_dev_does_not_retry_agent_errors(tmp_path):
    trainer = vl.Trainer(n_runners=1, inline=True, run_dir=tmp_path, max_attempts=3, progress=False)
    result = trainer.dev(sometimes_failing, [{"kind": "raise"}, {"kind": "ok"}])
    assert [r.attempt_count for r in result.rollouts] == [1, 1]
    assert [r.retry_agent_errors for r in result.rollouts] == [False, False]


def test_a_run_whose_rollouts_all_fail_stops_with_a_typed_error_after_the_summary(tmp_path, capsys):
    trainer = vl.Trainer(n_runners=1, inline=True, run_dir=tmp_path, name="f", progress=False)
    with pytest.raises(vl.TooManyFailuresError, match="all 2 rollouts failed"):
        trainer.fit(sometimes_failing, [{"kind": "raise"}] * 2, val_dataset=[{"kind": "ok"}])
    out = capsys.readouterr().out
    assert "ValueError: no answer in 'raise'" in out and "failures:" in out


def test_the_failure_limit_is_a_rate_and_none_turns_it_off(tmp_path):
    rows = [{"kind": "raise"}, {"kind": "ok"}]
    strict = vl.Trainer(inline=True, run_dir=tmp_path, stop_at_failure_rate=0.5, progress=False)
    with pytest.raises(vl.TooManyFailuresError, match="1 of 2 rollouts failed"):
        strict.dev(sometimes_failing, rows)
    never = vl.Trainer(inline=True, run_dir=tmp_path, stop_at_failure_rate=None, progress=False)
    assert never.dev(sometimes_failing, [{"kind": "raise"}]).stats.failed == 1
    with pytest.raises(ValueError, match="stop_at_failure_rate"):
        vl.Trainer(stop_at_failure_rate=0.0)


@pytest.mark.slow
def test_fit_runs_workers_as_processes(tmp_path: Path):
    trainer = vl.Trainer(n_runners=2, run_dir=tmp_path, name="p", progress=False)
    result = trainer.dev(Adder(), ROWS)
    assert result.stats.succeeded == 6
    attempts_by_worker = {r.final_attempt_id for r in result.rollouts}
    assert len(attempts_by_worker) == 6


class Marker(vl.LitAgent):
    """Writes 'start <pid>' when a rollout starts; sleeps on its first attempt so the test
    can kill the worker mid-rollout; writes 'done' when it finishes."""

    def __init__(self, log: str) -> None:
        self.log = log

    async def rollout(self, task, resources, ctx):
        import asyncio

        with open(self.log, "a") as f:
            f.write(f"start {os.getpid()} {ctx.attempt_id}\n")
        first = Path(self.log).read_text().count("start") == 1
        if first:
            await asyncio.sleep(3600)
        with open(self.log, "a") as f:
            f.write(f"done {ctx.attempt_id}\n")
        return 1.0


@pytest.mark.slow
def test_a_worker_killed_mid_rollout_is_replaced_and_the_task_completes_exactly_once(tmp_path):
    log = tmp_path / "events.log"
    log.touch()
    trainer = vl.Trainer(n_runners=1, run_dir=tmp_path, name="k", lease_s=1.0, progress=False)

    import threading

    def killer():
        deadline = time.time() + 60
        while time.time() < deadline:
            for line in log.read_text().splitlines():
                if line.startswith("start"):
                    os.kill(int(line.split()[1]), signal.SIGKILL)
                    return
            time.sleep(0.05)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    result = trainer.dev(Marker(str(log)), [{"x": 1}])
    t.join()
    [r] = result.rollouts
    assert r.status == "succeeded"
    lines = log.read_text().splitlines()
    assert sum(line.startswith("start") for line in lines) == 2
    assert [line for line in lines if line.startswith("done")] == [f"done {r.final_attempt_id}"]

    import asyncio

    async def attempts():
        store = SQLStore(tmp_path / "k" / "store.sqlite")
        try:
            return await store.get_attempts(r.rollout_id)
        finally:
            await store.close()

    first, second = asyncio.run(attempts())
    assert first.status == "expired" and second.status == "succeeded"


async def test_an_error_is_printed_while_its_rollout_is_still_being_retried(tmp_path, capsys):
    """``fit`` retries an agent error; its first occurrence is printed while the next attempt
    runs, not only after the rollout's last attempt."""
    import asyncio

    printed: list[str] = []
    attempts = 0

    async def agent(task, resources):
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise ValueError("the first try fails")
        for _ in range(400):  # the second try waits to see the first one's error printed
            printed.append(capsys.readouterr().out)
            if "the first try fails" in "".join(printed):
                return 1.0
            await asyncio.sleep(0.05)
        return 0.0

    trainer = vl.Trainer(store="memory", run_dir=tmp_path, inline=True, progress=False)
    result = await trainer.fit_async(agent, [{"q": 1}])
    assert result.rewards == [1.0] and attempts == 2
