"""The sampling a gateway fills into requests that leave it out: a run's ``max_tokens`` and
temperature reach agents that never pass ``llm.sampling_parameters`` (a LangChain or bare
OpenAI agent), a request's own values win, and what was sent is what is recorded."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_openai_backend import FakeBackend
from gateway_env import MESSAGES, gateway_env, new_rollout
from helpers import fake_trainer
from openai import AsyncOpenAI

import voltrl as vl
from voltrl.store.memory import InMemoryStore
from voltrl.types import Task

TRAIN = {"max_tokens": 7, "temperature": 1.0}
VAL = {"max_tokens": 5, "temperature": 0.0}


async def test_the_gateway_fills_sampling_by_rollout_mode_and_a_requests_own_values_win() -> None:
    async with gateway_env(sampling_for=lambda mode: VAL if mode == "val" else TRAIN) as env:
        rid, aid = await new_rollout(env.store)
        await env.store.enqueue([Task(input={})], mode="val")
        val = await env.store.claim("worker-val")
        assert val is not None and val.rollout.mode == "val"
        vid, vaid = val.rollout.rollout_id, val.attempt.attempt_id
        client, val_client = env.client(rid, aid), env.client(vid, vaid)
        await client.chat.completions.create(model="m", messages=MESSAGES)
        await client.chat.completions.create(model="m", messages=MESSAGES, temperature=0.3)
        await client.chat.completions.create(model="m", messages=MESSAGES, max_completion_tokens=3)
        await val_client.chat.completions.create(model="m", messages=MESSAGES)
        sent = [r["body"] for r in env.backend.requests]
        recorded = [c.request for c in await env.store.get_llm_calls(rid)]
        recorded += [c.request for c in await env.store.get_llm_calls(vid)]
    sampling = [
        {k: b.get(k) for k in ("max_tokens", "max_completion_tokens", "temperature")} for b in sent
    ]
    assert sampling == [
        {"max_tokens": 7, "max_completion_tokens": None, "temperature": 1.0},
        {"max_tokens": 7, "max_completion_tokens": None, "temperature": 0.3},
        {"max_tokens": None, "max_completion_tokens": 3, "temperature": 1.0},
        {"max_tokens": 5, "max_completion_tokens": None, "temperature": 0.0},
    ]
    assert [r.get("max_tokens") for r in recorded] == [7, 7, None, 5]  # as sent


@vl.rollout
async def passes_no_sampling(task: dict, llm: vl.LLM) -> float:
    """An agent that ignores ``llm.sampling_parameters``, as most framework agents do."""
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    await client.chat.completions.create(model=llm.model, messages=MESSAGES)
    return 1.0


class TwoLLMs(vl.LitAgent):
    """Calls ``main_llm``, then ``user_llm``, passing neither's sampling."""

    async def rollout(self, task: vl.Task, resources: vl.Resources) -> float:
        for name in ("main_llm", "user_llm"):
            llm = resources[name]
            client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
            await client.chat.completions.create(model=llm.model, messages=MESSAGES)
        return 1.0


async def test_each_trainer_llms_sampling_reaches_an_agent_that_passes_none(
    tmp_path: Path,
) -> None:
    """Two LLMs on one endpoint with different sampling: each gets a gateway of its own."""
    store = InMemoryStore()
    async with FakeBackend() as fb:
        llm = vl.LLM(endpoint=fb.url, model="m", sampling_parameters={"max_tokens": 9})
        user = vl.LLM(endpoint=fb.url, model="m", sampling_parameters={"max_tokens": 4})
        trainer = fake_trainer(store, tmp_path, llm)
        trainer.resources = {"main_llm": llm, "user_llm": user}
        result = await trainer.dev_async(TwoLLMs(), [{"q": 1}])
        assert result.rewards == [1.0]
    assert [r["body"]["max_tokens"] for r in fb.requests] == [9, 4]


@pytest.mark.slow
def test_local_rl_fills_its_sampling_into_calls_of_an_agent_that_passes_none(
    tmp_path: Path,
) -> None:
    """On the tiny model: the training calls get ``sampling`` (temperature 1, 3 tokens at
    most), the validation calls ``val_sampling`` (greedy, 2 tokens), though the agent passes
    neither."""
    from local_rl_setup import make_algorithm, stored

    algo = make_algorithm(
        schedule={"steps": 1},
        validation={"every": 1, "sampling": {"max_tokens": 2}},
        checkpoints={"every": 0},
        sampling={"max_tokens": 3},
    )
    trainer = vl.Trainer(algo, n_runners=1, inline=True, run_dir=tmp_path, name="s", progress=False)
    trainer.fit(passes_no_sampling, [{"q": c} for c in "ab"], val_dataset=[{"q": "c"}])
    rollouts, calls = stored(tmp_path / "s" / "store.sqlite")
    seen = set()
    for rollout in rollouts:
        for call in calls[rollout.rollout_id]:
            cap, temperature = (2, 0.0) if rollout.mode == "val" else (3, 1.0)
            assert call.request["max_tokens"] == cap and call.request["temperature"] == temperature
            assert 1 <= len(call.response_token_ids or []) <= cap
            seen.add(rollout.mode)
    assert seen == {"train", "val"}


def test_filling_keeps_the_requests_cap_under_either_name_and_never_its_streaming() -> None:
    from voltrl.gateway.upstream import fill_sampling

    defaults = {
        "max_completion_tokens": 9,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_headers": {"api-key": "k"},
        "extra_body": {"top_k": 5},
        "temperature": 0.5,
    }
    body = {"model": "m", "max_tokens": 3}
    fill_sampling(body, defaults)
    assert body == {"model": "m", "max_tokens": 3, "top_k": 5, "temperature": 0.5}
