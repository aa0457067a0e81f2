"""The gateway through real HTTP: the real ``openai`` client -> uvicorn -> Gateway -> a fake
vLLM-style backend on loopback, recording into an InMemoryStore."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
from fake_openai_backend import (
    TOOL_ARGS,
    FakeBackend,
    prompt_ids,
    reply_ids,
    reply_logprobs,
    reply_text,
    tool_call_ids,
)
from gateway_env import MESSAGES, SERVED, Env, gateway_env, new_rollout
from helpers import serve_gateway
from openai import AsyncOpenAI

from voltrl.gateway import Gateway
from voltrl.store.memory import InMemoryStore
from voltrl.types import Task

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def extras(obj: Any) -> dict[str, Any]:
    """Fields outside the OpenAI schema that the client received."""
    return dict(obj.model_extra or {})


# ---- non-streamed chat ------------------------------------------------------------------
async def test_chat_records_token_ids_and_strips_them(env: Env) -> None:
    rid, aid = await new_rollout(env.store)
    resp = await env.client(rid, aid).chat.completions.create(model="whatever", messages=MESSAGES)

    assert resp.choices[0].message.content == reply_text(0)
    assert resp.model == SERVED
    assert "prompt_token_ids" not in extras(resp)
    assert "token_ids" not in extras(resp.choices[0])
    assert resp.choices[0].logprobs is None

    sent = env.backend.requests[-1]["body"]
    assert sent["model"] == SERVED
    assert sent["return_token_ids"] is True
    assert sent["logprobs"] is True and sent["top_logprobs"] == 0

    (call,) = await env.store.get_llm_calls(rid)
    assert call.attempt_id == aid and call.sequence_id == 0
    assert call.prompt_token_ids == prompt_ids(sent)
    assert call.response_token_ids == reply_ids(0)
    assert call.response_logprobs == reply_logprobs(0)
    assert call.has_token_ids
    assert call.finish_reason == "stop"
    assert call.backend == env.backend.url
    assert call.model == SERVED
    assert call.resources_version == 7
    assert call.agent_name is None
    assert call.request["messages"] == MESSAGES
    assert call.response["choices"][0]["message"]["content"] == reply_text(0)
    assert "token_ids" not in call.response["choices"][0]
    assert call.ended_at is not None and call.ended_at >= call.started_at


async def test_client_that_asks_for_token_ids_and_logprobs_gets_them(env: Env) -> None:
    rid, aid = await new_rollout(env.store)
    resp = await env.client(rid, aid).chat.completions.create(
        model="m", messages=MESSAGES, logprobs=True, extra_body={"return_token_ids": True}
    )
    sent = env.backend.requests[-1]["body"]
    assert extras(resp)["prompt_token_ids"] == prompt_ids(sent)
    assert extras(resp.choices[0])["token_ids"] == reply_ids(0)
    assert resp.choices[0].logprobs is not None
    assert [c.logprob for c in resp.choices[0].logprobs.content or []] == reply_logprobs(0)
    (call,) = await env.store.get_llm_calls(rid)
    assert call.response_token_ids == reply_ids(0)


async def test_n_choices_record_one_call_each(env: Env) -> None:
    rid, aid = await new_rollout(env.store)
    resp = await env.client(rid, aid).chat.completions.create(model="m", messages=MESSAGES, n=3)
    assert [c.message.content for c in resp.choices] == [reply_text(i) for i in range(3)]
    calls = await env.store.get_llm_calls(rid)
    assert [c.choice_index for c in calls] == [0, 1, 2]
    assert [c.sequence_id for c in calls] == [0, 1, 2]
    for i, c in enumerate(calls):
        assert c.response_token_ids == reply_ids(i)
        assert c.response_logprobs == reply_logprobs(i)
        assert c.prompt_token_ids == prompt_ids({"messages": MESSAGES})


async def test_tool_calls_pass_through_and_are_recorded(env: Env) -> None:
    rid, aid = await new_rollout(env.store)
    resp = await env.client(rid, aid).chat.completions.create(
        model="m", messages=MESSAGES, tools=TOOLS
    )
    (tc,) = resp.choices[0].message.tool_calls or []
    assert tc.function.name == "weather"
    assert tc.function.arguments == "".join(TOOL_ARGS)
    assert resp.choices[0].finish_reason == "tool_calls"
    (call,) = await env.store.get_llm_calls(rid)
    assert call.request["tools"] == TOOLS
    assert call.finish_reason == "tool_calls"
    assert call.response_token_ids == tool_call_ids(0)
    recorded = call.response["choices"][0]["message"]["tool_calls"]
    assert recorded[0]["function"] == {"name": "weather", "arguments": "".join(TOOL_ARGS)}


# ---- streaming ----------------------------------------------------------------------------
async def test_streaming_chat_is_recorded_with_token_ids(env: Env) -> None:
    rid, aid = await new_rollout(env.store)
    stream = await env.client(rid, aid).chat.completions.create(
        model="m", messages=MESSAGES, stream=True
    )
    text, chunks = "", 0
    async for chunk in stream:
        chunks += 1
        assert chunk.usage is None
        assert "prompt_token_ids" not in extras(chunk)
        for ch in chunk.choices:
            assert "token_ids" not in extras(ch)
            assert ch.logprobs is None
            text += ch.delta.content or ""
    assert text == reply_text(0)
    assert chunks == len(reply_text(0))  # the usage-only chunk the gateway asked for is dropped

    sent = env.backend.requests[-1]["body"]
    assert sent["stream_options"] == {"include_usage": True}
    (call,) = await env.store.get_llm_calls(rid)
    assert call.prompt_token_ids == prompt_ids(sent)
    assert call.response_token_ids == reply_ids(0)
    assert call.response_logprobs == reply_logprobs(0)
    assert call.finish_reason == "stop"
    assert call.response["choices"][0]["message"]["content"] == reply_text(0)
    assert call.response["usage"]["completion_tokens"] == len(reply_ids(0))


async def test_streaming_with_usage_n_and_tools(env: Env) -> None:
    rid, aid = await new_rollout(env.store)
    stream = await env.client(rid, aid).chat.completions.create(
        model="m",
        messages=MESSAGES,
        tools=TOOLS,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    args: dict[int, str] = {0: "", 1: ""}
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                args[ch.index] += (tc.function.arguments if tc.function else None) or ""
    assert args == {0: "".join(TOOL_ARGS), 1: "".join(TOOL_ARGS)}
    assert usage is not None and usage.completion_tokens == 2 * len(TOOL_ARGS)

    calls = await env.store.get_llm_calls(rid)
    assert [c.choice_index for c in calls] == [0, 1]
    for i, c in enumerate(calls):
        assert c.response_token_ids == tool_call_ids(i)
        assert c.finish_reason == "tool_calls"
        (tc,) = c.response["choices"][0]["message"]["tool_calls"]
        assert tc["id"] == f"call_{env.backend._counter}_{i}"
        assert tc["function"] == {"name": "weather", "arguments": "".join(TOOL_ARGS)}


async def test_completions_endpoint_streamed_and_not(env: Env) -> None:
    rid, aid = await new_rollout(env.store)
    client = env.client(rid, aid)
    resp = await client.completions.create(model="m", prompt="Once upon", max_tokens=8)
    assert resp.choices[0].text == reply_text(0)
    assert resp.choices[0].logprobs is None
    assert "token_ids" not in extras(resp.choices[0])
    assert "prompt_token_ids" not in extras(resp.choices[0])
    assert env.backend.requests[-1]["body"]["logprobs"] == 0

    stream = await client.completions.create(model="m", prompt="Once upon", stream=True)
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == reply_text(0)

    calls = await env.store.get_llm_calls(rid)
    assert len(calls) == 2
    for c in calls:
        assert c.prompt_token_ids == prompt_ids({"prompt": "Once upon"})
        assert c.response_token_ids == reply_ids(0)
        assert c.response_logprobs == reply_logprobs(0)


# ---- retries --------------------------------------------------------------------------------
async def test_retries_on_429_and_500_then_succeeds(env: Env) -> None:
    rid, aid = await new_rollout(env.store)
    env.backend.fail_next(429, 500)
    resp = await env.client(rid, aid).chat.completions.create(model="m", messages=MESSAGES)
    assert resp.choices[0].message.content == reply_text(0)
    assert len(env.backend.requests) == 3
    assert len(await env.store.get_llm_calls(rid)) == 1


async def test_retries_exhausted_give_a_clear_error(env: Env) -> None:
    rid, aid = await new_rollout(env.store)
    env.backend.fail_next(500, 503, 500)
    with pytest.raises(openai.InternalServerError) as info:
        await env.client(rid, aid).chat.completions.create(model="m", messages=MESSAGES)
    assert "backend failed after 3 tries" in str(info.value)
    assert len(env.backend.requests) == 3
    assert await env.store.get_llm_calls(rid) == []


async def test_backend_4xx_is_passed_on_without_retry(env: Env) -> None:
    rid, aid = await new_rollout(env.store)
    env.backend.fail_next(400)
    with pytest.raises(openai.BadRequestError) as info:
        await env.client(rid, aid).chat.completions.create(model="m", messages=MESSAGES)
    assert "scripted failure 400" in str(info.value)
    assert len(env.backend.requests) == 1


async def test_unreachable_backend_is_a_502() -> None:
    backend = await FakeBackend().start()
    await backend.stop()  # nothing listens on its port any more
    store = InMemoryStore()
    rid, aid = await new_rollout(store)
    gw = Gateway(store, [backend.url], retries=1, backoff_s=0.001)
    async with (
        serve_gateway(gw) as base,
        AsyncOpenAI(
            base_url=f"{base}/rollouts/{rid}/attempts/{aid}/v1", api_key="x", max_retries=0
        ) as client,
    ):
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(model="m", messages=MESSAGES)
    assert info.value.status_code == 502
    assert "backend failed after 2 tries" in str(info.value)


# ---- routing ----------------------------------------------------------------------------------
async def test_sticky_routing_over_two_backends() -> None:
    async with gateway_env(backends=2) as env:
        rollouts = [await new_rollout(env.store, str(i)) for i in range(6)]
        for _ in range(3):
            for rid, aid in rollouts:
                await env.client(rid, aid).chat.completions.create(model="m", messages=MESSAGES)
        used = set()
        for rid, _ in rollouts:
            backends = {c.backend for c in await env.store.get_llm_calls(rid)}
            assert len(backends) == 1, backends
            used |= backends
        assert used == {b.url for b in env.backends}
        assert [len(b.requests) for b in env.backends] == [9, 9]


async def test_retry_moves_a_rollout_off_a_failing_replica() -> None:
    async with gateway_env(backends=2, retries=1, backoff_s=0.001) as env:
        rid, aid = await new_rollout(env.store)
        client = env.client(rid, aid)
        await client.chat.completions.create(model="m", messages=MESSAGES)
        first = {b.url: b for b in env.backends}[(await env.store.get_llm_calls(rid))[0].backend]
        first.fail_next(503)
        await client.chat.completions.create(model="m", messages=MESSAGES)
        await client.chat.completions.create(model="m", messages=MESSAGES)
        backends = [c.backend for c in await env.store.get_llm_calls(rid)]
        assert backends[0] == first.url
        assert backends[1] == backends[2] != first.url  # moved, then sticky again


async def test_two_concurrent_rollouts_never_mix(env: Env) -> None:
    a = await new_rollout(env.store, "a")
    b = await new_rollout(env.store, "b")

    async def agent(ids: tuple[str, str], word: str, k: int) -> None:
        msgs = [{"role": "user", "content": f"{word} {k}"}]
        client = env.client(*ids)
        if k % 2:
            await client.chat.completions.create(model="m", messages=msgs)
        else:
            stream = await client.chat.completions.create(model="m", messages=msgs, stream=True)
            assert [c async for c in stream]

    await asyncio.gather(*(agent(ids, w, k) for k in range(10) for ids, w in ((a, "x"), (b, "y"))))
    for (rid, aid), word in ((a, "x"), (b, "y")):
        calls = await env.store.get_llm_calls(rid)
        assert len(calls) == 10
        assert sorted(c.sequence_id or 0 for c in calls) == list(range(10))
        for c in calls:
            assert c.attempt_id == aid
            content = c.request["messages"][0]["content"]
            assert content.startswith(word)
            assert c.prompt_token_ids == prompt_ids({"messages": c.request["messages"]})


# ---- scoping: agent names and the header form -----------------------------------------------
async def test_agent_name_path_segment(env: Env) -> None:
    rid, aid = await new_rollout(env.store)
    await env.client(rid, aid, "planner").chat.completions.create(model="m", messages=MESSAGES)
    (call,) = await env.store.get_llm_calls(rid)
    assert call.agent_name == "planner"


async def test_an_agent_name_with_slashes_is_one_path_segment(env: Env) -> None:
    """``policy/wolves/werewolf/Player3`` is percent-encoded in the URL and kept whole."""
    rid, aid = await new_rollout(env.store)
    name = "policy/wolves/werewolf/Player3"
    await env.client(rid, aid, name).chat.completions.create(model="m", messages=MESSAGES)
    (call,) = await env.store.get_llm_calls(rid)
    assert call.agent_name == name


async def test_header_form_uses_running_attempt_and_agent_header(env: Env) -> None:
    rid, aid = await new_rollout(env.store)
    client = env.openai(
        f"{env.base}/v1", default_headers={"x-rollout-id": rid, "x-agent-name": "critic"}
    )
    await client.chat.completions.create(model="m", messages=MESSAGES)
    await client.chat.completions.create(
        model="m", messages=MESSAGES, extra_headers={"x-attempt-id": aid}
    )
    calls = await env.store.get_llm_calls(rid)
    assert [(c.attempt_id, c.agent_name) for c in calls] == [(aid, "critic"), (aid, "critic")]


async def test_custom_trace_header() -> None:
    async with gateway_env(trace_header="trace_id") as env:
        rid, aid = await new_rollout(env.store)
        client = env.openai(f"{env.base}/v1", default_headers={"trace_id": rid})
        await client.chat.completions.create(model="m", messages=MESSAGES)
        (call,) = await env.store.get_llm_calls(rid)
        assert call.attempt_id == aid


# ---- errors -------------------------------------------------------------------------------------
async def test_unknown_rollout_and_attempt_are_404(env: Env) -> None:
    rid, _ = await new_rollout(env.store)
    for client in (env.client("ro-nope", "at-nope"), env.client(rid, "at-nope")):
        with pytest.raises(openai.NotFoundError) as info:
            await client.chat.completions.create(model="m", messages=MESSAGES)
        assert "unknown" in str(info.value)
    headers = {"x-rollout-id": "ro-nope"}
    async with httpx.AsyncClient(base_url=env.base) as http:
        r = await http.post("/v1/chat/completions", json={"messages": MESSAGES}, headers=headers)
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"
    assert env.backend.requests == []


async def test_rollout_without_running_attempt_is_404_in_header_form(env: Env) -> None:
    (r,) = await env.store.enqueue([Task(input={})])
    async with httpx.AsyncClient(base_url=env.base) as http:
        r = await http.post(
            "/v1/chat/completions",
            json={"messages": MESSAGES},
            headers={"x-rollout-id": r.rollout_id},
        )
    assert r.status_code == 404
    assert "no running attempt" in r.json()["error"]["message"]


async def test_malformed_bodies_are_400(env: Env) -> None:
    rid, aid = await new_rollout(env.store)
    url = f"/rollouts/{rid}/attempts/{aid}/v1/chat/completions"
    async with httpx.AsyncClient(base_url=env.base) as http:
        bad_json = await http.post(
            url, content=b"{not json", headers={"content-type": "application/json"}
        )
        not_object = await http.post(url, json=[1, 2])
        no_messages = await http.post(url, json={"model": "m"})
        bad_n = await http.post(url, json={"messages": MESSAGES, "n": 0})
        no_rollout = await http.post("/v1/chat/completions", json={"messages": MESSAGES})
    for r in (bad_json, not_object, no_messages, bad_n, no_rollout):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
    assert "not valid JSON" in bad_json.json()["error"]["message"]
    assert "messages" in no_messages.json()["error"]["message"]
    assert env.backend.requests == []


async def test_oversized_request_is_413() -> None:
    async with gateway_env(max_body_bytes=2_000) as env:
        rid, aid = await new_rollout(env.store)
        client = env.client(rid, aid)
        with pytest.raises(openai.APIStatusError) as info:
            big = [{"role": "user", "content": "x" * 5_000}]
            await client.chat.completions.create(model="m", messages=big)
        assert info.value.status_code == 413
        assert "limit" in str(info.value)
        await client.chat.completions.create(model="m", messages=MESSAGES)
        assert len(env.backend.requests) == 1


async def test_unknown_route_and_models(env: Env) -> None:
    rid, aid = await new_rollout(env.store)
    models = await env.client(rid, aid).models.list()
    assert [m.id for m in models.data] == [SERVED]
    async with httpx.AsyncClient(base_url=env.base) as http:
        assert (await http.post("/v1/embeddings", json={})).status_code == 404
        assert (await http.get("/v1/chat/completions")).status_code == 405


# ---- hosted backends ----------------------------------------------------------------------------
async def test_backend_without_token_ids_is_recorded_as_such() -> None:
    async with gateway_env(token_ids=False, request_token_ids=False) as env:
        rid, aid = await new_rollout(env.store)
        client = env.client(rid, aid)
        await client.chat.completions.create(model="m", messages=MESSAGES)
        assert "return_token_ids" not in env.backend.requests[-1]["body"]  # hosted APIs reject it
        stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        calls = await env.store.get_llm_calls(rid)
    assert len(calls) == 2
    for c in calls:
        assert not c.has_token_ids
        assert c.prompt_token_ids is None and c.response_token_ids is None
        assert c.response_logprobs == reply_logprobs(0)
        assert c.response["choices"][0]["message"]["content"] == reply_text(0)


# ---- pause and drain ----------------------------------------------------------------------------
async def test_pause_drains_in_flight_calls_and_holds_new_ones(env: Env) -> None:
    rid, aid = await new_rollout(env.store)
    client = env.client(rid, aid)
    env.backend.hold = asyncio.Event()
    first = asyncio.create_task(client.chat.completions.create(model="m", messages=MESSAGES))
    await env.backend.arrived.wait()
    assert env.gateway.inflight == 1

    pausing = asyncio.create_task(env.gateway.pause())
    while not env.gateway.is_paused:
        await asyncio.sleep(0)
    second = asyncio.create_task(client.chat.completions.create(model="m", messages=MESSAGES))
    while env.gateway.waiting == 0:
        await asyncio.sleep(0.001)
    assert not pausing.done()  # the first call is still in flight

    env.backend.hold.set()
    await pausing  # returns once the first call finished and was recorded
    assert (await first).choices[0].message.content == reply_text(0)
    assert len(await env.store.get_llm_calls(rid)) == 1
    assert not second.done() and len(env.backend.requests) == 1

    env.gateway.resume()
    await second
    assert len(await env.store.get_llm_calls(rid)) == 2

    async with env.gateway.paused():
        assert env.gateway.is_paused and env.gateway.inflight == 0
    assert not env.gateway.is_paused


async def test_paused_gateway_answers_429_with_retry_after() -> None:
    async with gateway_env(pause_wait_s=0, pause_retry_after_s=3) as env:
        rid, aid = await new_rollout(env.store)
        client = env.client(rid, aid)
        async with env.gateway.paused():
            with pytest.raises(openai.RateLimitError) as info:
                await client.chat.completions.create(model="m", messages=MESSAGES)
        await client.chat.completions.create(model="m", messages=MESSAGES)
        assert info.value.response.headers["retry-after"] == "3"
        assert "paused" in str(info.value)
        assert len(await env.store.get_llm_calls(rid)) == 1


# ---- mounting ------------------------------------------------------------------------------------
async def test_mounted_under_a_starlette_app(env: Env) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Mount, Route

    rid, aid = await new_rollout(env.store)
    app = Starlette(
        routes=[
            Route("/health", lambda request: PlainTextResponse("ok")),
            Mount("/gw", app=env.gateway.app),
        ]
    )
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        client = env.openai(f"http://127.0.0.1:{port}/gw/rollouts/{rid}/attempts/{aid}/v1")
        resp = await client.chat.completions.create(model="m", messages=MESSAGES)
        assert resp.choices[0].message.content == reply_text(0)
    finally:
        server.should_exit = True
        await task
    assert len(await env.store.get_llm_calls(rid)) == 1


async def test_responses_api_gets_an_error_that_says_to_use_chat_completions(env: Env) -> None:
    rid, aid = await new_rollout(env.store)
    with pytest.raises(openai.NotFoundError) as raised:
        await env.client(rid, aid).responses.create(model="m", input="hi")
    message = str(raised.value)
    assert "voltrl.adapters.openai_agents.model(llm)" in message
    assert 'set_default_openai_api("chat_completions")' in message


async def test_a_closed_gateway_refuses_new_and_waiting_calls_at_once(env: Env) -> None:
    """What an algorithm does before stopping its backend: calls in flight finish, waiting
    and new ones get 503 without reaching the backend."""
    rid, aid = await new_rollout(env.store)
    client = env.client(rid, aid)  # max_retries=0
    await env.gateway.pause()
    waiting = asyncio.create_task(client.chat.completions.create(model="m", messages=MESSAGES))
    while not env.gateway.waiting:
        await asyncio.sleep(0.01)
    await asyncio.wait_for(env.gateway.close(), 5)
    with pytest.raises(openai.InternalServerError, match="the run is ending"):
        await asyncio.wait_for(waiting, 5)
    with pytest.raises(openai.InternalServerError, match="the run is ending"):
        await client.chat.completions.create(model="m", messages=MESSAGES)
    assert env.backend.requests == []
