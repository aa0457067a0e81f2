"""One way to serve a gateway (``TrainContext.serve_gateway`` on ``voltrl.cli.serve.
start_gateway``): every gateway of a run binds the trainer's host, checks the run's token,
publishes a URL other machines can use, and retries as the run says; off loopback without a
token it is refused."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_openai_backend import FakeBackend
from helpers import TESTS, fake_trainer, free_port

import voltrl as vl
from voltrl.algorithms.base import Algorithm
from voltrl.algorithms.local.update import PolicyUpdateConfig
from voltrl.gateway import start_gateway
from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from voltrl.retry import GatewayRetry
from voltrl.store.memory import InMemoryStore

AGENTS = TESTS / "serving_agents.py"
HOST = "127.0.0.2"  # a loopback address that is not the default one


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_local_rl_gateway_follows_the_trainer_host_and_token_for_remote_runners(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """LocalRL with ``n_runners=0`` on a non-default host: a ``voltrl runner`` process started
    with the printed command reaches LocalRL's gateway with the run's token (which it got from
    the token file), and a call without the token gets 401."""
    from serving_agents import calls_with_and_without_the_key

    tok = build_tiny_tokenizer()
    algo = vl.LocalRL(
        build_tiny_model(tok, seed=0),
        tokenizer=tok,
        schedule={"steps": 1, "tasks_per_step": 2, "group_size": 2},
        sampling={"temperature": 1.0, "max_tokens": 4},
        update=PolicyUpdateConfig(lr=1e-3, micro_batch_size=4),
    )
    port = free_port(HOST)
    trainer = vl.Trainer(
        algo, n_runners=0, host=HOST, port=port, run_dir=tmp_path, name="remote", progress=False
    )
    done: dict[str, Any] = {}

    def fit() -> None:
        try:
            done["result"] = trainer.fit(
                calls_with_and_without_the_key, [{"question": "hi", "host": HOST}] * 2
            )
        except BaseException as exc:
            done["error"] = exc

    thread = threading.Thread(target=fit)
    thread.start()
    token_file = tmp_path / "remote" / "runner.token"

    def written_token() -> str:
        """The token in the file, once it is written (the trainer's thread creates the file,
        then writes it), else empty."""
        try:
            return token_file.read_text().strip()
        except FileNotFoundError:
            return ""

    deadline = time.monotonic() + 300
    # read now: the file goes when the run ends
    while not (token := written_token()) and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert token, done
    command = [
        *("--store", f"http://{HOST}:{port}", "--token-file", str(token_file)),
        *("--agent", f"{AGENTS}:calls_with_and_without_the_key", "--lease", "10"),
    ]
    runner = subprocess.Popen([sys.executable, "-m", "voltrl.cli", "runner", *command])
    try:
        thread.join(500)
    finally:
        runner.terminate()
        runner.wait(60)
    assert not thread.is_alive() and "error" not in done, done
    result = done["result"]
    assert result.by_mode["train"].rollouts == 4
    assert result.rewards == [1.0] * 4  # answered with the token, 401 without, on HOST
    printed = capfd.readouterr().out
    assert not token_file.exists()
    assert f"--store http://{HOST}:{port} --token-file {token_file}" in printed
    assert token not in printed


class ServesAGateway(Algorithm):
    """Serves one gateway through the run's context and runs the rollouts against it."""

    name = "serves_a_gateway"

    def __init__(self, backend: str, **options: Any) -> None:
        self.backend, self.options = backend, options

    async def train(self, ctx, train, val):
        served = await ctx.serve_gateway([self.backend], **self.options)
        self.retries = served.gateway.backoff.retries
        await ctx.publish({"main_llm": vl.LLM(endpoint=served.url, model="m", gateway=True)})
        self.rollouts = await ctx.run_rollouts(train, mode="train")


@pytest.mark.parametrize(
    ("trainer_retry", "algorithm_retry", "failures", "retries", "rewarded"),
    [
        ({"retries": 2, "backoff_s": 0}, None, 2, 2, True),
        ({"retries": 1, "backoff_s": 0}, None, 2, 1, False),
        ({"retries": 1, "backoff_s": 0}, GatewayRetry(retries=3, backoff_s=0), 3, 3, True),
    ],
    ids=["trainer-enough", "trainer-too-few", "algorithm-wins"],
)
async def test_gateway_retries_as_the_run_says(
    tmp_path: Path,
    trainer_retry: dict[str, Any],
    algorithm_retry: GatewayRetry | None,
    failures: int,
    retries: int,
    rewarded: bool,
) -> None:
    from serving_agents import calls_once

    async with FakeBackend() as backend:
        backend.fail_next(*[503] * failures)
        algo = ServesAGateway(backend.url, retry=algorithm_retry)
        trainer = vl.Trainer(
            algo,
            store=InMemoryStore(),
            inline=True,
            progress=False,
            run_dir=tmp_path,
            max_attempts=1,
            stop_at_failure_rate=None,  # the rollout fails where retries are too few
            gateway_retry=trainer_retry,
        )
        await trainer.fit_async(calls_once, [{"q": 1}])
    assert algo.retries == retries
    assert [r.reward == 1.0 for r in algo.rollouts] == [rewarded]


async def test_a_gateway_off_loopback_without_a_token_is_refused() -> None:
    with pytest.raises(vl.VoltRLError, match="or set VOLTRL_TOKEN"):
        await start_gateway(InMemoryStore(), ["http://127.0.0.1:9/v1"], host="0.0.0.0")


async def test_the_trainers_gateways_check_the_run_token(tmp_path: Path) -> None:
    from serving_agents import calls_with_and_without_the_key

    async with FakeBackend() as backend:
        llm = vl.LLM(endpoint=backend.url, model="m")
        trainer = fake_trainer(InMemoryStore(), tmp_path, llm, host=HOST)
        result = await trainer.dev_async(
            calls_with_and_without_the_key, [{"question": "hi", "host": HOST}]
        )
    assert result.rewards == [1.0]


def test_retry_settings_from_the_command_line_and_yaml(tmp_path) -> None:
    from voltrl.cli import build_from_config, main
    from voltrl.cli.main import build_parser
    from voltrl.cli.serve import _gateway_retry

    args = build_parser().parse_args(
        ["gateway", "--store", "http://h:1", "--backend", "http://b/v1", "--retries", "5"]
    )
    assert _gateway_retry(args) == GatewayRetry(retries=5)
    args = build_parser().parse_args(["serve", "--backoff", "0.5", "--backend-timeout", "30"])
    assert _gateway_retry(args) == GatewayRetry(backoff_s=0.5, timeout_s=30)
    assert main(["serve", "--retries", "-1"]) == 2

    (tmp_path / "train.jsonl").write_text('{"x": 1}\n')  # voltrl train checks it exists
    trainer, *_ = build_from_config(
        {
            "agent": f"{AGENTS}:calls_once",
            "data": {"train": str(tmp_path / "train.jsonl")},
            "algorithm": {
                "name": "local_rl",
                "model": "m",
                "serving": {"gateway_retry": {"retries": 7}},
            },
            "trainer": {"gateway_retry": {"retries": 5, "max_backoff_s": 1}},
        }
    )
    assert trainer.gateway_retry == GatewayRetry(retries=5, max_backoff_s=1)
    assert trainer.algorithm.gateway_retry == GatewayRetry(retries=7)


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream under way"])
async def test_stopping_a_gateway_cuts_its_calls_in_flight_short_with_a_503(capfd, stream) -> None:
    """A run stopped early cancels its rollouts, but their calls may still wait on a slow
    backend: stopping the gateway gives them ``graceful_s``, then answers them 503 itself, so
    the server has nothing to cancel and prints no traceback."""
    from voltrl.gateway import start_gateway

    store = InMemoryStore()
    await store.enqueue([vl.Task(input={})])
    claim = await store.claim("worker")
    assert claim is not None
    async with FakeBackend() as backend:
        if stream:  # the backend starts its answer, then never finishes it
            backend.hold_stream = asyncio.Event()
        else:  # the backend never answers
            backend.hold = asyncio.Event()
        served = await start_gateway(store, [backend.url], graceful_s=0.2)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        relayed = asyncio.Event()  # the client has the answer's first event
        async with httpx.AsyncClient(timeout=30) as http:

            async def post() -> tuple[int, str]:
                url, rollout = f"{served.url}/chat/completions", claim.rollout.rollout_id
                headers = {"x-rollout-id": rollout}
                async with http.stream("POST", url, json=body, headers=headers) as response:
                    text = ""
                    async for chunk in response.aiter_text():
                        text += chunk
                        if "data: " in text:
                            relayed.set()
                    return response.status_code, text

            call = asyncio.create_task(post())
            while not backend.requests:
                await asyncio.sleep(0.01)
            if stream:  # stopped once the first event reached the client
                waiter = asyncio.create_task(relayed.wait())
                await asyncio.wait({call, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                assert relayed.is_set(), f"the call ended before its first event: {await call}"
            await served.stop()
            status, text = await call
    if stream:  # the status went out with the first event: the stream ends with an error
        assert status == 200
        last = [line for line in text.splitlines() if line.startswith("data: ")][-1]
        assert "stopped before the call finished" in last
    else:
        assert status == 503
        assert "stopped before the call finished" in json.loads(text)["error"]["message"]
    err = capfd.readouterr().err
    assert "Exception in ASGI application" not in err and "Traceback" not in err, err
    assert "timeout graceful shutdown exceeded" not in err, err
