"""``voltrl serve`` and ``voltrl gateway``: the store and the gateway in one server or apart,
bearer-token auth, JSON errors, and a schemathesis fuzz of the store API (no 5xx)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from fake_openai_backend import FakeBackend, reply_ids
from hypothesis import HealthCheck, settings
from openai import AsyncOpenAI
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig

from voltrl._http.auth import BearerAuth
from voltrl._http.serving import is_loopback, serve, serve_in_thread
from voltrl.cli.serve import server_app
from voltrl.gateway import Gateway
from voltrl.gateway.hosting import make_gateway
from voltrl.resources import LLM
from voltrl.store.http import HTTPStore
from voltrl.store.memory import InMemoryStore
from voltrl.store.sql import SQLStore
from voltrl.types import Task

TOKEN = "serve-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def start(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    """Start ``voltrl ARGS`` (on port 0) and return it with the first URL it prints."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "voltrl.cli", *args, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the first line names the URL, once the server listens
    found = re.search(r"http://127\.0\.0\.1:\d+", line)
    if found is None:
        proc.kill()
        raise AssertionError(f"no URL in {line!r}: {proc.communicate(timeout=10)[0]}")
    return proc, found.group(0)


def stop(proc: subprocess.Popen[str]) -> str:
    """SIGTERM the process; return its remaining output after checking it exited cleanly."""
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    return out


def test_loopback_hosts():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "example.com"))


@pytest.mark.slow
def test_serving_beyond_loopback_without_a_token_is_refused(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "VOLTRL_TOKEN"}
    for command in (["serve", "--store", "memory"], ["gateway", "--store", "http://x:1"]):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "voltrl.cli",
                *command,
                "--host",
                "0.0.0.0",
                "--backend",
                "x",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            cwd=tmp_path,
        )
        assert out.returncode == 2, out.stderr
        assert out.stderr.count("\n") == 1 and "or set VOLTRL_TOKEN" in out.stderr


@pytest.mark.slow
def test_serve_errors_are_one_line(tmp_path):
    """A port in use, an unknown store, an unreachable database."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for args, message in [
            (
                ["--store", "memory", "--port", port],
                "the port is in use (--port 0 picks a free one)",
            ),
            (["--store", "mysql://h/db", "--port", "0"], "unknown store 'mysql://h/db'"),
            (
                ["--store", "postgresql://u:secret@127.0.0.1:1/db", "--port", "0"],
                "cannot connect to PostgreSQL at 127.0.0.1:1/db",
            ),
            (["--store", "memory", "--lora-adapter", "writer"], "takes NAME=REGEX"),
            (["--store", "memory", "--lora-adapter", "w=("], "not a valid regex"),
            (["--store", "memory", "--lora-adapter", "w=a", "--lora-adapter", "w=b"], "twice"),
        ]:
            out = subprocess.run(
                [sys.executable, "-m", "voltrl.cli", "serve", *args],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=tmp_path,
            )
            assert out.returncode == 2 and message in out.stderr, out.stderr
            assert out.stderr.count("\n") == 1 and "secret" not in out.stderr


async def test_with_a_token_every_route_but_health_needs_it():
    async with FakeBackend() as backend:
        store = InMemoryStore()
        gateway = make_gateway(store, [backend.url], TOKEN, {})
        url, stop_server = await serve(server_app(store, token=TOKEN, gateway=gateway))
        try:
            async with httpx.AsyncClient(base_url=url) as http:
                assert (await http.get("/v1/store/health")).json() == {"status": "ok"}
                for method, path in [
                    ("GET", "/v1/store/runs"),
                    ("POST", "/v1/store/claims"),
                    ("GET", "/openapi.json"),
                    ("POST", "/v1/chat/completions"),
                    ("GET", "/v1/models"),
                ]:
                    for headers in ({}, {"Authorization": "Bearer wrong"}):
                        answer = await http.request(method, path, headers=headers)
                        assert answer.status_code == 401, (path, answer.text)
                        assert answer.json()["error"]["message"] == "missing or wrong bearer token"
                assert (await http.get("/v1/store/runs", headers=AUTH)).json() == []
                missing = await http.get("/v1/store/rollouts/nope", headers=AUTH)
                assert missing.status_code == 404 and "nope" in missing.json()["error"]["message"]
            # The gateway beside the store: an agent's call, with the token as its API key,
            # is recorded against its rollout.
            await store.enqueue([Task(input={"q": 1})])
            claim = await store.claim("w")
            assert claim is not None
            llm = LLM(endpoint=f"{url}/v1", model="m", api_key=TOKEN, gateway=True)
            llm = llm.scoped(claim.rollout.rollout_id, claim.attempt.attempt_id)
            client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
            reply = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            await client.close()
            [call] = await store.get_llm_calls(claim.rollout.rollout_id)
            assert call.response_token_ids == reply_ids(0) and reply.choices
        finally:
            await stop_server()
            await gateway.aclose()


async def test_an_unexpected_error_in_the_gateway_answers_json_without_a_traceback():
    store = InMemoryStore()
    gateway = Gateway(store, ["http://127.0.0.1:9/v1"])

    async def explode(scope, receive, send):
        raise RuntimeError("boom")

    gateway._handle = explode  # type: ignore[method-assign]
    url, stop_server = await serve(server_app(store, token=TOKEN, gateway=gateway))
    try:
        async with httpx.AsyncClient(base_url=url) as http:
            answer = await http.post("/v1/chat/completions", headers=AUTH, json={})
    finally:
        await stop_server()
        await gateway.aclose()
    assert answer.status_code == 500
    assert answer.json() == {
        "error": {"type": "InternalError", "message": "unexpected RuntimeError: boom"}
    }


def test_bearer_auth_needs_a_token():
    with pytest.raises(ValueError):
        BearerAuth(server_app(InMemoryStore()), "")


@pytest.mark.slow
async def test_voltrl_gateway_records_into_a_separate_store_server(tmp_path):
    """``voltrl serve --no-gateway`` holds the store; ``voltrl gateway`` records into it, and
    with ``--lora-adapter`` forwards an agent's calls to its LoRA adapter (as the model)."""
    async with FakeBackend() as backend:
        env = {"VOLTRL_TOKEN": TOKEN}
        store_args = ["serve", "--store", str(tmp_path / "s.sqlite"), "--no-gateway"]
        server, store_url = await asyncio.to_thread(start, *store_args, env=env)
        try:
            gw_args = ["gateway", "--store", store_url, "--backend", backend.url]
            gw_args += ["--lora-adapter", "writer=write|rewrite"]  # vLLM multi-LoRA routing
            gateway, gateway_url = await asyncio.to_thread(start, *gw_args, env=env)
            try:
                store = HTTPStore(store_url, TOKEN)
                [rollout] = await store.enqueue([Task(input={"q": 1})])
                claim = await store.claim("w")
                assert claim is not None and claim.rollout.rollout_id == rollout.rollout_id
                llm = LLM(endpoint=f"{gateway_url}/v1", model="m", api_key=TOKEN, gateway=True)
                llm = llm.scoped(rollout.rollout_id, claim.attempt.attempt_id)
                client = AsyncOpenAI(base_url=llm.endpoint, api_key=TOKEN, max_retries=0)
                await client.completions.create(model="m", prompt="2+2=", max_tokens=2)
                await client.close()
                writer = llm.for_agent("rewrite")
                client = AsyncOpenAI(base_url=writer.endpoint, api_key=TOKEN, max_retries=0)
                await client.completions.create(model="m", prompt="2+2=", max_tokens=2)
                await client.close()
                call, rewrite = await store.get_llm_calls(rollout.rollout_id)
                assert call.attempt_id == claim.attempt.attempt_id and call.has_token_ids
                assert (call.model, rewrite.model) == ("m", "writer")
                assert [r["body"]["model"] for r in backend.requests] == ["m", "writer"]
                health = httpx.get(f"{store_url}/v1/store/health", timeout=10)
                assert health.status_code == 200
                await store.close()
            finally:
                await asyncio.to_thread(stop, gateway)
        finally:
            out = await asyncio.to_thread(stop, server)
        assert "Traceback" not in out


# ---- fuzzing the store API --------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``voltrl serve``'s app on a SQLite store, on loopback, long polls capped short."""
    store = SQLStore(tmp_path_factory.mktemp("fuzz") / "store.sqlite")
    with serve_in_thread(server_app(store, token=TOKEN, max_wait_s=0.05)) as server:
        yield server.url
    asyncio.run(store.close())


def _schema() -> schemathesis.BaseSchema:
    # The spec is what the app serves at /openapi.json; built here from the same app so the
    # test can be parametrised at import time. Valid and invalid requests both.
    app = server_app(InMemoryStore())
    config = SchemathesisConfig.from_dict({"generation": {"mode": "all"}})
    return schemathesis.openapi.from_dict(app.openapi(), config=config)  # type: ignore[union-attr]


schema = _schema()


@pytest.mark.slow
@schema.parametrize()
@settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
def test_fuzzed_store_api_never_answers_5xx(case: schemathesis.Case, fuzzed_server: str) -> None:
    case.call_and_validate(base_url=fuzzed_server, headers=AUTH, checks=[not_a_server_error])


async def test_the_trainers_gateways_check_its_token(tmp_path):
    """Agents get the run's token as their LLM's API key; the gateway refuses any other."""
    import voltrl as vl

    seen: list[tuple[str, int]] = []

    @vl.rollout
    async def agent(task, llm):
        for key in (llm.api_key, "wrong"):
            client = AsyncOpenAI(base_url=llm.endpoint, api_key=key, max_retries=0)
            try:
                await client.completions.create(model=llm.model, prompt="hi", max_tokens=2)
                seen.append((key, 200))
            except Exception as exc:
                seen.append((key, getattr(exc, "status_code", 0)))
            finally:
                await client.close()
        return 1.0

    async with FakeBackend() as backend:
        llm = LLM(endpoint=backend.url, model="m", api_key="backend-key")
        trainer = vl.Trainer(
            n_runners=1,
            inline=True,
            token=TOKEN,
            resources={"main_llm": llm},
            run_dir=tmp_path,
            progress=False,
        )
        result = await trainer.dev_async(agent, [{"q": 1}])
    assert result.stats.succeeded == 1
    assert seen == [(TOKEN, 200), ("wrong", 401)]


@pytest.mark.slow
def test_serve_on_a_port_in_use_says_so_without_creating_the_store_file(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "voltrl.cli",
                "serve",
                "--store",
                "X.sqlite",
                "--port",
                port,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
    assert out.returncode == 2 and "port is in use (--port 0 picks a free one)" in out.stderr
    assert out.stderr.count("\n") == 1
    assert not (tmp_path / "X.sqlite").exists()


@pytest.mark.slow
def test_serve_prints_the_openapi_spec_and_serves_no_cdn_docs_page(tmp_path):
    server, url = start("serve", "--store", "memory", "--no-gateway")
    try:
        assert server.stdout is not None
        assert server.stdout.readline().startswith(f"OpenAPI spec: {url}/openapi.json;")
        assert httpx.get(f"{url}/openapi.json", timeout=10).status_code == 200
        assert httpx.get(f"{url}/docs", timeout=10).status_code == 404
    finally:
        stop(server)
