"""The agent_service sample: its OpenAI Agents SDK agent runs in its own process (the real
service on loopback, started the way ``run.py`` starts it), the trainer posts tasks to it, and
every LLM call the service makes is recorded against the right rollout by our gateway in front
of the scripted fake backend."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_openai_backend import FakeBackend, scripted_ids
from gateway_env import new_rollout
from helpers import fake_trainer, load_sample

import voltrl as vl
from voltrl._http.serving import serve
from voltrl.gateway import Gateway
from voltrl.store.memory import InMemoryStore

run = load_sample("agent_service", "run")
units = load_sample("agent_service", "units")
client = load_sample("agent_service", "client")


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The service as a subprocess, watching a gateway file that does not exist yet."""
    gateway_file = tmp_path_factory.mktemp("service") / "gateway.json"
    with run.service_process(gateway_file) as url:
        yield url, gateway_file


def converting_script(rows: list[dict[str, Any]]) -> Any:
    """A backend that calls ``convert`` with the row's arguments, then answers with the
    tool's result."""
    by_question = {r["question"]: r for r in rows}

    def script(req: dict[str, Any]) -> dict[str, str]:
        messages = req["messages"]
        results = [m["content"] for m in messages if m.get("role") == "tool"]
        if results:
            return {"text": f"The answer is {results[-1]}"}
        row = by_question[next(m["content"] for m in messages if m["role"] == "user")]
        args = {k: row[k] for k in ("value", "from_unit", "to_unit")}
        return {"tool": "convert", "arguments": json.dumps(args)}

    return script


async def dev_run(
    fb: FakeBackend, agent: vl.LitAgent, rows: list[dict], tmp_path: Path, name: str
) -> tuple[vl.RunResult, InMemoryStore]:
    store = InMemoryStore()
    llm = vl.LLM(endpoint=fb.url, model="m", sampling_parameters={"temperature": 0.3})
    trainer = fake_trainer(store, tmp_path, llm, max_concurrency=4, name=name)
    return await trainer.dev_async(agent, rows), store


@pytest.mark.slow
async def test_dev_through_the_service_records_each_rollout_apart(
    service: tuple[str, Path], tmp_path: Path
) -> None:
    url, gateway_file = service
    rows = units.make_tasks(4, seed=1)
    agent = client.ServiceAgent(url, gateway_file)

    async with httpx.AsyncClient() as http:  # nothing published yet: the service says so
        reply = await http.post(f"{url}/chat", json={"trace_id": "t", "row": rows[0]})
    assert reply.status_code == 503

    published = []
    for attempt in range(2):  # a second trainer run is a new gateway on a new port
        async with FakeBackend() as fb:
            fb.script = converting_script(rows)
            result, store = await dev_run(fb, agent, rows, tmp_path, f"dev{attempt}")
        published.append(json.loads(gateway_file.read_text())["endpoint"])

        assert result.rewards == [1.0] * len(rows)
        assert {r["body"]["temperature"] for r in fb.requests} == {0.3}
        for rollout in result.rollouts:
            calls = await store.get_llm_calls(rollout.rollout_id)
            assert len(calls) == 2
            assert {c.agent_name for c in calls} == {"converter"}
            assert {c.attempt_id for c in calls} == {rollout.final_attempt_id}
            question = rollout.task.input["question"]
            assert all(c.request["messages"][1]["content"] == question for c in calls)
            answer = calls[1].response["choices"][0]["message"]["content"]
            assert calls[1].response_token_ids == scripted_ids(answer)
            assert calls[0].prompt_token_ids and calls[1].prompt_token_ids

    assert published[0] != published[1]
    assert all(p.endswith("/v1") and "/rollouts/" not in p for p in published)


async def test_a_gateway_with_its_own_trace_header(service: tuple[str, Path]) -> None:
    """A gateway configured with ``trace_header="trace_id"`` (the verl recipe's name): the
    published file says so, and the service sends the trace id under that name."""
    url, gateway_file = service
    rows = units.make_tasks(1, seed=2)
    store = InMemoryStore()
    async with FakeBackend() as fb:
        fb.script = converting_script(rows)
        gateway = Gateway(store, [fb.url], trace_header="trace_id")
        seen: list[dict[str, str]] = []

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] == "http":  # the headers each call reaches the gateway with
                seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
            await gateway(scope, receive, send)

        base, stop = await serve(app)
        try:
            rid, aid = await new_rollout(store)
            llm = vl.LLM(endpoint=f"{base}/v1", model="m", gateway=True).scoped(rid, aid)
            client.publish_gateway(llm, gateway_file, trace_header="trace_id")
            reply = await client.AgentClient(url).chat(rid, {"max_tokens": 32}, **rows[0])
        finally:
            await stop()
            await gateway.aclose()
    assert reply["reward"] == 1.0
    calls = await store.get_llm_calls(rid)
    assert len(calls) == 2 and {c.attempt_id for c in calls} == {aid}
    assert len(seen) == 2
    assert all(h["trace_id"] == rid and "x-rollout-id" not in h for h in seen)
    assert {h["x-agent-name"] for h in seen} == {"converter"}
    assert {r["body"]["max_tokens"] for r in fb.requests} == {32}


def test_gateway_base_and_publish_only_on_change(tmp_path: Path) -> None:
    llm = vl.LLM(endpoint="http://127.0.0.1:9/v1", model="m", gateway=True).scoped("r1", "a1")
    assert client.gateway_base(llm) == "http://127.0.0.1:9/v1"
    path = tmp_path / "gw.json"
    assert client.publish_gateway(llm, path) is True
    assert client.publish_gateway(llm, path) is False
    assert json.loads(path.read_text())["trace_header"] == "x-rollout-id"
    assert units.reward("It is 3,500.0 m", {"answer": 3500}) == 1.0
    assert units.reward("no idea", {"answer": 3500}) == 0.0
