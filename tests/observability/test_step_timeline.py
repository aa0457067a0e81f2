"""benchmarks/step_timeline.py: a LocalRL run's step timeline from its store, checked on a
store whose calls have known times."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT

from voltrl.store.sql import SQLStore
from voltrl.types import AttemptResult, LLMCall, Run, Task

sys.path.insert(0, str(ROOT / "benchmarks"))
from step_timeline import busy_seconds, idle_fraction, table, timeline


def test_busy_seconds_counts_overlapping_calls_once() -> None:
    assert busy_seconds([(1, 3), (2, 4), (6, 7)], 0, 10) == 4
    assert busy_seconds([(-1, 2), (9, 12)], 0, 10) == 3  # clipped to the phase
    assert busy_seconds([], 0, 10) == 0


async def test_the_timeline_of_two_steps_from_the_store(tmp_path: Path) -> None:
    store = SQLStore(tmp_path / "store.sqlite")
    run = await store.add_run(Run(name="r", kind="fit"))
    for version in (1, 2):
        await store.enqueue(
            [Task(input={"i": i}) for i in range(2)], run_id=run.run_id, resources_version=version
        )
        claims = [await store.claim("w") for _ in range(2)]
        assert claims[0] is not None and claims[0].rollout.started_at is not None
        claimed = claims[0].rollout.started_at  # the step's first claim
        for k, claim in enumerate(claims):
            assert claim is not None
            a = claim.attempt
            # calls 0.05-0.15 s and 0.10-0.20 s after the first claim (however long after
            # queueing it came): 0.15 s with one in flight
            start = claimed + 0.05 * (k + 1)
            await store.add_llm_calls(
                [LLMCall(rollout_id=a.rollout_id, attempt_id=a.attempt_id,
                         started_at=start, ended_at=start + 0.1)]
            )  # fmt: skip
        # done 0.3 s or more after the first claim, so after both calls (a lower bound only)
        await asyncio.sleep(max(0.0, claimed + 0.3 - time.time()))
        for claim in claims:
            assert claim is not None
            done = AttemptResult(status="succeeded", reward=1.0)
            await store.complete(claim.attempt.attempt_id, done)
    await store.close()
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "update_s": 0.5}) + "\n" for s in (1, 2)))

    steps = await timeline(str(tmp_path / "store.sqlite"), metrics)
    assert [(s.version, s.rollouts, s.update) for s in steps] == [(1, 2, 0.5), (2, 2, 0.5)]
    first = steps[0]
    assert first.first_claim >= 0
    assert first.first_call == pytest.approx(first.first_claim + 0.05, abs=1e-6)
    assert first.idle == pytest.approx(first.last_done - 0.15, abs=1e-6)
    assert first.last_done >= 0.3
    assert steps[1].gap is None and first.gap is not None
    assert 0 <= idle_fraction(steps) <= 1
    assert "| 1 | 2 |" in table(steps) and "idle fraction" in table(steps)
