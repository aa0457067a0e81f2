"""LocalRL with ``trajectory={"audit": ...}``: an agent that returns explicit transitions whose
tokens were not sampled stops the run with ``"error"``, and is counted and warned of with
``"warn"``; an agent whose tokens are all sampled trains as before."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from drift_agents import ROWS, altered_transitions_agent, faithful_agent
from local_rl_setup import make_algorithm

import voltrl as vl
from voltrl.trajectory import build

ONE_STEP = {
    "schedule": {"steps": 1, "tasks_per_step": 2, "group_size": 2},
    "validation": {"every": 0},
    "checkpoints": {"every": 0},
}


def trainer(tmp_path: Path, name: str, audit: str) -> vl.Trainer:
    algorithm = make_algorithm(**ONE_STEP, trajectory={"mode": "trajectory", "audit": audit})
    return vl.Trainer(
        algorithm, n_runners=1, inline=True, run_dir=tmp_path, name=name, progress=False
    )


def test_audit_error_stops_a_run_that_would_train_tokens_never_sampled(tmp_path: Path) -> None:
    said = r"rollout ro-\w+: trained-token drift: .*explicit transition 0's response is not"
    with pytest.raises(vl.TokenDriftError, match=said):
        trainer(tmp_path, "stopped", "error").fit(altered_transitions_agent, ROWS)


def test_audit_warn_trains_warns_once_and_counts_the_drift_of_every_rollout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build, "_warned_drift", set())  # none warned of yet in this process
    with caplog.at_level(logging.WARNING, logger="voltrl.trajectory"):
        result = trainer(tmp_path, "warned", "warn").fit(altered_transitions_agent, ROWS)
    warnings = [r.getMessage() for r in caplog.records if "trained-token drift" in r.getMessage()]
    assert len(warnings) == 1 and "not warned of again" in warnings[0]
    (step,) = [m for m in result.metrics if "batch/rows" in m]
    assert step["batch/trained_token_drift"] == 4


def test_audit_error_lets_an_agent_whose_tokens_were_all_sampled_train(tmp_path: Path) -> None:
    result = trainer(tmp_path, "clean", "error").fit(faithful_agent, ROWS)
    (step,) = [m for m in result.metrics if "batch/rows" in m]
    assert "batch/trained_token_drift" not in step and "batch/merge_failures" not in step
    assert step["batch/merged"] == 4  # each rollout's two calls, one row
