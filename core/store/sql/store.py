"""SQL store: durable rollouts, attempts and records in SQLite (default) or PostgreSQL.

One implementation serves both: what differs between the databases is a
:class:`~voltrl.store.sql.dialects.Dialect`, every statement is written once in
:mod:`~voltrl.store.sql.statements`, the tables in :mod:`~voltrl.store.sql.schema`, and the
connection with its transactions is a :class:`~voltrl.store.sql.connection.Database`. Rows
hold the model as JSON next to the columns the store filters on, always written together from
the model; the state machine is :mod:`voltrl.store.lifecycle`'s, so the semantics are those
of the in-memory store.

Each operation is one transaction (two for those that first end due leases) that never awaits
in the middle, so it is atomic for every caller. Methods are written as plain blocking code;
``_db_call`` makes them the async methods of the store interface:

- SQLite calls are sub-millisecond, so they run inline on the event loop. WAL with
  ``synchronous=NORMAL``: a committed change survives the process being killed, and other
  processes (``voltrl runs`` reading while a trainer writes) can open the same file.
- PostgreSQL calls wait on a socket, so each store object sends them from one worker thread
  of its own, over one connection, in the order they were made: the event loop never waits
  on the network, and the code stays the same blocking code as SQLite's (psycopg's async
  connection would have split the implementation in two). Claims lock their row with
  ``FOR NO KEY UPDATE SKIP LOCKED`` and other changes lock the rows they read, so any
  number of processes can share one database; a transaction that PostgreSQL aborts to break
  a deadlock is run again. An operation whose caller is cancelled still finishes on the
  thread (a claim nobody receives is retried when its lease runs out). A lost connection is
  opened again on the next call.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from voltrl._redact import redact
from voltrl.errors import NotFoundError, StaleAttemptError, StoreError
from voltrl.resources import Resources
from voltrl.store.base import DEFAULT_LEASE_S, LocalStore
from voltrl.store.browse import (
    COUNT_CAP,
    RolloutCount,
    RolloutPage,
    RolloutQuery,
    count_order,
)
from voltrl.store.lifecycle import apply_result, expire_attempt, started_rollout
from voltrl.store.sql.connection import Database, sqlite_path
from voltrl.store.sql.dialects import (
    POSTGRES,
    SQLITE,
    Connection,
    Dialect,
    is_postgres_url,
    postgres_location,
)
from voltrl.store.sql.schema import ensure_schema
from voltrl.store.sql.statements import Statements, attempt_row, rollout_row
from voltrl.types import (
    Attempt,
    AttemptResult,
    Claim,
    LLMCall,
    Model,
    Reward,
    Rollout,
    RolloutMode,
    RolloutStatus,
    Run,
    Span,
    Task,
    now,
)

M = TypeVar("M", bound=Model)
Numbered = TypeVar("Numbered", LLMCall, Span)
T = TypeVar("T", Span, Reward)
P = ParamSpec("P")
R = TypeVar("R")
DEADLOCK_RETRIES = 4  # times a PostgreSQL transaction aborted to break a deadlock runs again
DEADLOCK_BACKOFF_S = 0.02  # before the first of them; doubled for each next one


def _tagged(records: Sequence[T], rollout_id: str, attempt_id: str) -> list[T]:
    """``records`` of an attempt's report, each tagged with the attempt (copied only when a
    record names another rollout or attempt: a runner's records already name their own)."""
    tag = {"rollout_id": rollout_id, "attempt_id": attempt_id}
    return [
        rec
        if (rec.rollout_id, rec.attempt_id) == (rollout_id, attempt_id)
        else rec.model_copy(update=tag)
        for rec in records
    ]


def _db_call(
    method: Callable[Concatenate[SQLStore, P], R],
) -> Callable[Concatenate[SQLStore, P], Coroutine[Any, Any, R]]:
    """The async store method for a blocking one: run inline (SQLite), or on the store's
    worker thread (PostgreSQL), again when PostgreSQL aborted it to break a deadlock."""

    @functools.wraps(method)
    async def call(self: SQLStore, *args: P.args, **kwargs: P.kwargs) -> R:
        executor = self._executor
        if executor is None:
            result = method(self, *args, **kwargs)
            group = self._db.group
            if group is not None:  # answer once what the method wrote is committed
                await Database.group_committed(group)
            return result
        run, loop = functools.partial(method, self, *args, **kwargs), asyncio.get_running_loop()
        for i in range(DEADLOCK_RETRIES):
            try:
                return await loop.run_in_executor(executor, run)
            except StoreError as e:
                if not self._dialect.retryable(e.__cause__):
                    raise
            await asyncio.sleep(DEADLOCK_BACKOFF_S * 2**i)  # let the other transaction finish
        return await loop.run_in_executor(executor, run)

    return call


class SQLStore(LocalStore):
    """The store in a SQL database: a SQLite file (``SQLStore("runs/store.sqlite")`` or
    ``SQLStore("sqlite:///runs/store.sqlite")``) or a PostgreSQL database
    (``SQLStore("postgresql://user:password@host:5432/voltrl")``, needs the ``postgres``
    extra). The file and the schema are created on open; several store objects and
    processes may open the same database at once. ``threaded``: run SQLite calls on a worker
    thread too, as PostgreSQL's are (a reader beside a busy event loop, like the dashboard's).
    A version 1 store (from before the browsing columns) is upgraded on open.
    ``read_only``: a reader's store (``voltrl show``, the dashboard, SFT's sources), which
    writes nothing to the database, not even its schema or a checkpoint, and refuses writes
    with a :class:`~voltrl.errors.StoreError`; the database must exist with this version's
    schema."""

    def __init__(
        self, path_or_url: str | Path, *, threaded: bool = False, read_only: bool = False
    ) -> None:
        super().__init__()
        text = str(path_or_url)
        self.path: Path | None
        """The SQLite file; None for PostgreSQL."""
        if is_postgres_url(text):
            self._dialect: Dialect = POSTGRES
            self.path, target, self.location = None, text, redact(text)
            notifier_key = f"postgresql://{postgres_location(text)}"
        else:
            self._dialect = SQLITE
            self.path = sqlite_path(path_or_url)
            target = self.location = str(self.path)
            notifier_key = str(self.path.resolve())
        self._sql = Statements(self._dialect)
        self._db = Database(self._dialect, target, self.location, notifier_key, read_only=read_only)
        try:
            ensure_schema(self._db)
        except BaseException:
            self._db.close()
            raise
        self._executor: ThreadPoolExecutor | None = None
        if self._dialect.in_thread or threaded:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="voltrl-store")
        self._changed = self._db.changed
        self._db.watch()

    def __repr__(self) -> str:
        return f"SQLStore({self.location!r})"

    def group_commits(self) -> None:
        """Commit the writes of concurrent calls together (SQLite only); see
        :meth:`Database.group_commits <voltrl.store.sql.connection.Database.group_commits>`.
        For a store used from one event loop only, as ``voltrl serve`` uses its own."""
        self._db.group_commits()

    async def close(self) -> None:
        self._db.commit_group()  # what calls wrote before the close is kept
        executor, self._executor = self._executor, None
        if executor is None:
            self._db.close()
            return
        await asyncio.get_running_loop().run_in_executor(executor, self._db.close)
        executor.shutdown(wait=False)

    # ---- row helpers (inside a transaction) ---------------------------------------------
    @staticmethod
    def _one(conn: Connection, sql: str, params: tuple, cls: type[M]) -> M | None:
        row = conn.execute(sql, params).fetchone()
        return None if row is None else cls.model_validate_json(row[0])

    @staticmethod
    def _all(conn: Connection, sql: str, params: tuple, cls: type[M]) -> list[M]:
        return [cls.model_validate_json(row[0]) for row in conn.execute(sql, params)]

    def _bump(self, conn: Connection, name: str, n: int) -> int:
        """Add ``n`` to a named counter; returns its new value."""
        return int(conn.execute(self._sql.bump, (name, n)).fetchone()[0])

    def _update_rollout(self, conn: Connection, r: Rollout) -> None:
        """Write a changed rollout; one that became queued goes to the back of the queue."""
        queue_seq = self._bump(conn, "queue", 1) if r.status == "queued" else None
        conn.execute(self._sql.update_rollout, (*rollout_row(r, queue_seq)[-8:], r.rollout_id))

    def _update_attempt(self, conn: Connection, a: Attempt) -> None:
        conn.execute(self._sql.update_attempt, (*attempt_row(a)[-3:], a.attempt_id))

    def _require_rollouts(self, conn: Connection, rollout_ids: Iterable[str]) -> None:
        for rollout_id in dict.fromkeys(rollout_ids):
            if conn.execute(self._sql.rollout_exists, (rollout_id,)).fetchone() is None:
                raise NotFoundError(f"no rollout with id {rollout_id!r}")

    def _with_sequence_ids(
        self, conn: Connection, kind: str, items: Sequence[Numbered], *, keep: bool
    ) -> list[Numbered]:
        """Give each item the next ``sequence_id`` of its attempt (counting from 0); with
        ``keep``, items that already have one keep it and take no number."""
        todo = [i for i, item in enumerate(items) if not (keep and item.sequence_id is not None)]
        counts = Counter((items[i].rollout_id, items[i].attempt_id) for i in todo)
        nxt = {k: self._bump(conn, f"{kind}:{k[0]}:{k[1]}", n) - n for k, n in counts.items()}
        out = list(items)
        for i in todo:
            key = (items[i].rollout_id, items[i].attempt_id)
            out[i] = items[i].model_copy(update={"sequence_id": nxt[key]})
            nxt[key] += 1
        return out

    def _insert_spans(self, conn: Connection, spans: Sequence[Span]) -> list[Span]:
        spans = self._with_sequence_ids(conn, "span", spans, keep=True)
        conn.cursor().executemany(
            self._sql.insert_span,
            [(s.rollout_id, s.attempt_id, s.sequence_id, s.model_dump_json()) for s in spans],
        )
        return spans

    def _insert_rewards(self, conn: Connection, rewards: Sequence[Reward]) -> None:
        conn.cursor().executemany(
            self._sql.insert_reward,
            [(rw.rollout_id, rw.attempt_id, rw.model_dump_json()) for rw in rewards],
        )

    def _expire_due(self, conn: Connection, t: float) -> int:
        due = self._all(conn, self._sql.due_attempts, (t,), Attempt)
        for a in due:
            r = self._one(conn, self._sql.get_rollout, (a.rollout_id,), Rollout)
            assert r is not None  # attempts reference rollouts
            expire_attempt(r, a)
            self._update_attempt(conn, a)
            self._update_rollout(conn, r)
        return len(due)

    # ---- runs and resources -------------------------------------------------------------
    @_db_call
    def add_run(self, run: Run) -> Run:
        with self._db.write() as conn:
            conn.execute(self._sql.upsert_run, (run.run_id, run.created_at, run.model_dump_json()))
        return run

    @_db_call
    def list_runs(self) -> list[Run]:
        with self._db.read() as conn:
            return self._all(conn, self._sql.list_runs, (), Run)

    @_db_call
    def add_resources(self, resources: Resources) -> Resources:
        with self._db.write() as conn:
            self._bump(conn, "resources", 1)  # a row lock: concurrent writers take turns
            version = int(conn.execute(self._sql.last_resources_version).fetchone()[0]) + 1
            saved = resources.model_copy(update={"version": version}, deep=True)
            conn.execute(
                self._sql.insert_resources, (version, saved.created_at, saved.model_dump_json())
            )
        self._db.notify()
        return saved

    @_db_call
    def get_resources(self, version: int | None = None) -> Resources | None:
        with self._db.read() as conn:
            if version is None:
                return self._one(conn, self._sql.latest_resources, (), Resources)
            return self._one(conn, self._sql.get_resources, (version,), Resources)

    # ---- queue --------------------------------------------------------------------------
    @_db_call
    def enqueue(
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
        settings = {"mode": mode, "run_id": run_id, "resources_version": resources_version}
        settings |= {"max_attempts": max_attempts, "timeout_s": timeout_s}
        settings |= {"retry_agent_errors": retry_agent_errors}
        rollouts = [Rollout(task=task, **settings) for task in tasks]
        if not rollouts:
            return []
        with self._db.write() as conn:
            first = self._bump(conn, "queue", len(rollouts)) - len(rollouts) + 1
            rows = [rollout_row(r, first + i) for i, r in enumerate(rollouts)]
            conn.cursor().executemany(self._sql.insert_rollout, rows)
        self._db.notify()
        return rollouts

    @_db_call
    def _claim_now(self, worker_id: str, lease_s: float) -> Claim | None:
        with self._db.write() as conn:
            r = self._one(conn, self._sql.next_queued, (), Rollout)
            if r is None:
                return None
            r.attempt_count += 1
            r.status = "running"
            r.started_at = r.started_at or now()
            a = Attempt(
                rollout_id=r.rollout_id,
                index=r.attempt_count,
                worker_id=worker_id,
                lease_expires_at=now() + lease_s,
            )
            self._update_rollout(conn, r)
            conn.execute(self._sql.insert_attempt, (a.attempt_id, *attempt_row(a)))
        return Claim(rollout=r, attempt=a)

    @_db_call
    def start_rollout(
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
        a = claim.attempt
        with self._db.write() as conn:
            conn.execute(self._sql.insert_rollout, rollout_row(claim.rollout, None))
            conn.execute(self._sql.insert_attempt, (a.attempt_id, *attempt_row(a)))
        self._db.notify()
        return claim

    @_db_call
    def _next_lease_expiry(self) -> float | None:
        with self._db.read() as conn:
            return conn.execute(self._sql.next_expiry).fetchone()[0]

    @_db_call
    def heartbeat(
        self, attempt_ids: Sequence[str], *, lease_s: float = DEFAULT_LEASE_S
    ) -> list[str]:
        self._expire_leases()
        if not attempt_ids:
            return []
        stale: list[str] = []
        with self._db.write() as conn:
            t = now()
            for attempt_id in attempt_ids:
                a = self._one(conn, self._sql.get_attempt, (attempt_id,), Attempt)
                if a is None or a.status != "running":
                    stale.append(attempt_id)
                    continue
                a.heartbeat_at = t
                a.lease_expires_at = t + lease_s
                self._update_attempt(conn, a)
        return stale

    @_db_call
    def complete(self, attempt_id: str, result: AttemptResult) -> Rollout:
        self._expire_leases()
        with self._db.write() as conn:
            a = self._one(conn, self._sql.get_attempt, (attempt_id,), Attempt)
            if a is None:
                raise StaleAttemptError(f"unknown attempt {attempt_id}")
            r = self._one(conn, self._sql.get_rollout, (a.rollout_id,), Rollout)
            assert r is not None  # attempts reference rollouts
            if a.status != "running":
                raise StaleAttemptError(
                    f"attempt {attempt_id} of rollout {a.rollout_id} no longer owns it "
                    f"(attempt status {a.status}, rollout status {r.status})"
                )
            self._insert_spans(conn, _tagged(result.spans, r.rollout_id, attempt_id))
            self._insert_rewards(conn, _tagged(result.rewards, r.rollout_id, attempt_id))
            apply_result(r, a, result)
            self._update_attempt(conn, a)
            self._update_rollout(conn, r)
        self._db.notify()
        return r

    @_db_call
    def cancel(self, rollout_id: str) -> Rollout:
        with self._db.write() as conn:
            r = self._one(conn, self._sql.get_rollout, (rollout_id,), Rollout)
            if r is None:
                raise NotFoundError(f"no rollout with id {rollout_id!r}")
            a = self._one(conn, self._sql.running_attempt_of, (rollout_id,), Attempt)
            if r.finished:
                return r
            if a is not None:
                a.status, a.finished_at = "cancelled", now()
                self._update_attempt(conn, a)
            r.status, r.finished_at, r.error = "cancelled", now(), "cancelled"
            self._update_rollout(conn, r)
        self._db.notify()
        return r

    @_db_call
    def expire_leases(self) -> int:
        """End attempts whose lease ran out."""
        return self._expire_leases()

    def _expire_leases(self) -> int:
        t = time.time()
        with self._db.read() as conn:
            if conn.execute(self._sql.any_due, (t,)).fetchone() is None:
                return 0
        with self._db.write() as conn:
            n = self._expire_due(conn, t)
        if n:
            self._db.notify()
        return n

    # ---- records ------------------------------------------------------------------------
    @_db_call
    def add_llm_calls(self, calls: Sequence[LLMCall]) -> list[LLMCall]:
        with self._db.write() as conn:
            self._require_rollouts(conn, (c.rollout_id for c in calls))
            calls = self._with_sequence_ids(conn, "call", calls, keep=False)
            conn.cursor().executemany(
                self._sql.insert_call,
                [(c.rollout_id, c.attempt_id, c.sequence_id, c.model_dump_json()) for c in calls],
            )
        return list(calls)

    @_db_call
    def add_spans(self, spans: Sequence[Span]) -> list[Span]:
        with self._db.write() as conn:
            self._require_rollouts(conn, (s.rollout_id for s in spans))
            return self._insert_spans(conn, spans)

    @_db_call
    def add_rewards(self, rewards: Sequence[Reward]) -> None:
        with self._db.write() as conn:
            self._require_rollouts(conn, (rw.rollout_id for rw in rewards))
            self._insert_rewards(conn, rewards)

    # ---- queries ------------------------------------------------------------------------
    @_db_call
    def get_rollout(self, rollout_id: str) -> Rollout:
        with self._db.read() as conn:
            r = self._one(conn, self._sql.read_rollout, (rollout_id,), Rollout)
        if r is None:
            raise NotFoundError(f"no rollout with id {rollout_id!r}")
        return r

    @_db_call
    def query_rollouts(
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
        statuses = [status] if isinstance(status, str) else list(dict.fromkeys(status or ()))
        filters = {"run_id": run_id, "status": statuses, "mode": mode, "since": since}
        filters["until"] = until
        if rollout_ids is None:
            chunks: list[list[str] | None] = [None]
        else:
            ids = list(dict.fromkeys(rollout_ids))
            size = self._dialect.max_params - len(statuses) - 5
            chunks = [ids[i : i + size] for i in range(0, len(ids), size)]
        rows: list[tuple[float, int, str]] = []
        with self._db.read() as conn:
            for chunk in chunks:
                sql, params = self._sql.query_rollouts({**filters, "rollout_ids": chunk}, limit)
                rows.extend(conn.execute(sql, params))
        if len(chunks) > 1:
            rows.sort(key=lambda row: (row[0], row[1]))
            rows = rows[:limit] if limit is not None else rows
        return [Rollout.model_validate_json(row[2]) for row in rows]

    @_db_call
    def browse_rollouts(self, query: RolloutQuery) -> RolloutPage:
        page, count, params = self._sql.browse_rollouts(query)
        with self._db.read() as conn:
            rows = conn.execute(page, [*params, query.limit, query.offset]).fetchall()
            total = conn.execute(count, [*params, COUNT_CAP + 1]).fetchone()[0]
        return RolloutPage(
            rollouts=[Rollout.model_validate_json(row[0]) for row in rows],
            total=min(total, COUNT_CAP),
            total_capped=total > COUNT_CAP,
        )

    @_db_call
    def rollout_counts(self, run_id: str) -> list[RolloutCount]:
        with self._db.read() as conn:
            rows = conn.execute(self._sql.rollout_counts(), (run_id,)).fetchall()
        counts = [
            RolloutCount(
                mode=mode,
                resources_version=None if version is None else int(version),
                status=status,
                count=n,
                rewarded=rewarded or 0,
                reward_sum=total or 0.0,
                reward_sq_sum=squares or 0.0,
            )
            for mode, version, status, n, rewarded, total, squares in rows
        ]
        return sorted(counts, key=count_order)

    @_db_call
    def get_attempts(self, rollout_id: str) -> list[Attempt]:
        with self._db.read() as conn:
            self._require_rollouts(conn, (rollout_id,))
            return self._all(conn, self._sql.attempts_of, (rollout_id,), Attempt)

    def _records(
        self, table: str, cls: type[M], rollout_id: str, attempt_id: str | None
    ) -> list[M]:
        with self._db.read() as conn:
            self._require_rollouts(conn, (rollout_id,))
            if attempt_id is None:
                return self._all(conn, self._sql.records_of[table, False], (rollout_id,), cls)
            sql = self._sql.records_of[table, True]
            return self._all(conn, sql, (rollout_id, attempt_id), cls)

    @_db_call
    def get_llm_calls(self, rollout_id: str, attempt_id: str | None = None) -> list[LLMCall]:
        return self._records("llm_calls", LLMCall, rollout_id, attempt_id)

    @_db_call
    def get_spans(self, rollout_id: str, attempt_id: str | None = None) -> list[Span]:
        return self._records("spans", Span, rollout_id, attempt_id)

    @_db_call
    def get_rewards(self, rollout_id: str, attempt_id: str | None = None) -> list[Reward]:
        return self._records("rewards", Reward, rollout_id, attempt_id)
