"""Tool-call parsers end to end: a tiny model taught to write a call in each format (Hermes tags,
bare and fenced JSON, a pythonic list) and two replies that are no call (JSON naming no tool,
malformed JSON), served by our engine with each parser (in-process, ``voltrl model serve
--tool-parser`` as a real process, LocalRL's ``serving.tool_parser``) and asked by the real
``openai`` client: a call in the parser's format comes back as ``tool_calls`` with
``finish_reason: "tool_calls"``, anything else as content, and the sampled token ids are the
same whatever the parser."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import Served
from local_rl_setup import stored
from openai import AsyncOpenAI, OpenAI

import voltrl as vl
from voltrl.algorithms.local.config import ADDED, RESUMABLE
from voltrl.algorithms.local.update import PolicyUpdateConfig
from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from voltrl.serving.engine import Engine
from voltrl.serving.openai_api import create_app, serve_engine_in_thread

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
CALL = '{"name": "calculator", "arguments": {"expression": "2 + 3"}}'
ARGS = {"expression": "2 + 3"}
REPLIES = {  # what the model writes when the user says the key
    "hermes": f"Let me compute.\n<tool_call>\n{CALL}\n</tool_call>",
    "json": CALL,
    "fenced": f"```json\n{CALL}\n```",
    "pythonic": '[calculator(expression="2 + 3")]',
    "lookalike": '{"name": "Ada", "arguments": {"age": 3}}',  # no tool of the request's
    "broken": CALL[:-1],  # malformed JSON
}
READS = {  # the replies each parser returns as a call
    "hermes": {"hermes"},
    "json": {"json", "fenced"},
    "pythonic": {"pythonic"},
    "auto": {"hermes", "json", "fenced", "pythonic"},
}
CONTENT = {"hermes": "Let me compute."}  # the content before a call (else None)


def ask(key: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": key}]


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def taught(tok: Any) -> Any:
    """The tiny model, taught to answer each key of REPLIES (with the calculator offered)
    with its reply, greedily: a few seconds of memorisation on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = build_tiny_model(tok, seed=1).train()
    examples = []
    for key, reply in REPLIES.items():
        text = tok.apply_chat_template(
            ask(key), tools=[CALC], add_generation_prompt=True, tokenize=False
        )
        prompt = tok.encode(text, add_special_tokens=False)
        answer = tok.encode(reply + "<|im_end|>", add_special_tokens=False)
        ids = torch.tensor([prompt + answer])
        labels = ids.clone()
        labels[0, : len(prompt)] = -100
        examples.append((ids, labels))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    try:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            for _ in range(400):
                losses = [model(input_ids=i, labels=lab).loss for i, lab in examples]
                opt.zero_grad()
                sum(losses).backward()
                opt.step()
                if max(loss.item() for loss in losses) < 0.01:
                    break
    finally:
        torch.set_num_threads(threads)
    return model.eval()


@pytest.fixture(scope="module")
def engine(tok: Any, taught: Any) -> Iterator[Engine]:
    with Engine(copy.deepcopy(taught), tok, max_batch_size=8, seed=0, threads=1) as eng:
        yield eng


def functions(calls: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls or []]


def expect(parser: str, key: str) -> tuple[str | None, list[tuple[str, Any]], str]:
    """The content, calls and finish reason of ``key``'s reply under ``parser``."""
    if key in READS[parser]:
        return CONTENT.get(key), [("calculator", ARGS)], "tool_calls"
    return REPLIES[key], [], "stop"


@pytest.mark.slow
def test_each_parser_returns_the_calls_of_its_format_and_the_rest_as_content(
    engine: Engine, tok: Any
) -> None:
    sampled: dict[str, set[tuple[int, ...]]] = {key: set() for key in REPLIES}
    for parser in READS:
        with serve_engine_in_thread(engine, model_name="taught", tool_parser=parser) as srv:
            oai = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
            for key in REPLIES:
                kw: dict[str, Any] = {
                    "model": "taught",
                    "messages": ask(key),
                    "tools": [CALC],
                    "temperature": 0,
                    "max_tokens": 80,
                }
                resp = oai.chat.completions.create(extra_body={"return_token_ids": True}, **kw)
                choice = resp.choices[0]
                got = (choice.message.content, functions(choice.message.tool_calls))
                content, calls, finish = expect(parser, key)
                assert (*got, choice.finish_reason) == (content, calls, finish), (parser, key)
                ids = resp.model_dump()["choices"][0]["token_ids"]
                assert tok.decode(ids) == REPLIES[key] + "<|im_end|>"  # parsed from the text
                sampled[key].add(tuple(ids))

                chunks = [c.choices[0] for c in oai.chat.completions.create(stream=True, **kw)]
                streamed = "".join(c.delta.content or "" for c in chunks)
                calls_streamed = [tc for c in chunks for tc in c.delta.tool_calls or []]
                assert streamed == (content or "") and functions(calls_streamed) == calls
                assert chunks[-1].finish_reason == finish
            # without tools (or with tool_choice "none") nothing is parsed
            plain = oai.chat.completions.create(
                model="taught",
                messages=ask("json"),
                tools=[CALC],
                tool_choice="none",
                temperature=0,
                max_tokens=80,
            )
            assert (
                plain.choices[0].message.content == CALL and not plain.choices[0].message.tool_calls
            )
    assert all(len(ids) == 1 for ids in sampled.values())  # the same tokens under every parser


def test_an_unknown_parser_is_refused_before_the_engine_starts(tok: Any) -> None:
    engine = Engine(build_tiny_model(tok, seed=0), tok, max_batch_size=2)
    try:
        with pytest.raises(ValueError, match=r"unknown tool parser 'llama3_json' \(choose one"):
            create_app(engine, tool_parser="llama3_json")
        assert not engine.running
    finally:
        engine.close()


@pytest.mark.slow
def test_voltrl_model_serve_parses_with_its_tool_parser(taught: Any, tok: Any, tmp_path: Path):
    taught.save_pretrained(tmp_path / "taught")
    tok.save_pretrained(tmp_path / "taught")
    args = ("--port", "0", "--threads", "1", "--tool-parser", "json")
    served = Served(str(tmp_path / "taught"), *args)
    try:
        assert "tool calls are parsed as json (--tool-parser)" in served.lines
        oai = OpenAI(base_url=served.endpoint, api_key="none", max_retries=0)
        for key in REPLIES:
            resp = oai.chat.completions.create(
                model="taught", messages=ask(key), tools=[CALC], temperature=0, max_tokens=80
            )
            choice = resp.choices[0]
            got = (choice.message.content, functions(choice.message.tool_calls))
            content, calls, finish = expect("json", key)
            assert (*got, choice.finish_reason) == (content, calls, finish), key
    finally:
        assert served.stop() == 0, served.stderr()


ANSWERS: list[dict[str, Any]] = []  # what the agent got: (mode, task, finish, content, calls)


async def calculator_agent(task: dict, llm: vl.LLM) -> float:
    """Asks with the calculator offered; reward 1 when the reply is a calculator call."""
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    resp = await client.chat.completions.create(
        model=llm.model, messages=ask(task["ask"]), tools=[CALC], **llm.sampling_parameters
    )
    choice = resp.choices[0]
    calls = functions(choice.message.tool_calls)
    ANSWERS.append((task["ask"], choice.finish_reason, choice.message.content, calls))
    return float(calls == [("calculator", ARGS)])


@pytest.mark.slow
def test_local_rl_serves_its_agent_with_its_tool_parser(taught: Any, tok: Any, tmp_path: Path):
    algorithm = vl.LocalRL(
        copy.deepcopy(taught),
        tokenizer=tok,
        serving={"tool_parser": "json"},
        schedule={"steps": 1, "tasks_per_step": 1, "group_size": 2},
        validation={"every": 1},
        sampling={"max_tokens": 80},
        update=PolicyUpdateConfig(lr=1e-7, micro_batch_size=4),
        compute={"threads": 1},
    )
    assert (
        algorithm.tool_parser == "json" and algorithm.config()["serving"]["tool_parser"] == "json"
    )
    tasks = [{"ask": key} for key in ("json", "fenced", "hermes", "lookalike")]
    ANSWERS.clear()
    trainer = vl.Trainer(
        algorithm, n_runners=1, inline=True, run_dir=tmp_path, name="tools", progress=False
    )
    result = trainer.fit(calculator_agent, tasks[:1], val_dataset=tasks)
    assert result.by_mode["val"].rollouts == 8 and result.by_mode["val"].failed == 0

    rollouts, calls = stored(tmp_path / "tools" / "store.sqlite")
    for rollout in (r for r in rollouts if r.mode == "val"):  # greedy: exactly as taught
        key = rollout.task.input["ask"]
        content, expected, finish = expect("json", key)
        assert rollout.reward == float(bool(expected))
        (call,) = calls[rollout.rollout_id]
        assert tok.decode(call.response_token_ids) == REPLIES[key] + "<|im_end|>"
        choice = call.response["choices"][0]
        assert choice["finish_reason"] == finish and choice["message"]["content"] == content
    assert ("json", "tool_calls", None, [("calculator", ARGS)]) in ANSWERS
    assert ("hermes", "stop", REPLIES["hermes"], []) in ANSWERS  # json does not read tags

    recorded = (tmp_path / "tools" / "train.yaml").read_text()
    assert "tool_parser: json" in recorded


def test_local_rl_checks_its_tool_parser_and_a_resume_may_not_change_it() -> None:
    with pytest.raises(ValueError, match=r"serving\.tool_parser: .*unknown tool parser 'xml'"):
        vl.LocalRL("tiny", serving={"tool_parser": "xml"})
    assert vl.LocalRL("tiny").tool_parser == "hermes"
    assert vl.LocalRL("smollm2-135m-instruct").tool_parser == "hermes"  # the packaged table's
    assert vl.LocalRL("tiny", serving={"tool_parser": "auto"}).tool_parser == "auto"
    # what the agent sees changes with it: the data of a run, so not resumable; runs recorded
    # before it parsed Hermes tags, which None still means
    assert not any(p in ("serving", "serving.tool_parser") for p in RESUMABLE)
    assert ADDED["serving.tool_parser"] is None
