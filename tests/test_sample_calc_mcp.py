"""samples/calc_mcp: the Agent Framework agent with its MCP stdio calculator server runs once
through ``Trainer.dev`` against the scripted backend; the server is a real subprocess."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from fake_openai_backend import FakeBackend, scripted_ids, tool_then_answer

import voltrl as vl
from voltrl.store.memory import InMemoryStore

SAMPLE = Path(__file__).resolve().parents[1] / "samples" / "calc_mcp"


def load(name: str) -> ModuleType:
    """A module of the sample, imported by path (its directory first on ``sys.path``)."""
    if str(SAMPLE) not in sys.path:
        sys.path.insert(0, str(SAMPLE))
    spec = importlib.util.spec_from_file_location(f"calc_mcp_{name}", SAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_sample_agent_runs_through_dev_with_the_mcp_server(tmp_path: Path) -> None:
    agent, data = load("agent"), load("data")
    [task] = data.make_problems(1, seed=3)
    arguments = '{"expression": "' + task["expression"] + '"}'
    store = InMemoryStore()
    async with FakeBackend() as fb:
        fb.script = tool_then_answer(arguments, f"Answer: {task['answer']}")
        trainer = vl.Trainer(
            n_runners=1,
            inline=True,
            store=store,
            resources={"main_llm": vl.LLM(endpoint=fb.url, model="fake-model")},
            run_dir=tmp_path,
            name="calc-mcp",
            progress=False,
        )
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
