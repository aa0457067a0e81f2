"""SQL store: durable rollouts, attempts and records in a database; SQLite by default.

One implementation serves every SQL database. What differs between databases (placeholders,
how a write transaction starts, how the claim query locks its row, column types, connection
setup) lives in a small :class:`Dialect`; every
statement is written once, in :class:`Statements`. Only SQLite is wired up today.

Rows hold the pydantic model as JSON in ``data``, next to real, indexed columns for what the
store filters and orders on (ids, status, mode, times, lease expiry, queue position). Both are
always written together from the model, and the state machine is the one in
:mod:`voltrl.store.lifecycle`, so the semantics are those of the in-memory store.

SQLite runs in WAL mode with ``synchronous=NORMAL``: a committed change survives the process
being killed, and other processes (``voltrl runs`` reading while a trainer writes) can open the
same file. Calls are sub-millisecond, so they run inline on the event loop; each operation is
one transaction that never awaits in the middle, so it is atomic for every caller, in this
process (a lock guards the connection) or another (``BEGIN IMMEDIATE``).

Waiters wake on changes made through store objects of this process (all objects on one file
share a notifier). The process that serves the store is its one writer in a VoltRL run; a
commit by another process on the same file is seen at the waiter's next wake-up (a change
here, a lease expiry or its deadline), not at once.
"""

from __future__ import annotations

import sqlite3
import threading
import time
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from voltrl.errors import NotFoundError, StaleAttemptError, StoreError
from voltrl.resources import Resources
from voltrl.store.base import DEFAULT_LEASE_S, LocalStore
from voltrl.store.lifecycle import Notifier, apply_result, expire_attempt
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

SCHEMA_VERSION = 1
M = TypeVar("M", bound=Model)
Numbered = TypeVar("Numbered", LLMCall, Span)


@dataclass(frozen=True)
class Dialect:
    """What differs between SQL databases; statements are rendered through it once."""

    name: str
    placeholder: str  # "?" for sqlite3, "%s" for psycopg
    begin_write: str  # starts a transaction that will write
    claim_lock: str  # ends the claim query; PostgreSQL: " FOR UPDATE SKIP LOCKED"
    row_lock: str  # ends reads of rows about to change; PostgreSQL: " FOR UPDATE"
    id_column: str  # an auto-incrementing integer primary key
    float_type: str
    setup: tuple[str, ...]  # run on each new connection
    max_params: int  # most ids in one IN (...) list

    def render(self, sql: str) -> str:
        """A statement written with ``?`` placeholders and ``{tokens}``, for this database."""
        sql = sql.format(
            id=self.id_column,
            float=self.float_type,
            claim_lock=self.claim_lock,
            row_lock=self.row_lock,
        )
        return sql if self.placeholder == "?" else sql.replace("?", self.placeholder)


SQLITE = Dialect(
    name="SQLite",
    placeholder="?",
    begin_write="BEGIN IMMEDIATE",  # take the write lock first: no stale read, no deadlock
    claim_lock="",
    row_lock="",
    id_column="INTEGER PRIMARY KEY",
    float_type="REAL",
    setup=(
        "PRAGMA busy_timeout=10000",  # first: the next ones may wait for another process
        "PRAGMA journal_mode=WAL",
        "PRAGMA synchronous=NORMAL",
        "PRAGMA foreign_keys=ON",
    ),
    max_params=900,
)


class Statements:
    """Every SQL statement the store runs, written once with ``?`` placeholders and
    ``{tokens}``; an instance holds them rendered for one dialect."""

    schema = (
        "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)",
        "CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
        "CREATE TABLE IF NOT EXISTS runs (seq {id}, run_id TEXT NOT NULL UNIQUE, "
        "created_at {float} NOT NULL, data TEXT NOT NULL)",
        "CREATE TABLE IF NOT EXISTS resources (version INTEGER PRIMARY KEY, "
        "created_at {float} NOT NULL, data TEXT NOT NULL)",
        "CREATE TABLE IF NOT EXISTS rollouts (seq {id}, rollout_id TEXT NOT NULL UNIQUE, "
        "run_id TEXT, status TEXT NOT NULL, mode TEXT NOT NULL, created_at {float} NOT NULL, "
        "queue_seq INTEGER, data TEXT NOT NULL)",
        "CREATE INDEX IF NOT EXISTS rollouts_queue ON rollouts (status, queue_seq)",
        "CREATE INDEX IF NOT EXISTS rollouts_created ON rollouts (created_at)",
        "CREATE INDEX IF NOT EXISTS rollouts_run ON rollouts (run_id, created_at)",
        "CREATE TABLE IF NOT EXISTS attempts (attempt_id TEXT PRIMARY KEY, "
        "rollout_id TEXT NOT NULL REFERENCES rollouts (rollout_id), idx INTEGER NOT NULL, "
        "status TEXT NOT NULL, lease_expires_at {float} NOT NULL, data TEXT NOT NULL)",
        "CREATE INDEX IF NOT EXISTS attempts_rollout ON attempts (rollout_id, idx)",
        "CREATE INDEX IF NOT EXISTS attempts_lease ON attempts (status, lease_expires_at)",
        *(
            f"CREATE TABLE IF NOT EXISTS {table} (seq {{id}}, "
            "rollout_id TEXT NOT NULL REFERENCES rollouts (rollout_id), "
            f"attempt_id TEXT NOT NULL, {extra}data TEXT NOT NULL)"
            for table, extra in (
                ("llm_calls", "sequence_id INTEGER NOT NULL, "),
                ("spans", "sequence_id INTEGER, "),
                ("rewards", ""),
            )
        ),
        *(
            f"CREATE INDEX IF NOT EXISTS {t}_rollout ON {t} (rollout_id, attempt_id)"
            for t in ("llm_calls", "spans", "rewards")
        ),
    )
    schema_version = "SELECT version FROM schema_version"
    set_schema_version = "INSERT INTO schema_version (version) VALUES (?)"
    bump = (
        "INSERT INTO counters (name, value) VALUES (?, ?) ON CONFLICT (name) "
        "DO UPDATE SET value = counters.value + excluded.value RETURNING value"
    )
    upsert_run = (
        "INSERT INTO runs (run_id, created_at, data) VALUES (?, ?, ?) ON CONFLICT (run_id) "
        "DO UPDATE SET created_at = excluded.created_at, data = excluded.data"
    )
    list_runs = "SELECT data FROM runs ORDER BY created_at, seq"
    last_resources_version = "SELECT COALESCE(MAX(version), 0) FROM resources"
    insert_resources = "INSERT INTO resources (version, created_at, data) VALUES (?, ?, ?)"
    get_resources = "SELECT data FROM resources WHERE version = ?"
    latest_resources = "SELECT data FROM resources ORDER BY version DESC LIMIT 1"
    insert_rollout = (
        "INSERT INTO rollouts (rollout_id, run_id, mode, created_at, status, queue_seq, data) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)"
    )
    update_rollout = "UPDATE rollouts SET status = ?, queue_seq = ?, data = ? WHERE rollout_id = ?"
    get_rollout = "SELECT data FROM rollouts WHERE rollout_id = ?{row_lock}"
    rollout_exists = "SELECT 1 FROM rollouts WHERE rollout_id = ?"
    next_queued = (
        "SELECT data FROM rollouts WHERE status = 'queued' ORDER BY queue_seq LIMIT 1{claim_lock}"
    )
    insert_attempt = (
        "INSERT INTO attempts (attempt_id, rollout_id, idx, status, lease_expires_at, data) "
        "VALUES (?, ?, ?, ?, ?, ?)"
    )
    update_attempt = (
        "UPDATE attempts SET status = ?, lease_expires_at = ?, data = ? WHERE attempt_id = ?"
    )
    get_attempt = "SELECT data FROM attempts WHERE attempt_id = ?{row_lock}"
    running_attempt_of = (
        "SELECT data FROM attempts WHERE rollout_id = ? AND status = 'running'{row_lock}"
    )
    attempts_of = "SELECT data FROM attempts WHERE rollout_id = ? ORDER BY idx"
    any_due = "SELECT 1 FROM attempts WHERE status = 'running' AND lease_expires_at <= ? LIMIT 1"
    due_attempts = (
        "SELECT data FROM attempts WHERE status = 'running' AND lease_expires_at <= ? "
        "ORDER BY lease_expires_at{row_lock}"
    )
    next_expiry = "SELECT MIN(lease_expires_at) FROM attempts WHERE status = 'running'"
    insert_call = (
        "INSERT INTO llm_calls (rollout_id, attempt_id, sequence_id, data) VALUES (?, ?, ?, ?)"
    )
    insert_span = (
        "INSERT INTO spans (rollout_id, attempt_id, sequence_id, data) VALUES (?, ?, ?, ?)"
    )
    insert_reward = "INSERT INTO rewards (rollout_id, attempt_id, data) VALUES (?, ?, ?)"

    FILTERS: ClassVar[dict[str, str]] = {
        "run_id": "run_id = ?",
        "mode": "mode = ?",
        "since": "created_at >= ?",
        "until": "created_at < ?",
    }

    def __init__(self, dialect: Dialect) -> None:
        self._render = dialect.render
        for name, sql in vars(Statements).items():
            if isinstance(sql, str) and not name.startswith("_"):
                setattr(self, name, dialect.render(sql))
        self.schema = tuple(dialect.render(sql) for sql in Statements.schema)
        self.records_of = {
            (table, by_attempt): dialect.render(
                f"SELECT data FROM {table} WHERE rollout_id = ?"
                + (" AND attempt_id = ?" if by_attempt else "")
                + " ORDER BY seq"
            )
            for table in ("llm_calls", "spans", "rewards")
            for by_attempt in (False, True)
        }

    def query_rollouts(self, filters: dict[str, Any], limit: int | None) -> tuple[str, list]:
        """The rollout query for the filters of :meth:`Store.query_rollouts`, by name (None,
        or an empty status list, does not filter), oldest first."""
        where, params = [], []
        for name, value in filters.items():
            if value is None or (name == "status" and not value):
                continue
            if name in ("status", "rollout_ids"):
                column = "status" if name == "status" else "rollout_id"
                where.append(f"{column} IN ({', '.join(['?'] * len(value))})")
                params.extend(value)
            else:
                where.append(self.FILTERS[name])
                params.append(value)
        sql = "SELECT created_at, seq, data FROM rollouts"
        sql += f" WHERE {' AND '.join(where)}" if where else ""
        sql += " ORDER BY created_at, seq" + (" LIMIT ?" if limit is not None else "")
        return self._render(sql), params if limit is None else [*params, limit]


_NOTIFIERS: weakref.WeakValueDictionary[str, Notifier] = weakref.WeakValueDictionary()
_NOTIFIERS_LOCK = threading.Lock()


def _shared_notifier(key: str) -> Notifier:
    """One notifier per database file in this process, so every store object on the file
    wakes the others' waiters."""
    with _NOTIFIERS_LOCK:
        return _NOTIFIERS.setdefault(key, Notifier())


def _rollout_row(r: Rollout, queue_seq: int | None) -> tuple[Any, ...]:
    """A rollout's columns in the order of ``Statements.insert_rollout``; the last three
    are the ones ``Statements.update_rollout`` sets."""
    return (r.rollout_id, r.run_id, r.mode, r.created_at, r.status, queue_seq, r.model_dump_json())


def _attempt_row(a: Attempt) -> tuple[Any, ...]:
    """An attempt's columns after its id, in the order of ``Statements.insert_attempt``; the
    last three are the ones ``Statements.update_attempt`` sets."""
    return (a.rollout_id, a.index, a.status, a.lease_expires_at, a.model_dump_json())


def sqlite_path(path_or_url: str | Path) -> Path:
    """The file of a SQLite store given as a path or a ``sqlite:///path`` URL (as in
    SQLAlchemy: ``sqlite:///runs/store.sqlite`` is relative, ``sqlite:////tmp/x`` absolute)."""
    text = str(path_or_url)
    if text.startswith("sqlite:"):
        if not text.startswith("sqlite:///") or len(text) == len("sqlite:///"):
            raise StoreError(f"bad SQLite URL {text!r}: expected sqlite:///PATH")
        text = text[len("sqlite:///") :]
    return Path(text).expanduser()


class SQLStore(LocalStore):
    """The store in a SQL database: ``SQLStore("runs/store.sqlite")`` or
    ``SQLStore("sqlite:///runs/store.sqlite")``. The file and its schema are created on open;
    several store objects and processes may open the same file at once."""

    def __init__(self, path_or_url: str | Path) -> None:
        super().__init__()
        self.path = sqlite_path(path_or_url)
        self._dialect = SQLITE
        self._sql = Statements(self._dialect)
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            conn = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, cached_statements=256
            )
        except sqlite3.Error as e:
            raise StoreError(f"cannot open SQLite store {self.path}: {e}") from e
        self._conn: sqlite3.Connection | None = conn
        try:
            with self._read() as conn:
                for statement in self._dialect.setup:
                    conn.execute(statement)
            self._ensure_schema()
        except BaseException:
            conn.close()
            raise
        self._changed = _shared_notifier(str(self.path.resolve()))

    def __repr__(self) -> str:
        return f"SQLStore({str(self.path)!r})"

    # ---- connection and transactions ----------------------------------------------------
    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StoreError(f"store {self.path} is closed")
        return self._conn

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                yield self._connection()
            except sqlite3.Error as e:
                raise StoreError(f"{self._dialect.name} store {self.path}: {e}") from e

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: committed on success, rolled back on any error."""
        with self._lock:
            conn = self._connection()
            try:
                conn.execute(self._dialect.begin_write)
                yield conn
                conn.execute("COMMIT")
            except BaseException as e:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                if isinstance(e, sqlite3.Error):
                    raise StoreError(f"{self._dialect.name} store {self.path}: {e}") from e
                raise

    def _ensure_schema(self) -> None:
        with self._read() as conn:
            try:
                row = conn.execute(self._sql.schema_version).fetchone()
            except sqlite3.OperationalError:
                row = None
        if row is None:
            with self._write() as conn:
                for statement in self._sql.schema:
                    conn.execute(statement)
                row = conn.execute(self._sql.schema_version).fetchone()
                if row is None:
                    conn.execute(self._sql.set_schema_version, (SCHEMA_VERSION,))
                    row = (SCHEMA_VERSION,)
        if row[0] != SCHEMA_VERSION:
            raise StoreError(
                f"store {self.path} has schema version {row[0]}; this VoltRL reads version "
                f"{SCHEMA_VERSION}"
            )

    async def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    # ---- row helpers (inside a transaction) ---------------------------------------------
    @staticmethod
    def _one(conn: sqlite3.Connection, sql: str, params: tuple, cls: type[M]) -> M | None:
        row = conn.execute(sql, params).fetchone()
        return None if row is None else cls.model_validate_json(row[0])

    @staticmethod
    def _all(conn: sqlite3.Connection, sql: str, params: tuple, cls: type[M]) -> list[M]:
        return [cls.model_validate_json(row[0]) for row in conn.execute(sql, params)]

    def _bump(self, conn: sqlite3.Connection, name: str, n: int) -> int:
        """Add ``n`` to a named counter; returns its new value."""
        return int(conn.execute(self._sql.bump, (name, n)).fetchone()[0])

    def _update_rollout(self, conn: sqlite3.Connection, r: Rollout) -> None:
        """Write a changed rollout; one that became queued goes to the back of the queue."""
        queue_seq = self._bump(conn, "queue", 1) if r.status == "queued" else None
        conn.execute(self._sql.update_rollout, (*_rollout_row(r, queue_seq)[-3:], r.rollout_id))

    def _update_attempt(self, conn: sqlite3.Connection, a: Attempt) -> None:
        conn.execute(self._sql.update_attempt, (*_attempt_row(a)[-3:], a.attempt_id))

    def _require_rollouts(self, conn: sqlite3.Connection, rollout_ids: Iterable[str]) -> None:
        for rollout_id in dict.fromkeys(rollout_ids):
            if conn.execute(self._sql.rollout_exists, (rollout_id,)).fetchone() is None:
                raise NotFoundError(f"no rollout with id {rollout_id!r}")

    def _with_sequence_ids(
        self, conn: sqlite3.Connection, kind: str, items: Sequence[Numbered], *, keep: bool
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

    def _insert_spans(self, conn: sqlite3.Connection, spans: Sequence[Span]) -> list[Span]:
        spans = self._with_sequence_ids(conn, "span", spans, keep=True)
        conn.executemany(
            self._sql.insert_span,
            [(s.rollout_id, s.attempt_id, s.sequence_id, s.model_dump_json()) for s in spans],
        )
        return spans

    def _insert_rewards(self, conn: sqlite3.Connection, rewards: Sequence[Reward]) -> None:
        conn.executemany(
            self._sql.insert_reward,
            [(rw.rollout_id, rw.attempt_id, rw.model_dump_json()) for rw in rewards],
        )

    def _expire_due(self, conn: sqlite3.Connection, t: float) -> int:
        due = self._all(conn, self._sql.due_attempts, (t,), Attempt)
        for a in due:
            r = self._one(conn, self._sql.get_rollout, (a.rollout_id,), Rollout)
            assert r is not None  # attempts reference rollouts
            expire_attempt(r, a)
            self._update_attempt(conn, a)
            self._update_rollout(conn, r)
        return len(due)

    # ---- runs and resources -------------------------------------------------------------
    async def add_run(self, run: Run) -> Run:
        with self._write() as conn:
            conn.execute(self._sql.upsert_run, (run.run_id, run.created_at, run.model_dump_json()))
        return run

    async def list_runs(self) -> list[Run]:
        with self._read() as conn:
            return self._all(conn, self._sql.list_runs, (), Run)

    async def add_resources(self, resources: Resources) -> Resources:
        with self._write() as conn:
            version = int(conn.execute(self._sql.last_resources_version).fetchone()[0]) + 1
            saved = resources.model_copy(update={"version": version}, deep=True)
            conn.execute(
                self._sql.insert_resources, (version, saved.created_at, saved.model_dump_json())
            )
        self._changed.notify()
        return saved

    async def get_resources(self, version: int | None = None) -> Resources | None:
        with self._read() as conn:
            if version is None:
                return self._one(conn, self._sql.latest_resources, (), Resources)
            return self._one(conn, self._sql.get_resources, (version,), Resources)

    # ---- queue --------------------------------------------------------------------------
    async def enqueue(
        self,
        tasks: Sequence[Task],
        *,
        mode: RolloutMode = "train",
        run_id: str | None = None,
        resources_version: int | None = None,
        max_attempts: int = 3,
        timeout_s: float | None = None,
    ) -> list[Rollout]:
        settings = {"mode": mode, "run_id": run_id, "resources_version": resources_version}
        settings |= {"max_attempts": max_attempts, "timeout_s": timeout_s}
        rollouts = [Rollout(task=task, **settings) for task in tasks]
        if not rollouts:
            return []
        with self._write() as conn:
            first = self._bump(conn, "queue", len(rollouts)) - len(rollouts) + 1
            rows = [_rollout_row(r, first + i) for i, r in enumerate(rollouts)]
            conn.executemany(self._sql.insert_rollout, rows)
        self._changed.notify()
        return rollouts

    async def _claim_now(self, worker_id: str, lease_s: float) -> Claim | None:
        with self._write() as conn:
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
            conn.execute(self._sql.insert_attempt, (a.attempt_id, *_attempt_row(a)))
        return Claim(rollout=r, attempt=a)

    async def _next_lease_expiry(self) -> float | None:
        with self._read() as conn:
            return conn.execute(self._sql.next_expiry).fetchone()[0]

    async def heartbeat(
        self, attempt_ids: Sequence[str], *, lease_s: float = DEFAULT_LEASE_S
    ) -> list[str]:
        await self.expire_leases()
        if not attempt_ids:
            return []
        stale: list[str] = []
        with self._write() as conn:
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

    async def complete(self, attempt_id: str, result: AttemptResult) -> Rollout:
        await self.expire_leases()
        with self._write() as conn:
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
            tag = {"rollout_id": r.rollout_id, "attempt_id": attempt_id}
            self._insert_spans(conn, [s.model_copy(update=tag) for s in result.spans])
            self._insert_rewards(conn, [rw.model_copy(update=tag) for rw in result.rewards])
            apply_result(r, a, result)
            self._update_attempt(conn, a)
            self._update_rollout(conn, r)
        self._changed.notify()
        return r

    async def cancel(self, rollout_id: str) -> Rollout:
        with self._write() as conn:
            a = self._one(conn, self._sql.running_attempt_of, (rollout_id,), Attempt)
            r = self._one(conn, self._sql.get_rollout, (rollout_id,), Rollout)
            if r is None:
                raise NotFoundError(f"no rollout with id {rollout_id!r}")
            if r.finished:
                return r
            if a is not None:
                a.status, a.finished_at = "cancelled", now()
                self._update_attempt(conn, a)
            r.status, r.finished_at, r.error = "cancelled", now(), "cancelled"
            self._update_rollout(conn, r)
        self._changed.notify()
        return r

    async def expire_leases(self) -> int:
        """End attempts whose lease ran out."""
        t = time.time()
        with self._read() as conn:
            if conn.execute(self._sql.any_due, (t,)).fetchone() is None:
                return 0
        with self._write() as conn:
            n = self._expire_due(conn, t)
        if n:
            self._changed.notify()
        return n

    # ---- records ------------------------------------------------------------------------
    async def add_llm_calls(self, calls: Sequence[LLMCall]) -> list[LLMCall]:
        with self._write() as conn:
            self._require_rollouts(conn, (c.rollout_id for c in calls))
            calls = self._with_sequence_ids(conn, "call", calls, keep=False)
            conn.executemany(
                self._sql.insert_call,
                [(c.rollout_id, c.attempt_id, c.sequence_id, c.model_dump_json()) for c in calls],
            )
        return list(calls)

    async def add_spans(self, spans: Sequence[Span]) -> list[Span]:
        with self._write() as conn:
            self._require_rollouts(conn, (s.rollout_id for s in spans))
            return self._insert_spans(conn, spans)

    async def add_rewards(self, rewards: Sequence[Reward]) -> None:
        with self._write() as conn:
            self._require_rollouts(conn, (rw.rollout_id for rw in rewards))
            self._insert_rewards(conn, rewards)

    # ---- queries ------------------------------------------------------------------------
    async def get_rollout(self, rollout_id: str) -> Rollout:
        with self._read() as conn:
            r = self._one(conn, self._sql.get_rollout, (rollout_id,), Rollout)
        if r is None:
            raise NotFoundError(f"no rollout with id {rollout_id!r}")
        return r

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
        with self._read() as conn:
            for chunk in chunks:
                sql, params = self._sql.query_rollouts({**filters, "rollout_ids": chunk}, limit)
                rows.extend(conn.execute(sql, params))
        if len(chunks) > 1:
            rows.sort(key=lambda row: (row[0], row[1]))
            rows = rows[:limit] if limit is not None else rows
        return [Rollout.model_validate_json(row[2]) for row in rows]

    async def get_attempts(self, rollout_id: str) -> list[Attempt]:
        with self._read() as conn:
            self._require_rollouts(conn, (rollout_id,))
            return self._all(conn, self._sql.attempts_of, (rollout_id,), Attempt)

    def _records(
        self, table: str, cls: type[M], rollout_id: str, attempt_id: str | None
    ) -> list[M]:
        with self._read() as conn:
            self._require_rollouts(conn, (rollout_id,))
            if attempt_id is None:
                return self._all(conn, self._sql.records_of[table, False], (rollout_id,), cls)
            sql = self._sql.records_of[table, True]
            return self._all(conn, sql, (rollout_id, attempt_id), cls)

    async def get_llm_calls(self, rollout_id: str, attempt_id: str | None = None) -> list[LLMCall]:
        return self._records("llm_calls", LLMCall, rollout_id, attempt_id)

    async def get_spans(self, rollout_id: str, attempt_id: str | None = None) -> list[Span]:
        return self._records("spans", Span, rollout_id, attempt_id)

    async def get_rewards(self, rollout_id: str, attempt_id: str | None = None) -> list[Reward]:
        return self._records("rewards", Reward, rollout_id, attempt_id)
