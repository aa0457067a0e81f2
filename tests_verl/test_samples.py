"""Every sample's ``train_verl.py`` builds its VERL algorithm: verl's config composes and
validates with the sample's keys and preset (the GPU run itself is not possible here). The
scripts import their agents only in ``main``, so the agent frameworks are not needed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import voltrl as vl

SAMPLES = Path(__file__).resolve().parents[1] / "samples"
SCRIPTS = sorted(SAMPLES.glob("*/train_verl.py"))


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"train_verl_{path.parent.name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_training_samples_have_a_script():
    expected = {
        "calculator",
        "calc_mcp",
        "sql_agent",
        "autogen_calc",
        "agent_service",
        "tau2_airline",
        "werewolf",
    }
    assert {p.parent.name for p in SCRIPTS} == expected


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.parent.name)
def test_train_verl_builds_its_algorithm(path):
    module = _load(path)
    args = module.parse(["--steps", "3", "trainer.save_freq=1"])
    algo = module.algorithm(args)
    assert isinstance(algo, vl.VERL)
    cfg = algo.verl_config
    assert cfg.trainer.total_training_steps == 3 and cfg.trainer.save_freq == 1
    assert cfg.actor_rollout_ref.model.path == args.model
    assert algo.trajectory.max_response_length == cfg.actor_rollout_ref.rollout.response_length
    assert algo.sampling["max_tokens"] <= cfg.actor_rollout_ref.rollout.response_length


def test_calculator_script_with_the_8gpu_preset():
    module = _load(SAMPLES / "calculator" / "train_verl.py")
    algo = module.algorithm(module.parse(["--preset", "8gpu"]))
    assert algo.verl_config.trainer.n_gpus_per_node == 8
