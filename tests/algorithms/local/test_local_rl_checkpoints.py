"""A long run's checkpoints on disk: the latest ``keep_checkpoints`` are kept, and a disk that
fills during a save fails the run cleanly, with the last complete checkpoint intact, named,
and resumable. LocalRL on the tiny model through ``Trainer.fit``, a real disk write failing
with ``ENOSPC`` where the test says."""

from __future__ import annotations

import asyncio
import errno
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from local_rl_setup import make_algorithm
from rl_agents import ROWS, two_turn_agent

import voltrl as vl
import voltrl.algorithms.local.checkpoints as checkpoints_module
import voltrl.algorithms.local.token_rows as rows_module
import voltrl.algorithms.local.update as update_module
from voltrl.errors import VoltRLError


def kept(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def fit(run_dir: Path, name: str, **options: Any) -> vl.RunResult:
    checkpoints = {"every": 1, **options.pop("checkpoints", {})}
    algo = make_algorithm(validation={"every": 0}, checkpoints=checkpoints, **options)
    trainer = vl.Trainer(algo, n_runners=1, inline=True, run_dir=run_dir, name=name, progress=False)
    return trainer.fit(two_turn_agent, ROWS)


@pytest.mark.slow
def test_only_the_latest_keep_checkpoints_stay_on_disk(tmp_path: Path) -> None:
    fit(tmp_path, "three", schedule={"steps": 4}, checkpoints={"keep": 2})
    assert kept(tmp_path / "three") == ["step_00000003", "step_00000004"]
    fit(tmp_path, "all", schedule={"steps": 2}, checkpoints={"keep": None})  # None keeps them all
    assert kept(tmp_path / "all") == ["step_00000001", "step_00000002"]
    with pytest.raises(ValueError, match="keep"):
        make_algorithm(checkpoints={"keep": 0})


@pytest.mark.slow
def test_a_full_disk_during_a_save_fails_the_run_with_the_last_checkpoint_named_and_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    write = checkpoints_module.durable_save

    def full_from_step_3(obj: Any, path: Path) -> None:
        if path.parent.name == ".tmp-step_00000003" and path.name == "optimizer.pt":
            path.write_bytes(b"half a file")  # the disk filled while this was written
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        write(obj, path)

    monkeypatch.setattr(checkpoints_module, "durable_save", full_from_step_3)
    last = tmp_path / "run" / "checkpoints" / "step_00000002"
    with pytest.raises(VoltRLError) as failed:
        fit(tmp_path, "run", schedule={"steps": 4}, checkpoints={"keep": 2})
    message = str(failed.value)
    assert "cannot save the checkpoint of step 3" in message and "the disk is full" in message
    assert f"the last complete checkpoint is {last}" in message
    assert kept(tmp_path / "run") == ["step_00000001", "step_00000002"]  # no half one left
    out = capsys.readouterr().out
    assert "no checkpoint saved" in out  # the save on the way out failed too, and said so

    monkeypatch.undo()  # space freed: the run resumes from step 2 and finishes
    result = fit(tmp_path, "run", schedule={"steps": 4}, checkpoints={"keep": 2, "resume": True})
    steps = [m["step"] for m in result.metrics if "update/loss" in m]
    assert steps == [3, 4]
    assert kept(tmp_path / "run") == ["step_00000003", "step_00000004"]


@pytest.mark.slow
def test_a_run_another_process_trains_is_refused_until_that_process_is_gone(
    tmp_path: Path,
) -> None:
    """A second process resuming a run that is still training would write the same
    checkpoints: refused, naming the holder; once the holder is killed (``kill -9``: the
    operating system drops its lock), the resume goes ahead."""
    (tmp_path / "busy").mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, pathlib; from voltrl.runtime.run_dir import locked_run_dir\n"
            "with locked_run_dir(pathlib.Path(sys.argv[1])):\n"
            "    print('locked', flush=True); sys.stdin.read()",
            str(tmp_path / "busy"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        with pytest.raises(VoltRLError, match=f"in use by another process \\(pid {holder.pid}\\)"):
            fit(tmp_path, "busy", schedule={"steps": 1}, checkpoints={"resume": True})
    finally:
        holder.kill()
        holder.wait()
    result = fit(tmp_path, "busy", schedule={"steps": 1}, checkpoints={"resume": True})
    assert result.run.status == "finished"


@pytest.mark.slow
async def test_a_run_stopped_during_an_update_ends_it_at_once_and_keeps_the_previous_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C (here: the run's task cancelled) while step 2's update runs a long forward and
    backward pass: the update ends when that pass does, before its optimizer step, not after
    the 7 passes left; the run keeps step 1's checkpoint and metrics line, nothing of step 2,
    and resumes from step 1."""
    passes: list[int] = []  # the update (its step) of each micro-batch's pass
    in_second = threading.Event()
    logprobs = rows_module.TokenRows.logprobs

    def long_pass(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        policy = trainers[0]
        passes.append(policy.global_step + 1)
        if policy.global_step == 1 and torch.is_grad_enabled():
            in_second.set()
            policy.stop.wait(60)  # a pass that lasts until the run is stopped
        return logprobs(self, model, *args, **kwargs)

    trainers: list[Any] = []
    init = update_module.PolicyTrainer.__init__

    def kept_trainer(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        trainers.append(self)

    monkeypatch.setattr(update_module.PolicyTrainer, "__init__", kept_trainer)
    monkeypatch.setattr(rows_module.TokenRows, "logprobs", long_pass)
    # 8 rows, 8 passes an update (an entropy term runs rows of equal rewards too)
    update = {"lr": 1e-3, "micro_batch_size": 1, "entropy_coef": 0.01}
    algo = make_algorithm(
        schedule={"steps": 3}, validation={"every": 0}, checkpoints={"every": 1}, update=update
    )
    trainer = vl.Trainer(algo, n_runners=1, inline=True, run_dir=tmp_path, name="r", progress=False)
    run = asyncio.create_task(trainer.fit_async(two_turn_agent, ROWS))
    assert await asyncio.to_thread(in_second.wait, 100), "step 2's update never began"
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    training = [p for p in passes if p == 2]
    assert len(training) == 1  # the pass under way ended the update: 7 were left
    assert kept(tmp_path / "r") == ["step_00000001"]
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines if "update/loss" in x] == [1]
    monkeypatch.undo()
    resumed = make_algorithm(
        schedule={"steps": 2},
        validation={"every": 0},
        checkpoints={"every": 1, "resume": True},
        update=update,
    )
    again = vl.Trainer(
        resumed, n_runners=1, inline=True, run_dir=tmp_path, name="r", progress=False
    )
    result = await again.fit_async(two_turn_agent, ROWS)
    assert [m["step"] for m in result.metrics if "update/loss" in m] == [2]


def test_a_stop_after_an_optimizer_step_lets_the_update_finish_so_its_weights_are_a_steps() -> None:
    """With two mini-batches, a stop that arrives once the first has stepped does not end the
    update half-way (weights of no step, nothing to checkpoint): it finishes."""
    from tiny_batches import sampled_batch

    from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    batch = sampled_batch(build_tiny_model(tok, seed=0), tok)
    config = update_module.PolicyUpdateConfig(lr=1e-3, mini_batches=2, entropy_coef=0.01)
    trainer = update_module.PolicyTrainer(build_tiny_model(tok, seed=0), config)
    step = trainer._optimizer_step

    def stopped_after() -> float:
        norm = step()
        trainer.stop.set()  # the run is stopped right after the first optimizer step
        return norm

    trainer._optimizer_step = stopped_after  # type: ignore[method-assign]
    metrics = trainer.step(batch)
    assert metrics["optimizer_steps"] == 2 and trainer.global_step == 1
    assert not trainer.mid_update  # the weights are the update's, whole
    with pytest.raises(update_module.UpdateStopped):
        trainer.step(batch)  # the next update stops before it steps
    assert not trainer.mid_update and trainer.global_step == 1
