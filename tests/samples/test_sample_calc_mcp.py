"""samples/calc_mcp: the Agent Framework agent with its MCP calculator server (its own over
stdio, or one shared over streamable HTTP) runs through ``Trainer.dev`` against the scripted
backend; the server is a real subprocess."""

from __future__ import annotations

import re
import socket
import ssl
import subprocess
from pathlib import Path
from typing import Any

import httpcore2
import pytest
from fake_openai_backend import FakeBackend, scripted_ids, tool_then_answer
from helpers import fake_trainer, load_sample

import voltrl as vl
from voltrl.adapters.openai_client import ssl_context
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


async def test_sample_agent_shares_one_mcp_server_over_http(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``calc_agent_at(url)``: every rollout calls the one server ``shared_calculator`` started
    (streamable HTTP on loopback), which outlives them; stopping it ends the process. The
    rollouts' MCP connections share one TLS context (building one reads the CA certificates),
    as the model clients do."""
    agent, data = load_sample("calc_mcp", "agent"), load_sample("calc_mcp", "data")
    tasks = data.make_problems(3, seed=5)
    store = InMemoryStore()
    built: list[ssl.SSLContext] = []
    default = httpcore2.default_ssl_context
    monkeypatch.setattr(
        httpcore2, "default_ssl_context", lambda **kw: built.append(default(**kw)) or built[-1]
    )
    ssl_context.cache_clear()
    with agent.shared_calculator() as url:
        assert url.startswith("http://127.0.0.1:") and url.endswith("/mcp")
        async with FakeBackend() as fb:
            fb.script = lambda req: tool_then_answer(
                '{"expression": "' + _task_of(req, tasks)["expression"] + '"}',
                f"Answer: {_task_of(req, tasks)['answer']}",
            )(req)
            llm = vl.LLM(endpoint=fb.url, model="fake-model")
            trainer = fake_trainer(store, tmp_path, llm, name="calc-mcp-shared")
            result = await trainer.dev_async(agent.calc_agent_at(url), tasks)
        assert [r.reward for r in result.rollouts] == [1.0, 1.0, 1.0]
        assert len(built) == 1  # one for the model clients and the MCP connections
        for rollout in result.rollouts:
            spans = await store.get_spans(rollout.rollout_id)
            [tool_span] = [s for s in spans if s.name == "execute_tool calculate"]
            assert tool_span.status != "error"
        port = int(url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(OSError):  # the server is gone with the block
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    # ...and the agent depends on it: with the server gone, its rollouts fail.
    async with FakeBackend() as fb:
        fb.script = lambda req: tool_then_answer(
            '{"expression": "1 + 1"}', f"Answer: {_task_of(req, tasks)['answer']}"
        )(req)
        llm = vl.LLM(endpoint=fb.url, model="fake-model")
        trainer = fake_trainer(store, tmp_path, llm, name="calc-mcp-server-gone")
        with pytest.raises(vl.TooManyFailuresError, match="Failed to create MCP session"):
            await trainer.dev_async(agent.calc_agent_at(url), tasks[:1])
    [gone] = await store.query_rollouts(status="failed")
    attempts = await store.get_attempts(gone.rollout_id)
    assert "Failed to create MCP session" in (attempts[-1].error or "")


def _task_of(req: dict[str, Any], tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """The task whose question is the request's user message."""
    question = next(m["content"] for m in req["messages"] if m["role"] == "user")
    text = question if isinstance(question, str) else question[0]["text"]
    return next(t for t in tasks if t["question"] == text)


def test_shared_calculator_that_cannot_start_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that exits before printing its URL: an error naming its exit code and its log,
    which holds what it printed."""
    agent = load_sample("calc_mcp", "agent")
    stub = tmp_path / "broken_server.py"
    stub.write_text("import sys\nprint('no such port', file=sys.stderr)\nsys.exit(3)\n")
    monkeypatch.setattr(agent, "SERVER", stub)
    log = tmp_path / "server.log"
    expected = f"exited with code 3 before it served.*{re.escape(str(log))}"
    with pytest.raises(RuntimeError, match=expected), agent.shared_calculator(log=log):
        pytest.fail("the block ran without a server")
    assert "no such port" in log.read_text()


class _StartedProcesses:
    """Stands in for ``subprocess`` in the sample's module, keeping the processes it starts."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen[Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    def Popen(self, *args: Any, **kwargs: Any) -> subprocess.Popen[Any]:
        process = subprocess.Popen(*args, **kwargs)
        self.processes.append(process)
        return process


def test_shared_calculator_warns_when_its_server_died_during_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Lines before the URL are skipped; a server gone before the block ends is reported."""
    agent = load_sample("calc_mcp", "agent")
    stub = tmp_path / "dying_server.py"
    stub.write_text("print('starting')\nprint('http://127.0.0.1:9/mcp', flush=True)\n")
    monkeypatch.setattr(agent, "SERVER", stub)
    started = _StartedProcesses()
    monkeypatch.setattr(agent, "subprocess", started)
    with agent.shared_calculator() as url:
        assert url == "http://127.0.0.1:9/mcp"
        [server] = started.processes
        assert server.wait(60) == 0  # the stub exits once it printed its URL
    assert "the calculator server had exited with code 0 before the end" in capfd.readouterr().err


def test_max_number_caps_every_number_a_problem_draws() -> None:
    data = load_sample("calc_mcp", "data")
    rows = data.make_problems(300, seed=3, max_number=20)
    assert rows == data.make_problems(300, seed=3, max_number=20) != data.make_problems(300, 3)
    for row in rows:
        question = row["question"]
        drawn = [int(n) for n in re.findall(r"\d+", question)]
        if "shares" in question:  # the cookies shared are the children x each one's share
            drawn = drawn[1:]
        if "pays with" in question:  # paid is the price x the count + the change
            drawn = drawn[:-1]
        if "drives at" in question:  # speeds start at 30 km per hour
            assert drawn[0] == 30
            drawn = drawn[1:]
        assert max(drawn) <= 20, question
        assert eval(row["expression"]) == row["answer"] >= 0  # the expression solves it
