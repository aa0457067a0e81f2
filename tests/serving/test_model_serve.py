"""``voltrl model serve`` as a user runs it (a real subprocess on loopback, the real ``openai``
client, ``voltrl dev`` against it), the ``"tiny"`` model name, and the engine server dropping
the work of clients that went away."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from helpers import ROOT, Served, recorded_calls, serve_gateway, voltrl
from openai import OpenAI

import voltrl as vl
from voltrl._http.serving import BackgroundServer
from voltrl.cli import build_from_config, main
from voltrl.gateway import Gateway
from voltrl.models.tiny import build_tiny
from voltrl.serving.engine import Engine
from voltrl.serving.openai_api import serve_engine_in_thread
from voltrl.store.memory import InMemoryStore

SAMPLE = ROOT / "samples" / "quickstart"
TOKEN = "model-serve-token"


@pytest.fixture(scope="module")
def tiny_server() -> Iterator[Served]:
    served = Served("tiny", "--port", "0", "--threads", "1", "--max-tokens", "16")
    yield served
    served.stop()


@pytest.mark.slow
def test_model_serve_tiny_answers_an_openai_client_with_token_ids(tiny_server: Served) -> None:
    client = OpenAI(base_url=tiny_server.endpoint, api_key="EMPTY", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    resp = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "What is 2 + 3?"}],
        max_tokens=8,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    data = resp.model_dump()
    assert len(data["choices"][0]["token_ids"]) == resp.usage.completion_tokens == 8
    assert data["prompt_token_ids"] and resp.model == "tiny"


@pytest.mark.slow
def test_model_serve_caps_a_reply_whose_request_sets_no_max_tokens_and_says_so(
    tiny_server: Served,
) -> None:
    assert "sets no max_tokens gets at most 16 tokens (--max-tokens)" in "\n".join(
        tiny_server.lines
    )
    client = OpenAI(base_url=tiny_server.endpoint, api_key="EMPTY", max_retries=0)
    resp = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Count to a million."}],
        extra_body={"ignore_eos": True},
    )
    assert resp.usage.completion_tokens == 16
    from voltrl.cli.main import build_parser

    args = build_parser().parse_args(["model", "serve", "tiny"])
    assert args.max_tokens == 1024


@pytest.mark.slow
def test_model_serve_prints_a_dev_line_that_runs_an_agent_end_to_end(
    tiny_server: Served, tmp_path: Path
) -> None:
    dev_line = next(line.strip() for line in tiny_server.lines if "voltrl dev" in line)
    assert dev_line == (
        "voltrl dev samples/quickstart/agent.py:agent --data samples/quickstart/tasks.jsonl"
        f" --llm-endpoint {tiny_server.endpoint} --model tiny --max-tokens 64"
    )
    assert tiny_server.endpoint.startswith("http://127.0.0.1:")
    assert any("random weights" in line for line in tiny_server.lines)
    args = shlex.split(dev_line)[2:]
    out = voltrl("dev", *args, "--run-dir", str(tmp_path), "--name", "tiny", cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    calls = asyncio.run(recorded_calls(tmp_path / "tiny" / "store.sqlite"))
    assert len(calls) == len((SAMPLE / "tasks.jsonl").read_text().splitlines())
    assert all(c.has_token_ids and c.model == "tiny" for c in calls)


@pytest.mark.slow
def test_model_serve_of_a_directory_with_a_token_guards_it_and_stops_on_sigint_with_0(
    tmp_path: Path,
) -> None:
    model, tokenizer = build_tiny(seed=1)
    model.save_pretrained(tmp_path / "my-model")
    tokenizer.save_pretrained(tmp_path / "my-model")
    args = (str(tmp_path / "my-model"), "--port", "0", "--threads", "1")
    served = Served(*args, env={"VOLTRL_TOKEN": TOKEN})
    try:
        assert served.lines[-2].endswith(
            '--model my-model --max-tokens 64 --api-key "$VOLTRL_TOKEN"'
        )
        assert not any("random weights" in line for line in served.lines)
        base = served.endpoint.removesuffix("/v1")
        assert httpx.get(f"{served.endpoint}/models").status_code == 401
        assert httpx.get(f"{base}/health").status_code == 200
        auth = {"Authorization": f"Bearer {TOKEN}"}
        models = httpx.get(f"{served.endpoint}/models", headers=auth)
        assert [m["id"] for m in models.json()["data"]] == ["my-model"]
    finally:
        status = served.stop(signal.SIGINT)
    assert status == 0, served.stderr()


def run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    status = main(args)
    return status, capsys.readouterr().err


def test_model_serve_of_a_bad_path_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("not a model")
    for path, message in [
        (tmp_path / "missing", "does not exist"),
        (tmp_path / "empty", "is not a Hugging Face model directory"),
        (tmp_path / "file.txt", "is not a Hugging Face model directory"),
    ]:
        status, err = run_main(["model", "serve", str(path)], capsys)
        assert status == 2 and message in err and err.count("\n") == 1, err


def test_model_serve_of_a_broken_model_directory_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text("{not json")
    status, err = run_main(["model", "serve", str(tmp_path)], capsys)
    assert status == 2 and "cannot load a model from" in err and err.count("\n") == 1, err


def test_model_serve_off_loopback_without_a_token_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("VOLTRL_TOKEN", raising=False)
    status, err = run_main(["model", "serve", "tiny", "--host", "0.0.0.0"], capsys)
    assert status == 2 and "or set VOLTRL_TOKEN" in err


def test_model_serve_without_torch_names_the_local_extra(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['torch'] = None; from voltrl.cli.main import main; "
        "sys.exit(main(['model', 'serve', 'tiny']))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert out.returncode == 2 and "pip install 'voltrl[local]'" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_local_rl_tiny_loads_the_built_in_model_and_tokenizer() -> None:
    algorithm = vl.LocalRL("tiny", compute={"device": "cpu"})
    model, tokenizer = algorithm._load()
    reference, reference_tokenizer = build_tiny()
    assert tokenizer.get_vocab() == reference_tokenizer.get_vocab()
    weights, expected = model.state_dict(), reference.state_dict()
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], expected[k]) for k in weights)
    assert algorithm.config()["model"] == "tiny"


def test_build_from_config_with_model_tiny_builds_local_rl_on_the_tiny_model(
    tmp_path: Path,
) -> None:
    config = {
        "agent": f"{SAMPLE / 'agent.py'}:agent",
        "data": {"train": str(SAMPLE / "tasks.jsonl")},
        "algorithm": {"name": "local_rl", "model": "tiny", "schedule": {"steps": 1}},
        "trainer": {"run_dir": str(tmp_path)},
    }
    trainer, _agent, train, _val = build_from_config(config)
    algorithm = trainer.algorithm
    assert isinstance(algorithm, vl.LocalRL) and algorithm.model == "tiny"
    model, _tokenizer = algorithm._load()
    assert type(model).__name__ == "Qwen2ForCausalLM" and train == str(SAMPLE / "tasks.jsonl")


# ---- the engine server stops generating for a client that went away ---------------------


@pytest.fixture(scope="module")
def one_slot() -> Iterator[tuple[Engine, BackgroundServer]]:
    """The tiny model behind the engine server, one sequence at a time: a sequence left
    running blocks every later request."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tokenizer = build_tiny()
    with (
        Engine(model, tokenizer, max_batch_size=1) as engine,
        serve_engine_in_thread(engine, model_name="tiny") as server,
    ):
        yield engine, server
    torch.set_num_threads(threads)


LONG = 4000  # tokens the hung-up request asks for (the tiny model's context is 4096)


def wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@contextlib.contextmanager
def held_until_aborted(engine: Engine) -> Iterator[threading.Event]:
    """Within the block, the engine's decode steps wait until every running request is
    aborted: a request whose client hangs up gets its first token only, however long the
    server takes to notice, and one the server never aborts decodes on once the block ends.
    The event yielded is set when the server aborts a request (``Engine._abort``), wherever
    the engine thread then is (under load the abort can come before the first decode step)."""
    decode, abort = engine._decode, engine._abort
    aborted, done = threading.Event(), threading.Event()

    def noted_abort(req: Any) -> None:
        aborted.set()
        abort(req)

    def all_aborted() -> bool:
        return all(s.req.aborted for s in engine._batch.seqs)

    def held() -> None:
        with engine._cv:  # an abort notifies it
            engine._cv.wait_for(lambda: done.is_set() or all_aborted())
        decode()

    engine._decode = held  # type: ignore[method-assign]
    engine._abort = noted_abort  # type: ignore[method-assign]
    try:
        yield aborted
    finally:
        del engine._decode, engine._abort
        done.set()
        with engine._cv:
            engine._cv.notify_all()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_client_hanging_up_frees_its_batch_slot(
    one_slot: tuple[Engine, BackgroundServer], path: str, stream: bool
) -> None:
    engine, server = one_slot
    body: dict[str, Any] = {"model": "tiny", "max_tokens": LONG, "ignore_eos": True}
    body["stream"] = stream
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "Count to a million."}]
    else:
        body["prompt"] = "Count to a million:"
    decoded = engine.stats["decode_tokens"]
    host, port = server.url.removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    with held_until_aborted(engine) as aborted:
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(f"{head}Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
            assert wait_for(lambda: engine.describe()["running"] == 1)
        assert wait_for(lambda: engine.describe()["running"] == 0), engine.describe()
    assert aborted.is_set(), "the server did not abort the request of the client that hung up"
    assert engine.stats["decode_tokens"] - decoded < LONG - 1  # the rest was never decoded
    short = {**body, "max_tokens": 4, "stream": False}
    resp = httpx.post(f"{server.url}{path}", json=short, timeout=30)  # the slot is free
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4


def test_a_client_hanging_up_on_the_gateway_frees_the_engines_batch_slot(
    one_slot: tuple[Engine, BackgroundServer],
) -> None:
    """The gateway in front of the engine, as in a run: the agent's client gives up, the
    gateway closes its call to the engine, and the engine stops decoding it (else the next
    weight update would wait for thousands of tokens nobody reads)."""
    engine, server = one_slot
    body = {"model": "tiny", "max_tokens": LONG, "ignore_eos": True}
    body["messages"] = [{"role": "user", "content": "Count to a million."}]
    raw = json.dumps(body).encode()

    async def hang_up_on_the_gateway() -> dict[str, int]:
        store = InMemoryStore()
        await store.enqueue([vl.Task(input={})])
        claim = await store.claim("worker")
        assert claim is not None
        path = f"/rollouts/{claim.rollout.rollout_id}/attempts/{claim.attempt.attempt_id}"
        gateway = Gateway(store, [f"{server.url}/v1"])
        async with serve_gateway(gateway) as base:
            host, port = base.removeprefix("http://").split(":")
            _, writer = await asyncio.open_connection(host, int(port))
            head = f"POST {path}/v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
            head += f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
            writer.write(head.encode() + raw)
            while engine.describe()["running"] != 1:  # bounded by the test timeout
                await asyncio.sleep(0.01)
            writer.close()
            while engine.describe()["running"] != 0:
                await asyncio.sleep(0.01)
            while gateway.inflight:
                await asyncio.sleep(0.01)
        return gateway.cut_off

    decoded = engine.stats["decode_tokens"]
    with held_until_aborted(engine) as aborted:
        cut_off = asyncio.run(hang_up_on_the_gateway())
    assert aborted.is_set(), "the engine never saw the gateway hang up"
    assert cut_off == {"client_disconnected": 1}
    assert engine.stats["decode_tokens"] - decoded < LONG - 1  # the rest was never decoded


def test_the_printed_dev_line_passes_the_token_the_way_it_was_given():
    from voltrl.cli.main import build_parser
    from voltrl.cli.model import _token_hint

    parse = build_parser().parse_args
    assert _token_hint(parse(["model", "serve", "tiny", "--token-file", "t.txt"])) == (
        '"$(cat t.txt)"'
    )
    assert _token_hint(parse(["model", "serve", "tiny"])) == '"$VOLTRL_TOKEN"'
    assert "9" * 12 not in _token_hint(parse(["model", "serve", "tiny", "--token", "9" * 12]))
