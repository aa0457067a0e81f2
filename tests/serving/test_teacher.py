"""The teacher server (``voltrl.serving.teacher``, ``voltrl teacher serve``): a Python policy
function answered to a real OpenAI client as text or OpenAI tool calls, plain and streamed; the
episode's rng; a policy that raises or returns a bad shape answers 500 and the server keeps
serving; policy targets that cannot be loaded; the token off loopback; the command as a user
runs it."""

from __future__ import annotations

import json
import random
import re
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from helpers import ROOT, Served, load_sample, voltrl
from openai import OpenAI

from voltrl.errors import VoltRLError
from voltrl.serving.teacher import episode_rng, load_policy, serve_teacher, teacher_app

CONVERT = {
    "type": "function",
    "function": {
        "name": "convert",
        "parameters": {
            "type": "object",
            "properties": {"value": {"type": "number"}, "unit": {"type": "string"}},
        },
    },
}


def policy(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Any:
    """Calls ``convert`` when it has the tool and no result yet, else answers with the result;
    a question starting with a keyword picks another reply shape."""
    question = messages[0]["content"]
    if question.startswith("raise"):
        raise ValueError("no idea what to do")
    if question.startswith("bad"):
        return 42
    if question.startswith("two"):
        return [
            {"name": "convert", "arguments": {"value": 1, "unit": "m"}},
            {"name": "convert", "arguments": '{"value": 2, "unit": "m"}'},
        ]
    if question.startswith("message"):
        return {"content": "Let me convert.", "tool_calls": [{"name": "convert"}]}
    if messages[-1]["role"] == "tool":
        return f"It is {messages[-1]['content']}."
    if tools:
        return {"name": "convert", "arguments": {"value": 3, "unit": "ft"}}
    return "I have no tool."


def client(url: str, **kwargs: Any) -> OpenAI:
    return OpenAI(base_url=url, api_key=kwargs.pop("api_key", "EMPTY"), max_retries=0, **kwargs)


@pytest.fixture(scope="module")
def teacher() -> Iterator[OpenAI]:
    with serve_teacher(policy) as url:
        yield client(url)


def ask(c: OpenAI, question: str, **kwargs: Any) -> Any:
    return c.chat.completions.create(
        model="teacher", messages=[{"role": "user", "content": question}], **kwargs
    )


def test_a_tool_call_is_an_openai_tool_call_and_the_result_gets_text(teacher: OpenAI) -> None:
    reply = ask(teacher, "How many feet in 1 m?", tools=[CONVERT])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "convert"
    assert json.loads(call.function.arguments) == {"value": 3, "unit": "ft"}
    again = ask(teacher, "How many feet in 1 m?", tools=[CONVERT])
    assert again.choices[0].message.tool_calls[0].id == call.id  # a re-run records the same

    messages = [
        {"role": "user", "content": "How many feet in 1 m?"},
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "3.28 ft"},
    ]
    answer = teacher.chat.completions.create(model="teacher", messages=messages, tools=[CONVERT])
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.content == "It is 3.28 ft."
    assert ask(teacher, "Hi").choices[0].message.content == "I have no tool."
    assert [m.id for m in teacher.models.list().data] == ["teacher"]


def test_a_list_is_several_tool_calls_and_a_message_may_carry_text_too(teacher: OpenAI) -> None:
    calls = ask(teacher, "two conversions").choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["value"] for c in calls] == [1, 2]
    assert len({c.id for c in calls}) == 2
    message = ask(teacher, "message with text").choices[0].message
    assert message.content == "Let me convert."
    assert message.tool_calls[0].function.arguments == "{}"


def test_a_streamed_reply_carries_the_tool_calls_and_the_finish(teacher: OpenAI) -> None:
    stream = ask(
        teacher,
        "How many feet?",
        tools=[CONVERT],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    calls = [c for ch in chunks for choice in ch.choices for c in choice.delta.tool_calls or []]
    assert [c.function.name for c in calls] == ["convert"]
    finishes = [choice.finish_reason for ch in chunks for choice in ch.choices]
    assert finishes[-1] == "tool_calls"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 0
    text = list(ask(teacher, "Hi", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in text if c.choices) == "I have no tool."


def test_a_policy_that_raises_answers_500_with_its_message_and_the_server_keeps_serving(
    teacher: OpenAI,
) -> None:
    with pytest.raises(openai.InternalServerError) as raised:
        ask(teacher, "raise please")
    assert "teacher policy failed: ValueError: no idea what to do" in str(raised.value)
    assert raised.value.response.headers["x-should-retry"] == "false"  # not run again
    with pytest.raises(openai.InternalServerError) as raised:
        ask(teacher, "bad shape")
    message = str(raised.value)
    assert "returned an int" in message and "expected a str" in message and "tool call" in message
    assert ask(teacher, "Hi").choices[0].message.content == "I have no tool."


@pytest.mark.parametrize(
    ("reply", "said"),
    [
        ([], "an empty list"),
        ({"contents": "typo"}, "a dict with keys ['contents']"),
        ({"content": "x", "extra": 1}, "unknown keys ['extra']"),
        ({"role": "user", "content": "x"}, "role 'user'"),
        ({"content": None}, "neither content nor tool calls"),
        ({"name": "convert", "arguments": "not json"}, "not a JSON object"),
        ({"name": "convert", "arguments": 3}, "arguments that are an int"),
        ([{"arguments": {}}], "without a name"),
    ],
)
def test_each_bad_shape_says_what_was_wrong(reply: Any, said: str) -> None:
    with serve_teacher(lambda messages, tools: reply) as url:
        response = httpx.post(f"{url}/chat/completions", json={"messages": []})
    assert response.status_code == 500
    assert said in response.json()["error"]["message"]


def test_the_rng_is_the_episodes_and_the_request_is_there_for_the_asking() -> None:
    seen: list[tuple[float, str]] = []

    async def drawing(messages, tools, *, rng: random.Random, request: dict) -> str:
        seen.append((rng.random(), request["model"]))
        return "ok"

    for seed in (0, 0, 1):
        with serve_teacher(drawing, seed=seed) as url:
            c = client(url)
            ask(c, "episode A")
            ask(
                c,
                "episode A",
                extra_body={
                    "messages": [
                        {"role": "user", "content": "episode A"},
                        {"role": "assistant", "content": "x"},
                    ]
                },
            )
            ask(c, "episode B")
    draws = [d for d, _ in seen]
    assert draws[0] == draws[1] == draws[3] == draws[4]  # one episode, one seed: the same
    assert draws[2] != draws[0] and draws[6] != draws[0]  # another episode, another seed
    assert draws[0] == episode_rng(0, [{"role": "user", "content": "episode A"}]).random()
    assert {m for _, m in seen} == {"teacher"}


def test_a_policy_that_cannot_take_messages_and_tools_is_refused_at_once() -> None:
    with pytest.raises(VoltRLError, match=r"cannot be called as policy\(messages, tools\)"):
        teacher_app(lambda messages: "x")
    with pytest.raises(VoltRLError, match=re.escape("(messages, tools, rng=..., request=...)")):
        teacher_app(lambda request, rng: "x")  # the samples' old (request, rng)
    teacher_app(lambda messages, tools, **extras: "x")


def test_bad_requests_are_400() -> None:
    with serve_teacher(policy) as url:
        assert httpx.post(f"{url}/chat/completions", content=b"{").status_code == 400
        assert httpx.post(f"{url}/chat/completions", json={"model": "x"}).status_code == 400


def test_load_policy_finds_a_module_function_or_a_file_function(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "helper_units.py").write_text("FACTOR = 3.28\n")
    (tmp_path / "my_teacher.py").write_text(
        "from helper_units import FACTOR\n\ndef policy(messages, tools):\n    return str(FACTOR)\n"
        "NOT_A_FUNCTION = 1\n"
    )
    found = load_policy(f"{tmp_path / 'my_teacher.py'}:policy")  # beside it: helper_units
    assert found([], []) == "3.28"
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_policy("my_teacher:policy")([], []) == "3.28"
    for target, said in [
        ("my_teacher.policy", "expected MODULE:FUNCTION"),
        ("missing.py:policy", "teacher file missing.py does not exist"),
        ("no_such_module_here:policy", "cannot import module 'no_such_module_here'"),
        ("my_teacher.py:nope", "has no attribute 'nope'"),
        ("my_teacher.py:NOT_A_FUNCTION", "is an int, not a function"),
    ]:
        with pytest.raises(VoltRLError, match=re.escape(said)):
            load_policy(target)
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(VoltRLError, match=r"importing broken\.py failed: RuntimeError: boom$"):
        load_policy("broken.py:policy")


def test_off_loopback_a_token_is_required_and_checked() -> None:
    with (
        pytest.raises(VoltRLError, match="exposes the server"),
        serve_teacher(policy, host="0.0.0.0"),
    ):
        pass
    with serve_teacher(policy, token="s3cret") as url:
        with pytest.raises(openai.AuthenticationError):
            ask(client(url), "Hi")
        assert ask(client(url, api_key="s3cret"), "Hi").choices[0].message.content


def test_a_samples_teacher_answers_as_its_teacher_reply_says() -> None:
    """The samples' ``teacher_reply(request, rng)`` behind the core server: the same messages
    as calling it with the episode's rng (recorded teacher runs stay what they were)."""
    if str(ROOT / "samples") not in sys.path:
        sys.path.insert(0, str(ROOT / "samples"))
    import teacher_server as samples_server  # samples/teacher_server.py

    agent = load_sample("calculator", "agent")
    teacher_reply = load_sample("calculator", "teacher").teacher_reply
    with serve_teacher(samples_server.load_sample_teacher("calculator"), seed=3) as url:
        c = client(url)
        for question in ("What is 12 + 30?", "What is 7 * 8?", "What is 50 - 9?"):
            messages = [
                {"role": "system", "content": agent.SYSTEM},
                {"role": "user", "content": question},
            ]
            got = (
                c.chat.completions.create(
                    model="teacher", messages=messages, tools=[agent.CALCULATOR]
                )
                .choices[0]
                .message
            )
            body = {"model": "teacher", "messages": messages, "tools": [agent.CALCULATOR]}
            direct = teacher_reply(body, episode_rng(3, messages))
            if "tool_calls" in direct:
                assert [json.loads(t.function.arguments) for t in got.tool_calls] == [
                    t["arguments"] for t in direct["tool_calls"]
                ]
            else:
                assert got.content == direct["content"]


def test_voltrl_teacher_serve_serves_a_files_policy_to_an_openai_client(tmp_path: Path) -> None:
    (tmp_path / "convert_teacher.py").write_text(
        "def teacher(messages, tools):\n"
        "    if messages[0]['content'] == 'raise':\n"
        "        raise KeyError('unit')\n"
        "    if messages[-1]['role'] == 'tool':\n"
        "        return 'It is ' + messages[-1]['content']\n"
        "    return {'name': 'convert', 'arguments': {'value': 1, 'unit': 'ft'}}\n"
    )
    served = Served(
        "convert_teacher.py:teacher", "--port", "0", command=("teacher", "serve"), cwd=tmp_path
    )
    try:
        assert "as model teacher (OpenAI-compatible; auth: none)" in served.lines[0]
        c = client(served.endpoint)
        call = ask(c, "How many feet?", tools=[CONVERT]).choices[0].message.tool_calls[0]
        assert call.function.name == "convert"
        with pytest.raises(openai.InternalServerError, match="KeyError: 'unit'"):
            ask(c, "raise")
        assert ask(c, "How many feet?").choices[0].finish_reason == "tool_calls"
    finally:
        code = served.stop()
    assert code == 0
    assert "KeyError: 'unit'" in served.stderr()  # the traceback, for whoever runs the server


def test_voltrl_teacher_serve_errors_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text("def two(messages):\n    return 'x'\n")
    for args, said in [
        (["missing.py:policy"], "teacher file missing.py does not exist"),
        (["t.py:nope"], "t.py has no attribute 'nope'"),
        (["t.py:two"], "cannot be called as policy(messages, tools)"),
        (["t.py:two", "--host", "0.0.0.0"], "exposes the server beyond this machine"),
    ]:
        done = voltrl("teacher", "serve", *args, "--port", "0", cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        assert said in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_plain_policy_waiting_on_something_holds_up_no_other_request() -> None:
    entered, released = threading.Event(), threading.Event()

    def waiting(messages, tools) -> str:
        if messages[0]["content"] == "wait":
            entered.set()
            return "released" if released.wait(60) else "never released"
        released.set()
        return "go"

    with serve_teacher(waiting) as url, ThreadPoolExecutor(1) as pool:
        first = pool.submit(ask, client(url), "wait")
        assert entered.wait(60)  # the first request is inside the policy, waiting
        assert ask(client(url), "release").choices[0].message.content == "go"
        assert first.result().choices[0].message.content == "released"
