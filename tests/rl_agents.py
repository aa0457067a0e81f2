"""Agents the LocalRL tests run, in runner processes among others.

This module imports only voltrl and openai: a runner process loads the module of the agent
it runs, and a test module that builds models would make each one import torch and
transformers first (7 s of CPU a process here)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from openai import AsyncOpenAI

import voltrl as vl

ROWS = [{"letter": c} for c in "abcd"]
"""Four tasks: say this letter."""


@vl.rollout
async def two_turn_agent(task: dict, llm: vl.LLM) -> float:
    """Two chained chat calls; reward 1 when the second reply contains the task's letter."""
    return await say_it_twice(task, llm)


async def say_it_twice(
    task: dict, llm: vl.LLM, between: Callable[[], Awaitable[object]] | None = None
) -> float:
    """:func:`two_turn_agent`'s work, awaiting ``between()`` between the calls."""
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    messages = [{"role": "user", "content": f"Say {task['letter']}."}]
    first = await client.chat.completions.create(
        model=llm.model, messages=messages, **llm.sampling_parameters
    )
    if between is not None:
        await between()
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "Again."},
    ]
    second = await client.chat.completions.create(
        model=llm.model, messages=messages, **llm.sampling_parameters
    )
    return float(task["letter"] in (second.choices[0].message.content or ""))


@vl.rollout
async def reply_then_fail(task: dict, llm: vl.LLM) -> float:
    """Calls the model, then fails on its reply, as an agent parsing it badly would."""
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    messages = [{"role": "user", "content": f"Say {task['letter']}."}]
    reply = await client.chat.completions.create(
        model=llm.model, messages=messages, **llm.sampling_parameters
    )
    raise ValueError(f"cannot parse {reply.choices[0].message.content!r}")


@vl.rollout
async def same_reward(task: dict, llm: vl.LLM) -> float:
    """Calls the model and rewards every reply alike: no group has any advantage."""
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    messages = [{"role": "user", "content": f"Say {task['letter']}."}]
    await client.chat.completions.create(
        model=llm.model, messages=messages, **llm.sampling_parameters
    )
    return 1.0


@vl.rollout
async def assistant_and_user(task: dict, resources: vl.Resources) -> float:
    """The assistant on the trained model (``main_llm``), a user role on ``user_llm``."""
    from voltrl.adapters.openai_client import async_openai

    llm, user_llm = resources["main_llm"], resources["user_llm"]
    user = async_openai(user_llm, agent_name="user")
    question = await user.chat.completions.create(
        model=user_llm.model, messages=[{"role": "user", "content": "Ask me something."}]
    )
    assistant = async_openai(llm, agent_name="assistant")
    reply = await assistant.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": question.choices[0].message.content or ""}],
        **llm.sampling_parameters,
    )
    return float(task["letter"] in (reply.choices[0].message.content or ""))


# ---- the asynchronous run's agent (tests/algorithms/local/test_local_rl_async.py) ------------

STEP = 4
"""Rollouts a step (2 tasks x 2); the runner holds one step's at a time (``max_concurrency``)."""


def take_a_number(notes: Path) -> int:
    """The order of this rollout's first call among all the run's: 0, 1, 2... (a note each,
    created exclusively, so two rollouts never take the same number)."""
    number = 0
    while True:
        try:
            (notes / f"call-{number}").touch(exist_ok=False)
            return number
        except FileExistsError:
            number += 1


async def until_exists(path: Path) -> None:
    while not path.exists():
        await asyncio.sleep(0.02)


@vl.rollout
async def thinks_between_calls(task: dict, llm: vl.LLM) -> float:
    """Two chained calls around a weight update, in an order the test fixes with notes in
    ``task["notes"]``, not with the scheduler's luck. The runner holds one step's rollouts at a
    time, and no rollout of step 1 goes on before all four have called, so the first four first
    calls are step 1's, the next four step 2's, and so on. A rollout of step ``s > 1`` makes its
    first call while update ``s - 1`` is held (it waits for them: ``held_update`` in
    tests/algorithms/local/test_local_rl_async.py), then waits for the weights of that update
    to be published before its second call: it spans the update."""
    notes = Path(task["notes"])

    async def wait_for_the_update() -> None:
        step = take_a_number(notes) // STEP + 1
        if step == 1:  # none of step 1 ends (freeing a slot) before all four have a number
            await until_exists(notes / f"call-{STEP - 1}")
        else:
            await until_exists(notes / f"weights-{step - 1}")

    return await say_it_twice(task, llm, between=wait_for_the_update)
