"""The OpenAI Agents SDK adapter: a real ``agents.Agent`` with a function tool run by the real
``Runner`` through our gateway against the scripted fake backend (a tool call, then an answer).

Checks the stored LLM calls (token ids, agent name), the SDK's spans in the rollout (the tool
call with its output), the reward, that concurrent rollouts sharing one model stay apart, and
that the SDK's default exporter no longer sends traces anywhere."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from agents import (
    Agent,
    GuardrailFunctionOutput,
    ModelSettings,
    RunContextWrapper,
    Runner,
    function_tool,
    handoff,
    input_guardrail,
)
from agents.tracing import processors as sdk_processors
from fake_openai_backend import FakeBackend, scripted_ids, tool_then_answer
from gateway_env import new_rollout
from helpers import ADD_ARGS as ARGS
from helpers import context, dev_adding_twice, serve_gateway

import voltrl as vl
from voltrl.adapters import openai_agents as vla
from voltrl.gateway import Gateway
from voltrl.resources import LLM
from voltrl.store.memory import InMemoryStore
from voltrl.tracing import RolloutContext, activate


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@function_tool
def broken(a: int, b: int) -> int:
    """A tool that always fails."""
    raise RuntimeError("the adder is broken")


@vl.rollout
async def solver(task: dict, llm: vl.LLM) -> float:
    """The smallest SDK agent: one function tool, reward 1 for the right number."""
    agent = Agent(
        name="solver",
        instructions="Use the add tool, then answer with the number only.",
        model=vla.model(llm),
        tools=[add],
    )
    result = await Runner.run(agent, task["question"])
    return float(result.final_output.strip() == str(task["answer"]))


@input_guardrail
def on_topic(ctx: RunContextWrapper, agent: Agent, text: object) -> GuardrailFunctionOutput:
    """A guardrail that lets arithmetic through."""
    return GuardrailFunctionOutput(output_info=None, tripwire_triggered="+" not in str(text))


@pytest.fixture(autouse=True)
def tracing() -> Iterator[vla.VoltRLTracingProcessor]:
    yield vla.install_tracing()


@pytest.mark.slow
async def test_agent_through_trainer_records_calls_spans_and_reward(tmp_path: Path) -> None:
    """In a runner process, where only ``vla.model`` installs the tracing processor."""
    store = InMemoryStore()

    result = await dev_adding_twice(solver, store, tmp_path)
    for rollout in result.rollouts:
        stored = await store.get_spans(rollout.rollout_id)
        spans = {s.name: s for s in stored}
        tool = spans["function:add"]
        assert tool.status == "ok" and tool.attributes["gen_ai.tool.name"] == "add"
        assert json.loads(tool.attributes["openai_agents.input"]) == {"a": 17, "b": 25}
        assert tool.attributes["openai_agents.output"] == "42"
        assert {"agent:solver", "trace:Agent workflow"} <= set(spans)
        assert sum(s.name == "generation" for s in stored) == 2
        by_id = {s.span_id: s for s in stored}
        chain, span = [], tool
        while span is not None:
            chain.append(span.name)
            span = by_id.get(span.parent_id or "")
        assert chain == [
            "function:add",
            "turn:1",
            "agent:solver",
            "task:Agent workflow",
            "trace:Agent workflow",
        ]


async def test_concurrent_rollouts_sharing_one_model_stay_apart() -> None:
    store = InMemoryStore()
    async with FakeBackend() as fb, serve_gateway(Gateway(store, [fb.url])) as base:
        fb.script = tool_then_answer(ARGS, "42")
        shared = vla.model(LLM(endpoint=f"{base}/v1", model="m", gateway=True))
        rollouts = [await new_rollout(store, f"r{i}") for i in range(2)]
        contexts = [context(rid, aid) for rid, aid in rollouts]

        async def one(ctx: RolloutContext, name: str) -> str:
            agent = Agent(name=name, instructions="Add.", model=shared, tools=[add])
            with activate(ctx):
                result = await Runner.run(agent, "What is 17 + 25?")
            return result.final_output

        outputs = await asyncio.gather(one(contexts[0], "alpha"), one(contexts[1], "beta"))
        await shared.aclose()

    assert outputs == ["42", "42"]
    for (rid, aid), ctx, name in zip(rollouts, contexts, ["alpha", "beta"], strict=True):
        calls = await store.get_llm_calls(rid)
        assert len(calls) == 2 and {c.attempt_id for c in calls} == {aid}
        assert {c.agent_name for c in calls} == {name}
        assert {s.rollout_id for s in ctx.spans} == {rid}
        assert [s.name for s in ctx.spans if s.name.startswith("agent:")] == [f"agent:{name}"]
        [tool] = [s for s in ctx.spans if s.name == "function:add"]
        assert tool.attributes["openai_agents.output"] == "42"


async def test_handoff_guardrail_and_failed_tool_spans_and_agent_names() -> None:
    store = InMemoryStore()
    async with FakeBackend() as fb, serve_gateway(Gateway(store, [fb.url])) as base:
        shared = vla.model(LLM(endpoint=f"{base}/v1", model="m", gateway=True))
        worker = Agent(name="worker", instructions="Add.", model=shared, tools=[broken])
        triage = Agent(
            name="triage",
            instructions="Hand off.",
            model=shared,
            handoffs=[handoff(worker)],
            input_guardrails=[on_topic],
        )

        def script(req: dict) -> dict[str, str]:
            names = [t["function"]["name"] for t in req.get("tools") or []]
            called = [
                tc["function"]["name"] for m in req["messages"] for tc in m.get("tool_calls") or []
            ]
            if "broken" in called:
                return {"text": "done"}
            if "transfer_to_worker" in names:
                return {"tool": "transfer_to_worker", "arguments": "{}"}
            return {"tool": "broken", "arguments": ARGS}

        fb.script = script
        rid, aid = await new_rollout(store)
        ctx = context(rid, aid)
        with activate(ctx):
            result = await Runner.run(triage, "What is 17 + 25?")
        await shared.aclose()

    assert result.final_output == "done"
    calls = await store.get_llm_calls(rid)
    assert [c.agent_name for c in calls] == ["triage", "worker", "worker"]
    names = [s.name for s in ctx.spans]
    assert "handoff:triage->worker" in names
    [guard] = [s for s in ctx.spans if s.name == "guardrail:on_topic"]
    assert guard.attributes["openai_agents.triggered"] is False
    [tool] = [s for s in ctx.spans if s.name == "function:broken"]
    assert tool.status == "error" and tool.events[0]["message"].startswith("Error running tool")


async def test_streamed_run_is_recorded_with_agent_name_and_token_ids() -> None:
    store = InMemoryStore()
    async with FakeBackend() as fb, serve_gateway(Gateway(store, [fb.url])) as base:
        fb.script = tool_then_answer(ARGS, "42")
        shared = vla.model(LLM(endpoint=f"{base}/v1", model="m", gateway=True))
        agent = Agent(name="streamer", instructions="Add.", model=shared, tools=[add])
        rid, aid = await new_rollout(store)
        ctx = context(rid, aid)
        with activate(ctx):
            result = Runner.run_streamed(agent, "What is 17 + 25?")
            async for _ in result.stream_events():
                pass
        await shared.aclose()
    assert result.final_output == "42"
    assert all(r["body"].get("stream") for r in fb.requests)
    calls = await store.get_llm_calls(rid)
    assert [c.response_token_ids for c in calls] == [scripted_ids(ARGS), scripted_ids("42")]
    assert {(c.attempt_id, c.agent_name) for c in calls} == {(aid, "streamer")}
    [tool] = [s for s in ctx.spans if s.name == "function:add"]
    assert tool.attributes["openai_agents.output"] == "42"


async def test_model_settings_and_fixed_agent_name() -> None:
    llm = LLM(
        endpoint="http://127.0.0.1:1/v1",
        model="m",
        sampling_parameters={"temperature": 0.5, "max_tokens": 64, "seed": 3, "n": 2, "top_k": 5},
    )
    settings = vla.model_settings(llm)
    assert (settings.temperature, settings.max_tokens) == (0.5, 64)
    assert settings.extra_args == {"seed": 3}
    store = InMemoryStore()
    async with FakeBackend() as fb, serve_gateway(Gateway(store, [fb.url])) as base:
        rid, aid = await new_rollout(store)
        scoped = LLM(endpoint=f"{base}/v1", model="m", gateway=True).scoped(rid, aid)
        fixed = vla.model(scoped, agent_name="writer")
        agent = Agent(
            name="sdk-name",
            instructions="Say hi.",
            model=fixed,
            model_settings=ModelSettings(temperature=0.1, top_p=0.9),
        )
        await Runner.run(agent, "hi")
        await fixed.aclose()
    [call] = await store.get_llm_calls(rid)
    assert (call.attempt_id, call.agent_name) == (aid, "writer")
    assert fb.requests[-1]["body"]["top_p"] == 0.9


class _Collector(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_POST(self) -> None:
        self.hits.append(self.path)
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


async def test_default_exporter_is_replaced_and_sends_nothing() -> None:
    """The SDK's own exporter, pointed at a loopback collector, exports a run's trace when it is
    installed, and nothing once ``install_tracing`` replaced it."""
    from agents import set_trace_processors, set_tracing_export_api_key

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    exporter = sdk_processors.default_exporter()
    saved = exporter.endpoint
    exporter.endpoint = f"http://127.0.0.1:{server.server_address[1]}/v1/traces/ingest"
    set_tracing_export_api_key("sk-test")
    store = InMemoryStore()
    try:
        async with FakeBackend() as fb, serve_gateway(Gateway(store, [fb.url])) as base:
            llm = LLM(endpoint=f"{base}/v1", model="m", gateway=True)
            rid, aid = await new_rollout(store)

            async def run_once() -> None:
                shared = vla.model(llm)
                with activate(context(rid, aid)):
                    await Runner.run(Agent(name="a", instructions="hi", model=shared), "hi")
                await shared.aclose()
                await asyncio.to_thread(sdk_processors.default_processor().force_flush)

            set_trace_processors([sdk_processors.default_processor()])
            await run_once()
            assert _Collector.hits, "the default exporter should export when installed"
            _Collector.hits.clear()

            processor = vla.install_tracing()
            before = processor.dropped
            await run_once()
            assert _Collector.hits == []
            assert processor.dropped == before
    finally:
        exporter.endpoint = saved
        set_tracing_export_api_key("")
        vla.install_tracing()
        server.shutdown()
        server.server_close()
