"""samples/calc_mcp: the Agent Framework agent with its MCP stdio calculator server runs once
through ``Trainer.dev`` against the scripted backend; the server is a real subprocess."""

from __future__ import annotations

from pathlib import Path

from fake_openai_backend import FakeBackend, scripted_ids, tool_then_answer
from helpers import fake_trainer, load_sample

import voltrl as vl
from voltrl.store.memory import InMemoryStore


async def test_sample_agent_runs_through_dev_with_the_mcp_server(tmp_path: Path) -> None:
    agent, data = load_sample("calc_mcp", "agent"), load_sample("calc_mcp", "data")
    [task] = data.make_problems(1, seed=3)
    arguments = '{"expression": "' + task["expression"] + '"}'
    store = InMemoryStore()
    async with FakeBackend() as fb:
        fb.script = tool_then_answer(arguments, f"Answer: {task['answer']}")
        llm = vl.LLM(endpoint=fb.url, model="fake-model")
        trainer = fake_trainer(store, tmp_path, llm, name="calc-mcp")
        result = await trainer.dev_async(agent.calc_agent, [task])
    [rollout] = result.rollouts
    assert rollout.status == "succeeded" and rollout.reward == 1.0
    calls = await store.get_llm_calls(rollout.rollout_id)
    assert [c.agent_name for c in calls] == ["solver", "solver"]
    assert calls[0].response_token_ids == scripted_ids(arguments)
    assert calls[1].response_token_ids == scripted_ids(f"Answer: {task['answer']}")
    # The calculator's result, computed by the MCP server process, went back to the model.
    tool_message = next(m for m in calls[1].request["messages"] if m["role"] == "tool")
    assert tool_message["content"] == str(task["answer"])
    spans = await store.get_spans(rollout.rollout_id)
    [tool_span] = [s for s in spans if s.name == "execute_tool calculate"]
    assert tool_span.attributes["gen_ai.tool.call.result"] == str(task["answer"])
    assert tool_span.status != "error"
    assert {"invoke_agent solver", "chat fake-model"} <= {s.name for s in spans}
