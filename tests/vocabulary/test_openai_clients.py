"""``LLM.openai_client()``: clients that cost no CA-bundle load, share each event loop's
connections, work on any loop, close with their loop, and keep every call on its own rollout
(real OpenAI clients, the real gateway, a real loopback backend)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ssl
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fake_openai_backend import FakeBackend
from gateway_env import new_rollout
from helpers import context, serve_gateway
from openai import AsyncOpenAI

import voltrl as vl
from voltrl import openai_clients
from voltrl.errors import VoltRLError
from voltrl.gateway import Gateway
from voltrl.openai_clients import SHARDS, ssl_context
from voltrl.store.memory import InMemoryStore
from voltrl.tracing import activate

MESSAGES = [{"role": "user", "content": "hi"}]


class Connections(set):  # type: ignore[type-arg]
    """A backend's open connections (the set it keeps), counting every one it accepted."""

    opened = 0

    def add(self, conn: Any) -> None:
        self.opened += 1
        super().add(conn)


def counted(fb: FakeBackend) -> Connections:
    fb._conns = conns = Connections()
    return conns


@contextlib.contextmanager
def backend_in_a_thread() -> Iterator[tuple[FakeBackend, Connections]]:
    """A loopback backend on its own thread and loop, so tests may start and end loops."""
    loop = asyncio.new_event_loop()
    fb = FakeBackend()
    conns = counted(fb)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(fb.start(), loop).result(30)
    try:
        yield fb, conns
    finally:
        asyncio.run_coroutine_threadsafe(fb.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def wait_until(done: Any, what: str) -> None:
    """Poll ``done()`` (a state another thread changes) until it holds."""
    deadline = time.monotonic() + 30
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


async def test_rollouts_on_shared_connections_record_their_own_calls() -> None:
    store = InMemoryStore()
    async with FakeBackend() as fb, serve_gateway(Gateway(store, [fb.url])) as base:
        gateway_llm = vl.LLM(endpoint=f"{base}/v1", model="m", gateway=True, api_key="k")
        rollouts = [await new_rollout(store, f"r{i}") for i in range(4)]

        async def rollout(k: int, rid: str, aid: str) -> None:
            llm = gateway_llm.scoped(rid, aid)
            async with llm.openai_client(f"agent{k}") as client:  # closes this client only
                for _ in range(k + 1):
                    await client.chat.completions.create(model="m", messages=MESSAGES)
                    await asyncio.sleep(0)

        await asyncio.gather(*(rollout(k, rid, aid) for k, (rid, aid) in enumerate(rollouts)))
        sync_rid, sync_aid = await new_rollout(store, "sync")
        sync = gateway_llm.scoped(sync_rid, sync_aid).sync_openai_client("checker")
        await asyncio.to_thread(sync.chat.completions.create, model="m", messages=MESSAGES)
        sync.close()

        for k, (rid, aid) in enumerate(rollouts):
            calls = await store.get_llm_calls(rid)
            assert len(calls) == k + 1
            assert {(c.attempt_id, c.agent_name) for c in calls} == {(aid, f"agent{k}")}
        [call] = await store.get_llm_calls(sync_rid)
        assert (call.attempt_id, call.agent_name) == (sync_aid, "checker")


async def test_a_shared_client_tags_each_call_with_the_rollout_running_it() -> None:
    store = InMemoryStore()
    async with FakeBackend() as fb, serve_gateway(Gateway(store, [fb.url])) as base:
        client = vl.LLM(endpoint=f"{base}/v1", model="m", gateway=True).openai_client("w")
        rollouts = [await new_rollout(store, f"r{i}") for i in range(3)]

        async def one(rid: str, aid: str) -> None:
            with activate(context(rid, aid)):
                await client.chat.completions.create(model="m", messages=MESSAGES)

        await asyncio.gather(*(one(rid, aid) for rid, aid in rollouts))
        for rid, aid in rollouts:
            [call] = await store.get_llm_calls(rid)
            assert (call.attempt_id, call.agent_name) == (aid, "w")


async def test_clients_of_one_loop_share_its_connections() -> None:
    async with FakeBackend() as fb:
        conns = counted(fb)
        llm = vl.LLM(endpoint=fb.url, model="m", api_key="k")
        for _ in range(3 * SHARDS):  # one rollout after another, each with its own client
            async with llm.openai_client(max_retries=0) as client:
                await client.chat.completions.create(model="m", messages=MESSAGES)
        assert conns.opened == SHARDS  # a connection per pool of the loop's, then reused
        assert fb.requests[-1]["authorization"] == "Bearer k"

        async def rollout() -> None:
            client = llm.openai_client(max_retries=0)
            await client.chat.completions.create(model="m", messages=MESSAGES)
            await client.close()

        for _ in range(3):  # steps of concurrent rollouts reuse those connections
            await asyncio.gather(*(rollout() for _ in range(4)))
        assert conns.opened == SHARDS


def test_a_client_works_on_several_loops_and_closes_with_each() -> None:
    with backend_in_a_thread() as (fb, conns):
        client = vl.LLM(endpoint=fb.url, model="m").openai_client(max_retries=0)

        async def call() -> str | None:
            reply = await client.chat.completions.create(model="m", messages=MESSAGES)
            return reply.choices[0].message.content

        assert asyncio.run(call()) == asyncio.run(call())  # a new loop each time
        results: list[str | None] = []
        threads = [
            threading.Thread(target=lambda: results.append(asyncio.run(call()))) for _ in range(3)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert len(results) == 3 and all(results)
        # each loop's connections closed when asyncio.run shut it down
        wait_until(lambda: not conns, "the loops' connections were left open")
        assert conns.opened == 5  # one per loop


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # those sockets close uncleanly
def test_a_loop_closed_without_shutting_down_leaves_no_pool_behind() -> None:
    with backend_in_a_thread() as (fb, conns):
        client = vl.LLM(endpoint=fb.url, model="m").openai_client(max_retries=0)

        async def call() -> None:
            await client.chat.completions.create(model="m", messages=MESSAGES)

        loops = []
        for _ in range(3):
            loops.append(loop := asyncio.new_event_loop())  # no asyncio.run: no shutdown
            loop.run_until_complete(call())
            loop.close()
        asyncio.run(call())
        pooled = [pool.loop() for pool in openai_clients._pools.values()]
        assert not any(loop in pooled for loop in loops)  # the next loop let go of theirs
        del loop, loops, pooled
        gc.collect()  # their connections close as they are collected
        wait_until(lambda: not conns, "a closed loop's connections were left open")
        assert conns.opened == 4


def test_getting_clients_loads_the_ca_bundle_once(monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[str] = []
    for name in ("load_verify_locations", "load_default_certs"):
        original = getattr(ssl.SSLContext, name)

        def load(self: ssl.SSLContext, *a: Any, _f: Any = original, **k: Any) -> Any:
            loads.append(_f.__name__)
            return _f(self, *a, **k)

        monkeypatch.setattr(ssl.SSLContext, name, load)
    ssl_context.cache_clear()
    llm = vl.LLM(endpoint="https://example.invalid/v1", model="m")
    clients = [llm.openai_client() for _ in range(5)] + [llm.sync_openai_client("a")]
    assert len(loads) == 1  # the first client built the process's one TLS context
    assert ssl_context().verify_mode == ssl.CERT_REQUIRED and len(clients) == 6
    AsyncOpenAI(base_url=llm.endpoint, api_key="k")  # what agents used to build per rollout
    assert len(loads) > 1


def test_without_openai_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "openai", None)
    with pytest.raises(VoltRLError, match=r"pip install 'openai"):
        vl.LLM(endpoint="http://127.0.0.1:1/v1", model="m").openai_client()
