"""Calls the backend refuses: a prompt over the model's context reaches the agent as OpenAI's
``context_length_exceeded`` 400 whichever backend said it (vLLM's words, LocalRL's engine, a
hosted API's code), other refusals pass unchanged; each is recorded as a ``gateway.refused``
span of its attempt and counted by the trajectory builder, and nothing hangs."""

from __future__ import annotations

import asyncio

import openai
import pytest
from gateway_env import MESSAGES, Env, new_rollout
from helpers import serve_gateway

from voltrl.gateway import Gateway
from voltrl.store.memory import InMemoryStore
from voltrl.trajectory import TrajectoryConfig, trajectories_from_store
from voltrl.types import REFUSED_SPAN, AttemptResult

VLLM_SAYS = (
    "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens "
    "(4900 in the messages, 100 in the completion). Please reduce the length of the messages."
)


async def refused_spans(store, rollout_id: str) -> list:
    for _ in range(100):  # the span is written in the background
        spans = [s for s in await store.get_spans(rollout_id) if s.name == REFUSED_SPAN]
        if spans:
            return spans
        await asyncio.sleep(0.01)
    return []


@pytest.mark.parametrize(
    "backend_says",
    [VLLM_SAYS, "the prompt has 5000 tokens; this model's context is 4096 tokens"],
    ids=["vllm", "local-engine"],
)
async def test_a_prompt_over_the_context_is_context_length_exceeded(
    env: Env,
    backend_says: str,
) -> None:
    rid, aid = await new_rollout(env.store)
    env.backend.fail_next(400, message=backend_says)
    client = env.client(rid, aid)
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model="m", messages=MESSAGES)
    assert info.value.code == "context_length_exceeded"
    assert "does not fit the model's context" in info.value.message
    assert backend_says in info.value.message
    assert len(env.backend.requests) == 1  # refused, not retried
    [span] = await refused_spans(env.store, rid)
    assert span.attempt_id == aid and span.status == "error"
    assert span.attributes["error.type"] == "context_length_exceeded"
    assert span.attributes["http.response.status_code"] == 400
    assert await env.store.get_llm_calls(rid) == []
    # the next call of the same rollout goes through as usual
    reply = await client.chat.completions.create(model="m", messages=MESSAGES)
    assert reply.choices[0].message.content


async def test_other_refusals_pass_unchanged_and_are_recorded(env: Env) -> None:
    rid, aid = await new_rollout(env.store)
    env.backend.fail_next(422, message="temperature must be at most 2")
    with pytest.raises(openai.UnprocessableEntityError) as info:
        await env.client(rid, aid, "critic").chat.completions.create(model="m", messages=MESSAGES)
    assert info.value.message.endswith(" - temperature must be at most 2")
    [span] = await refused_spans(env.store, rid)
    assert span.attributes["error.type"] == "server_error"
    assert span.attributes["voltrl.agent_name"] == "critic"


async def test_the_trajectory_builder_counts_refusals_and_rollouts_left_with_no_rows(
    env: Env,
) -> None:
    rid, aid = await new_rollout(env.store)
    client = env.client(rid, aid, "user")
    await client.chat.completions.create(model="m", messages=MESSAGES)
    env.backend.fail_next(400, message=VLLM_SAYS)
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="m", messages=MESSAGES)
    await refused_spans(env.store, rid)
    await env.store.complete(aid, AttemptResult(status="succeeded", reward=0.0))
    config = TrajectoryConfig(agent_filter="assistant")  # the one call is the user's
    [trajectory] = await trajectories_from_store(env.store, [rid], config)
    assert trajectory.transitions == []
    assert trajectory.stats["refused/context_length_exceeded"] == 1
    assert trajectory.stats["dropped/no_trainable_calls"] == 1
    assert trajectory.stats["dropped/agent_filter"] == 1


async def test_the_local_engine_behind_the_gateway_refuses_an_overlong_prompt() -> None:
    """LocalRL's engine (a tiny model with a 64-token context) and the gateway end to end."""
    from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer
    from voltrl.serving.engine import Engine
    from voltrl.serving.openai_api import serve_engine

    tok = build_tiny_tokenizer()
    engine = Engine(build_tiny_model(tok, max_positions=64), tok)
    store = InMemoryStore()
    url, stop = await serve_engine(engine)
    try:
        async with serve_gateway(Gateway(store, [f"{url}/v1"])) as base:
            rid, aid = await new_rollout(store)
            client = openai.AsyncOpenAI(
                base_url=f"{base}/rollouts/{rid}/attempts/{aid}/v1", api_key="x", max_retries=0
            )
            long = [{"role": "user", "content": "tell me " * 100}]
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model="m", messages=long, max_tokens=4)
            short = [{"role": "user", "content": "hi"}]
            ok = await client.chat.completions.create(model="m", messages=short, max_tokens=4)
            await client.close()
    finally:
        await stop()
        engine.close()
    assert info.value.code == "context_length_exceeded"
    assert "this model's context is 64 tokens" in info.value.message
    assert ok.choices[0].finish_reason in ("stop", "length")
    [span] = await refused_spans(store, rid)
    assert span.attributes["error.type"] == "context_length_exceeded"


async def test_an_agent_tells_a_context_overflow_from_other_refusals(env: Env) -> None:
    """``is_context_overflow``: the gateway's code, also when a framework wrapped the error."""
    from voltrl.gateway import is_context_overflow

    rid, aid = await new_rollout(env.store)
    client = env.client(rid, aid)
    caught = []
    for message in (VLLM_SAYS, "temperature must be at most 2"):
        env.backend.fail_next(400, message=message)
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="m", messages=MESSAGES)
        caught.append(info.value)
    try:
        raise RuntimeError("the framework's own error") from caught[0]
    except RuntimeError as wrapped:
        assert is_context_overflow(wrapped)
    assert is_context_overflow(caught[0]) and not is_context_overflow(caught[1])
