"""What differs between the databases a SQL store runs on: a :class:`Dialect` for each.

A dialect renders the statements (``?`` placeholders, ``{tokens}`` for types and locking
clauses), connects, names its driver's errors, tells whether a transaction is open, which
failures are worth running again, and how to hear of other processes' commits. Two exist:
:data:`SQLITE` (the standard library's ``sqlite3``, with :class:`WalCheckpointer`) and
:data:`POSTGRES` (psycopg 3, the ``postgres`` extra, imported only when a PostgreSQL store is
opened, with :class:`ChangeListener`). The PostgreSQL URL helpers live here too.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from voltrl._redact import redact, scrub
from voltrl.errors import StoreError

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
    reader_setup: tuple[str, ...]  # run instead on a read-only one: no statement that writes
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

    def connect(self, target: str, *, read_only: bool = False) -> Connection:
        """A new connection in autocommit mode (transactions are begun explicitly);
        ``read_only``: one that cannot write (its :attr:`reader_setup` makes sure of it)."""
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

    def connect(self, target: str, *, read_only: bool = False) -> Connection:
        path = Path(target)
        where: str | Path = path
        if read_only:  # the file opened read-only: no write, no file made
            where = f"{path.resolve().as_uri()}?mode=ro"
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return sqlite3.connect(
                where,
                uri=read_only,
                isolation_level=None,
                check_same_thread=False,
                cached_statements=256,
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

    def connect(self, target: str, *, read_only: bool = False) -> Connection:
        psycopg = _psycopg()  # a reader's connection is made read-only by reader_setup
        where = postgres_location(target)
        try:
            params = psycopg.conninfo.conninfo_to_dict(target)
        except psycopg.Error as e:
            why = scrub(str(e).strip(), urlsplit(target).password)
            raise StoreError(f"bad PostgreSQL URL {redact(target)!r}: {why}") from e
        params.setdefault("connect_timeout", CONNECT_TIMEOUT_S)
        params.setdefault("application_name", "voltrl")
        try:
            return psycopg.connect(**params, autocommit=True)
        except psycopg.Error as e:
            # the driver's error may repeat the connection string, password and all
            why = scrub(str(e).strip(), urlsplit(target).password)
            raise StoreError(f"cannot connect to PostgreSQL at {where}: {why}") from None

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
        """Stop the thread, checkpoint what is left (a reader still open, as the dashboard's,
        may be the last connection, and a read-only one cannot), close its connection."""
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(sqlite3.Error):  # busy: SQLite's own last close will do
            self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
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
    # a reader leaves the journal mode as the writer set it (WAL: it reads beside the writer)
    reader_setup=("PRAGMA busy_timeout=10000", "PRAGMA foreign_keys=ON"),
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
    reader_setup=("SET default_transaction_read_only = on",),
    max_params=10000,
    in_thread=True,
)


def is_postgres_url(text: str) -> bool:
    """Whether a store spec names a PostgreSQL database."""
    return text.startswith(("postgresql://", "postgres://"))


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
