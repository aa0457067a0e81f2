"""A gateway in front of the fake OpenAI backend, with a store to record into: what the gateway,
adapter and sample tests drive (the ``env`` fixture, ``conftest.py``)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from fake_openai_backend import (
    FakeBackend,
)
from helpers import serve_gateway
from openai import AsyncOpenAI

from voltrl.gateway import Gateway
from voltrl.resources import LLM
from voltrl.store.memory import InMemoryStore
from voltrl.types import Task

SERVED = "served-model"


MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
]


@dataclasses.dataclass
class Env:
    store: InMemoryStore
    backend: FakeBackend
    gateway: Gateway
    base: str  # http://127.0.0.1:P
    clients: list[AsyncOpenAI]
    backends: list[FakeBackend]
    by_url: dict[str, AsyncOpenAI] = dataclasses.field(default_factory=dict)

    def llm(self, rollout_id: str, attempt_id: str, agent_name: str | None = None) -> LLM:
        llm = LLM(endpoint=f"{self.base}/v1", model="anything", gateway=True)
        return llm.scoped(rollout_id, attempt_id, agent_name)

    def client(
        self, rollout_id: str, attempt_id: str, agent_name: str | None = None
    ) -> AsyncOpenAI:
        """An OpenAI client on the rollout-scoped endpoint (closed at the end of the test)."""
        return self.openai(self.llm(rollout_id, attempt_id, agent_name).endpoint)

    def openai(self, base_url: str, **kwargs: Any) -> AsyncOpenAI:
        """An OpenAI client (one per base URL unless options are given; closed at teardown)."""
        if not kwargs and base_url in self.by_url:
            return self.by_url[base_url]
        client = AsyncOpenAI(base_url=base_url, api_key="sk-test", max_retries=0, **kwargs)
        self.clients.append(client)
        if not kwargs:
            self.by_url[base_url] = client
        return client

    async def aclose(self) -> None:
        self.gateway.resume()  # never leave a call waiting, even when a test failed
        for backend in self.backends:
            if backend.hold is not None:
                backend.hold.set()
        for client in self.clients:
            await client.close()


async def new_rollout(store: InMemoryStore, name: str = "t") -> tuple[str, str]:
    """Queue one rollout and claim it: (rollout id, running attempt id)."""
    await store.enqueue([Task(input={"q": name})])
    claim = await store.claim(f"worker-{name}")
    assert claim is not None
    return claim.rollout.rollout_id, claim.attempt.attempt_id


@contextlib.asynccontextmanager
async def gateway_env(
    *, backends: int = 1, token_ids: bool = True, **options: Any
) -> AsyncIterator[Env]:
    """A store, fake backends, and a gateway in front of them served by uvicorn."""
    store = InMemoryStore()
    async with contextlib.AsyncExitStack() as stack:
        fakes = [
            await stack.enter_async_context(FakeBackend(token_ids=token_ids))
            for _ in range(backends)
        ]
        gw = Gateway(store, [f.url for f in fakes], **options)
        base = await stack.enter_async_context(serve_gateway(gw))
        env = Env(store, fakes[0], gw, base, [], fakes)
        try:
            yield env
        finally:
            await env.aclose()
