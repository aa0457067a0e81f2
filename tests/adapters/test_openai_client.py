"""The adapters' shared OpenAI client: one client shared by concurrent rollouts tags each call
with its own rollout (context variables), through the real gateway to a fake backend."""

from __future__ import annotations

import asyncio
import ssl

import httpcore2
import pytest
from fake_openai_backend import FakeBackend
from gateway_env import new_rollout
from helpers import context, serve_gateway

from voltrl.adapters.openai_client import (
    async_openai,
    call_headers,
    request_headers,
    ssl_context,
    sync_openai,
)
from voltrl.gateway import Gateway
from voltrl.resources import LLM
from voltrl.store.memory import InMemoryStore
from voltrl.tracing import activate

MESSAGES = [{"role": "user", "content": "hi"}]


async def test_shared_client_keeps_concurrent_rollouts_apart() -> None:
    store = InMemoryStore()
    async with FakeBackend() as fb, serve_gateway(Gateway(store, [fb.url])) as base:
        llm = LLM(endpoint=f"{base}/v1", model="m", gateway=True)
        client = async_openai(llm, agent_name="writer")  # made once, outside any rollout
        rollouts = [await new_rollout(store, f"r{i}") for i in range(4)]

        async def one(rid: str, aid: str, calls: int) -> None:
            with activate(context(rid, aid)):
                for _ in range(calls):
                    await client.chat.completions.create(model="m", messages=MESSAGES)
                    await asyncio.sleep(0)

        await asyncio.gather(*(one(rid, aid, k + 1) for k, (rid, aid) in enumerate(rollouts)))
        await client.close()
        for k, (rid, aid) in enumerate(rollouts):
            calls = await store.get_llm_calls(rid)
            assert len(calls) == k + 1
            assert {c.attempt_id for c in calls} == {aid}
            assert {c.agent_name for c in calls} == {"writer"}
            assert all(c.response_token_ids for c in calls)


async def test_request_headers_tag_calls_outside_a_rollout() -> None:
    store = InMemoryStore()
    async with FakeBackend() as fb, serve_gateway(Gateway(store, [fb.url])) as base:
        client = async_openai(LLM(endpoint=f"{base}/v1", model="m", gateway=True))
        rid, aid = await new_rollout(store)
        with request_headers({"x-rollout-id": rid}):
            await client.chat.completions.create(model="m", messages=MESSAGES)
        await client.close()
        [call] = await store.get_llm_calls(rid)
        assert call.attempt_id == aid


async def test_scoped_llm_needs_no_headers_and_sync_client_works() -> None:
    store = InMemoryStore()
    async with FakeBackend() as fb, serve_gateway(Gateway(store, [fb.url])) as base:
        rid, aid = await new_rollout(store)
        llm = LLM(endpoint=f"{base}/v1", model="m", gateway=True).scoped(rid, aid)
        assert call_headers() == {}
        client = sync_openai(llm, agent_name="checker")
        await asyncio.to_thread(client.chat.completions.create, model="m", messages=MESSAGES)
        client.close()
        [call] = await store.get_llm_calls(rid)
        assert (call.attempt_id, call.agent_name) == (aid, "checker")


def test_every_client_shares_one_tls_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a TLS context reads the CA certificates (tens of ms): clients that framework
    agents make in every rollout reuse one instead."""
    built: list[ssl.SSLContext] = []
    default = httpcore2.default_ssl_context

    def counted(**kwargs: object) -> ssl.SSLContext:
        built.append(default(**kwargs))  # type: ignore[arg-type]
        return built[-1]

    monkeypatch.setattr(httpcore2, "default_ssl_context", counted)
    ssl_context.cache_clear()
    llm = LLM(endpoint="https://example.invalid/v1", model="m")
    clients = [async_openai(llm), async_openai(llm, agent_name="b"), sync_openai(llm)]
    assert len(built) == 1 and built[0] is ssl_context()
    assert built[0].verify_mode == ssl.CERT_REQUIRED and built[0].check_hostname
    clients[2].close()
    asyncio.run(clients[0].close())
    asyncio.run(clients[1].close())
