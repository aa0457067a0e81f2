"""Runner workers: failures, timeouts, concurrency and lost leases end one attempt only."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
import time

import pytest
from helpers import ROOT, TESTS

import voltrl as vl
from voltrl.runtime.runner import RunnerConfig, run_worker
from voltrl.store.memory import InMemoryStore
from voltrl.types import Task

FAST = RunnerConfig(max_concurrency=4, lease_s=2.0, claim_wait_s=0.2)


async def run_until_done(store, agent, rollouts, *, config=FAST, workers=1, timeout=30.0):
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(run_worker(store, agent, worker_id=f"w{i}", config=config, stop=stop))
        for i in range(workers)
    ]
    try:
        return await store.wait_for_rollouts([r.rollout_id for r in rollouts], timeout_s=timeout)
    finally:
        stop.set()
        await asyncio.gather(*tasks)


def tasks(n: int) -> list[Task]:
    return [Task(task_id=f"t{i}", input={"i": i}) for i in range(n)]


class Flaky(vl.LitAgent):
    """Raises on task 0, returns junk on task 1, NaN on task 2, succeeds otherwise."""

    async def rollout(self, task, resources):
        i = task["i"]
        if i == 0:
            raise RuntimeError("tool exploded")
        if i == 1:
            return "not a reward"
        if i == 2:
            return float("nan")
        return 1.0


async def test_agent_errors_fail_their_attempt_with_traceback_and_the_worker_goes_on():
    store = InMemoryStore()
    rollouts = await store.enqueue(tasks(5), max_attempts=2)
    done = await run_until_done(store, Flaky(), rollouts)
    status = {r.task.input["i"]: r.status for r in done}
    assert status == {0: "failed", 1: "failed", 2: "failed", 3: "succeeded", 4: "succeeded"}
    attempts = await store.get_attempts(rollouts[0].rollout_id)
    assert len(attempts) == 2  # retried up to max_attempts
    assert "RuntimeError: tool exploded" in attempts[0].error
    assert "Traceback" in attempts[0].traceback and "tool exploded" in attempts[0].traceback
    junk = (await store.get_attempts(rollouts[1].rollout_id))[0]
    assert "InvalidRolloutResultError" in junk.error and rollouts[1].rollout_id in junk.error
    nan = (await store.get_attempts(rollouts[2].rollout_id))[0]
    assert "InvalidRewardError" in nan.error


async def test_agent_errors_are_reported_as_the_agents_own_and_timeouts_are_not():
    class Slow(vl.LitAgent):
        async def rollout(self, task, resources):
            await asyncio.sleep(3600)

    store = InMemoryStore()
    rollouts = await store.enqueue(tasks(3), max_attempts=3, retry_agent_errors=False)
    done = await run_until_done(store, Flaky(), rollouts)
    assert [r.status for r in done] == ["failed", "failed", "failed"]
    for r in done:  # raised, returned junk, returned NaN: each failed once, not retried
        [attempt] = await store.get_attempts(r.rollout_id)
        assert attempt.status == "failed"
    [slow] = await store.enqueue(tasks(1), max_attempts=2, timeout_s=0.1, retry_agent_errors=False)
    [slow] = await run_until_done(store, Slow(), [slow])
    attempts = await store.get_attempts(slow.rollout_id)
    assert [a.status for a in attempts] == ["timeout", "timeout"]  # still retried


async def test_async_rollout_past_its_timeout_is_cancelled():
    cancelled = asyncio.Event()

    class Hangs(vl.LitAgent):
        async def rollout(self, task, resources):
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.set()
                raise

    store = InMemoryStore()
    rollouts = await store.enqueue(tasks(1), max_attempts=1, timeout_s=0.2)
    [r] = await run_until_done(store, Hangs(), rollouts)
    assert r.status == "failed" and "timed out" in r.error
    assert cancelled.is_set()
    [a] = await store.get_attempts(r.rollout_id)
    assert a.status == "timeout"


@pytest.mark.parametrize("stuck_in", ["time.sleep", "a lock another thread holds"])
async def test_a_stuck_sync_rollout_times_out_at_once_without_wedging_the_worker(stuck_in):
    held = threading.Lock()
    held.acquire()  # held by the test until its end

    class Stuck(vl.LitAgent):
        def rollout(self, task, resources):
            if task["stuck"] and stuck_in == "time.sleep":
                time.sleep(3600)
            elif task["stuck"]:
                held.acquire()
            return 1.0

    store = InMemoryStore()
    [stuck] = await store.enqueue([Task(input={"stuck": True})], max_attempts=1, timeout_s=0.2)
    later = await store.enqueue([Task(input={"stuck": False})] * 3)
    config = RunnerConfig(max_concurrency=1, lease_s=2.0, claim_wait_s=0.2)
    try:
        done = await run_until_done(store, Stuck(), [stuck, *later], config=config)
    finally:
        held.release()
    assert [r.status for r in done] == ["failed", "succeeded", "succeeded", "succeeded"]
    assert "timed out after 0.2 s" in done[0].error
    [attempt] = await store.get_attempts(stuck.rollout_id)
    assert attempt.status == "timeout"


async def test_an_abandoned_sync_rollout_that_resumes_is_rejected_and_its_result_dropped():
    resume = threading.Event()
    late: list[BaseException] = []

    class Resumes(vl.LitAgent):
        def rollout(self, task, resources):
            resume.wait(30)
            try:
                vl.emit_reward(5.0)  # its rollout has timed out meanwhile
            except vl.NoActiveRolloutError as e:
                late.append(e)
            return 5.0

    store = InMemoryStore()
    rollouts = await store.enqueue(tasks(1), max_attempts=1, timeout_s=0.2)
    [r] = await run_until_done(store, Resumes(), rollouts)
    resume.set()
    async with asyncio.timeout(30):
        while not late:
            await asyncio.sleep(0.01)
    assert f"rollout {r.rollout_id} (attempt" in str(late[0]) and "has finished" in str(late[0])
    r = await store.get_rollout(r.rollout_id)
    assert (r.status, r.reward) == ("failed", None)
    assert await store.get_rewards(r.rollout_id) == []


async def test_a_worker_runs_up_to_max_concurrency_async_rollouts_at_once():
    running, peak = 0, 0
    gate = asyncio.Event()

    class Overlaps(vl.LitAgent):
        async def rollout(self, task, resources):
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            if peak == 4:
                gate.set()
            await asyncio.wait_for(gate.wait(), 10)
            running -= 1
            return 1.0

    store = InMemoryStore()
    rollouts = await store.enqueue(tasks(8))
    done = await run_until_done(store, Overlaps(), rollouts)
    assert [r.status for r in done] == ["succeeded"] * 8
    assert peak == 4


async def test_sync_agents_run_in_threads_concurrently():
    barrier = threading.Barrier(3, timeout=10)

    class Waits(vl.LitAgent):
        def rollout(self, task, resources):
            barrier.wait()  # only passes when three rollouts run at the same time
            return 1.0

    store = InMemoryStore()
    rollouts = await store.enqueue(tasks(3))
    done = await run_until_done(store, Waits(), rollouts)
    assert [r.status for r in done] == ["succeeded"] * 3


async def test_cancelling_a_running_rollout_stops_its_work_and_discards_its_result():
    started, cancelled = asyncio.Event(), asyncio.Event()

    class Slow(vl.LitAgent):
        async def rollout(self, task, resources):
            started.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.set()
                raise

    store = InMemoryStore()
    [ro] = await store.enqueue(tasks(1))
    # Frequent heartbeats, and a lease no stall of a loaded machine outlasts: the attempt
    # ends by the cancel, never by its lease running out (and its rollout claimed again).
    config = RunnerConfig(lease_s=60.0, heartbeat_s=0.05, claim_wait_s=0.1)
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(store, Slow(), worker_id="w", config=config, stop=stop))
    await asyncio.wait_for(started.wait(), 10)
    await store.cancel(ro.rollout_id)
    await asyncio.wait_for(cancelled.wait(), 10)  # the next heartbeat learns it is stale
    stop.set()
    await worker
    r = await store.get_rollout(ro.rollout_id)
    assert r.status == "cancelled"
    [a] = await store.get_attempts(ro.rollout_id)
    assert a.status == "cancelled"


async def test_rewards_and_spans_are_reported_with_the_attempt():
    class Emits(vl.LitAgent):
        async def rollout(self, task, resources, ctx):
            vl.emit_reward(0.2, name="step")
            with vl.span("tool:calc"):
                await asyncio.to_thread(vl.emit_reward, 0.7)
            return None

    store = InMemoryStore()
    rollouts = await store.enqueue(tasks(1))
    [r] = await run_until_done(store, Emits(), rollouts)
    assert r.status == "succeeded" and r.reward == 0.7  # last emitted reward
    rewards = await store.get_rewards(r.rollout_id)
    assert [(x.name, x.value) for x in rewards] == [("step", 0.2), ("reward", 0.7)]
    [span] = await store.get_spans(r.rollout_id)
    assert span.name == "tool:calc" and span.attempt_id == r.final_attempt_id


@pytest.mark.parametrize("thread", ["bare", "with a copy of the rollout's context"])
async def test_a_reward_from_a_thread_that_outlives_its_rollout_never_reaches_the_next(thread):
    """With one rollout at a time, rollout A leaves a thread behind that emits a reward while
    rollout B runs: the thread gets the error; B's rewards are its own."""
    b_running, emitted = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def late_reward():
        b_running.wait(30)
        try:
            vl.emit_reward(9.0)
        except vl.NoActiveRolloutError as e:
            errors.append(e)
        finally:
            emitted.set()

    class LeavesAThread(vl.LitAgent):
        async def rollout(self, task, resources):
            if task["i"] == 0:  # rollout A
                target = late_reward
                if thread != "bare":
                    target = functools.partial(contextvars.copy_context().run, late_reward)
                threading.Thread(target=target, daemon=True).start()
                return 1.0
            vl.emit_reward(0.5)  # rollout B
            b_running.set()
            await asyncio.to_thread(emitted.wait, 30)
            return None

    store = InMemoryStore()
    rollouts = await store.enqueue(tasks(2))
    config = RunnerConfig(max_concurrency=1, lease_s=2.0, claim_wait_s=0.2)
    a, b = await run_until_done(store, LeavesAThread(), rollouts, config=config)
    assert (a.status, a.reward, b.status, b.reward) == ("succeeded", 1.0, "succeeded", 0.5)
    assert [r.value for r in await store.get_rewards(b.rollout_id)] == [0.5]
    assert 9.0 not in [r.value for r in await store.get_rewards(a.rollout_id)]
    [error] = errors
    expected = "asyncio.to_thread" if thread == "bare" else f"rollout {a.rollout_id} (attempt"
    assert isinstance(error, vl.NoActiveRolloutError) and expected in str(error)


async def test_run_in_executor_inside_a_rollout_keeps_its_rollout():
    """AutoGen runs sync tools with ``loop.run_in_executor(None, ...)``, which copies no
    context by itself; the worker's default executor does."""

    class UsesTheExecutor(vl.LitAgent):
        async def rollout(self, task, resources):
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, vl.emit_reward, float(task["i"]))
            return None

    store = InMemoryStore()
    rollouts = await store.enqueue(tasks(4))
    done = await run_until_done(store, UsesTheExecutor(), rollouts)
    assert [r.reward for r in done] == [0.0, 1.0, 2.0, 3.0]


async def test_rollouts_receive_resources_scoped_to_their_attempt():
    seen = []

    @vl.rollout
    async def agent(task, llm):
        seen.append(llm.endpoint)
        return 1.0

    store = InMemoryStore()
    res = await store.add_resources(
        vl.Resources(items={"main_llm": vl.LLM(endpoint="http://gw/v1", model="m", gateway=True)})
    )
    rollouts = await store.enqueue(tasks(1), resources_version=res.version)
    [r] = await run_until_done(store, agent, rollouts)
    assert seen == [f"http://gw/rollouts/{r.rollout_id}/attempts/{r.final_attempt_id}/v1"]


@pytest.mark.slow
def test_trainer_with_no_runners_waits_for_a_remote_voltrl_runner(tmp_path, capsys):
    """``Trainer(n_runners=0)`` serves its store and prints a ``voltrl runner`` command; a
    runner started with exactly that command does the work."""
    import os
    import re
    import signal
    import socket
    import subprocess
    import sys

    from fault_agents import Trivial

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    trainer = vl.Trainer(
        n_runners=0, port=port, token="remote-token", run_dir=tmp_path, progress=False
    )
    command: list[str] = []

    def start_runner() -> subprocess.Popen[str]:
        # Wait for the trainer to print its command, then run it as a user would.
        deadline = time.monotonic() + 60
        while not command and time.monotonic() < deadline:
            printed = capsys.readouterr().out
            command.extend(m.group(0) for m in re.finditer(r"voltrl runner .*", printed))
            time.sleep(0.1)
        args = command[0].replace("--workers N", "--workers 1").split()[2:]
        return subprocess.Popen(
            [sys.executable, "-m", "voltrl.cli", "runner", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=TESTS,  # where the printed module, fault_agents, is found
            env={**os.environ, "VOLTRL_TOKEN": ""},
        )

    async def main():
        runner = asyncio.create_task(asyncio.to_thread(start_runner))
        try:
            result = await trainer.dev_async(Trivial(), [{"i": i} for i in range(6)])
        finally:
            proc = await runner
        return result, proc

    result, proc = asyncio.run(main())
    try:
        assert command[0].startswith(f"voltrl runner --store http://127.0.0.1:{port} ")
        agents = TESTS / "fault_agents.py"
        assert "--token-file " in command[0] and f"--agent {agents}:Trivial" in command[0]
        assert "remote-token" not in command[0]  # the token is read from a file, never shown
        assert [r.status for r in result.rollouts] == ["succeeded"] * 6
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out


def test_urls_of_servers_on_every_address_name_this_machine():
    import socket

    from voltrl._http.serving import reachable_url

    host = socket.gethostname()
    assert reachable_url("http://0.0.0.0:8400") == f"http://{host}:8400"
    assert reachable_url("http://[::]:8400") == f"http://{host}:8400"
    assert reachable_url("http://127.0.0.1:8400") == "http://127.0.0.1:8400"


async def test_a_stopped_worker_finishes_within_its_grace_period_and_releases_the_rest():
    gates = {"quick": asyncio.Event(), "slow": asyncio.Event()}

    class Gated(vl.LitAgent):
        async def rollout(self, task, resources):
            await gates[task["gate"]].wait()
            return 1.0

    store = InMemoryStore()
    quick, slow = await store.enqueue([Task(input={"gate": g}) for g in gates], max_attempts=2)
    config = RunnerConfig(lease_s=600, claim_wait_s=0.1, grace_s=0.5)
    stop = asyncio.Event()
    worker = asyncio.create_task(
        run_worker(store, Gated(), worker_id="w", config=config, stop=stop)
    )
    async with asyncio.timeout(10):
        while len(await store.query_rollouts(status="running")) < 2:
            await asyncio.sleep(0.01)
    stop.set()
    gates["quick"].set()  # finishes within the grace period; "slow" does not
    assert await asyncio.wait_for(worker, 10) == 2
    assert (await store.get_rollout(quick.rollout_id)).status == "succeeded"
    assert (await store.get_rollout(slow.rollout_id)).status == "queued"  # at once, not at 600 s
    [released] = await store.get_attempts(slow.rollout_id)
    assert released.status == "failed"
    assert released.error == "released: worker w stopped before the rollout finished"


async def test_an_inline_worker_past_the_abandoned_thread_limit_warns_and_goes_on(caplog):
    class Sleeps(vl.LitAgent):
        def rollout(self, task, resources):
            time.sleep(task["sleep"])
            return 1.0

    store = InMemoryStore()
    stuck = await store.enqueue([Task(input={"sleep": 3600})] * 2, max_attempts=1, timeout_s=0.2)
    later = await store.enqueue([Task(input={"sleep": 0})] * 2)
    config = RunnerConfig(max_concurrency=1, lease_s=2.0, claim_wait_s=0.2, max_abandoned_threads=1)
    with caplog.at_level(logging.WARNING, logger="voltrl.runtime.runner"):
        done = await run_until_done(store, Sleeps(), [*stuck, *later], config=config)
    assert [r.status for r in done] == ["failed", "failed", "succeeded", "succeeded"]
    # the runner's own lines (another test's client, garbage-collected here, may log too)
    [warning] = [r.getMessage() for r in caplog.records if r.name == "voltrl.runtime.runner"]
    assert "worker w0: 2 threads of timed-out or cancelled sync rollouts" in warning
    assert "cannot be replaced" in warning


@pytest.mark.slow
async def test_a_worker_process_past_the_abandoned_thread_limit_is_replaced_and_rollouts_go_on(
    caplog,
):
    from fault_agents import SyncSleeper

    from voltrl._http.serving import serve_in_thread
    from voltrl.runtime.workers import WorkerPool
    from voltrl.store.http import HTTPStore
    from voltrl.store.http.endpoints import store_app

    server = serve_in_thread(store_app(InMemoryStore(), token="t"))
    store = HTTPStore(server.url, "t")
    config = RunnerConfig(max_concurrency=1, lease_s=5.0, claim_wait_s=0.2, max_abandoned_threads=0)
    pool = WorkerPool(SyncSleeper(), server.url, n=1, token="t", config=config, max_restarts=0)
    try:
        [stuck] = await store.enqueue([Task(input={"sleep": 3600})], max_attempts=1, timeout_s=0.5)
        later = await store.enqueue([Task(input={"sleep": 0})] * 3)
        with caplog.at_level(logging.WARNING, logger="voltrl.runtime.runner"):
            pool.start()
            ids = [r.rollout_id for r in (stuck, *later)]
            done = await store.wait_for_rollouts(ids, timeout_s=120)
        assert [r.status for r in done] == ["failed", "succeeded", "succeeded", "succeeded"]
        assert "timed out" in done[0].error
        assert (pool.recycled, pool.restarts, pool.alive) == (1, 0, 1)
        pids = [[s.attributes["pid"] for s in await store.get_spans(r.rollout_id)] for r in done]
        assert pids[0] != pids[1] == pids[2] == pids[3]  # the later ones ran in a fresh process
        # the runner's own lines (another test's client, garbage-collected here, may log too)
        [line] = [r.getMessage() for r in caplog.records if r.name == "voltrl.runtime.runner"]
        assert line.startswith("worker worker-0 retired: more than 0 threads")
    finally:
        await asyncio.to_thread(pool.stop)
        await store.close()
        await asyncio.to_thread(server.stop)


class _ContendedLock:
    """A pool's lock that notes when the thread named ``contender`` finds it held."""

    def __init__(self, lock: threading.Lock, contender: str) -> None:
        self._lock, self._contender = lock, contender
        self.contended = threading.Event()

    def __enter__(self) -> bool:
        if not self._lock.acquire(blocking=False):
            if threading.current_thread().name == self._contender:
                self.contended.set()
            self._lock.acquire()
        return True

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


@pytest.mark.timeout(120)
def test_stopping_the_pool_while_its_supervisor_restarts_a_worker_leaves_no_process_behind(
    monkeypatch,
):
    """``stop()`` runs while the supervisor is inside a restart (its worker exited at once):
    it waits for that start, stops the new process too, and ends the supervisor."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from fault_agents import SyncSleeper

    from voltrl.runtime import workers

    started: list[subprocess.Popen[bytes]] = []
    restarting, release = threading.Event(), threading.Event()

    def popen(args, **kwargs):
        """The first worker reads its settings and exits; the restart blocks until
        released, then starts a worker that would run for 5 minutes."""
        if started:
            restarting.set()
            release.wait(60)
        lasts = 300 if started else 0
        code = f"import sys, time; sys.stdin.buffer.read(); time.sleep({lasts})"
        started.append(subprocess.Popen([sys.executable, "-c", code], **kwargs))
        return started[-1]

    fake = SimpleNamespace(
        Popen=popen, PIPE=subprocess.PIPE, TimeoutExpired=subprocess.TimeoutExpired
    )
    monkeypatch.setattr(workers, "subprocess", fake)
    errors: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    pool = workers.WorkerPool(SyncSleeper(), "http://127.0.0.1:9", n=1, token="t")
    lock = _ContendedLock(pool._lock, contender="stopper")
    pool._lock = lock
    try:
        pool.start()
        assert restarting.wait(60), "the supervisor never restarted the worker"
        stopper = threading.Thread(target=pool.stop, kwargs={"grace_s": 10.0}, name="stopper")
        stopper.start()
        # stop() is under way while the restart is: it waits for the lock the restart holds
        assert lock.contended.wait(60), "stop() never reached the pool's lock"
        release.set()
        stopper.join(60)
        assert not stopper.is_alive()
        assert len(started) == 2 and [p.poll() is None for p in started] == [False, False]
        assert [t for t in threading.enumerate() if "supervis" in t.name] == []
        assert errors == []
    finally:
        release.set()
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_readme_quick_start_runs_as_a_script_without_a_main_guard(tmp_path):
    """The README's first snippet, pasted into a file as it is (no ``__main__`` guard): its
    worker process does not re-import the script, so it runs once and leaves one run."""
    import re
    import subprocess
    import sys

    from helpers import FakeBackendProcess

    readme = (ROOT / "README.md").read_text()
    snippet = re.search(r"## Quick start\n\n```python\n(.*?)```", readme, re.S).group(1)
    assert "__main__" not in snippet and "http://127.0.0.1:8000/v1" in snippet
    script = tmp_path / "quick_start.py"
    with FakeBackendProcess() as url:
        script.write_text(snippet.replace("http://127.0.0.1:8000/v1", url))
        out = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240
        )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bootstrapping" not in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert len(list((tmp_path / "runs").iterdir())) == 1


def _run_script(tmp_path, text: str):
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(text)
    return subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240
    )


@pytest.mark.timeout(300)
def test_an_agent_using_a_global_that_cannot_be_pickled_gets_one_clear_error(tmp_path):
    out = _run_script(
        tmp_path,
        """
import threading
import voltrl as vl

lock = threading.Lock()

def agent(task, resources):
    with lock:
        return 1.0

try:
    vl.Trainer(run_dir="runs", name="locked", progress=False).dev(agent, [{"q": 1}])
except vl.AgentLoadError as exc:
    print("AgentLoadError:", exc)
""",
    )
    assert out.returncode == 0, out.stderr
    assert "it uses lock, which cannot be pickled" in out.stdout, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    from voltrl.store.sql import SQLStore

    store = SQLStore(tmp_path / "runs" / "locked" / "store.sqlite")
    [run] = asyncio.run(store.list_runs())
    asyncio.run(store.close())
    assert run.status == "failed" and "AgentLoadError" in run.error  # a failed start, recorded


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_that_cannot_load_the_agent_says_so_once_and_is_not_restarted(tmp_path):
    (tmp_path / "gone.py").write_text(
        "import voltrl as vl\n\nclass Agent(vl.LitAgent):\n"
        "    def rollout(self, task, resources):\n        return 1.0\n"
    )
    out = _run_script(
        tmp_path,
        """
import os, shutil, sys
sys.path.insert(0, os.getcwd())
import voltrl as vl
from gone import Agent

agent = Agent()
os.remove("gone.py")  # the workers cannot import it any more
shutil.rmtree("__pycache__", ignore_errors=True)
sys.path.remove(os.getcwd())
try:
    vl.Trainer(run_dir="runs", name="gone", n_runners=2, progress=False).dev(agent, [{"q": 1}])
except vl.VoltRLError as exc:
    print("VoltRLError:", exc)
""",
    )
    assert "VoltRLError: every worker has died" in out.stdout, out.stdout + out.stderr
    assert out.stderr.count("cannot load the agent: ModuleNotFoundError") == 2  # once a worker
    assert "restarting it" not in out.stderr.replace("not restarting it", "")


def test_connection_errors_and_server_failures_are_not_the_agents_own():
    import httpx
    import openai

    from voltrl.runtime.runner import _is_infrastructure

    request = httpx.Request("POST", "http://model/v1/chat/completions")

    def status(cls, code):
        return cls("x", response=httpx.Response(code, request=request), body=None)

    infrastructure = [
        openai.APIConnectionError(request=request),
        openai.APITimeoutError(request=request),
        status(openai.InternalServerError, 503),
        status(openai.RateLimitError, 429),
        ConnectionResetError(),
        TimeoutError(),
    ]
    agents_own = [status(openai.BadRequestError, 400), KeyError("answer"), ValueError("parse")]
    assert [_is_infrastructure(e) for e in infrastructure] == [True] * 6
    assert [_is_infrastructure(e) for e in agents_own] == [False] * 3
