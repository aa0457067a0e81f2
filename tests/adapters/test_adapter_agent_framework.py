"""Microsoft Agent Framework adapter: real ``Agent``s with function and MCP tools, through the
real gateway to the scripted backend. Calls are stored with token ids and the agent's name,
the framework's own spans (agent run, model calls, tool calls with results and failures) land
in the rollout, and concurrent rollouts sharing one client stay apart."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from agent_framework import Agent, MCPStdioTool, tool
from agent_framework.openai import OpenAIChatCompletionClient
from fake_openai_backend import FakeBackend, scripted_ids, tool_then_answer
from gateway_env import new_rollout
from helpers import ROOT, context, fake_trainer, serve_gateway
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

import voltrl as vl
from voltrl.adapters.agent_framework import chat_client, chat_options, instrument
from voltrl.gateway import Gateway
from voltrl.otel import RolloutSpanProcessor
from voltrl.resources import LLM
from voltrl.store.memory import InMemoryStore
from voltrl.tracing import RolloutContext, activate
from voltrl.types import Span

CALCULATOR_SERVER = ROOT / "samples" / "calc_mcp" / "calculator_server.py"


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def divide(a: int, b: int) -> float:
    """Divide a by b."""
    return a / b


def named(spans: list[Span], name: str) -> Span:
    [span] = [s for s in spans if s.name == name]
    return span


def test_sampling_parameters_become_chat_options() -> None:
    llm = LLM(
        endpoint="http://127.0.0.1:1/v1",
        model="m",
        sampling_parameters={"temperature": 0.7, "max_completion_tokens": 64, "top_k": 20},
    )
    assert chat_options(llm) == {
        "temperature": 0.7,
        "max_tokens": 64,
        "extra_body": {"top_k": 20},
    }
    client = chat_client(llm)
    assert isinstance(client, OpenAIChatCompletionClient)  # chat completions, not /responses
    assert str(client.client.base_url) == "http://127.0.0.1:1/v1/"


@pytest.mark.parametrize("stream", [False, True])
async def test_agent_with_a_function_tool_through_trainer_dev(tmp_path: Path, stream: bool) -> None:
    """Two tasks through Trainer.dev: each rollout has its calls, spans and reward."""

    @vl.rollout
    async def solver(task: dict[str, Any], llm: vl.LLM) -> float:
        instrument()
        client = chat_client(llm, agent_name="solver")
        agent = Agent(
            client=client,
            name="solver",
            instructions="Use the add tool.",
            tools=[add],
            default_options={"temperature": 0.2},  # the agent's own option wins
        )
        async with client.client:
            if stream:
                updates = agent.run(task["question"], stream=True)
                async for _ in updates:
                    pass
                response = await updates.get_final_response()
            else:
                response = await agent.run(task["question"])
        return float(response.text == "The sum is 5.")

    store = InMemoryStore()
    llm = LLM(
        endpoint="",
        model="fake-model",
        sampling_parameters={"temperature": 1.0, "max_tokens": 32, "top_k": 7},
    )
    async with FakeBackend() as fb:
        fb.script = tool_then_answer('{"a": 2, "b": 3}', "The sum is 5.")
        trainer = fake_trainer(
            store, tmp_path, llm.model_copy(update={"endpoint": fb.url}), name="af"
        )
        result = await trainer.dev_async(solver, [{"question": "2+3?"}, {"question": "3+2?"}])
    assert {req["path"] for req in fb.requests} == {"/v1/chat/completions"}
    body = fb.requests[0]["body"]
    assert (body["temperature"], body["max_completion_tokens"], body["top_k"]) == (0.2, 32, 7)
    assert body["stream"] is stream
    assert len(result.rollouts) == 2
    for rollout in result.rollouts:
        assert rollout.status == "succeeded" and rollout.reward == 1.0
        calls = await store.get_llm_calls(rollout.rollout_id)
        assert [c.agent_name for c in calls] == ["solver", "solver"]
        assert [c.response_token_ids for c in calls] == [
            scripted_ids('{"a": 2, "b": 3}'),
            scripted_ids("The sum is 5."),
        ]
        assert {c.attempt_id for c in calls} == {rollout.final_attempt_id}
        spans = await store.get_spans(rollout.rollout_id)
        run = named(spans, "invoke_agent solver")
        call = named(spans, "execute_tool add")
        assert call.attributes["gen_ai.tool.call.result"] == "5"
        assert json.loads(call.attributes["gen_ai.tool.call.arguments"]) == {"a": 2, "b": 3}
        assert call.status != "error"
        assert [s.name for s in spans].count("chat fake-model") == 2
        assert {s.trace_id for s in spans} == {run.trace_id}
        assert {s.attempt_id for s in spans} == {rollout.final_attempt_id}


def add_the_numbers(request: dict[str, Any]) -> dict[str, str]:
    """A backend script: call ``slow_add`` on the two numbers of the user's question, then
    state the tool's result."""
    messages = request["messages"]
    results = [m["content"] for m in messages if m["role"] == "tool"]
    if results:
        return {"text": f"It is {results[-1]}."}
    question = next(m["content"] for m in messages if m["role"] == "user")
    a, b = map(int, re.findall(r"\d+", question))
    return {"tool": "slow_add", "arguments": json.dumps({"a": a, "b": b})}


async def test_one_shared_client_keeps_concurrent_rollouts_apart() -> None:
    """One client made outside any rollout; two rollouts are inside their tool call at once."""
    instrument()
    both_in_tool = asyncio.Barrier(2)

    @tool
    async def slow_add(a: int, b: int) -> int:
        """Add two integers, slowly."""
        await both_in_tool.wait()
        return a + b

    store = InMemoryStore()
    async with FakeBackend() as fb, serve_gateway(Gateway(store, [fb.url])) as base:
        fb.script = add_the_numbers
        client = chat_client(LLM(endpoint=f"{base}/v1", model="m", gateway=True), "solver")
        rollouts = [await new_rollout(store, name) for name in ("first", "second")]
        contexts = [context(rid, aid) for rid, aid in rollouts]

        async def run(ctx: RolloutContext, a: int, b: int) -> str:
            agent = Agent(client=client, name="solver", tools=[slow_add])
            with activate(ctx):
                return (await agent.run(f"What is {a} + {b}?")).text

        both = asyncio.gather(run(contexts[0], 2, 3), run(contexts[1], 40, 2))
        answers = await asyncio.wait_for(both, 60)  # the barrier never opens if they are serial
        await client.client.close()
    assert answers == ["It is 5.", "It is 42."]
    for ctx, total in zip(contexts, ("5", "42"), strict=True):
        calls = await store.get_llm_calls(ctx.rollout_id)
        assert len(calls) == 2
        assert {(c.attempt_id, c.agent_name) for c in calls} == {(ctx.attempt_id, "solver")}
        assert calls[1].response_token_ids == scripted_ids(f"It is {total}.")
        assert (
            named(ctx.spans, "execute_tool slow_add").attributes["gen_ai.tool.call.result"] == total
        )
        assert {s.attributes["voltrl.rollout_id"] for s in ctx.spans} == {ctx.rollout_id}


async def test_a_failing_tool_is_an_error_span_and_the_model_is_told() -> None:
    provider = instrument()
    # Spans go to our processor; none of the SDK's exporting processors is on the provider.
    processors = provider._active_span_processor._span_processors
    assert any(isinstance(p, RolloutSpanProcessor) for p in processors)
    assert not any(isinstance(p, SimpleSpanProcessor | BatchSpanProcessor) for p in processors)
    store = InMemoryStore()
    async with FakeBackend() as fb, serve_gateway(Gateway(store, [fb.url])) as base:
        fb.script = tool_then_answer('{"a": 1, "b": 0}', "I cannot divide by zero.")
        rid, aid = await new_rollout(store)
        llm = LLM(endpoint=f"{base}/v1", model="m", gateway=True).scoped(rid, aid)
        agent = Agent(client=chat_client(llm), name="divider", tools=[divide])
        ctx = context(rid, aid)
        with activate(ctx):
            response = await agent.run("What is 1 / 0?")
    assert response.text == "I cannot divide by zero."
    failed = named(ctx.spans, "execute_tool divide")
    assert failed.status == "error"
    assert failed.attributes["error.type"] == "ZeroDivisionError"
    assert failed.attributes["gen_ai.tool.call.id"]  # the trajectory builder's AIR uses it
    calls = await store.get_llm_calls(rid)
    [tool_message] = [m for m in calls[1].request["messages"] if m["role"] == "tool"]
    assert tool_message["content"].startswith("Error")


@pytest.mark.slow
async def test_mcp_stdio_calculator_server_as_the_tool() -> None:
    """Agent Framework's own MCPStdioTool (mcp 2.x) runs the sample's calculator server."""
    instrument()
    store = InMemoryStore()
    async with FakeBackend() as fb, serve_gateway(Gateway(store, [fb.url])) as base:
        results = {}
        for expression in ("(12 + 7) * 3", "1 / 0"):
            arguments = json.dumps({"expression": expression})
            fb.script = tool_then_answer(arguments, "Done.")
            rid, aid = await new_rollout(store, expression)
            llm = LLM(endpoint=f"{base}/v1", model="m", gateway=True).scoped(rid, aid)
            calculator = MCPStdioTool(
                name="calculator",
                command=sys.executable,
                args=[str(CALCULATOR_SERVER)],
                load_prompts=False,
            )
            client = chat_client(
                llm, "solver", function_invocation_configuration={"include_detailed_errors": True}
            )
            ctx = context(rid, aid)
            with activate(ctx):
                async with Agent(client=client, name="solver", tools=calculator) as agent:
                    await agent.run(f"What is {expression}?")
            calls = await store.get_llm_calls(rid)
            assert [c.agent_name for c in calls] == ["solver", "solver"]
            assert calls[0].response_token_ids == scripted_ids(arguments)
            [tool_message] = [m for m in calls[1].request["messages"] if m["role"] == "tool"]
            results[expression] = (
                tool_message["content"],
                named(ctx.spans, "execute_tool calculate"),
            )
    content, span = results["(12 + 7) * 3"]
    assert content == "57" and span.attributes["gen_ai.tool.call.result"] == "57"
    assert span.status != "error"
    content, span = results["1 / 0"]
    assert "division by zero" in content
    assert span.status == "error" and span.attributes["gen_ai.tool.name"] == "calculate"
