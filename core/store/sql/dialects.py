"""The SQL of :class:`~voltrl.store.sql.store.SQLStore`, and what differs between the databases
it runs on.

Every statement of the store is written once, in :class:`Statements`, with ``?``
placeholders and ``{tokens}`` for types and locking clauses; a :class:`Dialect` renders it
for one database. The dialect also knows how to connect, which errors its driver raises,
whether a transaction is open, which failures are worth running again, and how to hear of
other processes' commits. Two exist: :data:`SQLITE` (the standard library's ``sqlite3``) and
:data:`POSTGRES` (psycopg 3, the ``postgres`` extra, imported only when a PostgreSQL store is
opened).
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol
from urllib.parse import parse_qs, urlsplit

from voltrl.errors import StoreError
from voltrl.store.browse import RolloutQuery

SCHEMA_VERSION = 2
"""Version 2 added the rollout columns that browsing filters and sorts on (reward, resources
version, attempts, task id, start and end times), filled from each row's JSON on upgrade."""

CHANNEL = "voltrl_changes"
"""The PostgreSQL notification channel on which commits that waiters care about are sent."""
LISTEN_TIMEOUT_S = 30.0  # a listener checks whether it was stopped at least this often
LISTEN_RETRY_S = 1.0  # a listener whose connection was lost connects again after this

CONNECT_TIMEOUT_S = 10
"""How long opening a PostgreSQL store waits for the server, unless the URL says."""


class Connection(Protocol):
    """The part of a DB-API connection the store uses (``sqlite3`` and psycopg share it)."""

    def execute(self, sql: str, params: Any = ..., /) -> Any: ...

    def cursor(self) -> Any: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Dialect:
    """What differs between SQL databases; statements are rendered through it once."""

    name: str
    placeholder: str  # "?" for sqlite3, "%s" for psycopg
    begin_write: str  # starts a transaction that will write
    claim_lock: str  # ends the claim query: lock the row, skip rows other claimers hold
    row_lock: str  # ends reads of rows about to change
    schema_lock: str  # first statement of the transaction that creates the schema, or ""
    schema_extra: tuple[str, ...]  # statements of this database's own, after the tables
    id_column: str  # an auto-incrementing integer primary key
    int_type: str  # counters and sequence numbers
    float_type: str
    setup: tuple[str, ...]  # run on each new connection
    max_params: int  # most ids in one IN (...) list
    in_thread: bool  # run calls on a worker thread (network round trips) rather than inline

    def render(self, sql: str) -> str:
        """A statement written with ``?`` placeholders and ``{tokens}``, for this database."""
        sql = sql.format(
            id=self.id_column,
            int=self.int_type,
            float=self.float_type,
            claim_lock=self.claim_lock,
            row_lock=self.row_lock,
        )
        return sql if self.placeholder == "?" else sql.replace("?", self.placeholder)

    def connect(self, target: str) -> Connection:
        """A new connection in autocommit mode (transactions are begun explicitly)."""
        raise NotImplementedError

    @property
    def error(self) -> type[Exception] | tuple[type[Exception], ...]:
        """The driver's errors: its base class, or a tuple of classes."""
        raise NotImplementedError

    def in_transaction(self, conn: Any) -> bool:
        """Whether ``conn`` has a transaction open that must be rolled back."""
        raise NotImplementedError

    def broken(self, conn: Any) -> bool:
        """Whether ``conn`` was lost (server restart, network) and must be opened again."""
        return False

    def retryable(self, error: BaseException | None) -> bool:
        """Whether a transaction that failed with ``error`` changed nothing and can simply
        run again (PostgreSQL: it lost a deadlock, or a serialisation conflict)."""
        return False

    def json_value(self, column: str, path: str, *, number: bool = False) -> str:
        """SQL for the value at ``path`` (dotted: ``task.task_id``) of the JSON in ``column``,
        as text, or as a number when ``number``; NULL where absent or JSON null."""
        raise NotImplementedError

    def json_text(self, column: str, key: str) -> str:
        """SQL for the JSON text of the object at ``key`` of the JSON in ``column``."""
        raise NotImplementedError

    like = "LIKE"
    """The case-insensitive LIKE (for ASCII letters at least)."""

    def listen(
        self, target: str, wake: Callable[[], None], own: Callable[[], Any]
    ) -> ChangeListener | None:
        """Call ``wake`` whenever another connection (``own`` returns the store's) commits a
        change that waiters care about; None where the database cannot tell."""
        return None


@dataclass(frozen=True)
class SQLiteDialect(Dialect):
    """SQLite through the standard library; ``target`` is a file path."""

    def connect(self, target: str) -> Connection:
        path = Path(target)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return sqlite3.connect(
                path, isolation_level=None, check_same_thread=False, cached_statements=256
            )
        except sqlite3.Error as e:
            raise StoreError(f"cannot open SQLite store {path}: {e}") from e

    @property
    def error(self) -> tuple[type[Exception], ...]:
        # sqlite3 raises OverflowError, not one of its own, for an int past 64 bits.
        return (sqlite3.Error, OverflowError)

    def in_transaction(self, conn: Any) -> bool:
        return bool(conn.in_transaction)

    def json_value(self, column: str, path: str, *, number: bool = False) -> str:
        return f"json_extract({column}, '$.{path}')"  # numbers come back as numbers

    def json_text(self, column: str, key: str) -> str:
        return f"json_extract({column}, '$.{key}')"


@dataclass(frozen=True)
class PostgresDialect(Dialect):
    """PostgreSQL through psycopg 3; ``target`` is a ``postgresql://`` URL."""

    def connect(self, target: str) -> Connection:
        psycopg = _psycopg()
        where = postgres_location(target)
        try:
            params = psycopg.conninfo.conninfo_to_dict(target)
        except psycopg.Error as e:
            raise StoreError(f"bad PostgreSQL URL {redact(target)!r}: {_scrub(e, target)}") from e
        params.setdefault("connect_timeout", CONNECT_TIMEOUT_S)
        params.setdefault("application_name", "voltrl")
        try:
            return psycopg.connect(**params, autocommit=True)
        except psycopg.Error as e:
            raise StoreError(
                f"cannot connect to PostgreSQL at {where}: {_scrub(e, target)}"
            ) from None  # the driver's error may repeat the connection string

    @property
    def error(self) -> type[Exception]:
        return _psycopg().Error

    def in_transaction(self, conn: Any) -> bool:
        status = _psycopg().pq.TransactionStatus
        return conn.info.transaction_status in (status.INTRANS, status.INERROR)

    like = "ILIKE"

    def json_value(self, column: str, path: str, *, number: bool = False) -> str:
        text = f"(({column})::jsonb #>> '{{{','.join(path.split('.'))}}}')"
        return f"{text}::double precision" if number else text

    def json_text(self, column: str, key: str) -> str:
        return f"((({column})::json) -> '{key}')::text"  # json keeps the stored text

    def broken(self, conn: Any) -> bool:
        return bool(conn.broken or conn.closed)

    def retryable(self, error: BaseException | None) -> bool:
        errors = _psycopg().errors
        return isinstance(error, errors.DeadlockDetected | errors.SerializationFailure)

    def listen(
        self, target: str, wake: Callable[[], None], own: Callable[[], Any]
    ) -> ChangeListener | None:
        return ChangeListener(self, target, wake, own)


class ChangeListener:
    """Wakes this process's waiters when another process commits a change to a PostgreSQL
    database: the ``rollouts_changed`` and ``resources_changed`` triggers send a
    notification on :data:`CHANNEL` at each commit that queues, finishes or publishes
    something; a thread of its own LISTENs for it on a connection of its own.

    After a (re)connection it wakes the waiters once, since it may have missed changes."""

    def __init__(
        self, dialect: Dialect, target: str, wake: Callable[[], None], own: Callable[[], Any]
    ) -> None:
        self._dialect, self._target, self._wake, self._own = dialect, target, wake, own
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="voltrl-store-listen", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn = self._dialect.connect(self._target)
                try:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self._wake()
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=LISTEN_TIMEOUT_S):
                            if self._stop.is_set():
                                break
                            own = self._own()
                            if own is None or note.pid != own.info.backend_pid:
                                self._wake()  # the store's own commits woke them already
                finally:
                    conn.close()
            except (StoreError, self._dialect.error):
                self._stop.wait(LISTEN_RETRY_S)  # the server is away: try again

    def close(self, conn: Any) -> None:
        """Stop listening; ``conn``, the store's open connection, wakes the thread."""
        self._stop.set()
        with contextlib.suppress(self._dialect.error):  # else it stops at its next timeout
            conn.execute(f"NOTIFY {CHANNEL}")
        self._thread.join(LISTEN_RETRY_S)


CHECKPOINT_EVERY_S = 0.25
"""How often a SQLite store's checkpointer moves committed WAL pages into the database file."""


class WalCheckpointer:
    """Checkpoints a SQLite store's write-ahead log on a thread and connection of its own.

    SQLite's automatic checkpoint runs inside the commit that crosses 1,000 WAL pages: that
    commit, and so the store server's event loop, waits while pages are copied and the file is
    fsynced. The store turns it off on its connection (``PRAGMA wal_autocheckpoint=0``) and
    this thread runs a PASSIVE checkpoint at most every :data:`CHECKPOINT_EVERY_S` seconds
    when something was committed since the last one. Commits are as durable as before (WAL,
    ``synchronous=NORMAL``); only the copy into the main file moved. A PASSIVE checkpoint never
    waits for writers or readers, and the WAL starts over once a checkpoint has caught up. The
    last connection to close checkpoints what is left, as SQLite always does.
    """

    def __init__(self, target: str, every_s: float = CHECKPOINT_EVERY_S) -> None:
        self._conn = SQLITE.connect(target)
        for statement in SQLITE.setup:
            self._conn.execute(statement)
        self._every_s = every_s
        self.dirty = False
        """Set by the store after each commit; cleared here before each checkpoint."""
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="voltrl-store-checkpoint", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            if self.dirty:
                self.dirty = False
                with contextlib.suppress(sqlite3.Error):  # busy or gone: the next one will do
                    self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()

    def close(self) -> None:
        """Stop the thread and close its connection."""
        self._stop.set()
        self._thread.join()
        self._conn.close()


SQLITE = SQLiteDialect(
    name="SQLite",
    placeholder="?",
    begin_write="BEGIN IMMEDIATE",  # take the write lock first: no stale read, no deadlock
    claim_lock="",
    row_lock="",
    schema_lock="",  # BEGIN IMMEDIATE already lets one writer in at a time
    schema_extra=(),
    id_column="INTEGER PRIMARY KEY",
    int_type="INTEGER",
    float_type="REAL",
    setup=(
        "PRAGMA busy_timeout=10000",  # first: the next ones may wait for another process
        "PRAGMA journal_mode=WAL",
        "PRAGMA synchronous=NORMAL",
        "PRAGMA foreign_keys=ON",
    ),
    max_params=900,
    in_thread=False,
)

POSTGRES = PostgresDialect(
    name="PostgreSQL",
    placeholder="%s",
    begin_write="BEGIN",  # READ COMMITTED: each statement sees what committed before it
    # Row locks that do not block foreign-key checks (no key ever changes); a claimer skips
    # the rows that another claimer, in any process, has locked.
    claim_lock=" FOR NO KEY UPDATE SKIP LOCKED",
    row_lock=" FOR NO KEY UPDATE",
    # Concurrent CREATE TABLE IF NOT EXISTS can collide; one opener at a time creates them.
    schema_lock="SELECT pg_advisory_xact_lock(8765432101)",
    # Other processes' waiters learn of changes from these notifications (ChangeListener):
    # rollouts queued, finished or requeued (not claimed), and new resources versions.
    schema_extra=(
        "CREATE OR REPLACE FUNCTION voltrl_notify_change() RETURNS trigger LANGUAGE plpgsql "
        f"AS $$ BEGIN PERFORM pg_notify('{CHANNEL}', ''); RETURN NULL; END $$",
        "DROP TRIGGER IF EXISTS rollouts_changed ON rollouts",
        "CREATE TRIGGER rollouts_changed AFTER INSERT OR UPDATE ON rollouts FOR EACH ROW "
        "WHEN (NEW.status <> 'running') EXECUTE FUNCTION voltrl_notify_change()",
        "DROP TRIGGER IF EXISTS resources_changed ON resources",
        "CREATE TRIGGER resources_changed AFTER INSERT ON resources "
        "FOR EACH STATEMENT EXECUTE FUNCTION voltrl_notify_change()",
    ),
    id_column="BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY",
    int_type="BIGINT",
    float_type="DOUBLE PRECISION",
    setup=(),
    max_params=10000,
    in_thread=True,
)


class Statements:
    """Every SQL statement the store runs, written once with ``?`` placeholders and
    ``{tokens}``; an instance holds them rendered for one dialect."""

    schema = (
        "CREATE TABLE IF NOT EXISTS schema_version (version {int} NOT NULL)",
        "CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value {int} NOT NULL)",
        "CREATE TABLE IF NOT EXISTS runs (seq {id}, run_id TEXT NOT NULL UNIQUE, "
        "created_at {float} NOT NULL, data TEXT NOT NULL)",
        "CREATE TABLE IF NOT EXISTS resources (version {int} PRIMARY KEY, "
        "created_at {float} NOT NULL, data TEXT NOT NULL)",
        "CREATE TABLE IF NOT EXISTS rollouts (seq {id}, rollout_id TEXT NOT NULL UNIQUE, "
        "run_id TEXT, status TEXT NOT NULL, mode TEXT NOT NULL, created_at {float} NOT NULL, "
        "queue_seq {int}, data TEXT NOT NULL, task_id TEXT, resources_version {int}, "
        "reward {float}, attempt_count {int}, started_at {float}, finished_at {float})",
        "CREATE INDEX IF NOT EXISTS rollouts_queue ON rollouts (status, queue_seq)",
        "CREATE INDEX IF NOT EXISTS rollouts_created ON rollouts (created_at)",
        "CREATE INDEX IF NOT EXISTS rollouts_run ON rollouts (run_id, created_at)",
        "CREATE TABLE IF NOT EXISTS attempts (attempt_id TEXT PRIMARY KEY, "
        "rollout_id TEXT NOT NULL REFERENCES rollouts (rollout_id), idx {int} NOT NULL, "
        "status TEXT NOT NULL, lease_expires_at {float} NOT NULL, data TEXT NOT NULL)",
        "CREATE INDEX IF NOT EXISTS attempts_rollout ON attempts (rollout_id, idx)",
        "CREATE INDEX IF NOT EXISTS attempts_lease ON attempts (status, lease_expires_at)",
        *(
            f"CREATE TABLE IF NOT EXISTS {table} (seq {{id}}, "
            "rollout_id TEXT NOT NULL REFERENCES rollouts (rollout_id), "
            f"attempt_id TEXT NOT NULL, {extra}data TEXT NOT NULL)"
            for table, extra in (
                ("llm_calls", "sequence_id {int} NOT NULL, "),
                ("spans", "sequence_id {int}, "),
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
        "INSERT INTO rollouts (rollout_id, run_id, mode, created_at, task_id, status, "
        "queue_seq, data, resources_version, reward, attempt_count, started_at, finished_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    )
    update_rollout = (
        "UPDATE rollouts SET status = ?, queue_seq = ?, data = ?, resources_version = ?, "
        "reward = ?, attempt_count = ?, started_at = ?, finished_at = ? WHERE rollout_id = ?"
    )
    ROLLOUT_COLUMNS: ClassVar[dict[str, str]] = {  # added by version 2: name -> JSON path
        "task_id": "task.task_id",
        "resources_version": "resources_version",
        "reward": "reward",
        "attempt_count": "attempt_count",
        "started_at": "started_at",
        "finished_at": "finished_at",
    }
    get_rollout = "SELECT data FROM rollouts WHERE rollout_id = ?{row_lock}"
    read_rollout = "SELECT data FROM rollouts WHERE rollout_id = ?"
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
        "ORDER BY lease_expires_at, attempt_id{row_lock}"
    )
    next_expiry = "SELECT MIN(lease_expires_at) FROM attempts WHERE status = 'running'"
    insert_call = (
        "INSERT INTO llm_calls (rollout_id, attempt_id, sequence_id, data) VALUES (?, ?, ?, ?)"
    )
    insert_span = (
        "INSERT INTO spans (rollout_id, attempt_id, sequence_id, data) VALUES (?, ?, ?, ?)"
    )
    insert_reward = "INSERT INTO rewards (rollout_id, attempt_id, data) VALUES (?, ?, ?)"

    BROWSE_FILTERS: ClassVar[dict[str, str]] = {  # RolloutQuery field -> its condition
        "run_id": "run_id = ?",
        "mode": "mode = ?",
        "reward_min": "reward >= ?",
        "reward_max": "reward <= ?",
        "resources_version": "resources_version = ?",
        "task_id": "task_id = ?",
        "min_attempts": "attempt_count >= ?",
    }

    FILTERS: ClassVar[dict[str, str]] = {
        "run_id": "run_id = ?",
        "mode": "mode = ?",
        "since": "created_at >= ?",
        "until": "created_at < ?",
    }

    def __init__(self, dialect: Dialect) -> None:
        self._render = dialect.render
        self._dialect = dialect
        for name, sql in vars(Statements).items():
            if isinstance(sql, str) and not name.startswith("_"):
                setattr(self, name, dialect.render(sql))
        self.schema = tuple(dialect.render(sql) for sql in Statements.schema)
        # Browsing by agent (``RolloutQuery.agent``) finds a rollout's calls of an agent
        # through this index, without reading each call's JSON.
        agent = dialect.json_value("data", "agent_name")
        agent_index = (
            f"CREATE INDEX IF NOT EXISTS llm_calls_agent ON llm_calls (rollout_id, {agent})"
        )
        self.schema += (agent_index, *dialect.schema_extra)
        types = {"task_id": "TEXT", "resources_version": dialect.int_type}
        self.upgrade_to_2 = (
            *(
                f"ALTER TABLE rollouts ADD COLUMN {c} {types.get(c, dialect.float_type)}"
                for c in self.ROLLOUT_COLUMNS
            ),
            "UPDATE rollouts SET "
            + ", ".join(
                f"{c} = {dialect.json_value('data', path, number=c != 'task_id')}"
                for c, path in self.ROLLOUT_COLUMNS.items()
            ),
            agent_index,
            "UPDATE schema_version SET version = 2",
        )
        """Statements that bring a version 1 store to version 2."""
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

    def browse_rollouts(self, query: RolloutQuery) -> tuple[str, str, list[Any]]:
        """The page query and the (capped) count query of :meth:`Store.browse_rollouts`,
        and their shared parameters: the page query then takes ``limit, offset``, the count
        query ``COUNT_CAP + 1``. The filters mean what :func:`voltrl.store.browse.matches`
        says."""
        d = self._dialect

        def num(path: str, column: str = "data") -> str:
            return d.json_value(column, path, number=True)

        where: list[str] = []
        params: list[Any] = []

        def add(sql: str, *values: Any) -> None:
            where.append(sql)
            params.extend(values)

        q = query
        for name, condition in self.BROWSE_FILTERS.items():
            value = getattr(q, name)
            if value is not None:
                add(condition, value)
        if q.status:
            add(f"status IN ({', '.join('?' * len(q.status))})", *q.status)
        if q.text:
            escaped = q.text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            add(f"{d.json_text('data', 'task')} {d.like} ? ESCAPE '\\'", f"%{escaped}%")
        if q.agent is not None:
            agent = d.json_value("c.data", "agent_name")  # as indexed (llm_calls_agent)
            add(
                "EXISTS (SELECT 1 FROM llm_calls c WHERE c.rollout_id = rollouts.rollout_id "
                f"AND {agent} = ?)",
                q.agent,
            )
        sort = {
            "created_at": "created_at",
            "status": "status",
            "reward": "reward",
            "attempts": "attempt_count",
            "resources_version": "resources_version",
            "duration": "(finished_at - started_at)",
        }[q.sort]
        way = "DESC" if q.descending else "ASC"
        filters = f" WHERE {' AND '.join(where)}" if where else ""
        nulls = "" if q.sort in ("created_at", "status") else f"({sort}) IS NULL, "  # NOT NULL
        page = (
            f"SELECT data FROM rollouts{filters} ORDER BY {nulls}{sort} {way}, "
            f"created_at {way}, rollout_id {way} LIMIT ? OFFSET ?"
        )
        count = f"SELECT COUNT(*) FROM (SELECT 1 FROM rollouts{filters} LIMIT ?) AS matched"
        mark = d.placeholder
        return page.replace("?", mark), count.replace("?", mark), params

    def rollout_counts(self) -> str:
        """The query of :meth:`Store.rollout_counts` (one parameter: the run id): rows of
        mode, resources version, status, count, rewarded, reward sum, sum of squares."""
        d = self._dialect
        ok = "status = 'succeeded' AND reward IS NOT NULL"
        sql = (
            "SELECT mode, resources_version, status, COUNT(*), "
            f"SUM(CASE WHEN {ok} THEN 1 ELSE 0 END), "
            f"SUM(CASE WHEN {ok} THEN reward ELSE 0 END), "
            f"SUM(CASE WHEN {ok} THEN reward * reward ELSE 0 END) "
            "FROM rollouts WHERE run_id = ? GROUP BY mode, resources_version, status"
        )
        return sql.replace("?", d.placeholder)


def is_postgres_url(text: str) -> bool:
    """Whether a store spec names a PostgreSQL database."""
    return text.startswith(("postgresql://", "postgres://"))


def redact(url: str) -> str:
    """A URL with its password replaced by ``***``, for messages and ``repr``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


def postgres_location(url: str) -> str:
    """``host:port/database`` of a PostgreSQL URL, for messages (no user, no password)."""
    try:
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        host = parts.hostname or query.get("host", ["localhost"])[0]
        port = parts.port or int(query.get("port", ["5432"])[0])
    except ValueError as e:
        raise StoreError(f"bad PostgreSQL URL {redact(url)!r}: {e}") from None
    return f"{host}:{port}{parts.path or '/'}"


def _scrub(error: BaseException, url: str) -> str:
    """The driver's message for ``error``, with the URL's password removed."""
    text = str(error).strip()
    password = urlsplit(url).password
    return text.replace(password, "***") if password else text


def _psycopg() -> Any:
    """The psycopg module; a clear error when the ``postgres`` extra is not installed."""
    try:
        import psycopg
        import psycopg.conninfo
    except ImportError as e:
        raise StoreError(
            "a PostgreSQL store needs psycopg 3: pip install 'voltrl[postgres]'"
        ) from e
    return psycopg
