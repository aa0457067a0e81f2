"""A long run's checkpoints on disk: the latest ``keep_checkpoints`` are kept, and a disk that
fills during a save fails the run cleanly, with the last complete checkpoint intact, named,
and resumable. LocalRL on the tiny model through ``Trainer.fit``, a real disk write failing
with ``ENOSPC`` where the test says."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rl_agents import ROWS, two_turn_agent
from test_local_rl import make_algorithm

import voltrl as vl
import voltrl.algorithms.local.update as update_module
from voltrl.errors import VoltRLError


def kept(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def fit(run_dir: Path, name: str, **options: Any) -> vl.RunResult:
    algo = make_algorithm(val_every=0, checkpoint_every=1, **options)
    trainer = vl.Trainer(algo, n_runners=1, inline=True, run_dir=run_dir, name=name, progress=False)
    return trainer.fit(two_turn_agent, ROWS)


@pytest.mark.slow
def test_only_the_latest_keep_checkpoints_stay_on_disk(tmp_path: Path) -> None:
    fit(tmp_path, "three", steps=4, keep_checkpoints=2)
    assert kept(tmp_path / "three") == ["step_00000003", "step_00000004"]
    fit(tmp_path, "all", steps=2, keep_checkpoints=None)  # None keeps them all
    assert kept(tmp_path / "all") == ["step_00000001", "step_00000002"]
    with pytest.raises(ValueError, match="keep_checkpoints"):
        make_algorithm(keep_checkpoints=0)


@pytest.mark.slow
def test_a_full_disk_during_a_save_fails_the_run_with_the_last_checkpoint_named_and_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    write = update_module.durable_save

    def full_from_step_3(obj: Any, path: Path) -> None:
        if path.parent.name == ".tmp-step_00000003" and path.name == "optimizer.pt":
            path.write_bytes(b"half a file")  # the disk filled while this was written
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        write(obj, path)

    monkeypatch.setattr(update_module, "durable_save", full_from_step_3)
    last = tmp_path / "run" / "checkpoints" / "step_00000002"
    with pytest.raises(VoltRLError) as failed:
        fit(tmp_path, "run", steps=4, keep_checkpoints=2)
    message = str(failed.value)
    assert "cannot save the checkpoint of step 3" in message and "the disk is full" in message
    assert f"the last complete checkpoint is {last}" in message
    assert kept(tmp_path / "run") == ["step_00000001", "step_00000002"]  # no half one left
    out = capsys.readouterr().out
    assert "no checkpoint saved" in out  # the save on the way out failed too, and said so

    monkeypatch.undo()  # space freed: the run resumes from step 2 and finishes
    result = fit(tmp_path, "run", steps=4, keep_checkpoints=2, resume=True)
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
            fit(tmp_path, "busy", steps=1, resume=True)
    finally:
        holder.kill()
        holder.wait()
    result = fit(tmp_path, "busy", steps=1, resume=True)
    assert result.run.status == "finished"
