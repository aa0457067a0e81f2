"""The AutoGen adapter: a real ``AssistantAgent`` with a tool, its model client built by
``model_client``, through our gateway against the scripted fake backend (a tool call, then an
answer after the tool result).

Checks the stored LLM calls (token ids, agent name), AutoGen's OpenTelemetry spans in the
rollout (the tool call with its result, success and failure), the reward, that concurrent
rollouts sharing one client stay apart, and the MCP bridge against a tiny ``mcp`` 2.x stdio
server."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
from autogen_agentchat import EVENT_LOGGER_NAME
from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.conditions import MaxMessageTermination, TextMentionTermination
from autogen_agentchat.teams import RoundRobinGroupChat, Swarm
from fake_openai_backend import FakeBackend, scripted_ids, tool_then_answer
from gateway_env import new_rollout
from helpers import ADD_ARGS as ARGS
from helpers import context, dev_adding_twice, serve_gateway
from mcp import StdioServerParameters

import voltrl as vl
from voltrl.adapters import autogen as vla
from voltrl.gateway import Gateway
from voltrl.resources import LLM
from voltrl.store.memory import InMemoryStore
from voltrl.tracing import RolloutContext, activate
from voltrl.types import Span


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def broken(a: int, b: int) -> int:
    """A tool that always fails."""
    raise RuntimeError("the adder is broken")


def solver(client: Any, tools: list[Any], name: str = "solver") -> AssistantAgent:
    """An agent that calls a tool, then answers after seeing the result."""
    return AssistantAgent(
        name,
        model_client=client,
        tools=tools,
        system_message="Use the tool, then answer with the number only.",
        max_tool_iterations=2,
    )


def tool_span(spans: list[Span], tool: str) -> Span:
    [span] = [s for s in spans if s.name == f"execute_tool {tool}"]
    return span


@pytest.mark.slow
async def test_agent_through_trainer_records_calls_spans_and_reward(tmp_path: Path) -> None:
    """In a runner process, where only ``model_client`` turns the span recording on."""
    store = InMemoryStore()

    @vl.rollout
    async def agent(task: dict, llm: vl.LLM) -> float:
        client = vla.model_client(llm, agent_name="solver")
        try:
            result = await solver(client, [add]).run(task=task["question"])
        finally:
            await client.close()
        return float(result.messages[-1].content.strip() == str(task["answer"]))

    result = await dev_adding_twice(agent, store, tmp_path)
    for rollout in result.rollouts:
        spans = await store.get_spans(rollout.rollout_id)
        tool = tool_span(spans, "add")
        assert tool.status == "ok"
        assert tool.attributes["gen_ai.tool.name"] == "add"
        assert tool.attributes["gen_ai.tool.call.result"] == "42"
        assert tool.attributes["voltrl.tool.is_error"] is False
        [invoke] = [s for s in spans if s.name == "invoke_agent solver"]
        assert tool.parent_id == invoke.span_id and tool.trace_id == invoke.trace_id


def add_what_is_asked(req: dict[str, Any]) -> dict[str, str]:
    """Call ``add`` on the numbers of the question, then answer with the tool's result."""
    messages = req["messages"]
    results = [m["content"] for m in messages if m["role"] == "tool"]
    if results:
        return {"text": results[-1]}
    question = next(m["content"] for m in messages if m["role"] == "user")
    a, b = (int(x) for x in question.removeprefix("What is ").rstrip("?").split(" + "))
    return {"tool": "add", "arguments": json.dumps({"a": a, "b": b})}


async def test_concurrent_rollouts_sharing_one_client_stay_apart() -> None:
    store = InMemoryStore()
    async with FakeBackend() as fb, serve_gateway(Gateway(store, [fb.url])) as base:
        fb.script = add_what_is_asked
        # Made once, outside any rollout, from the unscoped gateway LLM.
        shared = vla.model_client(LLM(endpoint=f"{base}/v1", model="m", gateway=True), "solver")
        rollouts = [await new_rollout(store, f"r{i}") for i in range(2)]
        contexts = [context(rid, aid) for rid, aid in rollouts]

        async def one(ctx: RolloutContext, a: int) -> str:
            with activate(ctx):
                result = await solver(shared, [add]).run(task=f"What is {a} + 1?")
            return result.messages[-1].content

        outputs = await asyncio.gather(one(contexts[0], 10), one(contexts[1], 20))
        await shared.close()

    assert outputs == ["11", "21"]
    for (rid, aid), ctx, answer in zip(rollouts, contexts, ["11", "21"], strict=True):
        calls = await store.get_llm_calls(rid)
        assert len(calls) == 2 and {c.attempt_id for c in calls} == {aid}
        assert {c.agent_name for c in calls} == {"solver"}
        assert calls[-1].response_token_ids == scripted_ids(answer)
        assert {s.rollout_id for s in ctx.spans} == {rid}
        assert tool_span(ctx.spans, "add").attributes["gen_ai.tool.call.result"] == answer


async def test_failed_tool_is_an_error_span_and_the_model_sees_the_error() -> None:
    store = InMemoryStore()
    async with FakeBackend() as fb, serve_gateway(Gateway(store, [fb.url])) as base:
        fb.script = tool_then_answer(ARGS, "sorry")
        rid, aid = await new_rollout(store)
        llm = LLM(endpoint=f"{base}/v1", model="m", gateway=True).scoped(rid, aid)
        ctx = context(rid, aid)
        client = vla.model_client(llm, agent_name="solver")
        with activate(ctx):
            result = await solver(client, [broken]).run(task="What is 17 + 25?")
        await client.close()

    assert result.messages[-1].content == "sorry"
    tool = tool_span(ctx.spans, "broken")
    assert tool.status == "error" and tool.attributes["voltrl.tool.is_error"] is True
    assert "the adder is broken" in tool.attributes["gen_ai.tool.call.result"]
    assert tool.attributes["error.type"] == "RuntimeError"
    tool_message = next(m for m in fb.requests[-1]["body"]["messages"] if m["role"] == "tool")
    assert "the adder is broken" in tool_message["content"]


async def test_team_agents_each_record_their_calls_under_their_name() -> None:
    store = InMemoryStore()
    async with FakeBackend() as fb, serve_gateway(Gateway(store, [fb.url])) as base:
        fb.script = lambda req: {"text": "fine"}
        rid, aid = await new_rollout(store)
        llm = LLM(endpoint=f"{base}/v1", model="m", gateway=True).scoped(rid, aid)
        ctx = context(rid, aid)
        names = ("writer", "critic")
        clients = [vla.model_client(llm, agent_name=name) for name in names]
        with activate(ctx):
            agents = [
                AssistantAgent(n, model_client=c) for n, c in zip(names, clients, strict=True)
            ]
            team = RoundRobinGroupChat(agents, termination_condition=MaxMessageTermination(4))
            await team.run(task="Write a haiku.")
        for client in clients:
            await client.close()

    calls = await store.get_llm_calls(rid)
    assert [c.agent_name for c in calls] == ["writer", "critic", "writer"]
    invoked = [s.name for s in ctx.spans if s.name.startswith("invoke_agent")]
    assert invoked == ["invoke_agent writer", "invoke_agent critic", "invoke_agent writer"]
    assert any(s.name.startswith("autogen process") for s in ctx.spans)  # runtime spans


def hand_off_then_add(req: dict[str, Any]) -> dict[str, str]:
    """The triage agent hands off; the worker calls ``add``, then answers."""
    names = [t["function"]["name"] for t in req.get("tools") or []]
    if "transfer_to_worker" in names:
        return {"tool": "transfer_to_worker", "arguments": "{}"}
    if req["messages"][-1]["role"] == "tool":
        return {"text": "42 DONE"}
    return {"tool": "add", "arguments": ARGS}


async def test_swarm_handoff_is_a_tool_span_and_each_agent_is_named() -> None:
    store = InMemoryStore()
    async with FakeBackend() as fb, serve_gateway(Gateway(store, [fb.url])) as base:
        fb.script = hand_off_then_add
        rid, aid = await new_rollout(store)
        llm = LLM(endpoint=f"{base}/v1", model="m", gateway=True).scoped(rid, aid)
        ctx = context(rid, aid)
        triage_client = vla.model_client(llm, agent_name="triage")
        worker_client = vla.model_client(llm, agent_name="worker")
        with activate(ctx):
            triage = AssistantAgent("triage", model_client=triage_client, handoffs=["worker"])
            worker = solver(worker_client, [add], name="worker")
            done = TextMentionTermination("DONE") | MaxMessageTermination(8)
            result = await Swarm([triage, worker], termination_condition=done).run(
                task="What is 17 + 25?"
            )
        await triage_client.close()
        await worker_client.close()

    assert result.messages[-1].content == "42 DONE"
    calls = await store.get_llm_calls(rid)
    assert [c.agent_name for c in calls] == ["triage", "worker", "worker"]
    handoff = tool_span(ctx.spans, "transfer_to_worker")
    assert handoff.status == "ok"
    assert "Transferred to worker" in handoff.attributes["gen_ai.tool.call.result"]
    assert tool_span(ctx.spans, "add").attributes["gen_ai.tool.call.result"] == "42"


async def test_model_client_takes_the_llms_settings_and_agent_name() -> None:
    store = InMemoryStore()
    sampling = {"temperature": 0.5, "max_tokens": 64, "seed": 3, "n": 4, "top_k": 5}
    async with FakeBackend() as fb, serve_gateway(Gateway(store, [fb.url])) as base:
        rid, aid = await new_rollout(store)
        llm = LLM(endpoint=f"{base}/v1", model="m", gateway=True, sampling_parameters=sampling)
        client = vla.model_client(llm.scoped(rid, aid), agent_name="writer", top_p=0.9)
        assert client.model_info == vla.DEFAULT_MODEL_INFO
        with activate(context(rid, aid)):
            await AssistantAgent("writer", model_client=client).run(task="Say hi.")
        await client.close()

    [call] = await store.get_llm_calls(rid)
    assert (call.attempt_id, call.agent_name) == (aid, "writer")
    body = fb.requests[-1]["body"]
    assert {k: body[k] for k in ("temperature", "max_tokens", "seed", "top_k", "top_p")} == {
        "temperature": 0.5,
        "max_tokens": 64,
        "seed": 3,
        "top_k": 5,
        "top_p": 0.9,
    }
    assert "n" not in body


async def test_debug_events_read_for_tool_results_do_not_reach_user_handlers() -> None:
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    handler = Keep(level=logging.DEBUG)
    events = logging.getLogger(EVENT_LOGGER_NAME)
    parent = events.parent
    assert parent is not None
    saved = parent.level
    parent.setLevel(logging.WARNING)  # what the events logger let through before instrument()
    events.addHandler(handler)
    store = InMemoryStore()
    try:
        async with FakeBackend() as fb, serve_gateway(Gateway(store, [fb.url])) as base:
            fb.script = tool_then_answer(ARGS, "42")
            rid, aid = await new_rollout(store)
            llm = LLM(endpoint=f"{base}/v1", model="m", gateway=True).scoped(rid, aid)
            ctx = context(rid, aid)
            client = vla.model_client(llm)
            with activate(ctx):
                await solver(client, [add]).run(task="What is 17 + 25?")
            await client.close()
    finally:
        events.removeHandler(handler)
        parent.setLevel(saved)
    assert tool_span(ctx.spans, "add").attributes["gen_ai.tool.call.result"] == "42"
    assert [r for r in seen if r.levelno < logging.WARNING] == []


MCP_SERVER = '''
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("calc")


@server.tool()
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@server.tool()
def divide(a: int, b: int) -> float:
    """Divide a by b."""
    if b == 0:
        raise ToolError("division by zero")
    return a / b


server.run()
'''


def multiply_then_divide(req: dict[str, Any]) -> dict[str, str]:
    """Call multiply, then divide by zero, then answer with the first tool result."""
    results = [m["content"] for m in req["messages"] if m["role"] == "tool"]
    if not results:
        return {"tool": "multiply", "arguments": '{"a": 6, "b": 7}'}
    if len(results) == 1:
        return {"tool": "divide", "arguments": '{"a": 1, "b": 0}'}
    return {"text": results[0]}


async def test_mcp_tools_from_an_mcp2_stdio_server(tmp_path: Path) -> None:
    script = tmp_path / "calc_server.py"
    script.write_text(MCP_SERVER)
    server = StdioServerParameters(command=sys.executable, args=[str(script)])
    store = InMemoryStore()
    async with (
        FakeBackend() as fb,
        serve_gateway(Gateway(store, [fb.url])) as base,
        vla.mcp_tools(server, names=["divide", "multiply"]) as tools,
    ):
        assert [t.name for t in tools] == ["multiply", "divide"]  # in the server's order
        assert tools[0].schema["parameters"]["required"] == ["a", "b"]
        fb.script = multiply_then_divide
        rid, aid = await new_rollout(store)
        llm = LLM(endpoint=f"{base}/v1", model="m", gateway=True).scoped(rid, aid)
        ctx = context(rid, aid)
        client = vla.model_client(llm, agent_name="calc")
        agent = AssistantAgent("calc", model_client=client, tools=tools, max_tool_iterations=3)
        with activate(ctx):
            result = await agent.run(task="What is 6 * 7?")
        await client.close()

    assert result.messages[-1].content == "42"
    assert len(await store.get_llm_calls(rid)) == 3
    good, bad = tool_span(ctx.spans, "multiply"), tool_span(ctx.spans, "divide")
    assert good.status == "ok" and good.attributes["gen_ai.tool.call.result"] == "42"
    assert bad.status == "error" and bad.attributes["voltrl.tool.is_error"] is True
    assert "division by zero" in bad.attributes["gen_ai.tool.call.result"]
    assert bad.attributes["error.type"] == "McpToolError"


async def test_mcp_tools_raise_plain_errors_not_exception_groups(tmp_path: Path) -> None:
    script = tmp_path / "calc_server.py"
    script.write_text(MCP_SERVER)
    server = StdioServerParameters(command=sys.executable, args=[str(script)])
    with pytest.raises(KeyError, match="from the block"):
        async with vla.mcp_tools(server, names=["multiply"]) as tools:
            assert [t.name for t in tools] == ["multiply"]
            raise KeyError("from the block")
