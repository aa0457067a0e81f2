"""Calls the gateway cuts off in flight: a client that disconnects, a pause that outlasts its
deadline. The backend's generation is closed with them, they are recorded as abandoned, and the
trajectory builder never trains what was sampled of them. Real HTTP throughout: the ``openai``
client or raw httpx -> uvicorn -> Gateway -> the fake backend, which notes when the gateway
hangs up on it (``hung_up``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from fake_openai_backend import reply_text
from gateway_env import MESSAGES, Env, gateway_env, new_rollout

from voltrl.trajectory import build_trajectory
from voltrl.types import ABANDONED, ABANDONED_SPAN, AttemptResult, Reward


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    async with gateway_env() as e:
        yield e


async def abandoned_reasons(env: Env, rollout_id: str) -> list[str]:
    """The cut-off reasons recorded for the rollout, once they are written (background)."""
    while not (spans := await env.store.get_spans(rollout_id)):  # bounded by the test timeout
        await asyncio.sleep(0.01)
    return [s.attributes["voltrl.cut_reason"] for s in spans if s.name == ABANDONED_SPAN]


async def test_a_client_that_disconnects_closes_the_backends_call_and_frees_the_next_pause(
    env: Env,
) -> None:
    rid, aid = await new_rollout(env.store)
    env.backend.hold = asyncio.Event()  # the backend never answers on its own
    request = asyncio.create_task(
        env.client(rid, aid).chat.completions.create(model="m", messages=MESSAGES)
    )
    await env.backend.arrived.wait()
    request.cancel()  # the client gives up: httpx closes its connection
    with contextlib.suppress(asyncio.CancelledError):
        await request
    await asyncio.wait_for(env.backend.hung_up.wait(), 30)  # the gateway hung up on it
    # nothing is left in flight, so a pause returns without waiting for a deadline
    await asyncio.wait_for(env.gateway.pause(deadline_s=None), 30)
    env.gateway.resume()
    assert env.gateway.inflight == 0
    assert env.gateway.cut_off == {"client_disconnected": 1}
    assert await abandoned_reasons(env, rid) == ["client_disconnected"]
    assert await env.store.get_llm_calls(rid) == []  # nothing was sampled to record


async def test_a_stream_whose_client_disconnects_is_recorded_as_abandoned_and_never_trained(
    env: Env,
) -> None:
    rid, aid = await new_rollout(env.store)
    env.backend.hold_stream = asyncio.Event()  # the first event, then nothing
    url = env.llm(rid, aid).endpoint + "/chat/completions"
    body = {"model": "m", "messages": MESSAGES, "stream": True}
    async with (
        httpx.AsyncClient(timeout=30) as http,
        http.stream("POST", url, json=body) as response,
    ):
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                break  # one event received; leaving the block closes the connection
    await asyncio.wait_for(env.backend.hung_up.wait(), 30)
    assert await abandoned_reasons(env, rid) == ["client_disconnected"]
    while not (calls := await env.store.get_llm_calls(rid)):
        await asyncio.sleep(0.01)
    (call,) = calls
    assert call.finish_reason == ABANDONED and call.response_token_ids  # the part sampled
    # the agent retried and the rollout succeeded: its abandoned part still trains nothing
    rollout = await env.store.complete(aid, AttemptResult(status="succeeded", reward=1.0))
    rewards = [Reward(rollout_id=rid, attempt_id=aid, value=1.0, source="return")]
    trajectory = build_trajectory(rollout, calls, rewards, await env.store.get_spans(rid))
    assert trajectory.transitions == []
    assert trajectory.stats["dropped/abandoned_call"] == 1
    assert trajectory.stats["abandoned/client_disconnected"] == 1


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream under way"])
async def test_a_pause_cuts_off_calls_still_running_at_its_deadline_with_a_retryable_503(
    stream: bool,
) -> None:
    async with gateway_env(pause_deadline_s=0.2) as env:
        rid, aid = await new_rollout(env.store)
        if stream:
            env.backend.hold_stream = asyncio.Event()
        else:
            env.backend.hold = asyncio.Event()
        client = env.client(rid, aid)  # max_retries=0: the 503 reaches the test
        if stream:
            events = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
            first = await anext(aiter(events))
            assert first.choices[0].delta.content
            request = asyncio.create_task(anext(aiter(events)))
        else:
            request = asyncio.create_task(
                client.chat.completions.create(model="m", messages=MESSAGES)
            )
            await env.backend.arrived.wait()
        await asyncio.wait_for(env.gateway.pause(), 30)  # the deadline cut the call off
        with pytest.raises(openai.APIError, match="cut off: the model weights are being updated"):
            await asyncio.wait_for(request, 30)
        assert env.gateway.inflight == 0 and env.gateway.cut_off == {"pause_deadline": 1}
        await asyncio.wait_for(env.backend.hung_up.wait(), 30)
        assert await abandoned_reasons(env, rid) == ["pause_deadline"]
        # after the update the client's retry goes through
        env.gateway.resume()
        env.backend.hold, env.backend.hold_stream = None, None
        again = await client.chat.completions.create(model="m", messages=MESSAGES)
        assert again.choices[0].message.content == reply_text(0)


async def test_a_call_whose_answer_is_being_recorded_is_not_cut_off_by_a_pause() -> None:
    """Once the backend's answer is complete the call is committed: a pause deadline that
    passes while its record is written (a slow store) cuts nothing, so the client gets its
    answer and the call is recorded once, as complete, not retried and recorded twice."""
    writing, written = asyncio.Event(), asyncio.Event()

    async with gateway_env(pause_deadline_s=0.05) as env:
        add_llm_calls = env.store.add_llm_calls

        async def slow_write(calls: Any) -> Any:
            writing.set()
            await written.wait()
            return await add_llm_calls(calls)

        env.store.add_llm_calls = slow_write  # type: ignore[method-assign]
        rid, aid = await new_rollout(env.store)
        request = asyncio.create_task(
            env.client(rid, aid).chat.completions.create(model="m", messages=MESSAGES)
        )
        await asyncio.wait_for(writing.wait(), 30)
        await asyncio.wait_for(env.gateway.pause(), 30)  # past its deadline, nothing to cut
        assert env.gateway.cut_off == {}
        written.set()
        reply = await asyncio.wait_for(request, 30)
        env.gateway.resume()
        assert reply.choices[0].message.content == reply_text(0)
        (call,) = await env.store.get_llm_calls(rid)
        assert call.finish_reason != ABANDONED
        assert [s for s in await env.store.get_spans(rid) if s.name == ABANDONED_SPAN] == []


def test_a_finished_stream_without_finish_reasons_is_not_called_abandoned() -> None:
    from voltrl.gateway.records import Call, StreamAccumulator

    call = Call("chat", "r", "a", None, {"model": "m"}, False, False, False)
    acc = StreamAccumulator("chat")
    acc.add({"id": "x", "choices": [{"index": 0, "delta": {"content": "hi"}, "token_ids": [1]}]})
    meta = ("http://b/v1", None, 0.0)
    assert [c.finish_reason for c in acc.calls(call, meta)] == [None]  # whole, reason unknown
    assert [c.finish_reason for c in acc.calls(call, meta, cut=True)] == [ABANDONED]
