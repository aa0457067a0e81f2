"""The agent API: @rollout signatures, result normalisation, hooks and modes."""

from __future__ import annotations

import math

import pytest

import voltrl as vl
from voltrl.agent import normalize_result, run_rollout
from voltrl.tracing import RolloutContext
from voltrl.types import Task


def make_ctx(
    resources: vl.Resources, mode: str = "train", task: dict | None = None
) -> RolloutContext:
    return RolloutContext(
        rollout_id="ro-1",
        attempt_id="at-1",
        task=Task(input=task or {"x": 1}),
        mode=mode,
        resources=resources,  # type: ignore[arg-type]
    )


LLM = vl.LLM(endpoint="http://127.0.0.1:1/v1", model="m")
TEMPLATE = vl.PromptTemplate(template="Q: {q}")


async def test_rollout_decorator_passes_the_llm_to_task_llm_functions():
    @vl.rollout
    def agent(task, llm):
        return 1.0 if llm.model == "m" and task["x"] == 1 else 0.0

    assert await run_rollout(agent, make_ctx(vl.Resources(items={"main_llm": LLM}))) == 1.0


async def test_rollout_decorator_passes_resources_and_prompt_templates():
    @vl.rollout
    async def with_resources(task, resources):
        return float("tpl" in resources)

    @vl.rollout
    def with_template(task, prompt_template):
        return float(prompt_template.format(q="a") == "Q: a")

    res = vl.Resources(items={"main_llm": LLM, "tpl": TEMPLATE})
    assert await run_rollout(with_resources, make_ctx(res)) == 1.0
    assert await run_rollout(with_template, make_ctx(res)) == 1.0


async def test_rollout_decorator_uses_type_hints_and_ctx_parameter():
    @vl.rollout
    async def agent(task: dict, model: vl.LLM, ctx: vl.RolloutContext) -> float:
        return float(model.model == "m" and ctx.rollout_id == "ro-1")

    assert await run_rollout(agent, make_ctx(vl.Resources(items={"a": LLM}))) == 1.0


def test_rollout_decorator_rejects_a_signature_it_cannot_read():
    with pytest.raises(TypeError, match="second parameter"):
        vl.rollout(lambda task, thing: 0.0)
    with pytest.raises(TypeError, match="must take"):
        vl.rollout(lambda task: 0.0)


async def test_ambiguous_llm_resources_raise_unknown_resource_error_naming_them():
    @vl.rollout
    def agent(task, llm):
        return 0.0

    res = vl.Resources(items={"a": LLM, "b": LLM})
    with pytest.raises(vl.UnknownResourceError, match=r"\['a', 'b'\]"):
        await run_rollout(agent, make_ctx(res))

    @vl.rollout(resource="b")
    def named(task, llm):
        return 1.0

    assert await run_rollout(named, make_ctx(res)) == 1.0


def test_unknown_resource_name_raises_a_typed_error_listing_what_exists():
    res = vl.Resources(items={"main_llm": LLM}, version=3)
    with pytest.raises(vl.UnknownResourceError, match=r"'judge'.*version 3.*main_llm"):
        res["judge"]


@pytest.mark.parametrize(
    ("value", "expected"),
    [(1, 1.0), (0.5, 0.5), (True, 1.0), (None, None)],
)
def test_normalize_result_accepts_numbers_and_none(value, expected):
    assert normalize_result(value, "ro-1") == (expected, None)


def test_normalize_result_accepts_transitions_and_takes_the_last_reward():
    ts = [
        vl.Transition(prompt_token_ids=[1], response_token_ids=[2], reward=0.1),
        vl.Transition(prompt_token_ids=[1, 2], response_token_ids=[3], reward=0.9),
    ]
    reward, transitions = normalize_result(ts, "ro-1")
    assert reward == 0.9 and transitions == ts


@pytest.mark.parametrize("value", ["1.0", {"reward": 1}, [1, 2], object()])
def test_normalize_result_rejects_non_numbers_naming_the_rollout(value):
    with pytest.raises(vl.InvalidRolloutResultError, match="rollout ro-7"):
        normalize_result(value, "ro-7")


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_normalize_result_rejects_nan_and_infinite_rewards(value):
    with pytest.raises(vl.InvalidRewardError, match=r"rollout ro-7.*finite"):
        normalize_result(value, "ro-7")


class HookedAgent(vl.LitAgent):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_rollout_start(self, task, resources, ctx):
        self.calls.append(f"start:{ctx.mode}")

    async def on_rollout_end(self, task, result, ctx):
        self.calls.append(f"end:{result}")

    def training_rollout(self, task, resources):
        self.calls.append("train")
        return 1.0

    async def validation_rollout(self, task, resources, ctx):
        self.calls.append("val")
        return 0.0


async def test_hooks_are_called_around_the_mode_specific_rollout():
    agent = HookedAgent()
    res = vl.Resources(items={})
    assert await run_rollout(agent, make_ctx(res, mode="train")) == 1.0
    assert await run_rollout(agent, make_ctx(res, mode="val")) == 0.0
    assert agent.calls == ["start:train", "train", "end:1.0", "start:val", "val", "end:0.0"]


async def test_plain_rollout_serves_every_mode_sync_or_async():
    class Sync(vl.LitAgent):
        def rollout(self, task, resources):
            return 0.25

    class Async(vl.LitAgent):
        async def rollout(self, task, resources, ctx):
            return 0.75

    for mode in ("train", "val", "dev"):
        assert await run_rollout(Sync(), make_ctx(vl.Resources(items={}), mode)) == 0.25
        assert await run_rollout(Async(), make_ctx(vl.Resources(items={}), mode)) == 0.75


def test_llm_scoping_embeds_rollout_attempt_and_agent_in_the_endpoint():
    gw = vl.LLM(endpoint="http://127.0.0.1:9/v1", model="m", gateway=True)
    scoped = gw.scoped("ro-1", "at-2")
    assert scoped.endpoint == "http://127.0.0.1:9/rollouts/ro-1/attempts/at-2/v1"
    assert scoped.for_agent("writer").endpoint.endswith("/attempts/at-2/agents/writer/v1")
    assert LLM.scoped("ro-1", "at-2") is LLM  # not a gateway: left alone
