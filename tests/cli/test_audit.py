"""``voltrl audit RUN`` on runs a real LocalRL ``fit`` recorded on the tiny model: an agent
that sends its answers back as they came (no drift), one that strips them (every second call
diverges, named with its exact position), one that trains altered tokens (exit status 1)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from drift_agents import ROWS, altered_transitions_agent, faithful_agent, stripping_agent
from local_rl_setup import make_algorithm, stored_async

import voltrl as vl
from voltrl.cli.main import main
from voltrl.types import LLMCall

ONE_STEP = {
    "schedule": {"steps": 1, "tasks_per_step": 2, "group_size": 2},
    "validation": {"every": 0},
    "checkpoints": {"every": 0},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("audit-runs")
    agents = {
        "faithful": faithful_agent,
        "stripped": stripping_agent,
        "altered": altered_transitions_agent,
    }
    for name, agent in agents.items():
        trainer = vl.Trainer(
            make_algorithm(**ONE_STEP), n_runners=1, inline=True, run_dir=root, name=name,
            progress=False,
        )  # fmt: skip
        trainer.fit(agent, ROWS)
    return root


def audit_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    status = main(["audit", *args, "--json"])
    return status, json.loads(capsys.readouterr().out)


def conversations(run_dir: Path) -> list[list[LLMCall]]:
    """Each rollout's calls, in order."""
    rollouts, calls = asyncio.run(stored_async(run_dir / "store.sqlite"))
    return [sorted(calls[r.rollout_id], key=lambda c: c.sequence_id or 0) for r in rollouts]


def test_an_agent_that_sends_answers_back_as_they_came_has_no_drift(
    runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["audit", "faithful", "--run-dir", str(runs)])
    out = capsys.readouterr().out
    assert status == 0
    assert "calls audited: 8 of 8: 8 identical, 0 diverging, 0 not checkable" in out
    assert "4 merged, 0 split (merge rate 100.0%)" in out
    assert "not checked: continuation/first_call 4" in out  # counted, never hidden
    assert "trained-token drift: none" in out and "diverging calls" not in out
    assert f"the run's tokenizer in {runs / 'faithful' / 'tokenizer'}" in out


def test_an_answer_sent_back_stripped_is_named_with_its_first_diverging_position(
    runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, found = audit_json(capsys, str(runs / "stripped"))  # a run directory
    assert status == 0  # rows split, but every trained token was sampled
    summary = found["summary"]
    assert (summary["calls"], summary["identical"], summary["diverging"]) == (8, 4, 4)
    assert (summary["merged"], summary["split"], summary["template_diverging"]) == (0, 4, 0)
    assert summary["split_rebuilt"] == 0  # each split in the answer sent back: drift
    calls = {c["call_id"]: c for r in found["rollouts"] for c in r["calls"]}
    for first, second in conversations(runs / "stripped"):
        sampled = first.prompt_token_ids + first.response_token_ids  # type: ignore[operator]
        sent = second.prompt_token_ids or []
        at = next(i for i, (a, b) in enumerate(zip(sampled, sent, strict=False)) if a != b)
        assert at >= len(first.prompt_token_ids or [])  # in the answer sent back
        audit = calls[second.call_id]
        assert audit["outcome"] == "diverges" and audit["previous_call_id"] == first.call_id
        split = audit["continuation"]["divergence"]
        assert split["position"] == at
        assert split["expected"] == sampled[at : at + 4] and split["recorded"] == sent[at : at + 4]
        assert audit["template"]["outcome"] == "identical"
    second = conversations(runs / "stripped")[0][1]
    assert main(["audit", "stripped", "--run-dir", str(runs), "--limit", "1"]) == 0
    out = capsys.readouterr().out
    assert "diverging calls (1 of 4 shown)" in out and "--all shows every one" in out
    assert "split: 4 in the previous answer" in out and "0 before it" in out
    assert main(["audit", "stripped", "--run-dir", str(runs), "--all"]) == 0
    out = capsys.readouterr().out
    position = calls[second.call_id]["continuation"]["divergence"]["position"]
    assert f"call {second.call_id} (sequence 1)" in out
    assert f"continuation diverges at position {position}:" in out and "⟦expected" in out


def test_trained_tokens_that_were_not_sampled_exit_with_status_1(
    runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["audit", "altered", "--run-dir", str(runs)])
    out = capsys.readouterr().out
    assert status == 1
    assert "trained-token drift: 4 row(s) train tokens that were not sampled (exit 1)" in out
    status, found = audit_json(capsys, "altered", "--run-dir", str(runs))
    assert status == 1 and len(found["trained_drift"]) == 4
    # each rollout made one call (no call is named where its first token is the changed one)
    by_rollout = {c.rollout_id: c for (c,) in conversations(runs / "altered")}
    for drift in found["trained_drift"]:
        sampled = by_rollout[drift["rollout_id"]].response_token_ids or []
        assert drift["kind"] == "transition" and drift["transition"] == 0
        assert drift["position"] == len(sampled) - 1  # the token the agent changed


def test_another_tokenizer_or_none_at_all(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, found = audit_json(capsys, "faithful", "--run-dir", str(runs), "--tokenizer", "tiny")
    assert status == 0 and found["tokenizer"] == "the tokenizer of tiny"
    assert found["summary"]["template_identical"] == 8
    bare = tmp_path / "faithful"
    shutil.copytree(runs / "faithful", bare)
    shutil.rmtree(bare / "tokenizer")
    shutil.rmtree(bare / "final", ignore_errors=True)
    status, found = audit_json(capsys, str(bare))
    assert status == 0 and "no tokenizer saved" in found["tokenizer"]
    assert found["summary"]["reasons"]["template/no_tokenizer"] == 8  # counted, not hidden
    assert found["summary"]["merged"] == 4  # continuations need no tokenizer


def test_usage_errors_exit_with_status_2(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "nobody", "--run-dir", str(runs)]) == 2
    assert "no run 'nobody'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad:
        main(["audit", "faithful", "--limit", "-1"])
    assert bad.value.code == 2
