"""The rollout/attempt state machine and change notification, shared by every store.

Keeping these rules in one place is what lets the in-memory and SQL stores behave the same.
"""

from __future__ import annotations

import asyncio
import threading

from voltrl.types import (
    Attempt,
    AttemptResult,
    Claim,
    Rollout,
    RolloutMode,
    RolloutStatus,
    Task,
    now,
)

RETRYABLE_ATTEMPT = frozenset({"failed", "timeout", "expired"})


def after_attempt(
    rollout: Rollout, attempt_status: str, agent_error: bool = False
) -> RolloutStatus:
    """The rollout's status once its current attempt ends with ``attempt_status``
    (``agent_error``: the agent's own code failed it, retried only if the rollout says so)."""
    if attempt_status == "succeeded":
        return "succeeded"
    if attempt_status == "cancelled":
        return "cancelled"
    if agent_error and not rollout.retry_agent_errors:
        return "failed"
    if attempt_status in RETRYABLE_ATTEMPT and rollout.attempt_count < rollout.max_attempts:
        return "queued"
    return "failed"


def final_reward(result: AttemptResult) -> float | None:
    """The rollout's reward: what the agent returned, else the last reward it emitted for
    the whole rollout (not one addressed to some agents, ``Reward.agents``)."""
    if result.reward is not None:
        return result.reward
    whole = [r for r in result.rewards if r.agents is None]
    return whole[-1].value if whole else None


def apply_result(rollout: Rollout, attempt: Attempt, result: AttemptResult) -> None:
    """Mutate a running rollout and its owning attempt to reflect the attempt's report."""
    t = now()
    attempt.status = result.status
    attempt.finished_at = t
    attempt.reward = final_reward(result)
    attempt.error = result.error
    attempt.traceback = result.traceback
    attempt.transitions = result.transitions
    rollout.status = after_attempt(rollout, result.status, result.agent_error)
    rollout.error = result.error
    if rollout.status == "succeeded":
        rollout.reward = attempt.reward
        rollout.final_attempt_id = attempt.attempt_id
    if rollout.status in ("succeeded", "failed", "cancelled"):
        rollout.finished_at = t


def started_rollout(
    task: Task,
    *,
    worker_id: str,
    mode: RolloutMode,
    run_id: str | None,
    resources_version: int | None,
    lease_s: float,
) -> Claim:
    """A rollout created running, its one attempt held by ``worker_id`` (what
    ``Store.start_rollout`` records): never queued, never retried (``max_attempts=1``)."""
    t = now()
    rollout = Rollout(
        task=task,
        mode=mode,
        run_id=run_id,
        resources_version=resources_version,
        max_attempts=1,
        status="running",
        attempt_count=1,
        started_at=t,
    )
    attempt = Attempt(
        rollout_id=rollout.rollout_id, index=1, worker_id=worker_id, lease_expires_at=t + lease_s
    )
    return Claim(rollout=rollout, attempt=attempt)


def expire_attempt(rollout: Rollout, attempt: Attempt) -> None:
    """Mutate a rollout whose running attempt's lease ran out."""
    t = now()
    attempt.status = "expired"
    attempt.finished_at = t
    attempt.error = f"lease expired (worker {attempt.worker_id} stopped heartbeating)"
    rollout.status = after_attempt(rollout, "expired")
    rollout.error = attempt.error
    if rollout.status == "failed":
        rollout.finished_at = t


class Notifier:
    """Wakes every waiter when the store changes. Safe to notify from any thread or loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.version = 0
        """Counts notifications; read it before checking, pass it to :meth:`wait`."""

    def notify(self) -> None:
        """Wake all current waiters."""
        with self._lock:
            self.version += 1
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_set_done, fut)
            except RuntimeError:  # that loop has closed: nobody is waiting there any more
                continue

    async def wait(self, timeout_s: float | None, seen: int | None = None) -> bool:
        """Sleep until the next :meth:`notify` or the timeout; True if notified.

        With ``seen`` (the :attr:`version` read before the caller checked the store), return
        at once if a notification came since, so none is lost between check and sleep.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if seen is not None and seen != self.version:
                return True
            self._waiters.append((loop, fut))
        try:
            # not asyncio.wait_for: on Python 3.11 it returns the result of a future done by
            # the time a cancellation reaches it, and the cancellation (a Ctrl-C) is lost
            async with asyncio.timeout(timeout_s):
                await fut
            return True
        except TimeoutError:
            return False
        finally:
            with self._lock:
                if (loop, fut) in self._waiters:
                    self._waiters.remove((loop, fut))


def _set_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
