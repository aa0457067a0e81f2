"""Runner workers: claim rollouts from the store, run the agent, heartbeat, report.

One worker is an asyncio loop (:func:`run_worker`) that keeps up to ``max_concurrency``
rollouts in flight. Each rollout gets a :class:`~voltrl.tracing.RolloutContext`, its timeout
is enforced by cancelling the work, and whatever the agent does (raise, hang, return junk)
ends that attempt only. :class:`~voltrl.runtime.workers.WorkerPool` runs workers as separate
processes talking to the store over HTTP, and restarts one that dies; the dead worker's leases
expire and the store hands its rollouts out again (``voltrl runner`` is such a pool).

Async rollouts run on the worker's loop, whose default executor copies the caller's context
(``loop.run_in_executor`` keeps the rollout); each sync rollout runs in a thread of its own.
A thread cannot be stopped safely from outside (an exception injected into it could fire
inside any library's critical section), so a sync rollout past its timeout, or cancelled, is
failed at once and its thread *abandoned*: it runs on untouched, its result is dropped and
whatever it emits is rejected. Abandoned threads that never return pile up, so a worker
process holding more than ``max_abandoned_threads`` of them still running retires: it claims
nothing more, finishes its other rollouts and exits with :data:`RECYCLE_EXIT_CODE`, and its
:class:`~voltrl.runtime.workers.WorkerPool` starts a fresh process in its place (not counted as a
crash). An inline worker (``Trainer(inline=True)``) shares the trainer's process and cannot
retire: it logs a warning instead.

A stopped worker claims nothing more, gives rollouts in flight ``grace_s`` to finish, and
releases the rest: they are reported failed with a "released" error, so the store queues them
again at once (the released attempt counts towards the rollout's ``max_attempts``).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from voltrl.agent import LitAgent, normalize_result, run_rollout
from voltrl.errors import StaleAttemptError, StoreError
from voltrl.resources import ApiKeys, Resources
from voltrl.store.base import Store
from voltrl.tracing import RolloutContext, activate, copy_context_into_executor
from voltrl.types import AttemptResult, Claim

log = logging.getLogger("voltrl.runtime.runner")

#: Exit status of a worker process that retires to shed abandoned threads; its pool starts
#: a fresh one in its place (a planned restart, not a crash).
RECYCLE_EXIT_CODE = 75


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
    max_abandoned_threads: int = 8
    """How many threads of timed-out or cancelled sync rollouts a worker may hold while they
    run on (abandoned, never interrupted); past it a worker process is replaced by a fresh
    one, and an inline worker, which cannot be, logs a warning."""

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
    keys: ApiKeys | None = None,
    recycle: asyncio.Event | None = None,
) -> int:
    """Claim and run rollouts until ``stop`` is set (or ``max_rollouts`` were started).

    ``keys`` are the API keys put back into the resources read from the store, which never
    holds them (default: the store's token as the key of gateway endpoints).

    On stop it claims nothing more; rollouts in flight get ``config.grace_s`` seconds to
    finish, then the rest are cancelled and released (reported as failed with a "released"
    error, so the store queues them again at once instead of waiting for their leases).

    ``recycle`` is given by a worker process, which can be replaced: once the worker holds
    more than ``config.max_abandoned_threads`` abandoned threads still running, it sets
    ``recycle``, claims nothing more, waits for its other rollouts and returns. Without it
    (inline workers) a warning is logged instead. Returns how many rollouts it ran.

    The loop's default executor becomes a :class:`~voltrl.tracing.ContextThreadPoolExecutor`,
    so ``loop.run_in_executor(None, ...)`` in a rollout keeps its rollout.
    """
    stop = stop or asyncio.Event()
    copy_context_into_executor(asyncio.get_running_loop())
    abandoned = _AbandonedThreads(worker_id, config.max_abandoned_threads, recycle)
    halts = [event for event in (stop, recycle) if event is not None]
    active: dict[str, asyncio.Task[None]] = {}
    stale: set[str] = set()
    keys = keys or ApiKeys(gateway=getattr(store, "token", None))
    resources_cache = _ResourcesCache(store, keys)
    slots = asyncio.Semaphore(config.max_concurrency)
    heartbeats = asyncio.create_task(_heartbeat_loop(store, active, stale, config, worker_id))
    started = 0
    try:
        while max_rollouts is None or started < max_rollouts:
            await slots.acquire()
            if any(event.is_set() for event in halts):  # checked once a slot is free
                break
            claim = await _claim_or_stop(store, worker_id, config, *halts)
            if claim is None:
                slots.release()
                continue
            started += 1
            aid = claim.attempt.attempt_id
            task = asyncio.create_task(
                _execute(store, agent, claim, resources_cache, config, stale, abandoned.add)
            )
            active[aid] = task
            task.add_done_callback(
                lambda _t, aid=aid: (active.pop(aid, None), stale.discard(aid), slots.release())
            )
        if active:
            recycling = abandoned.recycling and not stop.is_set()
            grace_s = None if recycling else config.grace_s  # recycling: let them finish
            await asyncio.wait(list(active.values()), timeout=grace_s)
    finally:
        for task in list(active.values()):
            task.cancel()
        if active:
            await asyncio.gather(*active.values(), return_exceptions=True)
        heartbeats.cancel()
        await asyncio.gather(heartbeats, return_exceptions=True)
    return started


async def _claim_or_stop(
    store: Store, worker_id: str, config: RunnerConfig, *stops: asyncio.Event
) -> Claim | None:
    """Long-poll for a claim, giving up as soon as one of ``stops`` is set."""
    claim_task = asyncio.create_task(
        store.claim(worker_id, lease_s=config.lease_s, wait_s=config.claim_wait_s)
    )
    stop_tasks = {asyncio.create_task(stop.wait()) for stop in stops}
    try:
        await asyncio.wait({claim_task, *stop_tasks}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for stop_task in stop_tasks:
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


class _AbandonedThreads:
    """A worker's threads of sync rollouts that ended (timed out, cancelled) while the
    thread ran on, and what happens when more than ``limit`` of them are still running:
    ``recycle`` is set (a worker process, which the pool replaces), else a warning."""

    def __init__(self, worker_id: str, limit: int, recycle: asyncio.Event | None) -> None:
        self._worker_id, self._limit, self._recycle = worker_id, limit, recycle
        self._threads: list[threading.Thread] = []

    @property
    def recycling(self) -> bool:
        """Whether the worker is to be replaced by a fresh process."""
        return self._recycle is not None and self._recycle.is_set()

    def add(self, thread: threading.Thread) -> None:
        """Count ``thread``, abandoned by its rollout, and forget those that have ended."""
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        if len(self._threads) <= self._limit:
            return
        if self._recycle is not None:
            self._recycle.set()
            return
        log.warning(
            "worker %s: %d threads of timed-out or cancelled sync rollouts are still running "
            "(max_abandoned_threads=%d); an inline worker cannot be replaced by a fresh "
            "process, so they stay until their code returns",
            self._worker_id,
            len(self._threads),
            self._limit,
        )


class _ResourcesCache:
    """Resources versions read from the store, with their API keys put back."""

    def __init__(self, store: Store, keys: ApiKeys) -> None:
        self._store, self._keys = store, keys
        self._versions: dict[int, Resources] = {}

    async def get(self, version: int | None) -> Resources:
        if version is not None and version in self._versions:
            return self._versions[version]
        stored = await self._store.get_resources(version) or Resources(items={})
        resources = stored.with_keys(self._keys)
        if version is not None:
            self._versions[version] = resources
        return resources


async def _execute(
    store: Store,
    agent: LitAgent,
    claim: Claim,
    resources_cache: _ResourcesCache,
    config: RunnerConfig,
    stale: set[str],
    on_abandon: Callable[[threading.Thread], None],
) -> None:
    """Run one claimed attempt and report its result (unless it became stale);
    ``on_abandon`` gets the thread of a sync rollout left running past its end."""
    rollout, attempt = claim.rollout, claim.attempt
    timeout = rollout.timeout_s if rollout.timeout_s is not None else config.default_timeout_s
    try:
        resources = await resources_cache.get(rollout.resources_version)
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
                value = await run_rollout(agent, ctx, on_abandon=on_abandon)
            reward, transitions = normalize_result(value, rollout.rollout_id)
            result = AttemptResult(status="succeeded", reward=reward, transitions=transitions)
        except TimeoutError:
            result = (
                AttemptResult(status="timeout", error=f"rollout timed out after {timeout} s")
                if deadline.expired()
                else _failed(agent_error=False)  # the agent's own client timed out
            )
        except asyncio.CancelledError:
            if attempt.attempt_id not in stale:  # worker shutting down: hand the rollout back
                error = f"released: worker {attempt.worker_id} stopped before the rollout finished"
                await _report(
                    store, attempt.attempt_id, AttemptResult(status="failed", error=error)
                )
            raise
        except Exception as exc:
            result = _failed(agent_error=not _is_infrastructure(exc))
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


_INFRASTRUCTURE_ERRORS = frozenset(
    {"APIConnectionError", "APITimeoutError", "InternalServerError", "RateLimitError"}
)
"""The ``openai`` client's errors that say the model server, not the agent, failed."""


def _is_infrastructure(exc: BaseException) -> bool:
    """Whether ``exc`` (raised out of the agent) is a failure of the network or the model
    server (a connection error, a timeout, a 5xx or 429 from an OpenAI client) rather than
    of the agent's code: such attempts are retried even where agent errors are not."""
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    return any(
        cls.__name__ in _INFRASTRUCTURE_ERRORS and cls.__module__.startswith("openai")
        for cls in type(exc).__mro__
    )


def _failed(*, agent_error: bool = False) -> AttemptResult:
    """The failed result of the exception being handled; ``agent_error``: the agent's own code
    raised it or returned something that is not a result (see ``Rollout.retry_agent_errors``)."""
    exc = sys.exc_info()[1]
    return AttemptResult(
        status="failed",
        error=f"{type(exc).__name__}: {exc}",
        traceback=traceback.format_exc(),
        agent_error=agent_error,
    )
