"""The LangChain / LangGraph adapter: real LangChain agents and LangGraph graphs through our
gateway to the scripted fake backend; spans from the callback handler; the MCP tool bridge
against a real MCP stdio server written with the ``mcp`` 2.x SDK."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from pathlib import Path
from typing import Any, TypedDict

from fake_openai_backend import FakeBackend, scripted_ids, tool_then_answer
from gateway_env import new_rollout
from helpers import context, fake_trainer, serve_gateway
from langchain.agents import create_agent
from langchain_core.tools import tool
from langgraph.graph import END, START, StateGraph
from mcp import StdioServerParameters

import voltrl as vl
from voltrl.adapters.langchain import chat_model, instrument, mcp_tools, tracing_config
from voltrl.gateway import Gateway
from voltrl.store.memory import InMemoryStore
from voltrl.tracing import RolloutContext, activate
from voltrl.types import Span

ARGS = '{"city": "Paris"}'
ANSWER = "It is sunny in Paris."


def by_name(spans: list[Span]) -> dict[str, list[Span]]:
    out: dict[str, list[Span]] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


async def test_create_agent_through_trainer_records_calls_spans_and_reward(tmp_path: Path):
    both_at_tool = asyncio.Barrier(2)  # the two rollouts really run at the same time

    @tool
    async def get_weather(city: str) -> str:
        """The weather in a city."""
        await asyncio.wait_for(both_at_tool.wait(), 30)
        return f"sunny in {city}"

    @vl.rollout
    async def agent(task: dict[str, Any], llm: vl.LLM) -> float:
        graph = create_agent(chat_model(llm), tools=[get_weather], name="weather")
        out = await graph.ainvoke(
            {"messages": [{"role": "user", "content": task["question"]}]},
            config=tracing_config(),
        )
        return float("sunny" in out["messages"][-1].content)

    store = InMemoryStore()
    async with FakeBackend() as fb:
        fb.script = tool_then_answer(ARGS, ANSWER)
        trainer = fake_trainer(store, tmp_path, vl.LLM(endpoint=fb.url, model="fake-model"))
        questions = ["Weather in Paris, please?", "Is it raining in Paris?"]
        result = await trainer.dev_async(agent, [{"question": q} for q in questions])

    assert [r.status for r in result.rollouts] == ["succeeded"] * 2
    assert result.rewards == [1.0, 1.0]
    for rollout in result.rollouts:
        question = rollout.task.input["question"]
        calls = await store.get_llm_calls(rollout.rollout_id)
        assert len(calls) == 2
        assert {c.attempt_id for c in calls} == {rollout.final_attempt_id}
        assert all(question in str(c.request["messages"]) for c in calls)
        assert {c.agent_name for c in calls} == {"weather"}
        assert [c.response_token_ids for c in calls] == [scripted_ids(ARGS), scripted_ids(ANSWER)]
        assert all(c.prompt_token_ids for c in calls)

        spans = by_name(await store.get_spans(rollout.rollout_id))
        [tool_span] = spans["tool:get_weather"]
        assert tool_span.status == "ok"
        assert tool_span.attributes["tool.output"] == "sunny in Paris"
        assert "Paris" in tool_span.attributes["tool.input"]
        [node] = spans["node:tools"]
        [root] = spans["chain:weather"]
        assert (tool_span.parent_id, node.parent_id, root.parent_id) == (
            node.span_id,
            root.span_id,
            None,
        )
        llm_spans = [s for name, ss in spans.items() if name.startswith("llm:") for s in ss]
        assert len(llm_spans) == 2 and {s.attributes["agent_name"] for s in llm_spans} == {
            "weather"
        }
        assert {s.trace_id for ss in spans.values() for s in ss} == {tool_span.trace_id}


class Draft(TypedDict):
    question: str
    draft: str
    verdict: str


async def test_shared_model_names_calls_after_langgraph_nodes_and_keeps_rollouts_apart():
    """One model for every node and rollout: async, sync-in-a-thread and streamed graphs."""
    store = InMemoryStore()
    async with FakeBackend() as fb, serve_gateway(Gateway(store, [fb.url])) as base:
        llm = vl.LLM(
            endpoint=f"{base}/v1",
            model="fake-model",
            gateway=True,
            sampling_parameters={"temperature": 0.5, "max_tokens": 16, "top_k": 5},
        )
        model = chat_model(llm)  # one model, made outside any rollout, shared by all

        def write(state: Draft) -> dict[str, str]:
            return {"draft": model.invoke(f"Write: {state['question']}").content}

        def check(state: Draft) -> dict[str, str]:
            return {"verdict": model.invoke(f"Check: {state['draft']}").content}

        builder = StateGraph(Draft)
        builder.add_node("write", write)
        builder.add_node("check", check)
        builder.add_edge(START, "write")
        builder.add_edge("write", "check")
        builder.add_edge("check", END)
        graph = builder.compile()
        instrument()  # every LangChain run is traced; no config needed

        rollouts = [await new_rollout(store, f"r{i}") for i in range(3)]
        contexts = [context(rid, aid) for rid, aid in rollouts]

        async def run(k: int, ctx: RolloutContext) -> None:
            with activate(ctx):
                inputs = {"question": f"question {k}", "draft": "", "verdict": ""}
                if k == 0:
                    await graph.ainvoke(inputs)
                elif k == 1:  # a sync graph in a thread of the rollout
                    await asyncio.to_thread(graph.invoke, inputs)
                else:  # streamed: LangChain gives the model no run manager then
                    assert [c async for c in graph.astream(inputs, stream_mode="messages")]

        await asyncio.gather(*(run(k, ctx) for k, ctx in enumerate(contexts)))

        assert fb.requests[0]["body"]["temperature"] == 0.5
        assert fb.requests[0]["body"]["max_completion_tokens"] == 16
        assert fb.requests[0]["body"]["top_k"] == 5
        assert sum(bool(r["body"].get("stream")) for r in fb.requests) == 2
        for k, (rid, aid) in enumerate(rollouts):
            calls = sorted(await store.get_llm_calls(rid), key=lambda c: c.sequence_id or 0)
            assert [c.agent_name for c in calls] == ["write", "check"]
            assert {c.attempt_id for c in calls} == {aid}
            assert f"question {k}" in str(calls[0].request["messages"])
            spans = by_name(contexts[k].spans)  # the runner stores them with the attempt result
            [write_span] = spans["node:write"]
            [llm_span] = [
                s for s in spans["llm:GatewayChatOpenAI"] if s.parent_id == write_span.span_id
            ]
            assert llm_span.attributes["agent_name"] == "write"
            assert write_span.attributes["langgraph.node"] == "write"
            assert write_span.parent_id == spans["chain:LangGraph"][0].span_id
            assert {s.attempt_id for ss in spans.values() for s in ss} == {aid}


MCP_SERVER = textwrap.dedent(
    '''
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    server = MCPServer("calculator")


    @server.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b


    @server.tool()
    def divide(a: int, b: int) -> float:
        """Divide a by b."""
        if b == 0:
            raise ToolError("division by zero")
        return a / b


    if __name__ == "__main__":
        server.run("stdio")
    '''
)


async def test_mcp_bridge_runs_stdio_server_tools_inside_an_agent(tmp_path: Path):
    script = tmp_path / "calc_server.py"
    script.write_text(MCP_SERVER)
    server = StdioServerParameters(command=sys.executable, args=[str(script)])
    store = InMemoryStore()
    async with (
        FakeBackend() as fb,
        serve_gateway(Gateway(store, [fb.url])) as base,
        mcp_tools(server) as tools,
    ):
        assert sorted(t.name for t in tools) == ["add", "divide"]
        assert {t.name: t.description for t in tools}["add"] == "Add two integers."
        llm = vl.LLM(endpoint=f"{base}/v1", model="fake-model", gateway=True)

        async def ask(script_args: str, tool_name: str, answer: str) -> RolloutContext:
            fb.script = tool_then_answer(script_args, answer, tool=tool_name)
            ctx = context(*await new_rollout(store, tool_name))
            with activate(ctx):
                graph = create_agent(chat_model(llm, agent_name="solver"), tools=tools)
                await graph.ainvoke(
                    {"messages": [{"role": "user", "content": "compute"}]},
                    config=tracing_config(),
                )
            return ctx

        added = await ask('{"a": 2, "b": 3}', "add", "5")
        divided = await ask('{"a": 1, "b": 0}', "divide", "cannot divide")

        [ok] = by_name(added.spans)["tool:add"]
        assert (ok.status, ok.attributes["tool.output"]) == ("ok", "5")
        [failed] = by_name(divided.spans)["tool:divide"]
        assert failed.status == "error"
        assert "division by zero" in failed.attributes["tool.output"]
        calls = await store.get_llm_calls(divided.rollout_id)
        assert {c.agent_name for c in calls} == {"solver"}
        tool_message = calls[-1].request["messages"][-1]
        assert tool_message["role"] == "tool" and "division by zero" in tool_message["content"]
