"""Fault tests with real processes on loopback: ``voltrl serve`` and ``voltrl runner`` are
started as a user would start them, then killed, cut off or loaded.

- a runner SIGKILLed mid-rollout: its rollouts are retried once their leases run out and
  complete exactly once; a runner sent SIGTERM finishes what it can within its grace period
  and releases the rest at once;
- the server SIGKILLed mid-run (SQLite and PostgreSQL): restarted on the same store, the
  runners carry on, and everything acknowledged before the kill is still there;
- a proxy that resets connections and cuts responses between runner and server: retried
  writes are applied once (request ids), nothing is lost;
- 32 concurrent rollouts (2 runners x 2 workers x 8) for 2,000 rollouts: none lost or
  duplicated, and the server's memory stays flat.

Every wait is bounded; every process a test starts is killed at its end, whatever happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from fake_openai_backend import FakeBackend
from helpers import TESTS

from voltrl.resources import LLM, Resources
from voltrl.store.http import HTTPStore
from voltrl.types import Rollout, Task

TOKEN = "fault-token"
AGENTS = TESTS / "fault_agents.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """Starts ``voltrl`` commands, each in its own process group with its output in a file,
    and kills whatever is left of them at the end of the test."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.started: list[subprocess.Popen[bytes]] = []

    def voltrl(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = (self.folder / f"{name}.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "voltrl.cli", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: SIGKILL takes its workers too
            env={**os.environ, "VOLTRL_TOKEN": TOKEN, **(env or {})},
        )
        log.close()
        self.started.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")

    async def serve(self, store: str, port: int, *args: str) -> subprocess.Popen:
        """``voltrl serve`` on ``port``; returns once it answers its health check. (Async, as
        every wait here: the tests' proxy and fake backend run on the test's event loop.)"""
        proc = self.voltrl("serve", "serve", "--store", store, "--port", str(port), *args)
        deadline = time.monotonic() + 60
        async with httpx.AsyncClient() as http:
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    health = await http.get(f"http://127.0.0.1:{port}/v1/store/health")
                    if health.is_success:
                        return proc
                assert proc.poll() is None, self.log("serve")
                await asyncio.sleep(0.1)
        raise AssertionError(f"voltrl serve did not start: {self.log('serve')}")

    def runner(
        self, name: str, url: str, agent: str, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """``voltrl runner`` for the store at ``url`` running ``tests/fault_agents.py:AGENT``."""
        return self.voltrl(
            name, "runner", "--store", url, "--agent", f"{AGENTS}:{agent}", *args, env=env
        )

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        """SIGKILL the process and its whole group (a runner's workers too)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)

    async def stop(self, proc: subprocess.Popen, name: str) -> None:
        """SIGTERM the process and check it exits cleanly."""
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 60) == 0, self.log(name)

    def kill_all(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                self.kill(proc)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    p = Processes(tmp_path)
    try:
        yield p
    finally:
        p.kill_all()


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    """Poll ``check`` until it is true; fail after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def all_finished(
    store: HTTPStore, rollouts: list[Rollout], timeout_s: float
) -> list[Rollout]:
    done = await store.wait_for_rollouts([r.rollout_id for r in rollouts], timeout_s=timeout_s)
    assert len(done) == len(rollouts), f"{len(done)} of {len(rollouts)} rollouts finished"
    return done


# ---- runners killed and stopped -----------------------------------------------------------


@pytest.mark.slow
async def test_a_runner_killed_mid_rollout_has_its_rollouts_retried_and_completed_once(
    tmp_path, procs
):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    await procs.serve(str(tmp_path / "store.sqlite"), port)
    store = HTTPStore(url, TOKEN)
    tasks = [Task(input={"dir": str(tmp_path), "gate": "open", "i": i}) for i in range(3)]
    # Room for a re-claim by the first runner too (its lease ran out while it was slowed).
    rollouts = await store.enqueue(tasks, max_attempts=5)
    first = procs.runner("first", url, "Blocking", "--max-concurrency", "4", "--lease", "3")

    async def all_started() -> bool:
        # Every rollout has an attempt that started (counted by rollout: a rollout whose
        # lease ran out and that was claimed again has two files).
        return all(any(tmp_path.glob(f"started-{r.rollout_id}-*")) for r in rollouts)

    await until(all_started, 60, "the first runner to start every rollout")
    procs.kill(first)
    (tmp_path / "open").touch()
    second = procs.runner("second", url, "Blocking", "--max-concurrency", "4", "--lease", "3")
    done = await all_finished(store, rollouts, 60)
    assert [r.status for r in done] == ["succeeded"] * 3
    for r in done:
        attempts = await store.get_attempts(r.rollout_id)
        assert attempts[0].status == "expired"  # the killed runner's attempt ran out its lease
        assert attempts[0].worker_id != attempts[-1].worker_id
        assert [a.status for a in attempts].count("succeeded") == 1
        assert attempts[-1].attempt_id == r.final_attempt_id
    await procs.stop(second, "second")
    await store.close()


@pytest.mark.slow
async def test_sigterm_lets_a_runner_finish_within_its_grace_period_then_release_the_rest(
    tmp_path, procs
):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    await procs.serve("memory", port)
    store = HTTPStore(url, TOKEN)
    quick, slow = await store.enqueue(
        [Task(input={"dir": str(tmp_path), "gate": gate}) for gate in ("quick", "slow")]
    )
    runner = procs.runner("runner", url, "Blocking", "--lease", "600", "--grace", "4")

    async def both_started() -> bool:
        return len(list(tmp_path.glob("started-*"))) == 2

    await until(both_started, 60, "the runner to start both rollouts")
    runner.send_signal(signal.SIGTERM)
    (tmp_path / "quick").touch()  # finishes within the grace period; "slow" does not
    assert await asyncio.to_thread(runner.wait, 60) == 0, procs.log("runner")
    assert (await store.get_rollout(quick.rollout_id)).status == "succeeded"
    # Released, not left to its 600 s lease: queued again at once.
    assert (await store.get_rollout(slow.rollout_id)).status == "queued"
    [released] = await store.get_attempts(slow.rollout_id)
    assert released.status == "failed" and released.error.startswith("released: worker")
    (tmp_path / "slow").touch()
    again = procs.runner("again", url, "Blocking")
    [done] = await all_finished(store, [slow], 60)
    assert done.status == "succeeded"
    await procs.stop(again, "again")
    await store.close()


# ---- the server killed ----------------------------------------------------------------------


def store_spec(kind: str, tmp_path: Path) -> str:
    if kind == "sqlite":
        return str(tmp_path / "store.sqlite")
    from pg import new_database_url

    return new_database_url()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_the_server_killed_mid_run_restarts_and_keeps_everything_acknowledged(
    tmp_path, procs, kind
):
    spec = store_spec(kind, tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    async with FakeBackend() as backend:
        serve_args = (spec, port, "--backend", backend.url)
        server = await procs.serve(*serve_args)
        store = HTTPStore(url, TOKEN, retries=8)
        llm = LLM(endpoint=f"{url}/v1", model="fake-model", api_key=TOKEN, gateway=True)
        resources = await store.add_resources(Resources(items={"main_llm": llm}))
        # The first 3 rollouts wait, once their call is made, for a file made only after the
        # kill: some work is surely unfinished at the kill, and as they are fewer than the
        # runner's 4 slots, the others still run meanwhile.
        gate = {"dir": str(tmp_path), "gate": "open"}
        tasks = [Task(input={"i": i, "sleep": 0.2, **(gate if i < 3 else {})}) for i in range(40)]
        rollouts = await store.enqueue(tasks, resources_version=resources.version, max_attempts=20)
        runner = procs.runner("runner", url, "CallsLLM", "--max-concurrency", "4", "--lease", "3")

        async def some_succeeded() -> bool:
            return len(await store.query_rollouts(status="succeeded")) >= 10

        await until(some_succeeded, 90, "10 rollouts to succeed")
        # What the server acknowledged so far: finished rollouts, their calls and spans.
        before = {r.rollout_id: r for r in await store.query_rollouts(status="succeeded")}
        calls = {c.call_id for r in rollouts for c in await store.get_llm_calls(r.rollout_id)}
        spans = {s.span_id for r in rollouts for s in await store.get_spans(r.rollout_id)}
        assert len(await store.query_rollouts(status=["queued", "running"])) >= 3
        procs.kill(server)
        assert server.returncode == -signal.SIGKILL
        (tmp_path / "open").touch()
        await procs.serve(*serve_args)
        done = await all_finished(store, rollouts, 120)
        assert [r.status for r in done] == ["succeeded"] * len(rollouts)
        for r in done:
            if r.rollout_id in before:  # unchanged by the kill
                assert r.final_attempt_id == before[r.rollout_id].final_attempt_id
            final = r.final_attempt_id
            assert len(await store.get_llm_calls(r.rollout_id, final)) == 1
            assert [s.name for s in await store.get_spans(r.rollout_id, final)] == ["chat"]
        calls_after = {c.call_id for r in rollouts for c in await store.get_llm_calls(r.rollout_id)}
        spans_after = {s.span_id for r in rollouts for s in await store.get_spans(r.rollout_id)}
        assert calls <= calls_after and spans <= spans_after
        assert len(calls) >= 10 and len(spans) >= 10
        await procs.stop(runner, "runner")
        await store.close()


# ---- network faults -------------------------------------------------------------------------


class FlakyProxy:
    """A TCP proxy on loopback that breaks a share of exchanges: it resets the connection
    before a request reaches the server, drops the whole response, or cuts it half-way."""

    FATES = ("reset", "drop", "cut")

    def __init__(self, target_port: int, rate: float, seed: int = 0) -> None:
        self.target_port = target_port
        self.rate = rate
        self.random = random.Random(seed)
        self.faults: Counter[str] = Counter()
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> FlakyProxy:
        self.server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _connection(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter):
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_w.transport.abort()
            return
        pending: list[str] = []  # the fate of the response to the request just forwarded

        def abort() -> None:
            client_w.transport.abort()
            server_w.transport.abort()

        async def upstream() -> None:
            while data := await client_r.read(65536):
                fate = self.random.choice(self.FATES) if self.random.random() < self.rate else ""
                if fate == "reset":
                    self.faults[fate] += 1
                    abort()
                    return
                pending[:] = [fate] if fate else []
                server_w.write(data)
                await server_w.drain()
            server_w.close()

        async def downstream() -> None:
            while data := await server_r.read(65536):
                if pending:
                    self.faults[pending[0]] += 1
                    if pending[0] == "cut":
                        client_w.write(data[: len(data) // 2])
                        await client_w.drain()
                    abort()
                    return
                client_w.write(data)
                await client_w.drain()
            client_w.close()

        await asyncio.gather(upstream(), downstream(), return_exceptions=True)
        abort()


@pytest.mark.slow
async def test_network_faults_between_runner_and_server_lose_nothing_and_duplicate_nothing(
    tmp_path, procs
):
    port = free_port()
    await procs.serve(str(tmp_path / "store.sqlite"), port)
    store = HTTPStore(f"http://127.0.0.1:{port}", TOKEN)  # the test itself goes direct
    async with FlakyProxy(port, rate=0.2, seed=5) as proxy:
        rollouts = await store.enqueue(
            [Task(input={"i": i, "sleep": 0.05}) for i in range(100)], max_attempts=20
        )
        runner = procs.runner(
            "runner",
            proxy.url,
            "Recording",
            "--max-concurrency",
            "8",
            "--lease",
            "15",  # heartbeats every 5 s: only a lost claim, not a slowed runner, expires
            env={"VOLTRL_FAULT_STORE": proxy.url},
        )
        done = await all_finished(store, rollouts, 150)
        await procs.stop(runner, "runner")
    assert [r.status for r in done] == ["succeeded"] * len(rollouts)
    statuses: Counter[str] = Counter()
    for r in done:
        attempts = await store.get_attempts(r.rollout_id)
        statuses.update(a.status for a in attempts)
        assert [a.status for a in attempts].count("succeeded") == 1
        calls = Counter(c.attempt_id for c in await store.get_llm_calls(r.rollout_id))
        assert calls[r.final_attempt_id] == 1 and max(calls.values()) == 1, calls
        assert [s.name for s in await store.get_spans(r.rollout_id, r.final_attempt_id)] == ["work"]
    print(f"\nproxy faults injected: {dict(proxy.faults)}; attempts: {dict(statuses)}")
    # A claim is applied once however often it is retried: an attempt left to expire is one
    # whose every retry failed, which the worker logs.
    assert statuses["expired"] <= procs.log("runner").count("claim failed")
    assert all(proxy.faults[fate] > 0 for fate in FlakyProxy.FATES), proxy.faults
    await store.close()


# ---- load ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)  # a bound for a hang only: a loaded machine is slow, not wrong
async def test_32_concurrent_runners_run_2000_rollouts_once_each_with_flat_server_memory(
    tmp_path, procs
):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = await procs.serve(str(tmp_path / "store.sqlite"), port)
    store = HTTPStore(url, TOKEN)
    rollouts = await store.enqueue([Task(input={"i": i}) for i in range(2000)])
    ids = [r.rollout_id for r in rollouts]
    started = time.monotonic()
    runners = [
        procs.runner(
            f"runner{i}", url, "Trivial", "--workers", "2", "--max-concurrency", "8"
        )  # 2 runners x 2 worker processes x 8 rollouts in flight = 32
        for i in range(2)
    ]
    memory = psutil.Process(server.pid)

    async def finished(part: list[str]) -> None:
        # A cheap poll: is any of them still unfinished? (A long poll on 2,000 ids costs the
        # server a query of them all at every change.) No deadline of its own: how fast the
        # rollouts go depends on the machine; the test's timeout bounds a hang.
        while await store.query_rollouts(rollout_ids=part, status=["queued", "running"], limit=1):
            await asyncio.sleep(0.5)

    await finished(ids[:1000])
    rss_half = memory.memory_info().rss
    await finished(ids)
    elapsed = time.monotonic() - started
    rss_end = memory.memory_info().rss
    cpu = sum(memory.cpu_times()[:2])
    for runner, name in zip(runners, ("runner0", "runner1"), strict=True):
        await procs.stop(runner, name)
    done = await store.query_rollouts()
    assert len(done) == 2000 and {r.rollout_id for r in done} == set(ids)
    assert Counter(r.status for r in done) == {"succeeded": 2000}
    assert sum(r.attempt_count for r in done) == 2000  # each claimed exactly once
    growth = (rss_end - rss_half) / 2**20
    print(
        f"\n2000 rollouts, 32 in flight: {elapsed:.1f} s ({2000 / elapsed:.0f} rollouts/s); "
        f"server RSS {rss_half / 2**20:.1f} MiB after 1000, {rss_end / 2**20:.1f} MiB after "
        f"2000 ({growth:+.1f} MiB); server CPU {cpu:.1f} s"
    )
    assert growth < 50
    await store.close()
