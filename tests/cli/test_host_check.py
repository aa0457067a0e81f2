"""The Host check of every server on loopback (DNS rebinding): a request whose ``Host`` is not
a loopback name gets 421 from ``voltrl serve`` (store, dashboard, gateway), ``voltrl
dashboard``, a served gateway and ``voltrl model serve``; ``localhost:PORT`` is let in. Off
loopback there is no Host check."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from fake_openai_backend import FakeBackend

from voltrl._http.hosts import host_name, is_loopback
from voltrl._http.serving import serve_in_thread
from voltrl.cli.serve import server_app
from voltrl.gateway import start_gateway
from voltrl.store.memory import InMemoryStore
from voltrl.store.sql import SQLStore

REBOUND = "rebound.attacker.example"
"""A name an attacker pointed at 127.0.0.1 after the browser loaded the attacker's page."""


@contextmanager
def voltrl(*args: str, ready: str) -> Iterator[str]:
    """Run ``voltrl ARGS --port 0`` until the block ends; yields the first URL on the line
    that contains ``ready``."""
    env = {k: v for k, v in os.environ.items() if k != "VOLTRL_TOKEN"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "voltrl.cli", *args, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 180
        for line in proc.stdout:
            found = re.search(r"http://127\.0\.0\.1:\d+", line)
            if ready in line and found:
                break
            assert time.monotonic() < deadline, "the server did not start"
        else:
            raise AssertionError(f"the server exited: {proc.wait()}")
        yield found.group(0)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)


def refused(url: str, path: str, host: str) -> bool:
    """Whether ``GET url+path`` with ``Host: host`` is refused as misdirected."""
    answer = httpx.get(url + path, headers={"Host": host})
    if answer.status_code != 421:
        return False
    assert answer.json()["error"]["type"] == "MisdirectedRequest"
    return True


def port_of(url: str) -> str:
    return url.rsplit(":", 1)[1].split("/")[0]


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("localhost:8400", "localhost"),
        ("LocalHost.", "localhost"),
        ("127.0.0.1", "127.0.0.1"),
        ("[::1]:8400", "::1"),
        ("localhost.rebound.example:80", "localhost.rebound.example"),
        ("127.0.0.1.rebound.example", "127.0.0.1.rebound.example"),
    ],
)
def test_the_name_of_a_host_header(header: str, name: str) -> None:
    assert host_name(header) == name
    assert is_loopback(name) == (".rebound." not in name)


@pytest.mark.slow
def test_voltrl_serve_answers_only_requests_for_loopback_names() -> None:
    backend = "http://127.0.0.1:9/v1"  # never called: the gateway's routes are only reached
    with voltrl("serve", "--store", "memory", "--backend", backend, ready="voltrl store") as url:
        for path in ("/v1/store/health", "/v1/store/runs", "/ui/", "/v1/models", "/openapi.json"):
            assert refused(url, path, f"{REBOUND}:{port_of(url)}"), path
            assert refused(url, path, REBOUND), path
        assert not refused(url, "/v1/store/runs", f"localhost:{port_of(url)}")
        assert not refused(url, "/ui/", "127.0.0.1")
        assert httpx.get(f"{url}/v1/store/runs", headers={"Host": "localhost"}).json() == []


@pytest.mark.slow
def test_voltrl_dashboard_answers_only_requests_for_loopback_names(tmp_path: Path) -> None:
    asyncio.run(SQLStore(tmp_path / "store.sqlite").close())
    with voltrl("dashboard", str(tmp_path), ready="voltrl dashboard") as url:
        assert refused(url, "/", f"{REBOUND}:{port_of(url)}")
        assert refused(url, "/static/dashboard.js", REBOUND)
        page = httpx.get(f"{url}/", headers={"Host": f"localhost:{port_of(url)}"})
        assert page.status_code == 200 and "Runs" in page.text


async def test_a_served_gateway_answers_only_requests_for_loopback_names() -> None:
    async with FakeBackend() as backend:
        served = await start_gateway(InMemoryStore(), [backend.url])
        try:
            base = served.url.removesuffix("/v1")
            async with httpx.AsyncClient() as http:
                evil = await http.get(f"{base}/v1/models", headers={"Host": REBOUND})
                assert evil.status_code == 421
                local = f"localhost:{port_of(base)}"
                ok = await http.get(f"{base}/v1/models", headers={"Host": local})
                assert ok.status_code == 200 and ok.json()["data"]
        finally:
            await served.stop()


@pytest.mark.slow
def test_voltrl_model_serve_answers_only_requests_for_loopback_names() -> None:
    with voltrl("model", "serve", "tiny", "--threads", "1", ready="voltrl model serve") as url:
        assert refused(url, "/health", REBOUND)
        assert refused(url, "/v1/models", f"{REBOUND}:{port_of(url)}")
        models = httpx.get(f"{url}/v1/models", headers={"Host": f"localhost:{port_of(url)}"})
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"


def test_off_loopback_any_host_is_answered() -> None:
    """Bound to every address (with a token, as off loopback needs one), clients reach the
    server by whatever name leads to the machine."""
    with serve_in_thread(server_app(InMemoryStore(), token="t"), host="0.0.0.0") as server:
        url = f"http://127.0.0.1:{server.port}"
        answer = httpx.get(f"{url}/v1/store/health", headers={"Host": "trainer.cluster.example"})
        assert answer.status_code == 200
