"""A rollout that times out while its LLM call is in flight at the gateway: the agent's client
goes with it, so the gateway cuts the call off at the backend (which would otherwise generate
on for nobody and hold up the next weight update) and records it, abandoned, for that attempt.

The runner's rollout deadline is made to fire once the call is at the backend, not after
0.5 s of wall time: a loaded machine could otherwise time the rollout out before its call
was sent, and there would be no call to check."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_openai_backend import FakeBackend
from helpers import fake_trainer
from openai import AsyncOpenAI

import voltrl as vl
import voltrl.runtime.runner as runner_module
from voltrl.store.memory import InMemoryStore
from voltrl.types import ABANDONED_SPAN


@vl.rollout
async def asks_once(task: dict, llm: vl.LLM) -> float:
    """One chat call; reward 1 when it is answered."""
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["question"]}]
    )
    return 1.0


class _Deadlines:
    """Stands in for ``asyncio`` in the runner's module: ``timeout(delay)`` records the delay
    the runner asked for and gives a deadline that only fires when the test says so."""

    def __init__(self) -> None:
        self.delays: list[float | None] = []
        self.deadlines: list[asyncio.Timeout] = []
        self.created = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    @contextlib.asynccontextmanager
    async def timeout(self, delay: float | None) -> Any:
        self.delays.append(delay)
        async with asyncio.timeout(None) as deadline:
            self.deadlines.append(deadline)
            self.created.set()
            yield deadline

    def fire(self) -> None:
        """Expire every deadline the runner holds now."""
        now = asyncio.get_running_loop().time()
        for deadline in self.deadlines:
            deadline.reschedule(now)


@pytest.fixture
def deadlines(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Deadlines]:
    fake = _Deadlines()
    monkeypatch.setattr(runner_module, "asyncio", fake)
    yield fake


async def test_call_in_flight_when_the_rollout_times_out_is_cut_off_and_recorded_abandoned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], deadlines: _Deadlines
) -> None:
    store = InMemoryStore()
    async with FakeBackend() as backend:
        backend.hold = asyncio.Event()
        llm = vl.LLM(endpoint=backend.url, model="m")
        trainer = fake_trainer(
            store, tmp_path, llm, rollout_timeout_s=0.5, max_attempts=1, stop_at_failure_rate=None
        )
        run = asyncio.create_task(trainer.dev_async(asks_once, [{"question": "2+2?"}]))
        await backend.arrived.wait()  # the call is at the backend, held there
        assert deadlines.created.is_set()
        assert deadlines.delays == [0.5]  # the runner applies the rollout's timeout
        deadlines.fire()
        await backend.hung_up.wait()  # the gateway closed the call (bounded by the timeout)
        result = await run
    (rollout,) = result.rollouts
    (attempt,) = await store.get_attempts(rollout.rollout_id)
    assert attempt.status == "timeout"
    assert await store.get_llm_calls(rollout.rollout_id) == []  # nothing came back to record
    (span,) = [s for s in await store.get_spans(rollout.rollout_id) if s.name == ABANDONED_SPAN]
    assert span.attempt_id == attempt.attempt_id
    assert span.attributes["voltrl.cut_reason"] == "client_disconnected"
    out = capsys.readouterr().out
    assert "rollout error: rollout timed out after 0.5 s" in out
    assert "voltrl dev --timeout SECONDS" in out
