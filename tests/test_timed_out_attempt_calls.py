"""A rollout that times out while its LLM call is in flight at the gateway: the call is still
recorded for that attempt once the backend answers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from fake_openai_backend import FakeBackend, reply_ids
from helpers import fake_trainer
from openai import AsyncOpenAI

import voltrl as vl
from voltrl.store.memory import InMemoryStore


@vl.rollout
async def asks_once(task: dict, llm: vl.LLM) -> float:
    """One chat call; reward 1 when it is answered."""
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["question"]}]
    )
    return 1.0


async def test_call_in_flight_when_the_rollout_times_out_is_recorded_for_that_attempt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = InMemoryStore()
    async with FakeBackend() as backend:
        backend.hold = asyncio.Event()
        llm = vl.LLM(endpoint=backend.url, model="m")
        trainer = fake_trainer(
            store, tmp_path, llm, rollout_timeout_s=0.5, max_attempts=1, stop_at_failure_rate=None
        )
        run = asyncio.create_task(trainer.dev_async(asks_once, [{"question": "2+2?"}]))
        while not (rollouts := await store.query_rollouts()) or not rollouts[0].finished:
            await asyncio.sleep(0.01)  # bounded by the test timeout
        backend.hold.set()
        result = await run
    (rollout,) = result.rollouts
    (attempt,) = await store.get_attempts(rollout.rollout_id)
    assert attempt.status == "timeout"
    (call,) = await store.get_llm_calls(rollout.rollout_id)
    assert call.attempt_id == attempt.attempt_id
    assert call.response_token_ids == reply_ids(0)
    out = capsys.readouterr().out
    assert "rollout error: rollout timed out after 0.5 s" in out
    assert "voltrl dev --timeout SECONDS" in out
