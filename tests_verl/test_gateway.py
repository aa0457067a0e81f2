"""The gateway VERL puts in front of verl's rollout replicas: given their ``host:port``
addresses (what verl's ``LLMServerManager.get_addresses`` returns), it learns the served
model name from ``/v1/models``, records every call with its token ids, keeps a rollout on one
replica, drains on pause, checks the run's token, and is refused off loopback without one.
vLLM is not installed here, so two LocalRL engine servers (the same OpenAI-compatible surface
with vLLM's ``return_token_ids``; tests_vllm checks it against vLLM itself) stand in for the
replicas."""

from __future__ import annotations

import asyncio

import openai
import pytest
from openai import AsyncOpenAI

import voltrl as vl
from voltrl.algorithms.base import Algorithm

SERVED = "/tmp/verl/local_copy_of_model"  # vLLM serves verl's local copy under its path


@vl.rollout
async def two_calls(task: dict, llm: vl.LLM) -> float:
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    stranger = AsyncOpenAI(base_url=llm.endpoint, api_key="not-the-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError):  # the gateway checks the run's token
        await stranger.models.list()
    for turn in range(2):
        await client.chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": f"{task['q']} {turn}"}],
            max_tokens=3,
            **llm.sampling_parameters,
        )
    return 1.0


class GatewayProbe(Algorithm):
    """Serves two engine replicas, lets VERL put its gateway in front, runs rollouts."""

    name = "gateway_probe"

    def __init__(self) -> None:
        self.seen: dict = {}

    async def train(self, ctx, train, val):
        from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer
        from voltrl.serving.engine import Engine
        from voltrl.serving.openai_api import serve_engine

        tok = build_tiny_tokenizer()
        engines, stops, addresses = [], [], []
        for seed in (0, 1):
            engine = Engine(build_tiny_model(tok, seed=seed), tok, seed=seed)
            url, stop = await serve_engine(engine, model_name=SERVED)
            engines.append(engine)
            stops.append(stop)
            addresses.append(url.removeprefix("http://"))  # verl's form: host:port
        algo = vl.VERL({"actor_rollout_ref": {"model": {"path": "Qwen/unused"}}})
        try:
            llm = await algo._serve_gateway(ctx, addresses)
            await ctx.publish({"main_llm": llm})
            rollouts = await ctx.run_rollouts(train, mode="train")
            calls = [await ctx.store.get_llm_calls(r.rollout_id) for r in rollouts]
            await algo._gateway.pause()  # nothing in flight: returns at once, holds new calls
            paused = algo._gateway.is_paused
            algo._gateway.resume()
            self.seen = {"llm": llm, "rollouts": rollouts, "calls": calls, "paused": paused}
        finally:
            await algo.teardown(ctx)
            for stop in stops:
                await stop()
            for engine in engines:
                await asyncio.to_thread(engine.close)


class ExposedWithoutToken(Algorithm):
    """VERL asked to bind its gateway to every address in a run that has no token."""

    name = "exposed_probe"

    async def train(self, ctx, train, val):
        algo = vl.VERL(
            {"actor_rollout_ref": {"model": {"path": "Qwen/unused"}}},
            overrides=["voltrl.gateway_host=0.0.0.0"],
        )
        ctx.token = None  # e.g. a store server given as an URL without a token
        with pytest.raises(vl.VoltRLError, match="or set VOLTRL_TOKEN"):
            await algo.setup(ctx)  # refused before Ray or verl start
        with pytest.raises(vl.VoltRLError, match="exposes the server"):  # the one serving path
            await ctx.serve_gateway(["http://127.0.0.1:9/v1"], host=algo.voltrl.gateway_host)
        self.refused = True


def test_gateway_off_loopback_without_a_token_is_refused(tmp_path):
    probe = ExposedWithoutToken()
    vl.Trainer(probe, store="memory", inline=True, progress=False, run_dir=tmp_path).fit(
        two_calls, [{"q": "x"}]
    )
    assert probe.refused


@pytest.mark.timeout(600)
def test_gateway_fronts_replica_addresses(tmp_path):
    probe = GatewayProbe()
    rows = [{"q": f"question {i}"} for i in range(6)]
    vl.Trainer(probe, store="memory", inline=True, progress=False, run_dir=tmp_path).fit(
        two_calls, rows
    )
    seen = probe.seen
    assert seen["llm"].model == SERVED and seen["llm"].gateway
    assert all(r.status == "succeeded" for r in seen["rollouts"])
    backends = set()
    for calls in seen["calls"]:
        assert len(calls) == 2
        assert all(c.prompt_token_ids and c.response_token_ids for c in calls)
        assert all(len(c.response_logprobs or []) == len(c.response_token_ids) for c in calls)
        assert len({c.backend for c in calls}) == 1  # sticky: one replica per rollout
        backends |= {c.backend for c in calls}
    assert len(backends) == 2  # both replicas served rollouts
    assert seen["paused"]


def test_gateway_retry_and_host_come_from_the_voltrl_section():
    from voltrl.retry import GatewayRetry

    algo = vl.VERL(
        {
            "actor_rollout_ref": {"model": {"path": "Qwen/unused"}},
            "voltrl": {"gateway_retry": {"retries": 7, "backoff_s": 0.1}},
        },
        overrides=["voltrl.gateway_host=127.0.0.2"],
    )
    assert algo.voltrl.gateway_retry == GatewayRetry(retries=7, backoff_s=0.1)
    assert algo.voltrl.gateway_host == "127.0.0.2"
    assert vl.VERL({"actor_rollout_ref": {"model": {"path": "m"}}}).voltrl.gateway_host is None
