"""verl's config composes with our presets, dicts, YAML files and overrides, and is validated
by verl's own checks; the version gate refuses unsupported verl versions."""

from __future__ import annotations

import pytest

from voltrl.algorithms.verl.config import PRESETS, compose_config
from voltrl.algorithms.verl.version import VerlUnavailableError, check_version, require_verl


def test_supported_versions():
    assert require_verl() == "0.9.1"
    check_version("0.9.0")
    check_version("0.9.1rc1")
    for bad in ("0.8.5", "0.10.0", "1.0.0"):
        with pytest.raises(VerlUnavailableError, match=r"voltrl\[verl\]"):
            check_version(bad)


def test_composed_config_is_wired_for_voltrl(composed):
    cfg, ours = composed
    assert cfg.trainer.use_v1 and cfg.trainer.v1.trainer_mode == "sync"
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.actor_rollout_ref.rollout.calculate_log_probs is True
    assert cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class == (
        "voltrl.algorithms.verl.driver.VoltAgentLoopManager"
    )
    assert cfg.data.custom_cls.name == "VoltTaskDataset"
    # the preset's offload and micro-batch settings landed in verl's keys
    assert cfg.actor_rollout_ref.actor.fsdp_config.param_offload is True
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 2
    vllm = cfg.actor_rollout_ref.rollout.engine_kwargs.vllm
    assert vllm.enable_auto_tool_choice and vllm.tool_call_parser == "hermes"
    traj = ours.trajectory_config(cfg)
    assert traj.max_prompt_length == cfg.data.max_prompt_length == 1024
    assert traj.max_response_length == cfg.actor_rollout_ref.rollout.response_length
    assert traj.length_policy == "drop"


def test_dict_yaml_and_overrides_compose_in_order(tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text(
        "actor_rollout_ref:\n  actor:\n    optim:\n      lr: 2.0e-6\n"
        "trainer:\n  total_training_steps: 7\n"
        "  logger: [console, tensorboard]\n"
        "voltrl:\n  rollout_weighting: true\n  trajectory:\n    mode: trajectory\n"
    )
    cfg, ours = compose_config(
        path,
        [
            "trainer.total_training_steps=9",
            "voltrl.rounding=pad",
            "+actor_rollout_ref.rollout.engine_kwargs.vllm.max_num_seqs=64",
        ],
        preset="8gpu",
    )
    assert cfg.actor_rollout_ref.actor.optim.lr == 2e-6
    assert cfg.trainer.total_training_steps == 9  # overrides come last
    assert cfg.trainer.n_gpus_per_node == 8
    assert list(cfg.trainer.logger) == ["console", "tensorboard"]
    assert ours.rollout_weighting and ours.rounding == "pad"
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.max_num_seqs == 64
    assert ours.trajectory_config(cfg).mode == "trajectory"
    assert set(PRESETS) == {"1gpu-40gb", "1gpu-80gb", "8gpu"}


@pytest.mark.parametrize(
    ("config", "overrides", "match"),
    [
        ({"trainer": {"no_such_key": 1}}, [], "no_such_key"),
        ({}, ["actor_rollout_ref.actor.no_such=1"], "no_such"),
        ({"trainer": {"v1": {"trainer_mode": "separate_async"}}}, [], "trainer_mode"),
        # verl's own check: train_batch_size * n must divide over the GPUs
        ({"data": {"train_batch_size": 3}, "actor_rollout_ref": {"rollout": {"n": 1}}}, [], "verl"),
    ],
)
def test_bad_configs_fail_before_anything_starts(config, overrides, match):
    with pytest.raises(ValueError, match=match):
        compose_config(config, overrides, preset="8gpu")


def test_unknown_preset_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="unknown preset"):
        compose_config(None, preset="tpu")
    with pytest.raises(FileNotFoundError):
        compose_config(tmp_path / "missing.yaml")
