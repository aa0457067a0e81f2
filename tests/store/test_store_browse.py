"""Browsing a store (pages of rollouts, a run's counts), checked against every implementation:
each answer equals the reference meaning in ``voltrl.store.browse`` (``matches``, ``page_of``,
``counts_of``) applied to all the rollouts."""

from __future__ import annotations

import itertools
import random

import pytest

from voltrl.store.base import Store
from voltrl.store.browse import COUNT_CAP, RolloutQuery, counts_of, matches, page_of
from voltrl.store.sql.schema import ROLLOUT_COLUMNS
from voltrl.types import AttemptResult, LLMCall, Rollout, Run, Task


async def fill(store: Store) -> tuple[str, dict[str, list[str | None]]]:
    """A run with 24 rollouts of every status, mode, a few versions and rewards, some retried,
    with LLM calls of two agents; returns the run id and each rollout's agent names."""
    rng = random.Random(7)
    run = await store.add_run(Run(name="browse", kind="fit"))
    other = await store.add_run(Run(name="other", kind="fit"))
    await store.enqueue([Task(input={"q": "elsewhere"})], run_id=other.run_id)
    agents: dict[str, list[str | None]] = {}
    for version in (1, 2, 3):
        for mode in ("train", "val"):
            tasks = [
                Task(task_id=f"t{i % 2}", input={"q": f"question {version}-{mode}-{i}", "n": i})
                for i in range(4)
            ]
            await store.enqueue(tasks, mode=mode, run_id=run.run_id, resources_version=version)
    while (claim := await store.claim("w")) is not None:
        rid, aid = claim.rollout.rollout_id, claim.attempt.attempt_id
        names = rng.sample(["writer", "checker", None], rng.randint(0, 2))
        calls = [LLMCall(rollout_id=rid, attempt_id=aid, agent_name=n) for n in names]
        await store.add_llm_calls(calls)
        agents.setdefault(rid, []).extend(names)
        fate = rng.random()
        if fate < 0.1:
            continue  # stays running
        if fate < 0.25:
            result = AttemptResult(status="failed", error="boom")  # retried: queued again
        else:
            reward = rng.choice([None, 0.0, 0.25, 0.5, 1.0])
            result = AttemptResult(status="succeeded", reward=reward)
        await store.complete(aid, result)
    return run.run_id, agents


QUERIES = [
    {},
    {"sort": "created_at", "descending": False},
    {"status": ["succeeded"], "sort": "reward"},
    {"status": ["succeeded", "running"], "sort": "reward", "descending": False},
    {"mode": "val", "sort": "duration"},
    {"reward_min": 0.25, "reward_max": 0.75},
    {"reward_min": 1.0, "sort": "attempts"},
    {"resources_version": 2, "sort": "resources_version"},
    {"task_id": "t1", "mode": "train"},
    {"agent": "writer"},
    {"agent": "checker", "status": ["succeeded"], "sort": "reward"},
    {"min_attempts": 2, "sort": "attempts"},
    {"text": "QUESTION 2-val"},
    {"text": "%"},
    {"text": '"n": 3'.replace(" ", "")},
    {"sort": "status", "limit": 5, "offset": 3},
    {"sort": "reward", "limit": 4, "offset": 20},
]


@pytest.mark.parametrize("query", QUERIES, ids=[str(q) for q in QUERIES])
async def test_browse_rollouts_returns_the_reference_page(store: Store, query: dict) -> None:
    run_id, agents = await fill(store)
    q = RolloutQuery(run_id=run_id, **query)
    everything = await store.query_rollouts(run_id=run_id)
    expected = page_of([r for r in everything if matches(r, q, agents.get(r.rollout_id, []))], q)
    page = await store.browse_rollouts(q)
    assert [r.rollout_id for r in page.rollouts] == [r.rollout_id for r in expected.rollouts]
    assert (page.total, page.total_capped) == (expected.total, False)
    assert page.rollouts == expected.rollouts  # whole records, not just ids


async def test_browse_rollouts_sorts_missing_values_last_either_way(store: Store) -> None:
    run_id, _ = await fill(store)
    for descending in (True, False):
        q = RolloutQuery(run_id=run_id, sort="reward", descending=descending, limit=500)
        rewards = [r.reward for r in (await store.browse_rollouts(q)).rollouts]
        present = [x for x in rewards if x is not None]
        assert rewards == present + [None] * (len(rewards) - len(present))
        assert present == sorted(present, reverse=descending) and present


async def test_browse_rollouts_without_run_id_sees_every_run(store: Store) -> None:
    run_id, _ = await fill(store)
    page = await store.browse_rollouts(RolloutQuery(text="elsewhere"))
    assert page.total == 1 and page.rollouts[0].run_id != run_id


async def test_rollout_counts_match_the_reference(store: Store) -> None:
    run_id, _ = await fill(store)
    counts = await store.rollout_counts(run_id)
    expected = counts_of(await store.query_rollouts(run_id=run_id))
    assert [(c.mode, c.resources_version, c.status, c.count, c.rewarded) for c in counts] == [
        (c.mode, c.resources_version, c.status, c.count, c.rewarded) for c in expected
    ]
    for got, want in zip(counts, expected, strict=True):
        assert got.reward_sum == pytest.approx(want.reward_sum)
        assert got.reward_std == pytest.approx(want.reward_std)
    assert sum(c.count for c in counts) == 24
    assert await store.rollout_counts("run-unknown") == []


async def test_browse_rollouts_counts_up_to_the_cap(tmp_path, monkeypatch) -> None:
    from voltrl.store import browse
    from voltrl.store.sql import store as sql

    monkeypatch.setattr(browse, "COUNT_CAP", 5)
    monkeypatch.setattr(sql, "COUNT_CAP", 5)
    store = sql.SQLStore(tmp_path / "store.sqlite")
    try:
        await store.enqueue([Task(input={"i": i}) for i in range(8)])
        page = await store.browse_rollouts(RolloutQuery(limit=3))
        assert (page.total, page.total_capped, len(page.rollouts)) == (5, True, 3)
        page = await store.browse_rollouts(RolloutQuery(limit=3, text='"i":7'))
        assert (page.total, page.total_capped) == (1, False)
    finally:
        await store.close()


def test_rollout_query_refuses_pages_past_the_limit() -> None:
    with pytest.raises(ValueError, match="less than or equal"):
        RolloutQuery(limit=10_000)
    with pytest.raises(ValueError, match="greater than or equal"):
        RolloutQuery(offset=-1)
    assert COUNT_CAP >= 1000


def test_reference_sort_is_total() -> None:
    """``page_of`` orders every permutation of the same rollouts the same way."""
    rs = [
        Rollout(task=Task(input={}), reward=r, created_at=t, status="succeeded")
        for r, t in [(1.0, 3.0), (None, 2.0), (1.0, 1.0), (0.0, 4.0)]
    ]
    q = RolloutQuery(sort="reward")
    orders = {
        tuple(x.rollout_id for x in page_of(p, q).rollouts) for p in itertools.permutations(rs)
    }
    assert len(orders) == 1


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_a_version_1_store_is_upgraded_on_open_and_browses_the_same(
    kind: str, store_factory
) -> None:
    """A store written before the browsing columns (schema version 1: the rollouts' fields
    only in their JSON) gets the columns, filled from the JSON, when it is opened."""
    store = await store_factory(kind)
    run_id, _ = await fill(store)
    q = RolloutQuery(run_id=run_id, sort="reward", reward_min=0.25, agent="writer")
    before = await store.browse_rollouts(q)
    counts = await store.rollout_counts(run_id)
    target = store._db.target
    with store._db.write() as conn:  # back to version 1's schema
        conn.execute("DROP INDEX llm_calls_agent")
        for column in ROLLOUT_COLUMNS:
            conn.execute(f"ALTER TABLE rollouts DROP COLUMN {column}")
        conn.execute("UPDATE schema_version SET version = 1")
    await store.close()

    from voltrl.store.sql import SQLStore

    upgraded = SQLStore(target)
    try:
        with upgraded._db.read() as conn:
            assert conn.execute("SELECT version FROM schema_version").fetchone()[0] == 2
        after = await upgraded.browse_rollouts(q)
        assert [r.rollout_id for r in after.rollouts] == [r.rollout_id for r in before.rollouts]
        assert after.total == before.total > 0
        assert await upgraded.rollout_counts(run_id) == counts
    finally:
        await upgraded.close()
