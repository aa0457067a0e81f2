"""An agent's chained calls through the gateway become one merged training sequence.

The agent talks to our engine (a tiny model) through the gateway with the ``/v1/completions``
API and token-id prompts, feeding each reply plus a "tool result" into the next call, as a
token-level agent loop does. Trajectory mode must merge the three calls into one row whose loss
mask is 1 exactly on the sampled tokens, with their logprobs, and the reward on the last one.
"""

from __future__ import annotations

import asyncio

from openai import AsyncOpenAI

import voltrl as vl
from voltrl._http.serving import serve
from voltrl.gateway import Gateway
from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from voltrl.runtime.runner import RunnerConfig, run_worker
from voltrl.serving.engine import Engine
from voltrl.serving.openai_api import serve_engine
from voltrl.store.memory import InMemoryStore
from voltrl.trajectory import TrajectoryConfig, collate, trajectories_from_store

TOOL_RESULT = [11, 12, 13]  # token ids the "tool" inserts between calls


class ThreeCalls(vl.LitAgent):
    async def rollout(self, task, resources, ctx):
        llm = resources["main_llm"]
        client = AsyncOpenAI(base_url=llm.endpoint, api_key="x", max_retries=0)
        prompt = list(task["prompt"])
        for _ in range(3):
            reply = await client.completions.create(
                model=llm.model,
                prompt=prompt,
                max_tokens=4,
                temperature=1.0,
                extra_body={"return_token_ids": True},
            )
            prompt = prompt + list(reply.choices[0].token_ids) + TOOL_RESULT
        vl.emit_reward(0.75)
        return None


async def test_three_chained_calls_merge_into_one_masked_sequence():
    tok = build_tiny_tokenizer()
    engine = Engine(build_tiny_model(tok, seed=1), tok, seed=0)
    store = InMemoryStore()
    engine_url, stop_engine = await serve_engine(engine, model_name="tiny")
    gateway = Gateway(store, [f"{engine_url}/v1"], model="tiny")
    gateway_url, stop_gateway = await serve(gateway.app)
    try:
        llm = vl.LLM(endpoint=f"{gateway_url}/v1", model="tiny", gateway=True)
        resources = await store.add_resources(vl.Resources(items={"main_llm": llm}))
        [queued] = await store.enqueue(
            [vl.Task(task_id="t", input={"prompt": [5, 6, 7, 8]})],
            resources_version=resources.version,
        )
        stop = asyncio.Event()
        worker = asyncio.create_task(
            run_worker(store, ThreeCalls(), worker_id="w", config=RunnerConfig(), stop=stop)
        )
        [rollout] = await store.wait_for_rollouts([queued.rollout_id], timeout_s=60)
        stop.set()
        await worker
        assert rollout.status == "succeeded" and rollout.reward == 0.75

        calls = await store.get_llm_calls(rollout.rollout_id)
        assert [c.sequence_id for c in calls] == [0, 1, 2]
        [traj] = await trajectories_from_store(
            store, [rollout], TrajectoryConfig(mode="trajectory")
        )
        assert traj.merge_failures == 0 and len(traj.transitions) == 1
        [row] = traj.transitions
        assert row.prompt_token_ids == [5, 6, 7, 8]
        expected_ids, expected_mask, expected_logprobs = [], [], []
        for i, call in enumerate(calls):
            expected_ids += call.response_token_ids
            expected_mask += [1] * len(call.response_token_ids)
            expected_logprobs += call.response_logprobs
            if i < 2:
                expected_ids += TOOL_RESULT
                expected_mask += [0] * len(TOOL_RESULT)
                expected_logprobs += [0.0] * len(TOOL_RESULT)
        assert row.response_token_ids == expected_ids
        assert row.response_mask == expected_mask
        assert row.response_logprobs == expected_logprobs

        batch = collate([traj], TrajectoryConfig(mode="trajectory"))
        last_generated = max(i for i, m in enumerate(batch.response_mask[0]) if m)
        assert batch.token_level_rewards[0][last_generated] == 0.75
        assert sum(batch.token_level_rewards[0]) == 0.75
        assert batch.group_ids == ["t"]
    finally:
        await stop_gateway()
        await gateway.aclose()
        await stop_engine()
        engine.close()
