"""A rollout whose only rewards are addressed to agents (``emit_reward(v, agents=...)``) trains
those agents' calls through LocalRL; calls no reward addresses are left out and counted."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import voltrl as vl
from voltrl.algorithms.local.update import PolicyUpdateConfig
from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer


@vl.rollout
async def two_teams_and_a_referee(task: dict, llm: vl.LLM) -> None:
    """A game of two teams judged by a referee; only the teams are rewarded, by team."""
    from voltrl.adapters.openai_client import async_openai

    for name in ("red-1", "blue-1", "referee"):
        client = async_openai(llm, agent_name=name, max_retries=0)
        await client.chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": f"{name}: say {task['letter']}."}],
            **llm.sampling_parameters,
        )
    vl.emit_reward(1.0, agents="red.*")  # red won
    vl.emit_reward(0.0, agents="blue.*")


def test_a_rollout_rewarded_only_per_team_trains_each_teams_calls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    tok = build_tiny_tokenizer()
    algo = vl.LocalRL(
        build_tiny_model(tok, seed=0),
        tokenizer=tok,
        schedule={"steps": 1, "tasks_per_step": 2, "group_size": 2},
        validation={"every": 0},
        checkpoints={"every": 0},
        sampling={"temperature": 1.0, "max_tokens": 4},
        update=PolicyUpdateConfig(lr=1e-3, micro_batch_size=8),
    )
    trainer = vl.Trainer(algo, n_runners=1, inline=True, run_dir=tmp_path, name="teams")
    with caplog.at_level(logging.WARNING, logger="voltrl.trajectory"):
        result = trainer.fit(two_teams_and_a_referee, [{"letter": c} for c in "ab"])
    assert result.by_mode["train"].rollouts == 4 and result.by_mode["train"].failed == 0
    assert all(r.reward is None for r in result.rollouts)  # no reward of the whole rollout
    (step,) = [m for m in result.metrics if "update/loss" in m]
    assert step["batch/rows"] == 8  # red's and blue's call of each of the 4 rollouts
    assert step["batch/rollouts_with_rows"] == 4
    assert step["batch/dropped/no_agent_reward"] == 4  # the referee's calls
    assert "batch/dropped/no_reward" not in step
    assert step["update/adv_tokens"] > 0  # red 1 vs blue 0 within each task's group
    assert "no trainable rows" not in capsys.readouterr().out
    warnings = [r.getMessage() for r in caplog.records if r.name == "voltrl.trajectory"]
    assert len(warnings) == 1 and "['referee']" in warnings[0]
