"""VERL's run set-up that needs no GPU: the per-run verl config (tasks as data files,
checkpoints and experiment name in the run directory, validation off without a validation
set), and the refusal of ``dev`` runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import voltrl as vl
from voltrl.algorithms.verl.driver import VoltTaskDataset


@pytest.fixture(scope="module")
def algo():
    return vl.VERL({"actor_rollout_ref": {"model": {"path": "/nonexistent/model"}}})


class ProbeRunConfig(vl.Algorithm):
    name = "probe"

    def __init__(self, algo: vl.VERL, with_val: bool) -> None:
        self.algo, self.with_val, self.cfg = algo, with_val, None

    async def train(self, ctx, train, val):
        self.cfg = self.algo.run_config(ctx, train, val if self.with_val else None)
        self.run_dir, self.run_name = ctx.run_dir, ctx.run.name


@vl.rollout
def noop(task: dict, llm: vl.LLM) -> float:
    return 0.0


@pytest.mark.parametrize("with_val", [True, False])
def test_run_config_points_verl_at_the_run(tmp_path, algo, with_val):
    probe = ProbeRunConfig(algo, with_val)
    rows = [{"q": i} for i in range(5)]
    vl.Trainer(probe, store="memory", inline=True, progress=False, run_dir=tmp_path).fit(
        noop, rows, val_dataset=rows[:2]
    )
    cfg = probe.cfg
    assert cfg.trainer.experiment_name == probe.run_name
    assert cfg.trainer.default_local_dir == str(probe.run_dir / "checkpoints")
    assert cfg.transfer_queue.enable is True
    train = VoltTaskDataset(cfg.data.train_files)
    assert len(train) == 5 and train[0]["data_source"] == "voltrl"
    lines = [json.loads(x) for x in Path(cfg.data.train_files).read_text().splitlines()]
    assert [row["index"] for row in lines] == list(range(5))
    if with_val:
        assert len(VoltTaskDataset(cfg.data.val_files)) == 2
        assert cfg.trainer.val_before_train is True
    else:
        assert cfg.trainer.val_before_train is False and cfg.trainer.test_freq == -1


def test_dev_runs_are_refused(tmp_path, algo):
    trainer = vl.Trainer(algo, store="memory", inline=True, progress=False, run_dir=tmp_path)
    with pytest.raises(vl.VoltRLError, match="VERL only trains"):
        trainer.dev(noop, [{"q": 1}])
