"""A run's result has one definition everywhere (the end of a run, ``voltrl show``, ``voltrl
runs``, the dashboard): the mean reward of its last validation, else of its dev rollouts, else
of its last step; a validation or step cut short by an interrupt is not the last one; what the
mean leaves out (failed, cancelled, unrewarded rollouts) is said beside it."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
from helpers import version_labels

from voltrl._http.serving import serve_in_thread
from voltrl.observability.dashboard import Catalog, dashboard_app
from voltrl.observability.metrics import run_outcome
from voltrl.store.browse import RolloutCount
from voltrl.store.sql import SQLStore
from voltrl.types import AttemptResult, Run, Task


def cell(mode: str, version: int | None, status: str, count: int, rewards: list[float] = ()):
    return RolloutCount(
        mode=mode,
        resources_version=version,
        status=status,
        count=count,
        rewarded=len(rewards),
        reward_sum=sum(rewards),
        reward_sq_sum=sum(r * r for r in rewards),
    )


def test_the_last_validation_is_the_result_not_the_mean_of_every_validation() -> None:
    counts = [
        cell("train", 1, "succeeded", 4, [1, 1, 1, 1]),
        cell("val", 0, "succeeded", 4, [0, 0, 1, 1]),
        cell("val", 5, "succeeded", 4, [1, 1, 1, 0]),
        cell("val", 9, "succeeded", 4, [1, 1, 1, 1]),
    ]
    outcome = run_outcome(counts)
    assert outcome is not None and outcome.reward_mean == 1.0
    assert outcome.line() == "result: reward 1.000 at the last validation (4 rollouts)"


def test_a_validation_or_step_cut_short_by_an_interrupt_is_not_the_result() -> None:
    counts = [
        cell("val", 0, "succeeded", 4, [0.5] * 4),
        cell("val", 5, "succeeded", 1, [0.0]),
        cell("val", 5, "cancelled", 3),
    ]
    assert run_outcome(counts).reward_mean == 0.5  # the whole validation before it
    steps = [
        cell("train", 1, "succeeded", 4, [0.25] * 4),
        cell("train", 2, "succeeded", 6, [0.0] * 6),
        cell("train", 2, "cancelled", 58),
    ]
    outcome = run_outcome(steps)
    assert outcome.of == "the last step" and outcome.reward_mean == 0.25
    only_cut = run_outcome(steps[1:])  # no whole step: the one there is, with what it lacks
    assert only_cut.line() == (
        "result: reward 0.000 at the last step (6 of 64 rewarded: 58 cancelled)"
    )


def test_training_after_the_last_validation_makes_the_last_step_the_result() -> None:
    """A run stopped after step 7 that last validated at step 5 ended on its step 7."""
    counts = [
        cell("val", 0, "succeeded", 4, [0.0] * 4),
        cell("val", 6, "succeeded", 4, [0.5] * 4),
        cell("train", 5, "succeeded", 4, [0.5] * 4),
        cell("train", 7, "succeeded", 4, [0.75] * 4),
        cell("train", 8, "succeeded", 4, [1.0] * 4),
    ]
    assert run_outcome(counts).line() == "result: reward 1.000 at the last step (4 rollouts)"


def test_a_prompt_search_gives_its_best_validation_and_a_running_step_is_passed_over() -> None:
    candidates = [
        cell("val", 1, "succeeded", 2, [0.5, 0.5]),
        cell("val", 3, "succeeded", 2, [1.0, 1.0]),
        cell("val", 5, "succeeded", 2, [0.0, 0.5]),  # the last candidate, refused
    ]
    assert run_outcome(candidates).reward_mean == 0.25
    best = run_outcome(candidates, best=True)
    assert best.line() == "result: reward 1.000 at the best validation (2 rollouts)"
    running = [
        cell("train", 1, "succeeded", 4, [0.5] * 4),
        cell("train", 2, "succeeded", 2, [1.0, 1.0]),
        cell("train", 2, "running", 6),
    ]
    assert run_outcome(running).reward_mean == 0.5  # step 1: step 2 is still running
    assert run_outcome(running[1:]).line() == (
        "result: reward 1.000 at the last step (2 of 8 rewarded: 6 still running)"
    )


def test_failed_and_unrewarded_rollouts_are_said_beside_the_mean() -> None:
    counts = [
        cell("dev", None, "succeeded", 7, [1.0] * 5),  # two returned None, emitted nothing
        cell("dev", None, "failed", 2),
    ]
    outcome = run_outcome(counts)
    assert outcome.line() == (
        "result: reward 1.000 over the dev rollouts "
        "(5 of 9 rewarded: 2 failed, 2 without a final reward)"
    )
    assert run_outcome([]) is None


def record_versions(
    path: Path, status: str, versions: list[tuple[str, int, list[float], int]]
) -> None:
    """A run with, per ``(mode, version, rewards, cancelled)``, rollouts that finished with
    those rewards and ``cancelled`` more that an interrupt cancelled."""

    async def record() -> None:
        store = SQLStore(path / "store.sqlite")
        try:
            run = await store.add_run(Run(name=path.name, kind="fit", status=status))
            for mode, version, rewards, cancelled in versions:
                tasks = [Task(input={"q": i}) for i in range(len(rewards) + cancelled)]
                rollouts = await store.enqueue(
                    tasks, mode=mode, run_id=run.run_id, resources_version=version
                )
                for reward in rewards:
                    claim = await store.claim("w")
                    assert claim is not None
                    result = AttemptResult(status="succeeded", reward=reward)
                    await store.complete(claim.attempt.attempt_id, result)
                for rollout in rollouts[len(rewards) :]:
                    await store.cancel(rollout.rollout_id)
        finally:
            await store.close()

    path.mkdir()
    asyncio.run(record())


def test_the_runs_page_gives_the_result_and_no_point_for_an_interrupted_step(
    tmp_path: Path,
) -> None:
    versions = [("train", 1, [1.0, 0.0], 0), ("train", 2, [0.0], 3)]
    record_versions(tmp_path / "stopped", "interrupted", versions)
    with (
        serve_in_thread(dashboard_app(Catalog([tmp_path]))) as server,
        httpx.Client(base_url=server.url) as client,
    ):
        page = client.get("/").text
        run_id = re.search(r'data-run-id="([^"]+)"', page).group(1)
        run_page = client.get(f"/runs/{run_id}").text
    assert "data-values='[0.5]'" in page  # step 2's lone finished rollout is not its reward
    assert 'title="result: reward 0.500 at the last step (2 rollouts)">0.500' in page
    assert "result: reward 0.500 at the last step (2 rollouts)" in run_page
    assert run_page.count("(cut short)") == 1  # version 2's mean, of its one finished rollout


def test_the_run_page_says_what_each_version_was(tmp_path: Path) -> None:
    """Validation rollouts are told apart by when they ran: before training, or after which
    step (LocalRL publishes a version for each validation and logs it); training rollouts an
    interrupt cancelled are an interrupted step."""
    versions = [
        ("val", 1, [0.0, 1.0], 0),
        ("train", 2, [1.0], 0),
        ("train", 3, [0.0], 2),  # interrupted, done again at 4 once resumed
        ("train", 4, [1.0], 0),
        ("val", 6, [1.0, 1.0], 0),
    ]
    record_versions(tmp_path / "labelled", "finished", versions)
    lines = [  # as LocalRL logs them (the interrupted step logged nothing)
        {"step": 0, "val/resources_version": 1, "val/reward_mean": 0.5},
        {"step": 1, "resources_version": 2, "batch/rows": 1},
        {"step": 2, "resources_version": 4, "batch/rows": 1},
        {"step": 2, "val/resources_version": 6, "val/reward_mean": 1.0},
    ]
    metrics = "".join(json.dumps(line) + "\n" for line in lines)
    (tmp_path / "labelled" / "metrics.jsonl").write_text(metrics)
    assert version_labels(tmp_path) == [
        "validation before training",
        "step 1",
        "interrupted step",
        "step 2",
        "validation after step 2",
    ]
