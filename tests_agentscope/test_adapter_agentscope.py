"""AgentScope adapter: real AgentScope 2.x ``Agent``s with tools, structured output and
several players, through the real gateway to the scripted backend. Calls are stored with token
ids and the calling agent's name, AgentScope's spans (replies, model calls, tool calls with
results) land in the rollout, and concurrent rollouts sharing one model stay apart."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

from agentscope.agent import Agent, InjectionConfig, ReActConfig
from agentscope.formatter import OpenAIMultiAgentFormatter
from agentscope.message import AssistantMsg, UserMsg
from agentscope.middleware import TracingMiddleware
from agentscope.permission import PermissionBehavior, PermissionDecision
from agentscope.tool import FunctionTool, Toolkit
from fake_openai_backend import FakeBackend, scripted_ids, tool_then_answer
from gateway_env import new_rollout
from helpers import ADD_ARGS, context, fake_trainer, serve_gateway
from pydantic import BaseModel

import voltrl as vl
from voltrl.adapters.agentscope import AgentNames, chat_model, instrument, model_parameters
from voltrl.gateway import Gateway
from voltrl.resources import LLM
from voltrl.store.memory import InMemoryStore
from voltrl.tracing import activate
from voltrl.types import Span

ALLOW = PermissionDecision(behavior=PermissionBehavior.ALLOW, message="allowed")


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def divide(a: int, b: int) -> float:
    """Divide a by b.

    Args:
        a: the dividend.
        b: the divisor.
    """
    return a / b


def toolkit(*functions: Any) -> Toolkit:
    return Toolkit(tools=[FunctionTool(f, permission=ALLOW) for f in functions])


def agent(name: str, model: Any, *functions: Any, **options: Any) -> Agent:
    """An agent as a user would write it, with AgentScope's tracing, no injected clock."""
    return Agent(
        name=name,
        system_prompt=f"You are {name}.",
        model=model,
        toolkit=toolkit(*functions),
        middlewares=[TracingMiddleware(), *options.pop("middlewares", [])],
        injection_config=InjectionConfig(inject_runtime_state=False),
        react_config=ReActConfig(max_iters=4),
        **options,
    )


def named(spans: list[Span], name: str) -> Span:
    [span] = [s for s in spans if s.name == name]
    return span


def test_sampling_parameters_become_model_parameters_and_body_fields() -> None:
    fields, extra = model_parameters(
        {"temperature": 0.7, "max_completion_tokens": 64, "top_k": 20, "stop": ["\n"]}
    )
    assert fields == {"temperature": 0.7, "max_tokens": 64}
    assert extra == {"top_k": 20, "stop": ["\n"]}


@vl.rollout
async def solver(task: dict, llm: vl.LLM) -> float:
    """An AgentScope agent with an add tool; reward 1 when the answer holds the sum."""
    instrument()
    reply = await agent("solver", chat_model(llm, "solver"), add).reply(
        UserMsg("user", task["question"])
    )
    return float(str(task["answer"]) in (reply.get_text_content() or ""))


async def test_an_agent_with_a_tool_runs_through_dev_recorded_with_its_name(tmp_path: Path):
    store = InMemoryStore()
    async with FakeBackend() as fb:
        fb.script = tool_then_answer(ADD_ARGS, "It is 42.")
        llm = vl.LLM(
            endpoint=fb.url,
            model="fake-model",
            sampling_parameters={"temperature": 0.3, "max_tokens": 32, "top_k": 5},
        )
        trainer = fake_trainer(store, tmp_path, llm)
        result = await trainer.dev_async(solver, [{"question": "What is 17 + 25?", "answer": 42}])
    [rollout] = result.rollouts
    assert rollout.status == "succeeded" and rollout.reward == 1.0
    calls = await store.get_llm_calls(rollout.rollout_id)
    assert [c.agent_name for c in calls] == ["solver", "solver"]
    assert [c.response_token_ids for c in calls] == [
        scripted_ids(ADD_ARGS),
        scripted_ids("It is 42."),
    ]
    body = fb.requests[0]["body"]
    assert (body["temperature"], body["max_completion_tokens"], body["top_k"]) == (0.3, 32, 5)
    assert body["stream"] is False
    tool_result = next(m for m in calls[1].request["messages"] if m["role"] == "tool")
    assert "42" in json.dumps(tool_result["content"])
    spans = await store.get_spans(rollout.rollout_id)
    assert {"invoke_agent solver", "chat fake-model", "execute_tool add"} <= {s.name for s in spans}
    tool_span = named(spans, "execute_tool add")
    assert json.loads(tool_span.attributes["gen_ai.tool.call.arguments"]) == {"a": 17, "b": 25}
    assert "42" in tool_span.attributes["gen_ai.tool.call.result"]


async def test_a_failing_tool_is_told_to_the_model_and_recorded() -> None:
    instrument()
    store = InMemoryStore()
    async with FakeBackend() as fb, serve_gateway(Gateway(store, [fb.url])) as base:
        fb.script = tool_then_answer('{"a": 1, "b": 0}', "I cannot divide by zero.")
        rid, aid = await new_rollout(store)
        llm = LLM(endpoint=f"{base}/v1", model="m", gateway=True).scoped(rid, aid)
        ctx = context(rid, aid)
        with activate(ctx):
            reply = await agent("divider", chat_model(llm, "divider"), divide).reply(
                UserMsg("user", "What is 1 / 0?")
            )
        told = next(m for m in fb.requests[1]["body"]["messages"] if m["role"] == "tool")
    assert reply.get_text_content() == "I cannot divide by zero."
    assert "division by zero" in json.dumps(told["content"])
    failed = named(ctx.spans, "execute_tool divide")
    assert "division by zero" in failed.attributes["gen_ai.tool.call.result"]


class Vote(BaseModel):
    """A vote for one player."""

    target: str
    reason: str


@vl.rollout
async def voter(task: dict, llm: vl.LLM) -> float:
    """Structured output: the agent's vote, validated by AgentScope against ``Vote``."""
    instrument()
    reply = await agent("voter", chat_model(llm, "voter")).reply(
        UserMsg("moderator", "Vote for a player: alice or bob."), structured_schema=Vote
    )
    return float(reply.structured_output == task["expected"])


async def test_structured_output_through_the_gateway(tmp_path: Path):
    vote = {"target": "bob", "reason": "he was quiet"}
    store = InMemoryStore()
    async with FakeBackend() as fb:
        fb.script = lambda req: {"tool": "GenerateStructuredOutput", "arguments": json.dumps(vote)}
        trainer = fake_trainer(store, tmp_path, vl.LLM(endpoint=fb.url, model="fake-model"))
        result = await trainer.dev_async(voter, [{"expected": vote}])
    [rollout] = result.rollouts
    assert rollout.reward == 1.0
    [call] = await store.get_llm_calls(rollout.rollout_id)
    assert call.agent_name == "voter" and call.response_token_ids == scripted_ids(json.dumps(vote))
    offered = [t["function"]["name"] for t in call.request["tools"]]
    assert offered == ["GenerateStructuredOutput"]


def speak(req: dict[str, Any]) -> dict[str, str]:
    """Each player says its own name and the number of the conversation it is in."""
    system = req["messages"][0]["content"]
    text = system if isinstance(system, str) else system[0]["text"]
    who = re.search(r"You are (\w+)", text).group(1)
    history = json.dumps(req["messages"])
    room = re.search(r"room (\d+)", history).group(1)
    return {"text": f"{who} here, in room {room}."}


async def test_players_sharing_one_model_in_concurrent_rollouts_stay_apart() -> None:
    """One model object, made outside any rollout, serves two players in each of two rollouts
    running at once; each call is recorded in its own rollout under its player's name, and a
    player sees what the other said (``observe``)."""
    instrument()
    store = InMemoryStore()
    async with FakeBackend() as fb, serve_gateway(Gateway(store, [fb.url])) as base:
        fb.script = speak
        shared = chat_model(
            LLM(endpoint=f"{base}/v1", model="m", gateway=True),
            formatter=OpenAIMultiAgentFormatter(),
        )
        rollouts = [await new_rollout(store, name) for name in ("first", "second")]
        contexts = [context(rid, aid) for rid, aid in rollouts]

        async def game(ctx: Any, room: int) -> list[str]:
            players = [agent(n, shared, middlewares=[AgentNames()]) for n in ("alice", "bob")]
            said = []
            with activate(ctx):
                for player, other in (players, players[::-1]):
                    msg = await player.reply(UserMsg("moderator", f"Speak, room {room}."))
                    said.append(msg.get_text_content())
                    await other.observe(AssistantMsg(player.name, msg.get_text_content()))
            return said

        first, second = await asyncio.gather(game(contexts[0], 1), game(contexts[1], 2))
    assert first == ["alice here, in room 1.", "bob here, in room 1."]
    assert second == ["alice here, in room 2.", "bob here, in room 2."]
    for ctx, room in zip(contexts, ("1", "2"), strict=True):
        calls = await store.get_llm_calls(ctx.rollout_id)
        assert [c.agent_name for c in calls] == ["alice", "bob"]
        assert {c.attempt_id for c in calls} == {ctx.attempt_id}
        bob_saw = json.dumps(calls[1].request["messages"])
        assert f"alice: alice here, in room {room}." in bob_saw
        assert {s.attributes["voltrl.rollout_id"] for s in ctx.spans} == {ctx.rollout_id}
        assert {"invoke_agent alice", "invoke_agent bob"} <= {s.name for s in ctx.spans}
