"""Agents that ``voltrl runner`` processes load by path in the serving and secrets tests."""

from __future__ import annotations

import openai
from openai import AsyncOpenAI

import voltrl as vl


@vl.rollout
async def calls_with_and_without_the_key(task: dict, llm: vl.LLM) -> float:
    """One call with the key the runner gave the agent, one with a wrong key; reward 1 when
    the first is answered, the second refused with 401, and the endpoint is the expected
    host's (``task["host"]``)."""
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    reply = await client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": task["question"]}],
        **llm.sampling_parameters,
    )
    stranger = AsyncOpenAI(base_url=llm.endpoint, api_key="not-the-token", max_retries=0)
    try:
        await stranger.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        refused = False
    except openai.AuthenticationError:
        refused = True
    on_host = llm.endpoint.startswith(f"http://{task['host']}:")
    return float(bool(reply.choices) and refused and on_host)


@vl.rollout
async def calls_once(task: dict, llm: vl.LLM) -> float:
    """One call with the key and sampling the agent was given (no client retries); reward 1
    if answered."""
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    reply = await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": "hello"}], **llm.sampling_parameters
    )
    return float(bool(reply.choices))


@vl.rollout
async def calls_twice_slowly(task: dict, llm: vl.LLM) -> float:
    """Two calls half a second apart: a rollout likely to be between its calls when the run
    is stopped."""
    import asyncio

    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    for _ in range(2):
        reply = await client.chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": "hello"}],
            **llm.sampling_parameters,
        )
        await asyncio.sleep(0.5)
    return float(bool(reply.choices))


@vl.rollout
async def calls_twice_across_an_update(task: dict, llm: vl.LLM, ctx: vl.RolloutContext) -> float:
    """:func:`calls_twice_slowly` whose first steps overlap, whatever the machine's speed:
    after its first call a rollout leaves a note named after its resources version in
    ``task["meet_dir"]``; one sampled by the first weights (``weights_version`` 0) then waits
    for a note of the next version (the next step's: each step queued ahead publishes one)
    before its second call. So step 0's batch is complete, and its update starts, only once
    step 1 has called the model: under ``max_staleness >= 1`` step 1's rows are a step stale
    when they train. Needs the run's concurrency to hold the queued steps' rollouts at once."""
    import asyncio
    from pathlib import Path

    meet = Path(task["meet_dir"])
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    messages = [{"role": "user", "content": "hello"}]
    await client.chat.completions.create(
        model=llm.model, messages=messages, **llm.sampling_parameters
    )
    mine = ctx.resources.version
    (meet / f"{mine}.{ctx.rollout_id}").touch()
    while llm.weights_version == 0 and not any(
        note.name.startswith(f"{mine + 1}.") for note in meet.iterdir()
    ):
        await asyncio.sleep(0.05)
    reply = await client.chat.completions.create(
        model=llm.model, messages=messages, **llm.sampling_parameters
    )
    return float(bool(reply.choices))


@vl.rollout
async def calls_then_waits(task: dict, llm: vl.LLM) -> float:
    """One call, then a note in ``task["started_dir"]`` and a long wait: a rollout that is in
    flight when the test presses Ctrl-C. With ``task["slow_to_cancel"]`` it ignores being
    cancelled, so its worker is killed only when the stop's grace runs out."""
    import asyncio
    from pathlib import Path

    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": "hello"}], max_tokens=2
    )
    (Path(task["started_dir"]) / f"{task['i']}.started").touch()
    while True:
        try:
            await asyncio.sleep(600)
            return 1.0
        except asyncio.CancelledError:
            if not task.get("slow_to_cancel"):
                raise  # else: an agent that will not let go, which holds a clean stop
