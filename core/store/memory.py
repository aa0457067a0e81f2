"""In-memory store: fast and simple, for tests and throwaway runs. Nothing survives the process."""

from __future__ import annotations

import pickle
import time
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from typing import TypeVar

from voltrl.errors import NotFoundError, StaleAttemptError
from voltrl.resources import Resources
from voltrl.store.base import DEFAULT_LEASE_S, LocalStore
from voltrl.store.lifecycle import apply_result, expire_attempt, started_rollout
from voltrl.types import (
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
    now,
)

R = TypeVar("R")


def _copied(record: R) -> R:
    """A deep copy of a record, so neither the store nor its caller sees the other's changes.
    Through pickle: several times faster than ``model_copy(deep=True)`` on calls holding
    thousands of token ids."""
    return pickle.loads(pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL))


class InMemoryStore(LocalStore):
    """Every record in dicts. All methods run on the caller's event loop without awaiting in
    the middle of a change, so each operation is atomic."""

    def __init__(self) -> None:
        super().__init__()
        self._runs: dict[str, Run] = {}
        self._resources: list[Resources] = []
        self._rollouts: dict[str, Rollout] = {}
        self._queue: OrderedDict[str, None] = OrderedDict()
        self._attempts: dict[str, Attempt] = {}
        self._attempts_of: dict[str, list[str]] = defaultdict(list)
        self._running: dict[str, str] = {}  # rollout_id -> attempt_id of its running attempt
        self._calls: dict[str, list[LLMCall]] = defaultdict(list)
        self._spans: dict[str, list[Span]] = defaultdict(list)
        self._rewards: dict[str, list[Reward]] = defaultdict(list)
        self._seq: dict[tuple[str, str], int] = defaultdict(int)

    # ---- runs and resources -----------------------------------------------------------
    async def add_run(self, run: Run) -> Run:
        self._runs[run.run_id] = _copied(run)
        return run

    async def list_runs(self) -> list[Run]:
        return sorted((r.model_copy() for r in self._runs.values()), key=lambda r: r.created_at)

    async def add_resources(self, resources: Resources) -> Resources:
        # Stored as every store stores them: serialized, so secrets (API keys) are left out.
        saved = Resources.model_validate(
            {**resources.model_dump(), "version": len(self._resources) + 1}
        )
        self._resources.append(saved)
        self._changed.notify()
        return _copied(saved)

    async def get_resources(self, version: int | None = None) -> Resources | None:
        if not self._resources:
            return None
        if version is None:
            return _copied(self._resources[-1])
        if not 1 <= version <= len(self._resources):
            return None
        return _copied(self._resources[version - 1])

    # ---- queue ------------------------------------------------------------------------
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
        out = []
        for task in tasks:
            r = Rollout(
                task=task,
                mode=mode,
                run_id=run_id,
                resources_version=resources_version,
                max_attempts=max_attempts,
                retry_agent_errors=retry_agent_errors,
                timeout_s=timeout_s,
            )
            self._rollouts[r.rollout_id] = r
            self._queue[r.rollout_id] = None
            out.append(_copied(r))
        self._changed.notify()
        return out

    async def _claim_now(self, worker_id: str, lease_s: float) -> Claim | None:
        if not self._queue:
            return None
        rollout_id, _ = self._queue.popitem(last=False)
        r = self._rollouts[rollout_id]
        r.attempt_count += 1
        r.status = "running"
        r.started_at = r.started_at or now()
        a = Attempt(
            rollout_id=rollout_id,
            index=r.attempt_count,
            worker_id=worker_id,
            lease_expires_at=now() + lease_s,
        )
        self._attempts[a.attempt_id] = a
        self._attempts_of[rollout_id].append(a.attempt_id)
        self._running[rollout_id] = a.attempt_id
        return Claim(rollout=_copied(r), attempt=_copied(a))

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
        claim = started_rollout(
            task,
            worker_id=worker_id,
            mode=mode,
            run_id=run_id,
            resources_version=resources_version,
            lease_s=lease_s,
        )
        r, a = claim.rollout, claim.attempt
        self._rollouts[r.rollout_id] = _copied(r)
        self._attempts[a.attempt_id] = _copied(a)
        self._attempts_of[r.rollout_id].append(a.attempt_id)
        self._running[r.rollout_id] = a.attempt_id
        self._changed.notify()
        return claim

    async def _next_lease_expiry(self) -> float | None:
        return min(
            (self._attempts[a].lease_expires_at for a in self._running.values()), default=None
        )

    async def heartbeat(
        self, attempt_ids: Sequence[str], *, lease_s: float = DEFAULT_LEASE_S
    ) -> list[str]:
        await self.expire_leases()
        stale, t = [], now()
        for aid in attempt_ids:
            a = self._attempts.get(aid)
            if a is None or self._running.get(a.rollout_id) != aid:
                stale.append(aid)
                continue
            a.heartbeat_at = t
            a.lease_expires_at = t + lease_s
        return stale

    def _owned(self, attempt_id: str) -> tuple[Rollout, Attempt]:
        a = self._attempts.get(attempt_id)
        if a is None:
            raise StaleAttemptError(f"unknown attempt {attempt_id}")
        if self._running.get(a.rollout_id) != attempt_id:
            raise StaleAttemptError(
                f"attempt {attempt_id} of rollout {a.rollout_id} no longer owns it "
                f"(attempt status {a.status}, rollout status {self._rollouts[a.rollout_id].status})"
            )
        return self._rollouts[a.rollout_id], a

    async def complete(self, attempt_id: str, result: AttemptResult) -> Rollout:
        await self.expire_leases()
        r, a = self._owned(attempt_id)
        for span in result.spans:
            self._add_span(
                span.model_copy(update={"rollout_id": r.rollout_id, "attempt_id": attempt_id})
            )
        self._rewards[r.rollout_id].extend(
            rw.model_copy(update={"rollout_id": r.rollout_id, "attempt_id": attempt_id})
            for rw in result.rewards
        )
        apply_result(r, a, result)
        del self._running[r.rollout_id]
        if r.status == "queued":
            self._queue[r.rollout_id] = None
        self._changed.notify()
        return _copied(r)

    async def cancel(self, rollout_id: str) -> Rollout:
        r = self._get(rollout_id)
        if r.finished:
            return _copied(r)
        if (aid := self._running.pop(rollout_id, None)) is not None:
            a = self._attempts[aid]
            a.status, a.finished_at = "cancelled", now()
        self._queue.pop(rollout_id, None)
        r.status, r.finished_at, r.error = "cancelled", now(), "cancelled"
        self._changed.notify()
        return _copied(r)

    async def expire_leases(self) -> int:
        t, n = time.time(), 0
        for rollout_id, aid in list(self._running.items()):
            a = self._attempts[aid]
            if a.lease_expires_at > t:
                continue
            r = self._rollouts[rollout_id]
            expire_attempt(r, a)
            del self._running[rollout_id]
            if r.status == "queued":
                self._queue[rollout_id] = None
            n += 1
        if n:
            self._changed.notify()
        return n

    # ---- records ----------------------------------------------------------------------
    def _next_seq(self, rollout_id: str, attempt_id: str, kind: str) -> int:
        key = (f"{kind}:{rollout_id}", attempt_id)
        seq = self._seq[key]
        self._seq[key] = seq + 1
        return seq

    async def add_llm_calls(self, calls: Sequence[LLMCall]) -> list[LLMCall]:
        for c in calls:
            self._get(c.rollout_id)
        out = []
        for c in calls:
            c = c.model_copy(
                update={"sequence_id": self._next_seq(c.rollout_id, c.attempt_id, "call")}
            )
            self._calls[c.rollout_id].append(c)
            out.append(_copied(c))
        return out

    def _add_span(self, span: Span) -> Span:
        if span.sequence_id is None:
            span = span.model_copy(
                update={"sequence_id": self._next_seq(span.rollout_id, span.attempt_id, "span")}
            )
        self._spans[span.rollout_id].append(span)
        return span

    async def add_spans(self, spans: Sequence[Span]) -> list[Span]:
        for s in spans:
            self._get(s.rollout_id)
        return [_copied(self._add_span(s)) for s in spans]

    async def add_rewards(self, rewards: Sequence[Reward]) -> None:
        for rw in rewards:
            self._get(rw.rollout_id)
        for rw in rewards:
            self._rewards[rw.rollout_id].append(_copied(rw))

    # ---- queries ----------------------------------------------------------------------
    def _get(self, rollout_id: str) -> Rollout:
        try:
            return self._rollouts[rollout_id]
        except KeyError:
            raise NotFoundError(f"no rollout with id {rollout_id!r}") from None

    async def get_rollout(self, rollout_id: str) -> Rollout:
        return _copied(self._get(rollout_id))

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
        statuses = {status} if isinstance(status, str) else set(status) if status else None
        pool = (
            (self._rollouts[i] for i in dict.fromkeys(rollout_ids) if i in self._rollouts)
            if rollout_ids is not None
            else self._rollouts.values()
        )
        out = [
            _copied(r)
            for r in pool
            if (run_id is None or r.run_id == run_id)
            and (statuses is None or r.status in statuses)
            and (mode is None or r.mode == mode)
            and (since is None or r.created_at >= since)
            and (until is None or r.created_at < until)
        ]
        out.sort(key=lambda r: r.created_at)
        return out[:limit] if limit is not None else out

    async def get_attempts(self, rollout_id: str) -> list[Attempt]:
        self._get(rollout_id)
        return [_copied(self._attempts[a]) for a in self._attempts_of[rollout_id]]

    @staticmethod
    def _of(items: list, attempt_id: str | None) -> list:
        return [_copied(x) for x in items if attempt_id is None or x.attempt_id == attempt_id]

    async def get_llm_calls(self, rollout_id: str, attempt_id: str | None = None) -> list[LLMCall]:
        self._get(rollout_id)
        return self._of(self._calls[rollout_id], attempt_id)

    async def get_spans(self, rollout_id: str, attempt_id: str | None = None) -> list[Span]:
        self._get(rollout_id)
        return self._of(self._spans[rollout_id], attempt_id)

    async def get_rewards(self, rollout_id: str, attempt_id: str | None = None) -> list[Reward]:
        self._get(rollout_id)
        return self._of(self._rewards[rollout_id], attempt_id)
