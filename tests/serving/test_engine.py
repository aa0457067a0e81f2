"""LocalRL inference engine and its OpenAI-compatible server: a real tiny model, a real HTTP
server on loopback, the real ``openai`` client."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from openai import AsyncOpenAI, BadRequestError, OpenAI

from voltrl._http.serving import BackgroundServer
from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from voltrl.models.toolcalls import parse_tool_calls
from voltrl.serving.engine import Engine, SamplingParams
from voltrl.serving.engine.prefix_cache import PrefixCache, shared_length
from voltrl.serving.openai_api import serve_engine_in_thread

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
ASK = [{"role": "user", "content": "What is 2 + 3?"}]
CALL_TEXT = (
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
)
HELLO = [{"role": "user", "content": "Say hello."}]
HELLO_TEXT = "Hello there! The answer is 42."
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """A tiny model runs fastest on one thread, and a busy machine makes a second one a
    liability (the thread pool waits on a core it does not get)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    return build_tiny_model(tok, seed=1)


@pytest.fixture(scope="module")
def trained(tok: Any, model: Any) -> dict[str, Any]:
    """Weights that answer ASK (with tools) by calling the calculator and HELLO with
    HELLO_TEXT, greedily: a few hundred milliseconds of memorisation."""
    student = copy.deepcopy(model).train()
    examples = []
    for messages, tools, reply in ((ASK, [CALC], CALL_TEXT), (HELLO, None, HELLO_TEXT)):
        text = tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        prompt = tok.encode(text, add_special_tokens=False)
        answer = tok.encode(reply + "<|im_end|>", add_special_tokens=False)
        ids = torch.tensor([prompt + answer])
        labels = ids.clone()
        labels[0, : len(prompt)] = -100
        examples.append((ids, labels))
    opt = torch.optim.Adam(student.parameters(), lr=1e-2)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for _ in range(400):
            loss = sum(student(input_ids=i, labels=lab).loss for i, lab in examples)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if loss.item() < 0.02:
                break
    return {k: v.detach().clone() for k, v in student.state_dict().items()}


@pytest.fixture(scope="module")
def engine(tok: Any, model: Any) -> Iterator[Engine]:
    with Engine(model, tok, max_batch_size=16, seed=0) as eng:
        yield eng


@pytest.fixture(scope="module")
def smart(tok: Any, model: Any, trained: dict[str, Any]) -> Iterator[Engine]:
    m = copy.deepcopy(model)
    m.load_state_dict(trained)
    with Engine(m, tok, seed=0) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[BackgroundServer]:
    with serve_engine_in_thread(engine, model_name="tiny") as srv:
        yield srv


@pytest.fixture(scope="module")
def smart_server(smart: Engine) -> Iterator[BackgroundServer]:
    with serve_engine_in_thread(smart, model_name="tiny-smart") as srv:
        yield srv


def client(srv: BackgroundServer) -> OpenAI:
    return OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def teacher_forced(model: Any, prompt: list[int], ids: list[int]) -> list[float]:
    """Log-probabilities (temperature 1) of ``ids`` after ``prompt``, in one forward pass."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0].float()
    lps = torch.log_softmax(logits, dim=-1)
    return [lps[len(prompt) - 1 + k, t].item() for k, t in enumerate(ids)]


# ---- chat template and tool-call parsing --------------------------------------------------
def test_chat_template_renders_tools_calls_and_results(tok: Any) -> None:
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "2 + 3"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    text = tok.apply_chat_template(messages, tools=[CALC], tokenize=False)
    assert "<|im_start|>system\n<tools>calculator(expression)</tools><|im_end|>\n" in text
    assert f"<|im_start|>assistant\n{CALL_TEXT}<|im_end|>\n" in text
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n" in text
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("<tool_call>") in ids
    plain = tok.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=False)
    assert plain == "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"


def test_parse_tool_calls() -> None:
    content, calls = parse_tool_calls(f"Let me compute.\n{CALL_TEXT}")
    assert content == "Let me compute."
    assert [c["function"] for c in calls] == [
        {"name": "calculator", "arguments": '{"expression": "2 + 3"}'}
    ]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}'
    content, calls = parse_tool_calls(two)
    assert content is None and [c["function"]["name"] for c in calls] == ["a", "b"]
    assert calls[0]["id"] != calls[1]["id"]
    for bad in ("<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>'):
        assert parse_tool_calls(bad) == (bad, [])
    assert parse_tool_calls("no calls here") == ("no calls here", [])


def test_tool_call_round_trip_through_the_template(tok: Any) -> None:
    """Parsed calls, sent back as the assistant message, re-render the generated text."""
    generated = f"Let me compute.\n{CALL_TEXT}"
    content, calls = parse_tool_calls(generated)
    head = tok.apply_chat_template(ASK, tools=[CALC], add_generation_prompt=True, tokenize=False)
    turn = {"role": "assistant", "content": content, "tool_calls": calls}
    full = tok.apply_chat_template([*ASK, turn], tools=[CALC], tokenize=False)
    assert full == head + generated + "<|im_end|>\n"


# ---- the engine ---------------------------------------------------------------------------
async def test_concurrent_requests_batch_like_sequential_ones(engine: Engine, tok: Any) -> None:
    prompts = [
        tok.encode("What is " + "1 + " * k + "2?", add_special_tokens=False) for k in range(6)
    ]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [(await engine.generate(p, greedy)).choices[0] for p in prompts]
    # Two requests are mid-flight (caches shorter and longer than the newcomers' prompts)
    # when the others join them; the joiners finish first and leave the batch.
    long = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    streams = []
    for p in (prompts[0], prompts[-1]):
        streams.append(engine.stream(p, long))
        await anext(streams[-1])
    together = await asyncio.gather(*(engine.generate(p, greedy) for p in prompts[1:-1]))
    for stream, a in zip(streams, (alone[0], alone[-1]), strict=True):
        rest = [d for deltas in [item async for item in stream] for d in deltas]
        assert len(rest) == 29 and rest[-1].finish_reason == "length"
        assert [d.token_ids[0] for d in rest[:11]] == a.token_ids[1:]
    for a, b in zip(alone[1:-1], together, strict=True):
        assert b.choices[0].token_ids == a.token_ids
        assert b.choices[0].logprobs == pytest.approx(a.logprobs, abs=1e-4)


async def test_logprobs_are_raw_model_logprobs(engine: Engine, model: Any, tok: Any) -> None:
    prompt = tok.encode("What is 7 * 6?", add_special_tokens=False)
    params = SamplingParams(
        max_tokens=16, temperature=0.7, top_k=50, top_p=0.9, seed=3, n=2, ignore_eos=True
    )
    out = await engine.generate(prompt, params)
    for c in out.choices:
        assert len(c.token_ids) == len(c.logprobs) == len(c.sampling_logprobs) == 16
        assert c.logprobs == pytest.approx(teacher_forced(model, prompt, c.token_ids), abs=1e-4)
        # The sampling distribution is sharper than the raw one (temperature < 1, top-k/p).
        assert all(s >= r for s, r in zip(c.sampling_logprobs, c.logprobs, strict=True))
    again = await engine.generate(prompt, params)
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in out.choices]
    assert out.choices[0].token_ids != out.choices[1].token_ids


def hold_until_update_queued(eng: Engine) -> None:
    """Make the engine thread's next decode step wait until a weights update is queued (then
    decode as usual): a request's first token goes out, and its second is only sampled once
    the update waits for the next step boundary, however slowly the test's side runs."""
    decode, seen = eng._decode, threading.Event()

    def held() -> None:
        if not seen.is_set():
            with eng._cv:  # update_weights queues under this lock and notifies it
                queued = eng._cv.wait_for(lambda: eng._updates or eng._closing, timeout=120)
            assert queued, "no weights update was queued"
            seen.set()
        decode()

    eng._decode = held  # type: ignore[method-assign]


async def test_weight_swap_at_a_step_boundary(
    tok: Any, model: Any, trained: dict[str, Any]
) -> None:
    text = tok.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    greedy = SamplingParams(max_tokens=40, temperature=0)
    long = SamplingParams(max_tokens=200, temperature=0, **NO_EOS)
    with Engine(copy.deepcopy(model), tok) as eng:
        before = (await eng.generate(prompt, greedy)).choices[0]
        unswapped = (await eng.generate(prompt, long)).choices[0].token_ids  # old weights only
        hold_until_update_queued(eng)  # the stream cannot end before the update is asked for
        inflight = eng.stream(prompt, long)
        first = await anext(inflight)  # the first token, sampled by the weights before
        assert await eng.aupdate_weights(trained) == 1
        rest = [
            i for deltas in [item async for item in inflight] for d in deltas for i in d.token_ids
        ]
        after = (await eng.generate(prompt, greedy)).choices[0]
    # the stream went on with the new weights: greedy, the old ones alone would repeat themselves
    assert first[0].token_ids == unswapped[:1] and len(rest) == 199 and rest != unswapped[1:]
    assert before.text != after.text == HELLO_TEXT
    assert after.finish_reason == "stop" and after.token_ids[-1] == tok.eos_token_id


async def test_bad_requests_raise_value_errors(engine: Engine) -> None:
    for prompt, params in [
        ([], SamplingParams()),
        ([10**6], SamplingParams()),
        ([5] * engine.max_model_len, SamplingParams()),
        ([5], SamplingParams(max_tokens=engine.max_model_len)),
        ([5], SamplingParams(top_p=0)),
        ([5], SamplingParams(n=10**3)),
    ]:
        with pytest.raises(ValueError):
            engine.stream(prompt, params)


# ---- prompt prefixes ----------------------------------------------------------------------
def agent_prompts(
    tok: Any, questions: list[str], system: str = "You are a careful assistant."
) -> list[list[int]]:
    """Chat prompts of one agent: the same system prompt and tool schema, their own question."""
    return [
        tok.apply_chat_template(
            [
                {"role": "system", "content": system},
                {"role": "user", "content": q},
            ],
            tools=[CALC],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
        for q in questions
    ]


async def test_prompts_sharing_a_prefix_decode_as_if_each_were_fed_whole(
    model: Any, tok: Any
) -> None:
    first = agent_prompts(tok, [f"What is {k} + {k * 7}?" for k in range(4)])
    later = agent_prompts(tok, ["What is 2 * 3?", "And what is the capital of France, then?"])
    # another role's prompts arrive with them: prefilled as a group of their own
    reviewer = agent_prompts(tok, ["Is 6 right?", "Is 7 right?"], system="You review answers.")
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    two = SamplingParams(max_tokens=10, temperature=0.9, ignore_eos=True, seed=5, n=2)
    outputs = []
    for prefix_cache_tokens in (0, 8192):
        with Engine(model, tok, seed=0, prefix_cache_tokens=prefix_cache_tokens) as eng:
            running = eng.stream(first[0], SamplingParams(max_tokens=30, temperature=0, **NO_EOS))
            await anext(running)  # in flight while the others join (a longer cache)
            wave = await asyncio.gather(*(eng.generate(p, greedy) for p in first[1:]))
            again = await asyncio.gather(  # the kept prefix serves the first three
                *(eng.generate(p, greedy) for p in [*later, *reviewer]),
                eng.generate(later[0], two),
            )
            rest = [d.token_ids[0] for deltas in [x async for x in running] for d in deltas]
            outputs.append((wave + again, rest, dict(eng.stats)))
    (whole, whole_rest, whole_stats), (shared, shared_rest, stats) = outputs
    assert shared_rest == whole_rest
    for a, b in zip(whole, shared, strict=True):
        for x, y in zip(a.choices, b.choices, strict=True):
            assert y.token_ids == x.token_ids
            assert y.logprobs == pytest.approx(x.logprobs, abs=1e-4)
    assert "prefix_cached_tokens" not in whole_stats
    shared_len = shared_length(first + later)
    assert stats["prefix_cached_tokens"] >= shared_len * 3  # the later three prompts
    assert stats["prefill_tokens"] < whole_stats["prefill_tokens"] - shared_len * 3
    assert shared[-1].choices[0].token_ids != shared[-1].choices[1].token_ids


def admit_all_at_once(eng: Engine, n: int) -> None:
    """Make the engine thread's next admission wait until ``n`` requests are waiting, as if
    they had come in the same instant, however the event loop and the engine thread happen to
    interleave the submissions."""
    admit, done = eng._admit, threading.Event()

    def held() -> list:
        if not done.is_set():  # called holding eng._cv, which waiting releases
            arrived = eng._cv.wait_for(lambda: len(eng._waiting) >= n, timeout=120)
            assert arrived, f"{len(eng._waiting)} requests came, not {n}"
            done.set()
        return admit()

    eng._admit = held  # type: ignore[method-assign]


async def test_the_prefill_budget_leaves_out_what_the_prefix_cache_holds(
    model: Any, tok: Any
) -> None:
    """Prompts whose long system prompt is kept are admitted together, on the tokens still to
    feed: one prefill of four, not four prefills of one (as for a tau2 assistant's 5k-token
    policy and tools under the default 8,192-token budget)."""
    first, *rest = agent_prompts(tok, [f"What is {k} + {k * 7}?" for k in range(5)])
    longest, shared = max(map(len, rest)), shared_length([first, *rest])
    budget = 2 * longest - 1  # one whole prompt fits, two do not; five rests do
    assert 5 * (longest - shared) <= budget
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    with Engine(model, tok, seed=0, max_prefill_tokens=budget) as eng:
        await eng.generate(first, greedy)  # keeps the shared prefix
        groups: list[int] = []
        prefill = eng._prefill
        eng._prefill = lambda new: (groups.append(len(new)), prefill(new))[1]
        admit_all_at_once(eng, len(rest))
        await asyncio.gather(*(eng.generate(p, greedy) for p in rest))
    assert groups == [4]


async def test_new_weights_drop_the_kept_prefixes(
    model: Any, tok: Any, trained: dict[str, Any]
) -> None:
    prompts = agent_prompts(tok, ["What is 2 + 3?", "What is 4 + 5?"])
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(trained)
    with Engine(copy.deepcopy(model), tok) as eng:
        await asyncio.gather(*(eng.generate(p, greedy) for p in prompts))
        # one entry when both were admitted together, two when the first came alone
        assert len(eng._prefixes) >= 1
        await eng.aupdate_weights(trained)
        assert len(eng._prefixes) == 0
        out = (await eng.generate(prompts[1], greedy)).choices[0]
        assert len(eng._prefixes) == 1
        # an update that fails part-way may have copied some weights: the prefixes go too
        broken = {**trained, "lm_head.weight": torch.zeros(3)}
        with pytest.raises(RuntimeError):
            await eng.aupdate_weights(broken)
        assert len(eng._prefixes) == 0
    assert out.logprobs == pytest.approx(teacher_forced(fresh, prompts[1], out.token_ids), abs=1e-4)


def test_the_prefix_cache_serves_the_longest_prefix_of_its_adapter_and_evicts_the_oldest() -> None:
    def kv(n: int, fill: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
        t = torch.full((1, 1, n, 2), fill)
        return [(t, t.clone())]

    cache = PrefixCache(max_tokens=60, min_tokens=4)
    system = list(range(20))
    cache.add(None, system, kv(20, 1.0), cache.epoch)
    cache.add("expert", system, kv(20, 2.0), cache.epoch)
    cache.add(None, system[:10], kv(10, 3.0), cache.epoch)  # shorter: kept beside the longer
    n, got = cache.longest(None, [[*system, 50, 51], [*system[:15], 60, 61]])
    assert n == 15 and got[0][0].shape[2] == 15 and float(got[0][0][0, 0, 0, 0]) == 1.0
    n, got = cache.longest("expert", [[*system, 7]])
    assert n == 20 and float(got[0][0][0, 0, 0, 0]) == 2.0
    order = list(cache._entries)
    assert cache.cached_length(None, [*system, 50]) == 20 and cache._entries == order
    assert cache.cached_length(None, [*system[:3], 7]) == 0  # under min_tokens
    assert cache.longest(None, [[99] * 30]) == (0, [])
    assert cache.longest(None, [[*system[:3], 7, 7]]) == (0, [])  # under min_tokens
    cache.add(None, [*system, 1, 2, 3], kv(23, 4.0), cache.epoch)  # supersedes its prefixes
    assert cache.tokens == 43 and len(cache) == 2
    cache.add(None, [5] * 30, kv(30, 5.0), cache.epoch)  # over max_tokens: the oldest go
    assert cache.tokens <= 60 and cache.longest("expert", [[*system, 7]]) == (0, [])
    computed_in = cache.epoch  # keys computed, then new weights come before they are kept
    cache.clear()
    cache.add(None, system, kv(20, 6.0), computed_in)
    assert len(cache) == 0


# ---- the server ---------------------------------------------------------------------------
def test_chat_token_ids_decode_and_logprobs_recompute(
    server: BackgroundServer, model: Any, tok: Any
) -> None:
    resp = client(server).chat.completions.create(
        model="anything",
        messages=[{"role": "system", "content": "Be brief."}, *HELLO],
        max_tokens=24,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_token_ids": True, **NO_EOS},
    )
    data = resp.model_dump()
    prompt, ids = data["prompt_token_ids"], data["choices"][0]["token_ids"]
    rendered = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *HELLO],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt == tok.encode(rendered, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == resp.choices[0].message.content
    content = resp.choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx(
        teacher_forced(model, prompt, ids), abs=1e-4
    )
    assert all(
        len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in content
    )
    assert resp.model == "tiny" and resp.usage.completion_tokens == len(ids) == 24
    assert resp.choices[0].finish_reason == "length"


def test_n_choices_and_stop_strings(server: BackgroundServer, tok: Any) -> None:
    oai = client(server)
    kw: dict[str, Any] = {"model": "m", "messages": HELLO, "max_tokens": 20, "seed": 11}
    extra = {"return_token_ids": True, **NO_EOS}
    resp = oai.chat.completions.create(n=3, extra_body=extra, **kw)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    texts = [c.message.content for c in resp.choices]
    assert len(set(texts)) == 3
    for c in resp.model_dump()["choices"]:
        assert tok.decode(c["token_ids"], skip_special_tokens=True) == c["message"]["content"]
    text = texts[0]
    stop = next(text[i : i + 2] for i in range(3, len(text)) if text[i : i + 2].isprintable())
    cut = oai.chat.completions.create(n=3, stop=[stop, "never-seen"], extra_body=extra, **kw)
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.model_dump()["choices"][0]["stop_reason"] == stop
    ids = resp.model_dump()["choices"][0]["token_ids"]
    by_id = oai.chat.completions.create(extra_body={**extra, "stop_token_ids": [ids[4]]}, **kw)
    dumped = by_id.model_dump()["choices"][0]
    assert dumped["token_ids"] == ids[: ids.index(ids[4]) + 1]
    assert dumped["finish_reason"] == "stop" and dumped["stop_reason"] == ids[4]


def test_completions_endpoint(server: BackgroundServer, model: Any, tok: Any) -> None:
    resp = client(server).completions.create(
        model="m",
        prompt=["What is", "1 + 1 ="],
        max_tokens=6,
        n=2,
        logprobs=1,
        temperature=0,
        extra_body={"return_token_ids": True, **NO_EOS},
    )
    data = resp.model_dump()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    for c in data["choices"]:
        prompt = tok.encode(["What is", "1 + 1 ="][c["index"] // 2], add_special_tokens=False)
        assert c["prompt_token_ids"] == prompt
        assert tok.decode(c["token_ids"]) == c["text"]
        lps = c["logprobs"]["token_logprobs"]
        assert lps == pytest.approx(teacher_forced(model, prompt, c["token_ids"]), abs=1e-4)
    assert data["usage"]["completion_tokens"] == 24


def test_completions_streaming_several_prompts(server: BackgroundServer) -> None:
    kw: dict[str, Any] = {"model": "m", "prompt": ["What is", "1 + 1 ="], "max_tokens": 5}
    extra = {"return_token_ids": True, **NO_EOS}
    oai = client(server)
    full = oai.completions.create(n=2, temperature=0, extra_body=extra, **kw).model_dump()
    ids: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    prompts: dict[int, list[int]] = {}
    for chunk in oai.completions.create(n=2, temperature=0, stream=True, extra_body=extra, **kw):
        for ch in chunk.model_dump()["choices"]:
            ids.setdefault(ch["index"], []).extend(ch["token_ids"])
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
            prompts.setdefault(ch["index"], ch.get("prompt_token_ids"))
    for c in full["choices"]:
        assert ids[c["index"]] == c["token_ids"] and texts[c["index"]] == c["text"]
        assert prompts[c["index"]] == c["prompt_token_ids"]


async def test_streaming_reassembles_to_the_same_tokens(server: BackgroundServer) -> None:
    oai = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    kw: dict[str, Any] = {"model": "m", "messages": HELLO, "max_tokens": 16, "temperature": 0}
    extra = {"return_token_ids": True, **NO_EOS}
    full = (await oai.chat.completions.create(extra_body=extra, logprobs=True, **kw)).model_dump()
    stream = await oai.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, logprobs=True, extra_body=extra, **kw
    )
    ids: list[int] = []
    lps: list[float] = []
    text, prompt, usage, finish = "", None, None, None
    async for chunk in stream:
        data = chunk.model_dump()
        prompt = prompt or data.get("prompt_token_ids")
        usage = usage or data.get("usage")
        for ch in data["choices"]:
            ids += ch.get("token_ids") or []
            text += ch["delta"].get("content") or ""
            lps += [e["logprob"] for e in (ch.get("logprobs") or {}).get("content") or []]
            finish = ch["finish_reason"] or finish
    choice = full["choices"][0]
    assert ids == choice["token_ids"] and text == choice["message"]["content"]
    assert lps == pytest.approx([e["logprob"] for e in choice["logprobs"]["content"]])
    assert prompt == full["prompt_token_ids"] and finish == "length"
    assert usage is not None
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), 16)
    await oai.close()


def test_tool_calls_from_the_model(smart_server: BackgroundServer, tok: Any) -> None:
    oai = client(smart_server)
    kw: dict[str, Any] = {"model": "m", "messages": ASK, "tools": [CALC], "temperature": 0}
    resp = oai.chat.completions.create(extra_body={"return_token_ids": True}, **kw)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "2 + 3"}
    ids = resp.model_dump()["choices"][0]["token_ids"]
    assert tok.decode(ids) == CALL_TEXT + "<|im_end|>"
    streamed = oai.chat.completions.create(stream=True, **kw)
    deltas = [c.choices[0] for c in streamed if c.choices]
    calls = [tc for d in deltas for tc in d.delta.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("calculator", call.function.arguments)
    ]
    assert "".join(d.delta.content or "" for d in deltas) == ""
    assert deltas[-1].finish_reason == "tool_calls"
    plain = oai.chat.completions.create(model="m", messages=HELLO, temperature=0)
    assert plain.choices[0].message.content == HELLO_TEXT
    assert plain.choices[0].finish_reason == "stop" and not plain.choices[0].message.tool_calls


def test_models_health_and_bad_requests(server: BackgroundServer) -> None:
    oai = client(server)
    assert [m.id for m in oai.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").status_code == 200
    base: dict[str, Any] = {"model": "no-such-model", "messages": HELLO, "max_tokens": 2}
    assert oai.chat.completions.create(**base).model == "tiny"
    for bad in [
        {"messages": []},
        {"n": 0},
        {"top_p": 2},
        {"temperature": "hot"},
        {"presence_penalty": 0.5},
        {"stop": 3},
        {"messages": [{"role": "robot", "content": "hi"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"max_tokens": 10**6},
        {"stream": True, "max_tokens": 10**6},
    ]:
        with pytest.raises(BadRequestError) as err:
            oai.chat.completions.create(**{**base, **bad})
        assert err.value.body and err.value.body.get("message")
    raw = httpx.post(server.url + "/v1/chat/completions", content=b"{nope")
    assert raw.status_code == 400 and "JSON" in raw.json()["error"]["message"]
    with pytest.raises(BadRequestError):
        oai.completions.create(model="m", prompt=[[1, 2], "mixed"], max_tokens=2)  # type: ignore[list-item]
