"""The sql_agent sample's LangGraph agent, once per question through ``Trainer.dev`` against a
scripted backend: a wrong first query, a review, a rewrite, an approval; execution-match
reward; calls named after their nodes; the agent filter keeps only write/rewrite calls."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from fake_openai_backend import FakeBackend, scripted_ids
from helpers import SAMPLES, fake_trainer, load_sample

import voltrl as vl
from voltrl.store.memory import InMemoryStore
from voltrl.trajectory import TrajectoryConfig, trajectories_from_store

SAMPLE = SAMPLES / "sql_agent"


run = load_sample("sql_agent", "run")
agent = run.load_agent_module()
ROWS = run.questions("val")[:2]
GOLD = {r["question"]: r["gold_sql"] for r in ROWS}
WRONG = "SELECT name FROM customers"
REVIEW = "The query does not answer the question."


def sql_backend(req: dict[str, Any]) -> dict[str, str]:
    """Write a wrong query, reject it, rewrite it to the gold query, approve that."""
    system, user = req["messages"][0]["content"], req["messages"][-1]["content"]
    question = next(q for q in GOLD if q in user)
    if system.startswith("You review"):
        return {"text": "CORRECT" if GOLD[question] in user else REVIEW}
    if "previous query was wrong" in system:
        return {"text": f"```sql\n{GOLD[question]};\n```"}
    return {"text": f"```sql\n{WRONG}\n```"}


def test_sql_agent_runs_through_dev_and_trains_only_write_and_rewrite(tmp_path: Path):
    store = InMemoryStore()

    async def main() -> vl.RunResult:
        async with FakeBackend() as fb:
            fb.script = sql_backend
            llm = vl.LLM(endpoint=fb.url, model="fake-model")
            trainer = fake_trainer(store, tmp_path, llm)
            return await trainer.dev_async(agent.sql_agent, ROWS)

    result = asyncio.run(main())
    assert result.rewards == [1.0, 1.0]

    async def inspect() -> None:
        for rollout in result.rollouts:
            gold = rollout.task.input["gold_sql"]
            calls = sorted(
                await store.get_llm_calls(rollout.rollout_id), key=lambda c: c.sequence_id or 0
            )
            assert [c.agent_name for c in calls] == ["write", "check", "rewrite", "check"]
            assert calls[0].response_token_ids == scripted_ids(f"```sql\n{WRONG}\n```")
            assert calls[2].response_token_ids == scripted_ids(f"```sql\n{gold};\n```")
            spans = await store.get_spans(rollout.rollout_id)
            nodes = [
                s.name
                for s in sorted(spans, key=lambda s: s.start_time)
                if s.name.startswith("node:")
            ]
            assert nodes == [
                "node:write",
                "node:execute",
                "node:check",
                "node:rewrite",
                "node:execute",
                "node:check",
            ]
        config = TrajectoryConfig(agent_filter=agent.AGENT_FILTER)
        trajectories = await trajectories_from_store(store, result.rollouts, config)
        for trajectory in trajectories:
            assert [t.agent_name for t in trajectory.transitions] == ["write", "rewrite"]
            assert trajectory.stats["dropped/agent_filter"] == 2
            assert {t.reward for t in trajectory.transitions} == {1.0}

    asyncio.run(inspect())


def test_reward_is_execution_match_and_the_database_is_read_only():
    gold = "SELECT COUNT(*) FROM orders WHERE status = 'shipped'"
    assert agent.execution_match("SELECT count(id) FROM orders WHERE status='shipped'", gold) == 1.0
    assert agent.execution_match("SELECT COUNT(*) FROM orders", gold) == 0.0
    assert agent.execution_match("DROP TABLE orders", gold) == 0.0
    assert agent.execution_match("not sql at all", gold) == 0.0
    assert agent.extract_sql("Here:\n```sql\nSELECT 1;\n```") == "SELECT 1"
    rows = [json.loads(line) for line in (SAMPLE / "questions.jsonl").read_text().splitlines()]
    for row in rows:  # every gold query runs and returns something
        assert agent.run_sql(row["gold_sql"])[0], row["question"]
    assert {r["split"] for r in rows} == {"train", "val"}


def test_a_task_can_prune_the_schema_its_prompts_show(tmp_path: Path):
    systems: dict[str, list[str]] = {"write": [], "rewrite": [], "check": []}

    def recording_backend(req: dict[str, Any]) -> dict[str, str]:
        system = req["messages"][0]["content"]
        role = "check" if system.startswith("You review") else "write"
        role = "rewrite" if "previous query was wrong" in system else role
        systems[role].append(system)
        return sql_backend(req)

    async def main() -> vl.RunResult:
        async with FakeBackend() as fb:
            fb.script = recording_backend
            llm = vl.LLM(endpoint=fb.url, model="fake-model")
            trainer = fake_trainer(InMemoryStore(), tmp_path, llm)
            pruned = [{**ROWS[0], "tables": ["products"]}]
            return await trainer.dev_async(agent.sql_agent, pruned)

    assert asyncio.run(main()).rewards == [1.0]  # the database keeps every table
    for role in ("write", "rewrite"):
        (system,) = systems[role]
        assert "CREATE TABLE products" in system
        assert "CREATE TABLE customers" not in system and "CREATE TABLE orders" not in system
    assert agent.schema_for(None) == agent.SCHEMA and agent.SCHEMA.count("CREATE TABLE") == 4
    with pytest.raises(ValueError, match="'tables' must name some of"):
        agent.schema_for(["product"])


def test_the_cpu_recipe_questions_are_parsed_by_the_teacher_and_held_out_apart(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.syspath_prepend(str(SAMPLES.parent / "benchmarks"))
    from learning import load_recipe  # drops other samples' ``agent`` from sys.modules

    recipe = load_recipe("sql_agent")
    teacher = load_sample("sql_agent", "teacher")
    _, train, val = recipe.tasks(0)
    assert len(train) + len(val) == 2083 and recipe.tasks(1)[2] == val  # the same for every seed
    assert len(val) == 64 and not {r["question"] for r in val} & {r["question"] for r in train}
    assert all(r["tables"] == ["products"] for r in train + val)
    for row in train[:50] + val:
        template, x = teacher._parse(row["question"])
        assert template.fill(x) == (row["question"], row["gold_sql"])
        assert agent.run_sql(row["gold_sql"])[0], row["question"]
