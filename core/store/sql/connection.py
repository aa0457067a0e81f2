"""A SQL store's hold on its database: one connection, its transactions and group commits.

Each store object has one connection, guarded by a lock within the process, opened again when
the server dropped it. A write is one transaction (``BEGIN IMMEDIATE`` on SQLite serialises
writers across processes); with :meth:`Database.group_commits` the writes of one turn of the
event loop are savepoints of one transaction that commits at the next turn.

Waiters wake on changes made through store objects of this process (all objects on one
database share a notifier). On PostgreSQL they also wake when another process commits a
change (:class:`~voltrl.store.sql.dialects.ChangeListener`). On SQLite, where the process that
serves the store is its one writer in a VoltRL run, a commit by another process on the same
file is seen at the waiter's next wake-up (a change here, a lease expiry or its deadline), not
at once.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from voltrl.errors import StoreError
from voltrl.store.lifecycle import Notifier
from voltrl.store.sql.dialects import (
    SQLITE,
    ChangeListener,
    Connection,
    Dialect,
    WalCheckpointer,
)

_NOTIFIERS: weakref.WeakValueDictionary[str, Notifier] = weakref.WeakValueDictionary()
_NOTIFIERS_LOCK = threading.Lock()


def shared_notifier(key: str) -> Notifier:
    """One notifier per database in this process, so every store object on it wakes the
    others' waiters."""
    with _NOTIFIERS_LOCK:
        return _NOTIFIERS.setdefault(key, Notifier())


def sqlite_path(path_or_url: str | Path) -> Path:
    """The file of a SQLite store given as a path or a ``sqlite:///path`` URL (as in
    SQLAlchemy: ``sqlite:///runs/store.sqlite`` is relative, ``sqlite:////tmp/x`` absolute)."""
    text = str(path_or_url)
    if text.startswith("sqlite:"):
        if not text.startswith("sqlite:///") or len(text) == len("sqlite:///"):
            raise StoreError(f"bad SQLite URL {text!r}: expected sqlite:///PATH")
        text = text[len("sqlite:///") :]
    return Path(text).expanduser()


class Database:
    """The connection of one store object to ``target`` (a SQLite file or a PostgreSQL URL;
    ``location`` names it in messages, without a password), the transactions run on it, and
    ``changed``, the notifier its commits wake. ``read_only``: a reader's, which writes nothing
    (no schema, no checkpoint) and refuses every write."""

    def __init__(
        self,
        dialect: Dialect,
        target: str,
        location: str,
        notifier_key: str,
        *,
        read_only: bool = False,
    ) -> None:
        self.dialect, self.target, self.location = dialect, target, location
        self.read_only = read_only
        self.lock = threading.Lock()
        """Held by whoever uses the connection: one call at a time."""
        self.changed = shared_notifier(notifier_key)
        self.group: asyncio.Future[None] | None = None
        """The open group transaction's commit (:meth:`group_commits`)."""
        self._grouping = False
        self._notify_after_group = False
        self._listener: ChangeListener | None = None
        self._checkpointer: WalCheckpointer | None = None
        self._conn: Connection | None = self._open()

    def watch(self) -> None:
        """Start the threads that watch the database, once its schema exists: a PostgreSQL
        store hears other processes' commits, a SQLite store checkpoints its WAL."""
        self._listener = self.dialect.listen(self.target, self.changed.notify, self.own)
        if self.dialect is SQLITE and not self.read_only:  # commits no longer wait for checkpoints
            self._checkpointer = WalCheckpointer(self.target)
            self.connection().execute("PRAGMA wal_autocheckpoint=0")

    # ---- the connection ----------------------------------------------------------------
    def _open(self) -> Connection:
        conn = self.dialect.connect(self.target, read_only=self.read_only)
        try:
            for statement in self.dialect.reader_setup if self.read_only else self.dialect.setup:
                conn.execute(statement)
        except self.dialect.error as e:
            conn.close()
            raise StoreError(f"cannot open {self.dialect.name} store {self.location}: {e}") from e
        return conn

    def connection(self) -> Connection:
        """The open connection (opened again if the server dropped it)."""
        if self._conn is None:
            raise StoreError(f"store {self.location} is closed")
        if self.dialect.broken(self._conn):  # the server restarted: connect again
            self._conn = self._open()
        return self._conn

    def own(self) -> Connection | None:
        """The connection as it is, or None once closed (the listener tells its commits)."""
        return self._conn

    def close(self) -> None:
        """Stop the watching threads and close the connection."""
        with self.lock:
            if self._conn is not None:
                if self._listener is not None:
                    self._listener.close(self._conn)
                if self._checkpointer is not None:
                    self._checkpointer.close()
                    self._checkpointer = None
                self._conn.close()
                self._conn = None

    def _error(self, e: BaseException) -> StoreError:
        return StoreError(f"{self.dialect.name} store {self.location}: {e}")

    # ---- transactions ------------------------------------------------------------------
    @contextmanager
    def read(self) -> Iterator[Connection]:
        """The connection, for reads; the driver's errors become :class:`StoreError`."""
        with self.lock:
            try:
                yield self.connection()
            except self.dialect.error as e:
                raise self._error(e) from e

    @contextmanager
    def write(self) -> Iterator[Connection]:
        """One write transaction: committed on success, rolled back on any error (with
        :meth:`group_commits`, a savepoint of the group transaction). Refused read-only."""
        if self.read_only:
            raise StoreError(f"store {self.location} is open read-only: it cannot be written")
        if self._grouping:
            with self._grouped_write() as conn:
                yield conn
            return
        with self.lock:
            conn = self.connection()
            try:
                conn.execute(self.dialect.begin_write)
                yield conn
                conn.execute("COMMIT")
                if self._checkpointer is not None:
                    self._checkpointer.dirty = True
            except BaseException as e:
                if self.dialect.in_transaction(conn):
                    conn.execute("ROLLBACK")
                if isinstance(e, self.dialect.error):
                    raise self._error(e) from e
                raise

    def notify(self) -> None:
        """Wake waiters on this database; after the commit when a group is open."""
        if self.group is not None:
            self._notify_after_group = True
        else:
            self.changed.notify()

    # ---- group commits (SQLite) --------------------------------------------------------
    def group_commits(self) -> None:
        """Commit the writes of concurrent calls together (SQLite only; PostgreSQL ignores it).

        Each write still runs in a transaction of its own (a savepoint: an error undoes only
        that call's changes), but the savepoints of one turn of the event loop share one
        ``COMMIT``, run at the start of the next turn, and every call answers only once that
        commit is done: nothing is answered that is not committed, and a failed commit fails
        every call in it. A rollout's pages (the tail of each table and index) are written to
        the WAL once per group rather than once per call, which is most of a commit's cost.

        For a store used from one event loop only, as ``voltrl serve`` uses its own.
        """
        if self.dialect is SQLITE:
            self._grouping = True

    @contextmanager
    def _grouped_write(self) -> Iterator[Connection]:
        """A savepoint in the group transaction, which is opened (and its commit scheduled
        for the next turn of the event loop) if none is open."""
        with self.lock:
            conn = self.connection()
            try:
                if self.group is None:
                    loop = asyncio.get_running_loop()
                    conn.execute(self.dialect.begin_write)
                    self.group = loop.create_future()
                    loop.call_soon(self.commit_group)
                conn.execute("SAVEPOINT call")
            except self.dialect.error as e:
                raise self._error(e) from e
            try:
                yield conn
                conn.execute("RELEASE call")
            except BaseException as e:
                try:
                    conn.execute("ROLLBACK TO call")
                    conn.execute("RELEASE call")
                except self.dialect.error:  # the whole transaction is gone: end the group
                    if self.dialect.in_transaction(conn):
                        conn.execute("ROLLBACK")
                    group, self.group = self.group, None
                    if group is not None:
                        group.set_exception(StoreError(f"store {self.location}: {e}"))
                        group.exception()
                if isinstance(e, self.dialect.error):
                    raise self._error(e) from e
                raise

    def commit_group(self) -> None:
        """Commit the open group transaction; its calls get the outcome."""
        group, self.group = self.group, None
        if group is None:
            return
        error: BaseException | None = None
        with self.lock:
            conn = self._conn
            try:
                if conn is None:
                    raise StoreError(f"store {self.location} is closed")
                conn.execute("COMMIT")
            except self.dialect.error as e:
                error = self._error(e)
            except StoreError as e:
                error = e
            if error is not None and conn is not None and self.dialect.in_transaction(conn):
                conn.execute("ROLLBACK")
        if error is not None:
            group.set_exception(error)
            group.exception()  # retrieved by each waiting call; no warning if none is left
            return
        if self._checkpointer is not None:
            self._checkpointer.dirty = True
        group.set_result(None)
        if self._notify_after_group:
            self._notify_after_group = False
            self.changed.notify()

    @staticmethod
    async def group_committed(group: asyncio.Future[None]) -> None:
        """Wait for ``group``'s commit. A call that is cancelled meanwhile still waits for it
        (its changes are in the group), then raises the cancellation: it is not lost (a
        Ctrl-C that lands during a write still stops the run)."""
        try:
            await asyncio.shield(group)
        except asyncio.CancelledError:
            if not group.done():
                await group
            group.result()
            raise
