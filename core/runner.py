"""Runner workers: claim rollouts from the store, run the agent, heartbeat, report.

One worker is an asyncio loop (:func:`run_worker`) that keeps up to ``max_concurrency``
rollouts in flight. Each rollout gets a :class:`~voltrl.tracing.RolloutContext`, its timeout
is enforced by cancelling the work, and whatever the agent does (raise, hang, return junk)
ends that attempt only. A :class:`WorkerPool` runs workers as separate processes talking to
the store over HTTP, and restarts one that dies; the dead worker's leases expire and the
store hands its rollouts out again. :func:`run_runner` is ``voltrl runner``: a pool for a
store server anywhere, until SIGTERM.

A stopped worker claims nothing more, gives rollouts in flight ``grace_s`` to finish, and
releases the rest: they are reported failed with a "released" error, so the store queues them
again at once (the released attempt counts towards the rollout's ``max_attempts``).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from voltrl.agent import LitAgent, normalize_result, run_rollout
from voltrl.errors import StaleAttemptError, StoreError
from voltrl.resources import Resources
from voltrl.store.base import Store
from voltrl.tracing import RolloutContext, activate
from voltrl.types import AttemptResult, Claim

log = logging.getLogger("voltrl.runner")


@dataclass(frozen=True)
class RunnerConfig:
    """How a worker runs rollouts."""

    max_concurrency: int = 4
    """Rollouts in flight per worker (async agents overlap; sync ones get a thread each)."""
    lease_s: float = 30.0
    """How long a claim stays valid without a heartbeat."""
    heartbeat_s: float | None = None
    """Seconds between heartbeats; defaults to a third of the lease."""
    claim_wait_s: float = 5.0
    """Long-poll duration of one claim request."""
    default_timeout_s: float | None = None
    """Timeout for rollouts enqueued without one; None means no limit."""
    grace_s: float = 30.0
    """On stop, how long rollouts in flight may run on before they are released (handed
    back to the store, which queues them again at once)."""

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between heartbeats."""
        return self.heartbeat_s if self.heartbeat_s is not None else self.lease_s / 3


async def run_worker(
    store: Store,
    agent: LitAgent,
    *,
    worker_id: str,
    config: RunnerConfig = RunnerConfig(),
    stop: asyncio.Event | None = None,
    max_rollouts: int | None = None,
) -> int:
    """Claim and run rollouts until ``stop`` is set (or ``max_rollouts`` were started).

    On stop it claims nothing more; rollouts in flight get ``config.grace_s`` seconds to
    finish, then the rest are cancelled and released (reported as failed with a "released"
    error, so the store queues them again at once instead of waiting for their leases).
    Returns how many rollouts it ran.
    """
    stop = stop or asyncio.Event()
    active: dict[str, asyncio.Task[None]] = {}
    stale: set[str] = set()
    resources_cache: dict[int | None, Resources] = {}
    slots = asyncio.Semaphore(config.max_concurrency)
    heartbeats = asyncio.create_task(_heartbeat_loop(store, active, stale, config, worker_id))
    started = 0
    try:
        while not stop.is_set() and (max_rollouts is None or started < max_rollouts):
            await slots.acquire()
            claim = await _claim_or_stop(store, worker_id, config, stop)
            if claim is None:
                slots.release()
                continue
            started += 1
            aid = claim.attempt.attempt_id
            task = asyncio.create_task(
                _execute(store, agent, claim, resources_cache, config, stale)
            )
            active[aid] = task
            task.add_done_callback(
                lambda _t, aid=aid: (active.pop(aid, None), stale.discard(aid), slots.release())
            )
        if active:
            await asyncio.wait(list(active.values()), timeout=config.grace_s)
    finally:
        for task in list(active.values()):
            task.cancel()
        if active:
            await asyncio.gather(*active.values(), return_exceptions=True)
        heartbeats.cancel()
        await asyncio.gather(heartbeats, return_exceptions=True)
    return started


async def _claim_or_stop(
    store: Store, worker_id: str, config: RunnerConfig, stop: asyncio.Event
) -> Claim | None:
    """Long-poll for a claim, giving up as soon as ``stop`` is set."""
    claim_task = asyncio.create_task(
        store.claim(worker_id, lease_s=config.lease_s, wait_s=config.claim_wait_s)
    )
    stop_task = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({claim_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop_task.cancel()
    if not claim_task.done():
        claim_task.cancel()
        await asyncio.gather(claim_task, return_exceptions=True)
        return None
    try:
        return claim_task.result()
    except Exception as exc:  # store unreachable: back off, the loop retries
        log.warning("worker %s: claim failed: %s", worker_id, exc)
        await asyncio.sleep(1.0)
        return None


async def _heartbeat_loop(
    store: Store,
    active: dict[str, asyncio.Task[None]],
    stale: set[str],
    config: RunnerConfig,
    worker_id: str,
) -> None:
    """Renew leases of in-flight attempts; cancel the ones the store says are stale."""
    while True:
        await asyncio.sleep(config.heartbeat_interval)
        if not active:
            continue
        try:
            lost = await store.heartbeat(list(active), lease_s=config.lease_s)
        except Exception as exc:
            log.warning("worker %s: heartbeat failed: %s", worker_id, exc)
            continue
        for aid in lost:
            if (task := active.get(aid)) is not None:
                log.info("worker %s: attempt %s lost its rollout; stopping it", worker_id, aid)
                stale.add(aid)
                task.cancel()


async def _resources_for(
    store: Store, cache: dict[int | None, Resources], version: int | None
) -> Resources:
    if version is not None and version in cache:
        return cache[version]
    resources = await store.get_resources(version) or Resources(items={})
    if version is not None:
        cache[version] = resources
    return resources


async def _execute(
    store: Store,
    agent: LitAgent,
    claim: Claim,
    resources_cache: dict[int | None, Resources],
    config: RunnerConfig,
    stale: set[str],
) -> None:
    """Run one claimed attempt and report its result (unless it became stale)."""
    rollout, attempt = claim.rollout, claim.attempt
    timeout = rollout.timeout_s if rollout.timeout_s is not None else config.default_timeout_s
    try:
        resources = await _resources_for(store, resources_cache, rollout.resources_version)
    except Exception:
        await _report(store, attempt.attempt_id, _failed())
        return
    ctx = RolloutContext(
        rollout_id=rollout.rollout_id,
        attempt_id=attempt.attempt_id,
        task=rollout.task,
        mode=rollout.mode,
        resources=resources.scoped(rollout.rollout_id, attempt.attempt_id),
        worker_id=attempt.worker_id,
    )
    with activate(ctx):
        try:
            async with asyncio.timeout(timeout) as deadline:
                value = await run_rollout(agent, ctx)
            reward, transitions = normalize_result(value, rollout.rollout_id)
            result = AttemptResult(status="succeeded", reward=reward, transitions=transitions)
        except TimeoutError:
            result = (
                AttemptResult(status="timeout", error=f"rollout timed out after {timeout} s")
                if deadline.expired()
                else _failed()
            )
        except asyncio.CancelledError:
            if attempt.attempt_id not in stale:  # worker shutting down: hand the rollout back
                error = f"released: worker {attempt.worker_id} stopped before the rollout finished"
                await _report(
                    store, attempt.attempt_id, AttemptResult(status="failed", error=error)
                )
            raise
        except Exception:
            result = _failed()
    result.rewards, result.spans = list(ctx.rewards), list(ctx.spans)
    await _report(store, attempt.attempt_id, result, patience_s=config.lease_s)


async def _report(
    store: Store, attempt_id: str, result: AttemptResult, patience_s: float = 0.0
) -> None:
    """Report an attempt's result. While the store cannot take it (unreachable, restarting),
    try again for up to ``patience_s`` seconds: heartbeats go on meanwhile, so the attempt
    keeps its rollout unless the outage outlasts its lease (the store then rejects it)."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            await store.complete(attempt_id, result)
            return
        except StaleAttemptError as exc:
            log.info("result of %s rejected: %s", attempt_id, exc)
            return
        except StoreError as exc:
            if time.monotonic() >= deadline:
                log.error("could not report attempt %s: %s", attempt_id, exc)
                return
            log.warning("could not report attempt %s yet, trying again: %s", attempt_id, exc)
            await asyncio.sleep(1.0)
        except Exception:
            log.exception("could not report attempt %s", attempt_id)
            return


def _failed() -> AttemptResult:
    exc = sys.exc_info()[1]
    return AttemptResult(
        status="failed",
        error=f"{type(exc).__name__}: {exc}",
        traceback=traceback.format_exc(),
    )


# ---- processes ---------------------------------------------------------------------------


def _worker_process_main(
    store_url: str,
    token: str | None,
    agent_blob: bytes,
    worker_id: str,
    config: RunnerConfig,
    sys_path: list[str],
) -> None:
    """Entry point of a worker process: connect to the store server and run until SIGTERM,
    SIGINT, or the death of the process that started it (each stops it gracefully)."""
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s [{worker_id}] %(levelname)s %(message)s"
    )
    import cloudpickle

    from voltrl.store.client import HTTPStore

    agent = cloudpickle.loads(agent_blob)
    parent = os.getppid()

    async def watch_parent(stop: asyncio.Event) -> None:
        while os.getppid() == parent:
            await asyncio.sleep(1.0)
        log.warning("worker %s: the process that started it is gone; stopping", worker_id)
        stop.set()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        orphaned = asyncio.create_task(watch_parent(stop))
        store = HTTPStore(store_url, token=token)
        try:
            await run_worker(store, agent, worker_id=worker_id, config=config, stop=stop)
        finally:
            orphaned.cancel()
            await store.close()

    asyncio.run(main())


class WorkerPool:
    """``n`` worker processes on this machine, restarted when one dies unexpectedly."""

    def __init__(
        self,
        agent: LitAgent,
        store_url: str,
        *,
        n: int,
        token: str | None = None,
        config: RunnerConfig = RunnerConfig(),
        max_restarts: int = 10,
        name: str = "worker",
    ) -> None:
        import cloudpickle

        self._blob = cloudpickle.dumps(agent)
        self._url, self._token, self._config = store_url, token, config
        self._n, self._name, self._max_restarts = n, name, max_restarts
        self._ctx = multiprocessing.get_context("spawn")
        self.processes: dict[str, multiprocessing.process.BaseProcess] = {}
        self.restarts = 0
        self._stopping = False
        self._supervisor: threading.Thread | None = None

    def _spawn(self, worker_id: str) -> None:
        proc = self._ctx.Process(
            target=_worker_process_main,
            args=(self._url, self._token, self._blob, worker_id, self._config, list(sys.path)),
            name=f"voltrl-{worker_id}",
            daemon=True,
        )
        proc.start()
        self.processes[worker_id] = proc

    def start(self) -> None:
        """Start the processes and a thread that restarts any that die."""
        for i in range(self._n):
            self._spawn(f"{self._name}-{i}")
        self._supervisor = threading.Thread(target=self._supervise, daemon=True)
        self._supervisor.start()

    def _supervise(self) -> None:
        from multiprocessing.connection import wait

        while not self._stopping:
            by_sentinel = {p.sentinel: wid for wid, p in self.processes.items()}
            for sentinel in wait(list(by_sentinel), timeout=1.0):
                if self._stopping:
                    return
                wid = by_sentinel[sentinel]
                code = self.processes[wid].exitcode
                if self.restarts >= self._max_restarts:
                    log.error("worker %s died (exit %s); restart limit reached", wid, code)
                    self.processes.pop(wid)
                    continue
                self.restarts += 1
                log.warning("worker %s died (exit %s); restarting it", wid, code)
                self._spawn(wid)
            if not self.processes:
                return

    @property
    def alive(self) -> int:
        """How many worker processes are running."""
        return sum(p.is_alive() for p in self.processes.values())

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM every worker (they finish or release in-flight rollouts, see
        :func:`run_worker`), then kill the ones still running after ``grace_s`` (default: the
        config's ``grace_s`` plus 10 s to report)."""
        self._stopping = True
        if grace_s is None:
            grace_s = self._config.grace_s + 10.0
        for proc in self.processes.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in self.processes.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        if self._supervisor is not None:
            self._supervisor.join(2)


def run_runner(
    agent: LitAgent,
    store_url: str,
    *,
    token: str | None = None,
    workers: int = 1,
    config: RunnerConfig = RunnerConfig(),
    name: str | None = None,
) -> int:
    """``voltrl runner``: ``workers`` worker processes on this machine running ``agent`` for
    the store server at ``store_url``, until SIGTERM or SIGINT.

    Checks first that the store answers (a clear :class:`~voltrl.errors.StoreError` if it is
    unreachable or refuses the token). On the signal, workers stop claiming and rollouts in
    flight get ``config.grace_s`` seconds before they are released. Returns the exit status:
    0 after a signal, 1 if every worker died for good.
    """
    import socket

    from voltrl.store.client import HTTPStore

    async def check() -> None:
        store = HTTPStore(store_url, token=token, retries=0)
        try:
            await store.get_resources()
        finally:
            await store.close()

    asyncio.run(check())
    if workers < 1:
        raise ValueError("workers must be >= 1")
    name = name or f"{socket.gethostname()}-{os.getpid()}"
    pool = WorkerPool(agent, store_url, n=workers, token=token, config=config, name=name)
    stop = threading.Event()
    handlers = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    pool.start()
    print(
        f"voltrl runner {name}: {workers} worker(s) x {config.max_concurrency} rollouts "
        f"against {store_url}",
        flush=True,
    )
    try:
        while not stop.wait(0.5):
            if not pool.processes:
                log.error("every worker died; giving up")
                return 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        pool.stop()
    print(f"voltrl runner {name}: stopped", flush=True)
    return 0
