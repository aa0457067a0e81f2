"""A real PostgreSQL server for tests, started once per test process on loopback.

``new_database_url()`` is what a test needs: the URL of a fresh, empty database on that
server (``postgresql://voltrl@127.0.0.1:PORT/voltrl_...``), for ``SQLStore``/``open_store``
in this process or in child processes (a store server, runners, writers to SIGKILL).

The server is found and started like this:

- binaries: ``initdb`` and ``pg_ctl`` from ``$VOLTRL_PG_BINDIR``, the directory of ``initdb``
  on PATH, ``pg_config --bindir``, or the newest ``/usr/lib/postgresql/*/bin`` (Debian);
- ``initdb`` into a new directory under the system's temporary directory, trust
  authentication for user ``voltrl``, then ``pg_ctl start`` on a free loopback port, with its
  unix socket in that directory too;
- PostgreSQL refuses to run as root, so as root both run as the ``postgres`` system user
  (``nobody`` when there is none) through ``runuser``, owning that directory;
- ``fsync=off``: no test crashes the machine, and a killed process (client or server) loses
  nothing the operating system already has;
- stopped and deleted at the end of the session (``stop_cluster``, also at exit).

When no binaries are found or the server does not start, :class:`PostgresUnavailable` says
why and how to install PostgreSQL; tests that need it fail, they are never skipped.
"""

from __future__ import annotations

import atexit
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
import uuid
from pathlib import Path

INSTALL_HINT = (
    "the store tests start a PostgreSQL server of their own and need only its binaries "
    "(initdb, pg_ctl): set VOLTRL_PG_BINDIR (`make test PG_BINDIR=...`) to the directory that "
    "holds them, or let `make test` install them (scripts/test_postgres.sh: Debian's "
    "postgresql package, its system service stopped again)"
)
USER = "voltrl"  # the database superuser the tests connect as


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server could be started for the tests."""


def find_bindir() -> Path | None:
    """The directory with ``initdb`` and ``pg_ctl``, or None."""
    candidates: list[str] = []
    if env := os.environ.get("VOLTRL_PG_BINDIR"):
        candidates.append(env)
    if initdb := shutil.which("initdb"):
        candidates.append(str(Path(initdb).resolve().parent))
    if pg_config := shutil.which("pg_config"):
        result = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
        candidates.append(result.stdout.strip())
    versions = glob.glob("/usr/lib/postgresql/*/bin")
    candidates += sorted(versions, key=lambda d: int(Path(d).parent.name), reverse=True)
    for candidate in candidates:
        if candidate and all((Path(candidate) / exe).is_file() for exe in ("initdb", "pg_ctl")):
            return Path(candidate)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresCluster:
    """One PostgreSQL server in a directory of its own; :meth:`start` it, then ask it for
    databases with :meth:`new_database_url`."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="voltrl-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = 0
        self._as_user: list[str] = []
        if os.geteuid() == 0:  # postgres refuses to run as root
            user = _unprivileged_user()
            entry = pwd.getpwnam(user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            self._as_user = ["runuser", "-u", user, "--"]

    def url(self, database: str = "postgres") -> str:
        """The URL of one database on this server."""
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str) -> None:
        command = [*self._as_user, *args]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise PostgresUnavailable(
                f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}"
                f"{result.stderr}{log}\n{INSTALL_HINT}"
            )

    def start(self) -> None:
        """Create the cluster and start its server on a free loopback port."""
        self._run(
            str(self.bindir / "initdb"),
            *("-D", str(self.data), "-U", USER, "--auth=trust", "-E", "UTF8", "--no-sync"),
        )
        for tries_left in reversed(range(3)):  # another process may take the port first
            self.port = _free_port()
            options = (
                f"-c listen_addresses=127.0.0.1 -c port={self.port} "
                f"-c unix_socket_directories={self.root} -c fsync=off "
                "-c full_page_writes=off -c max_connections=300"
            )
            try:
                self._run(
                    str(self.bindir / "pg_ctl"),
                    *("-D", str(self.data), "-l", str(self.log), "-o", options),
                    *("-w", "-t", "60", "start"),
                )
                return
            except PostgresUnavailable:
                if not tries_left:
                    raise

    def stop(self) -> None:
        """Stop the server and delete its directory."""
        if (self.data / "postmaster.pid").exists():
            pg_ctl = str(self.bindir / "pg_ctl")
            stop = [pg_ctl, "-D", str(self.data), "-m", "immediate", "-w", "stop"]
            subprocess.run([*self._as_user, *stop], capture_output=True, timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)

    def new_database_url(self) -> str:
        """Create an empty database; returns its URL."""
        import psycopg

        name = f"voltrl_{uuid.uuid4().hex[:16]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)


def _unprivileged_user() -> str:
    for user in ("postgres", "nobody"):
        try:
            pwd.getpwnam(user)
            return user
        except KeyError:
            continue
    raise PostgresUnavailable(
        "running as root and no 'postgres' or 'nobody' user to run PostgreSQL as"
    )


_lock = threading.Lock()
_cluster: PostgresCluster | None = None
_failure: PostgresUnavailable | None = None


def cluster() -> PostgresCluster:
    """The server of this test process, started on first use."""
    global _cluster, _failure
    with _lock:
        if _failure is not None:
            raise _failure
        if _cluster is None:
            bindir = find_bindir()
            if bindir is None:
                _failure = PostgresUnavailable(f"PostgreSQL not found: {INSTALL_HINT}")
                raise _failure
            started = PostgresCluster(bindir)
            try:
                started.start()
            except PostgresUnavailable as e:
                started.stop()
                _failure = e
                raise
            atexit.register(started.stop)
            _cluster = started
        return _cluster


def new_database_url() -> str:
    """The URL of a fresh, empty database on this process's test server."""
    return cluster().new_database_url()


def stop_cluster() -> None:
    """Stop this process's test server, if one was started."""
    global _cluster
    with _lock:
        if _cluster is not None:
            _cluster.stop()
            _cluster = None


if __name__ == "__main__":  # scripts/test_postgres.sh: where the binaries are, if anywhere
    found = find_bindir()
    if found is not None:
        print(found)
    raise SystemExit(0 if found is not None else 1)
