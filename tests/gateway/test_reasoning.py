"""The gateway's opt-in reasoning split: ``<think>...</think>`` written into a chat response's
content reaches the agent as ``reasoning_content``, streamed or not, while the recorded call
keeps what was sampled (text and token ids). On the scripted backend and on LocalRL's engine
with a tiny model taught to think."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from fake_openai_backend import FakeBackend, scripted_ids
from gateway_env import new_rollout
from helpers import serve_gateway
from hypothesis import given, settings
from hypothesis import strategies as st

from voltrl.gateway import Gateway
from voltrl.gateway.reasoning import ReasoningSplitter, split_reasoning
from voltrl.store.memory import InMemoryStore

THOUGHT = "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe answer is 4."


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        (THOUGHT, "\nThe user wants 2+2. That is 4.\n", "The answer is 4."),
        ("no thinking here", None, "no thinking here"),
        ("opened in the prompt</think> answer", "opened in the prompt", "answer"),
        ("<think>cut off by max_tokens", "cut off by max_tokens", ""),
        ("<think></think>just this", "", "just this"),
    ],
)
def test_split_reasoning(text: str, reasoning: str | None, content: str) -> None:
    assert split_reasoning(text) == (reasoning, content)


PIECES = ["<think>", "</think>", "<th", "ink>", "</", "think>", " ", "\n", "a", "b", "<", ">"]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(PIECES), max_size=14),
    st.lists(st.integers(1, 5), min_size=1, max_size=30),
)
def test_a_stream_splits_as_the_whole_text_does(pieces: list[str], cuts: list[int]) -> None:
    text = "".join(pieces)
    splitter, reasoning, content, i = ReasoningSplitter(), "", "", 0
    for n in cuts * (len(text) + 1):
        if i >= len(text):
            break
        r, c = splitter.feed(text[i : i + n])
        reasoning, content, i = reasoning + r, content + c, i + n
    r, c = splitter.finish()
    expected_reasoning, expected_content = split_reasoning(text)
    assert (reasoning + r, content + c) == (expected_reasoning or "", expected_content)


async def gateway_call(split: bool, stream: bool, reply: str) -> tuple[str, str, list]:
    """One chat call through a gateway to the scripted backend answering ``reply``: the
    content and reasoning the client saw, and the recorded calls."""
    store = InMemoryStore()
    async with (
        FakeBackend() as fb,
        serve_gateway(Gateway(store, [fb.url], reasoning_split=split)) as base,
    ):
        fb.script = lambda req: {"text": reply}
        rid, aid = await new_rollout(store)
        client = openai.AsyncOpenAI(
            base_url=f"{base}/rollouts/{rid}/attempts/{aid}/v1", api_key="x", max_retries=0
        )
        messages = [{"role": "user", "content": "2+2?"}]
        if stream:
            content = reasoning = ""
            async for chunk in await client.chat.completions.create(
                model="m", messages=messages, stream=True
            ):
                for choice in chunk.choices:
                    content += choice.delta.content or ""
                    reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
        else:
            message = await client.chat.completions.create(model="m", messages=messages)
            message = message.choices[0].message
            content = message.content or ""
            reasoning = (message.model_extra or {}).get("reasoning_content") or ""
        await client.close()
        return content, reasoning, await store.get_llm_calls(rid)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_the_agent_gets_the_split_the_store_keeps_what_was_sampled(stream: bool) -> None:
    content, reasoning, [call] = await gateway_call(True, stream, THOUGHT)
    assert (reasoning, content) == split_reasoning(THOUGHT)
    assert call.response_token_ids == scripted_ids(THOUGHT)
    assert call.response["choices"][0]["message"]["content"] == THOUGHT


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_the_split_is_off_unless_asked_for(stream: bool) -> None:
    content, reasoning, _ = await gateway_call(False, stream, THOUGHT)
    assert (content, reasoning) == (THOUGHT, "")


@pytest.mark.slow
async def test_on_the_local_engine_token_ids_stay_those_sampled() -> None:
    """A tiny model taught to answer ``<think>hm</think>ok``: through a splitting gateway the
    agent gets ``hm`` / ``ok``; the recorded ids are the engine's sampled ones and decode to
    the whole text."""
    import torch

    from voltrl.algorithms.local.supervised import supervised_warmup
    from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer
    from voltrl.serving.engine import Engine
    from voltrl.serving.openai_api import serve_engine

    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, seed=0, max_positions=128)
    messages = [{"role": "user", "content": "hi"}]
    taught = {"messages": [*messages, {"role": "assistant", "content": "<think>hm</think>ok"}]}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        supervised_warmup(model, tok, [taught], steps=150, batch_size=4, lr=3e-3, threads=1)
    engine = Engine(model, tok)
    store = InMemoryStore()
    url, stop = await serve_engine(engine)
    try:
        async with serve_gateway(Gateway(store, [f"{url}/v1"], reasoning_split=True)) as base:
            rid, aid = await new_rollout(store)
            client = openai.AsyncOpenAI(
                base_url=f"{base}/rollouts/{rid}/attempts/{aid}/v1", api_key="x", max_retries=0
            )
            reply = await client.chat.completions.create(
                model="m", messages=messages, temperature=0, max_tokens=32
            )
            await client.close()
    finally:
        await stop()
        engine.close()
    message = reply.choices[0].message
    [call] = await store.get_llm_calls(rid)
    sampled = tok.decode(call.response_token_ids, skip_special_tokens=True)
    assert sampled == "<think>hm</think>ok"
    assert (message.model_extra.get("reasoning_content"), message.content) == ("hm", "ok")
    assert call.response["choices"][0]["message"]["content"] == "<think>hm</think>ok"


async def test_an_llm_resource_asks_for_the_split_its_gateway_makes_it(tmp_path) -> None:
    """``LLM(reasoning_split=True)`` given to the trainer: its gateway splits, another LLM's
    does not."""
    from helpers import fake_trainer

    import voltrl as vl

    @vl.rollout
    async def both(task: dict, resources: vl.Resources) -> float:
        from voltrl.adapters.openai_client import async_openai

        seen = []
        for name in ("main_llm", "other_llm"):
            llm = resources[name]
            reply = await async_openai(llm).chat.completions.create(
                model=llm.model, messages=[{"role": "user", "content": "2+2?"}]
            )
            seen.append(reply.choices[0].message.content)
        return float(seen == ["The answer is 4.", THOUGHT])

    store = InMemoryStore()
    async with FakeBackend() as fb, FakeBackend() as other:
        fb.script = other.script = lambda req: {"text": THOUGHT}
        trainer = fake_trainer(
            store, tmp_path, vl.LLM(endpoint=fb.url, model="m", reasoning_split=True)
        )
        trainer.resources["other_llm"] = vl.LLM(endpoint=other.url, model="m")
        result = await trainer.dev_async(both, [{}])
    assert result.rewards == [1.0]


def chunk(index: int = 0, finish: str | None = None, **delta: Any) -> dict:
    choice: dict[str, Any] = {"index": index, "finish_reason": finish}
    if delta:
        choice["delta"] = delta
    return {"id": "c", "model": "m", "choices": [choice]}


def test_streamed_edge_cases_lose_nothing_and_add_nothing() -> None:
    from voltrl.gateway.reasoning import flush_deltas, split_deltas

    split: dict = {}
    role = chunk(role="assistant", content=None)
    split_deltas(role, split)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": None}
    held = chunk(content="Hello")  # no <think>: held back until it is known
    split_deltas(held, split)
    assert held["choices"][0]["delta"]["content"] == ""
    last = chunk(finish="stop")  # a finish chunk with no delta at all
    split_deltas(last, split)
    assert last["choices"][0]["delta"] == {"content": "Hello"}
    # a stream that ends without a finish_reason: the rest comes in a last chunk
    split = {}
    split_deltas(chunk(content="<think>a"), split)
    split_deltas(chunk(content="b</th"), split)
    tail = flush_deltas(split, {"id": "c", "model": "m", "created": 1, "usage": {}})
    assert tail is not None and "usage" not in tail
    assert tail["choices"] == [{"index": 0, "delta": {"reasoning_content": "</th"},
                                "finish_reason": None}]  # fmt: skip
    assert flush_deltas(split, {}) is None


def test_a_backend_that_splits_itself_is_passed_through() -> None:
    from voltrl.gateway.reasoning import split_deltas

    split: dict = {}
    first = chunk(reasoning_content="thinking")
    split_deltas(first, split)
    answer = chunk(content="The answer </think> stays")
    split_deltas(answer, split)
    assert first["choices"][0]["delta"] == {"reasoning_content": "thinking"}
    assert answer["choices"][0]["delta"] == {"content": "The answer </think> stays"}


def test_a_split_asked_of_an_llm_that_is_a_gateway_already_is_refused(tmp_path) -> None:
    import voltrl as vl

    llm = vl.LLM(endpoint="http://127.0.0.1:1/v1", model="m", gateway=True, reasoning_split=True)
    trainer = vl.Trainer(resources={"main_llm": llm}, run_dir=tmp_path, inline=True)
    with pytest.raises(vl.VoltRLError, match="a gateway already"):
        trainer.dev(lambda task, llm: 1.0, [{}])
