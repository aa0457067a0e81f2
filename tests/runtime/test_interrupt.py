"""Ctrl-C, as a terminal sends it (SIGINT to the whole process group), and SIGTERM, as a
scheduler preempting a job sends it, during ``voltrl dev`` and a LocalRL ``voltrl train``: the
run stops within seconds, its rollouts in flight are cancelled (not failed), LocalRL
checkpoints, the run is marked ``interrupted``, the command exits 130 (Ctrl-C) or 143
(SIGTERM); a second signal exits at once; ``resume`` continues an interrupted run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import TESTS, FakeBackendProcess, voltrl_here

from voltrl.store.sql import SQLStore

AGENTS = TESTS / "serving_agents.py"
EXIT_S = 240
"""How long a stopped process may take to exit before the test fails: a bound for one that
hangs, not a speed check (on a loaded machine a clean stop took over 90 s)."""


def voltrl(*args: str, cwd: Path) -> subprocess.Popen[str]:
    """``voltrl ARGS`` in a process group of its own, as a shell starts a foreground job."""
    return subprocess.Popen(
        [sys.executable, "-m", "voltrl.cli", *args],
        cwd=cwd,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def ctrl_c(proc: subprocess.Popen[str]) -> None:
    os.killpg(proc.pid, signal.SIGINT)


def sigterm(proc: subprocess.Popen[str]) -> None:
    """SIGTERM to the ``voltrl`` process alone, as ``kill`` or a container runtime sends it."""
    os.kill(proc.pid, signal.SIGTERM)


def sigterm_all(proc: subprocess.Popen[str]) -> None:
    """SIGTERM to the whole process group (its workers too), as Slurm preempts a job."""
    os.killpg(proc.pid, signal.SIGTERM)


def stored(path: Path):
    async def read():
        store = SQLStore(path)
        try:
            return await store.list_runs(), await store.query_rollouts()
        finally:
            await store.close()

    return asyncio.run(read())


@pytest.fixture
def backend() -> Iterator[str]:
    with FakeBackendProcess() as url:
        yield url


def dev_command(tmp_path: Path, url: str, slow_to_cancel: bool = False) -> list[str]:
    """``voltrl dev`` of four ``calls_then_waits`` rollouts (``slow_to_cancel``: rollouts that
    hold a clean stop until their worker's grace runs out, 12 s)."""
    tasks = tmp_path / "tasks.jsonl"
    started = tmp_path / "started"
    started.mkdir()
    row = {"started_dir": str(started), "slow_to_cancel": slow_to_cancel}
    rows = [{"i": i, **row} for i in range(4)]
    tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return [
        "dev",
        f"{AGENTS}:calls_then_waits",
        *("--data", str(tasks), "--llm-endpoint", url, "--model", "fake-model"),
        *("--n-runners", "1", "--max-concurrency", "4", "--name", "dev-run"),
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_stops_voltrl_dev_cleanly_and_marks_the_run_interrupted(
    tmp_path: Path, backend: str
) -> None:
    proc = voltrl(*dev_command(tmp_path, backend), cwd=tmp_path)
    until(lambda: len(list((tmp_path / "started").iterdir())) == 4, 120, "4 rollouts to start")
    ctrl_c(proc)
    out, _ = proc.communicate(timeout=EXIT_S)
    assert proc.returncode == 130, out
    assert "Ctrl-C: stopping the run" in out and "Traceback" not in out
    assert "exiting now" not in out  # one Ctrl-C is a clean stop, not the hard exit
    runs, rollouts = stored(tmp_path / "runs" / "dev-run" / "store.sqlite")
    assert [r.status for r in runs] == ["interrupted"], out
    assert sorted(r.status for r in rollouts) == ["cancelled"] * 4  # not failed, not left running


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_in_a_users_script_ends_it_with_one_line_not_a_traceback(
    tmp_path: Path, backend: str
) -> None:
    """A script calling ``Trainer.dev`` (or ``fit``) and catching nothing: Ctrl-C stops the run
    as in ``voltrl dev``, and the process ends as Ctrl-C ends a Python program, without the
    20 lines of ``asyncio.run``'s stack after the run's own message."""
    command = dev_command(tmp_path, backend)
    data, url = command[command.index("--data") + 1], command[command.index("--llm-endpoint") + 1]
    script = tmp_path / "train.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(TESTS)!r})\n"
        "import voltrl as vl\n"
        "from serving_agents import calls_then_waits\n"
        f"llm = vl.LLM(endpoint={url!r}, model='fake-model')\n"
        "trainer = vl.Trainer(resources={'main_llm': llm}, n_runners=1, max_concurrency=4,\n"
        "                     name='dev-run')\n"
        f"trainer.dev(calls_then_waits, {data!r})\n"
        "print('not reached')\n"
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    until(lambda: len(list((tmp_path / "started").iterdir())) == 4, 120, "4 rollouts to start")
    ctrl_c(proc)
    out, _ = proc.communicate(timeout=EXIT_S)
    assert proc.returncode == -signal.SIGINT, out  # killed by it, as Python ends on Ctrl-C
    assert "Traceback" not in out and "not reached" not in out
    assert "run 'dev-run' interrupted: runs/dev-run" in out
    assert out.rstrip().endswith("KeyboardInterrupt: the run was stopped by Ctrl-C"), out
    runs, _ = stored(tmp_path / "runs" / "dev-run" / "store.sqlite")
    assert [r.status for r in runs] == ["interrupted"], out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_second_signal_of_either_kind_exits_at_once(tmp_path: Path, backend: str) -> None:
    """The rollouts will not let go, so the clean stop the first signal begins is still
    waiting for them (for 12 s) when the second comes, a moment after its message."""
    proc = voltrl(*dev_command(tmp_path, backend, slow_to_cancel=True), cwd=tmp_path)
    until(lambda: len(list((tmp_path / "started").iterdir())) == 4, 120, "4 rollouts to start")
    sigterm(proc)
    assert proc.stdout is not None
    said = ""
    while "SIGTERM: stopping the run" not in said:  # the clean stop is under way
        line = proc.stdout.readline()
        assert line, f"voltrl dev ended before it said it was stopping:\n{said}"
        said += line
    ctrl_c(proc)
    out, _ = proc.communicate(timeout=EXIT_S)
    out = said + out
    assert proc.returncode == 130, out  # 128 + the second signal's number
    assert "exiting now" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_stops_voltrl_dev_as_ctrl_c_does_and_exits_143(
    tmp_path: Path, backend: str
) -> None:
    proc = voltrl(*dev_command(tmp_path, backend), cwd=tmp_path)
    until(lambda: len(list((tmp_path / "started").iterdir())) == 4, 120, "4 rollouts to start")
    sigterm(proc)
    out, _ = proc.communicate(timeout=EXIT_S)
    assert proc.returncode == 143, out
    assert "SIGTERM: stopping the run" in out and "terminated by SIGTERM" in out
    assert "Traceback" not in out and "exiting now" not in out
    runs, rollouts = stored(tmp_path / "runs" / "dev-run" / "store.sqlite")
    assert [r.status for r in runs] == ["interrupted"], out
    assert sorted(r.status for r in rollouts) == ["cancelled"] * 4


def stop_local_rl_training_then_resume(
    tmp_path: Path, stop, status: int, here: dict[str, Any], max_staleness: int = 0
) -> list[dict]:
    """Train LocalRL with ``voltrl train``, ``stop`` it after two steps (it must exit with
    ``status``, checkpointed and ``interrupted``), then resume it for one step more (in this
    process: ``here`` holds the test's ``capsys`` and ``monkeypatch``); returns the metrics
    records of both sessions. With ``max_staleness`` the agent holds each of the
    first weights' steps until the next step has called the model, so steps overlap on any
    machine (``calls_twice_across_an_update``)."""
    tasks = tmp_path / "tasks.jsonl"
    meet = tmp_path / "meet"
    meet.mkdir()
    tasks.write_text("".join(f'{{"question": "q{i}", "meet_dir": "{meet}"}}\n' for i in range(4)))
    agent = "calls_twice_across_an_update" if max_staleness else "calls_twice_slowly"
    config = {
        "agent": f"{AGENTS}:{agent}",
        "data": {"train": str(tasks)},
        "algorithm": {
            "name": "local_rl",
            "model": "tiny",
            "schedule": {
                "steps": 1000,
                "tasks_per_step": 2,
                "group_size": 2,
                "max_staleness": max_staleness,
            },
            "sampling": {"temperature": 1.0, "max_tokens": 4},
            "update": {"lr": 1e-3, "micro_batch_size": 4, "entropy_coef": 0.01},
        },
        # every rollout of the steps queued ahead in flight at once: 4 a step, 1 + k steps
        "trainer": {
            "name": "train-run",
            "run_dir": str(tmp_path / "runs"),
            "max_concurrency": 4 * (1 + max_staleness),
        },
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "runs" / "train-run"
    proc = voltrl("train", str(path), cwd=tmp_path)
    metrics = run_dir / "metrics.jsonl"
    until(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, 300, "two steps")
    stop(proc)
    out, _ = proc.communicate(timeout=EXIT_S)
    assert proc.returncode == status, out
    assert "interrupted: checkpoint of step" in out and "exiting now" not in out
    runs, rollouts = stored(run_dir / "store.sqlite")
    assert [r.status for r in runs] == ["interrupted"], out
    # the rollouts in flight were cancelled before the gateway closed, not failed by it
    assert [r.status for r in rollouts if r.status not in ("succeeded", "cancelled")] == []
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    assert checkpoints, out
    done = int(checkpoints[-1].name.removeprefix("step_"))
    assert done >= 2
    assert (run_dir / "reward_curve.png").exists() and (run_dir / "train.yaml").exists()

    config["algorithm"]["schedule"]["steps"] = done + 1
    config["algorithm"]["checkpoints"] = {"resume": True}
    path.write_text(yaml.safe_dump(config))
    resumed = voltrl_here("train", str(path), cwd=tmp_path, **here)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    runs, _ = stored(run_dir / "store.sqlite")
    assert [r.status for r in runs] == ["finished"]  # the same run, continued
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records[-1]["step"] == done + 1
    assert {r["run_id"] for r in records} == {runs[0].run_id}
    return records


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_during_local_rl_training_checkpoints_and_resume_continues(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kill PID``: SIGTERM reaches the trainer, whose workers go on claiming until the run
    cancels its rollouts. (Ctrl-C takes the same path: its first signal cancels the run, as
    the dev tests above show.)"""
    here = {"capsys": capsys, "monkeypatch": monkeypatch}
    stop_local_rl_training_then_resume(tmp_path, sigterm, 143, here)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_while_steps_are_queued_ahead_resumes_without_training_a_rollout_twice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``max_staleness=2``: when Ctrl-C lands, the next steps' rollouts are queued or running.
    They are cancelled or left untrained; the resumed run queues its steps again, so every
    step trained rollouts of its own resources version, none of them another step's."""
    here = {"capsys": capsys, "monkeypatch": monkeypatch}
    records = stop_local_rl_training_then_resume(tmp_path, ctrl_c, 130, here, max_staleness=2)
    steps = [r for r in records if "update_s" in r]
    versions = [r["resources_version"] for r in steps]
    assert len(set(versions)) == len(versions), steps  # no batch trained twice
    assert all(r["staleness/max"] <= 2 and r["dropped/stale"] == 0 for r in steps)
    second = next(r for r in steps if r["step"] == 2)
    assert second["staleness/max"] == 1  # its calls began before the first update
    _, rollouts = stored(tmp_path / "runs" / "train-run" / "store.sqlite")
    trained = [r for r in rollouts if r.resources_version in versions]
    assert len(trained) == 4 * len(steps)  # each step's own four, no more
    assert all(r.status == "succeeded" for r in trained)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_to_the_process_group_stops_the_workers_and_the_run(
    tmp_path: Path, backend: str
) -> None:
    """A preempted job: SIGTERM reaches the trainer and its workers at once."""
    proc = voltrl(*dev_command(tmp_path, backend), cwd=tmp_path)
    until(lambda: len(list((tmp_path / "started").iterdir())) == 4, 120, "4 rollouts to start")
    sigterm_all(proc)
    out, _ = proc.communicate(timeout=EXIT_S)
    assert proc.returncode == 143, out
    runs, rollouts = stored(tmp_path / "runs" / "dev-run" / "store.sqlite")
    assert [r.status for r in runs] == ["interrupted"], out
    assert sorted(r.status for r in rollouts) == ["cancelled"] * 4
