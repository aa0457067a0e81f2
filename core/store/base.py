"""The store interface: the single source of truth between algorithm, runners and gateway.

Semantics every implementation keeps (the tests in ``tests/store/test_store.py`` run against each):

- ``claim`` is atomic: two workers never get the same queued rollout. It starts a new attempt
  holding a lease until ``now + lease_s``.
- ``heartbeat`` renews the lease of running attempts. A lease that runs out ends its attempt
  as ``expired``; the rollout is queued again while ``attempt_count < max_attempts``, else it
  fails. Leases are checked on every ``claim``/``wait_for_rollouts``/``expire_leases``.
- ``complete`` applies an attempt's whole report (status, reward, rewards, spans,
  transitions) at once, only if that attempt still owns its running rollout; otherwise it
  raises :class:`~voltrl.errors.StaleAttemptError` and changes nothing.
- A failed (or timed-out) attempt is retried like an expired one, up to ``max_attempts``,
  except one failed by the agent's own code (``AttemptResult.agent_error``) of a rollout
  enqueued with ``retry_agent_errors=False``: that rollout fails at once.
- Waiting (``claim(wait_s=...)``, ``wait_for_rollouts``) wakes on changes; it never sleeps
  on a fixed interval.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence

from voltrl.errors import NotFoundError
from voltrl.resources import Resources
from voltrl.store.browse import RolloutCount, RolloutPage, RolloutQuery, counts_of, matches, page_of
from voltrl.store.lifecycle import Notifier
from voltrl.types import (
    FINISHED_ROLLOUT,
    Attempt,
    AttemptResult,
    Claim,
    LLMCall,
    Reward,
    Rollout,
    RolloutMode,
    RolloutStatus,
    Run,
    Span,
    Task,
)

DEFAULT_LEASE_S = 30.0


class Store(abc.ABC):
    """Async interface of every store (in-memory, SQL, HTTP client)."""

    # ---- runs -------------------------------------------------------------------------
    @abc.abstractmethod
    async def add_run(self, run: Run) -> Run:
        """Record a run (a ``fit`` or ``dev`` session)."""

    @abc.abstractmethod
    async def list_runs(self) -> list[Run]:
        """All runs, oldest first."""

    # ---- resources --------------------------------------------------------------------
    @abc.abstractmethod
    async def add_resources(self, resources: Resources) -> Resources:
        """Save a new resources version; returns it with ``version`` assigned (1, 2, ...)."""

    @abc.abstractmethod
    async def get_resources(self, version: int | None = None) -> Resources | None:
        """One version, or the latest when ``version`` is None; None if there is none."""

    # ---- queue ------------------------------------------------------------------------
    @abc.abstractmethod
    async def enqueue(
        self,
        tasks: Sequence[Task],
        *,
        mode: RolloutMode = "train",
        run_id: str | None = None,
        resources_version: int | None = None,
        max_attempts: int = 3,
        timeout_s: float | None = None,
        retry_agent_errors: bool = True,
    ) -> list[Rollout]:
        """Queue one rollout per task, in order. ``retry_agent_errors=False``: an attempt
        failed by the agent's own code (``AttemptResult.agent_error``) fails the rollout at
        once; other failures are still retried up to ``max_attempts``."""

    @abc.abstractmethod
    async def claim(
        self, worker_id: str, *, lease_s: float = DEFAULT_LEASE_S, wait_s: float = 0.0
    ) -> Claim | None:
        """Take the oldest queued rollout and start an attempt on it.

        Waits up to ``wait_s`` seconds for one to be queued; returns None if none came.
        """

    @abc.abstractmethod
    async def start_rollout(
        self,
        task: Task,
        *,
        worker_id: str,
        mode: RolloutMode,
        run_id: str | None = None,
        resources_version: int | None = None,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> Claim:
        """Record a rollout that the caller runs itself instead of queueing it for runners
        (APO records its optimizer's calls in one): it is created ``running``, with one attempt
        held by ``worker_id``, and is never retried; gateways record calls against it like any
        other. End it with :meth:`complete` (renew its lease with :meth:`heartbeat`)."""

    @abc.abstractmethod
    async def heartbeat(
        self, attempt_ids: Sequence[str], *, lease_s: float = DEFAULT_LEASE_S
    ) -> list[str]:
        """Renew the leases of running attempts; returns the ids that no longer own their
        rollout (expired, superseded, cancelled), which the worker should stop."""

    @abc.abstractmethod
    async def complete(self, attempt_id: str, result: AttemptResult) -> Rollout:
        """Finish an attempt with its whole report; see the module docstring."""

    @abc.abstractmethod
    async def cancel(self, rollout_id: str) -> Rollout:
        """Cancel a rollout that has not finished (its running attempt becomes stale)."""

    @abc.abstractmethod
    async def expire_leases(self) -> int:
        """End attempts whose lease ran out; returns how many."""

    @abc.abstractmethod
    async def wait_for_rollouts(
        self, rollout_ids: Sequence[str], *, timeout_s: float | None = None
    ) -> list[Rollout]:
        """Wait until every given rollout has finished or ``timeout_s`` passed; returns the
        finished ones, in the order given."""

    # ---- records ----------------------------------------------------------------------
    @abc.abstractmethod
    async def add_llm_calls(self, calls: Sequence[LLMCall]) -> list[LLMCall]:
        """Record LLM calls; assigns each a ``sequence_id`` (per attempt, counting from 0)."""

    @abc.abstractmethod
    async def add_spans(self, spans: Sequence[Span]) -> list[Span]:
        """Record spans; assigns ``sequence_id`` where missing."""

    @abc.abstractmethod
    async def add_rewards(self, rewards: Sequence[Reward]) -> None:
        """Record rewards outside an attempt report (OTLP, the HTTP API)."""

    # ---- queries ----------------------------------------------------------------------
    @abc.abstractmethod
    async def get_rollout(self, rollout_id: str) -> Rollout:
        """One rollout; raises :class:`~voltrl.errors.NotFoundError`."""

    @abc.abstractmethod
    async def query_rollouts(
        self,
        *,
        run_id: str | None = None,
        status: RolloutStatus | Sequence[RolloutStatus] | None = None,
        mode: RolloutMode | None = None,
        since: float | None = None,
        until: float | None = None,
        rollout_ids: Sequence[str] | None = None,
        limit: int | None = None,
    ) -> list[Rollout]:
        """Rollouts matching every given filter (``since``/``until`` bound ``created_at``),
        oldest first."""

    @abc.abstractmethod
    async def get_attempts(self, rollout_id: str) -> list[Attempt]:
        """A rollout's attempts, first to last."""

    @abc.abstractmethod
    async def get_llm_calls(self, rollout_id: str, attempt_id: str | None = None) -> list[LLMCall]:
        """A rollout's LLM calls (of one attempt when given), by sequence id."""

    @abc.abstractmethod
    async def get_spans(self, rollout_id: str, attempt_id: str | None = None) -> list[Span]:
        """A rollout's spans (of one attempt when given), by sequence id."""

    @abc.abstractmethod
    async def get_rewards(self, rollout_id: str, attempt_id: str | None = None) -> list[Reward]:
        """A rollout's rewards (of one attempt when given), oldest first."""

    # ---- browsing (the dashboard) --------------------------------------------------------
    async def browse_rollouts(self, query: RolloutQuery) -> RolloutPage:
        """One page of the rollouts matching ``query`` (see :mod:`voltrl.store.browse`).

        This default reads every rollout of the run (and, to filter by agent, their calls);
        the SQL store and the HTTP client answer it in one query."""
        pool = await self.query_rollouts(run_id=query.run_id, status=query.status or None)
        found = []
        for r in pool:
            if not matches(r, query.model_copy(update={"agent": None})):
                continue
            if query.agent is not None:
                agents = [c.agent_name for c in await self.get_llm_calls(r.rollout_id)]
                if query.agent not in agents:
                    continue
            found.append(r)
        return page_of(found, query)

    async def rollout_counts(self, run_id: str) -> list[RolloutCount]:
        """A run's rollouts counted by mode, resources version and status, with reward sums
        (see :func:`voltrl.store.browse.counts_of`)."""
        return counts_of(await self.query_rollouts(run_id=run_id))

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and files."""


class LocalStore(Store):
    """A store whose data lives in this process: adds change-driven waiting on top of
    ``_claim_now``/``_next_lease_expiry`` that each implementation provides."""

    def __init__(self) -> None:
        self._changed = Notifier()

    @abc.abstractmethod
    async def _claim_now(self, worker_id: str, lease_s: float) -> Claim | None:
        """Claim without waiting."""

    @abc.abstractmethod
    async def _next_lease_expiry(self) -> float | None:
        """When the earliest running lease runs out, or None when none is running."""

    async def _sleep_until_change(self, deadline: float | None, seen: int) -> None:
        """Sleep until the store changes (after version ``seen`` of its notifier), the
        deadline, or the next lease expiry."""
        wake = deadline
        expiry = await self._next_lease_expiry()
        if expiry is not None:
            wake = expiry if wake is None else min(wake, expiry)
        await self._changed.wait(
            None if wake is None else max(0.0, wake - time.time()) + 0.005, seen
        )

    async def claim(
        self, worker_id: str, *, lease_s: float = DEFAULT_LEASE_S, wait_s: float = 0.0
    ) -> Claim | None:
        deadline = time.time() + wait_s
        while True:
            seen = self._changed.version
            await self.expire_leases()
            claim = await self._claim_now(worker_id, lease_s)
            if claim is not None or time.time() >= deadline:
                return claim
            await self._sleep_until_change(deadline, seen)

    async def wait_for_rollouts(
        self, rollout_ids: Sequence[str], *, timeout_s: float | None = None
    ) -> list[Rollout]:
        deadline = None if timeout_s is None else time.time() + timeout_s
        ids = list(rollout_ids)
        pending, done = set(ids), {}
        found = {r.rollout_id for r in await self.query_rollouts(rollout_ids=ids)} if ids else set()
        if missing := pending - found:
            raise NotFoundError(f"no rollouts with ids {sorted(missing)}")
        while True:
            seen = self._changed.version
            await self.expire_leases()
            finished = list(FINISHED_ROLLOUT)  # only rows that changed state are read back
            if pending:
                rows = await self.query_rollouts(rollout_ids=list(pending), status=finished)
            else:
                rows = []
            for r in rows:
                done[r.rollout_id] = r
                pending.discard(r.rollout_id)
            if not pending or (deadline is not None and time.time() >= deadline):
                return [done[i] for i in ids if i in done]
            await self._sleep_until_change(deadline, seen)
