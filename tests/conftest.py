"""Shared fixtures. ``store`` runs a test once per store implementation."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from voltrl._http.serving import BackgroundServer
from voltrl.store.base import Store
from voltrl.store.http import HTTPStore

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

STORE_KINDS = ["memory", "sqlite", "sqlite-grouped", "postgres", "http"]

HTTP_STORE_TOKEN = "test-token"


class ServedHTTPStore(HTTPStore):
    """An HTTP store client that owns its store server: closing it stops the server."""

    def __init__(self, server: BackgroundServer) -> None:
        super().__init__(server.url, HTTP_STORE_TOKEN)
        self.server = server

    async def close(self) -> None:
        await super().close()
        await asyncio.to_thread(self.server.stop)


async def make_store(kind: str, tmp_path: Path) -> Store:
    """A fresh, empty store of one kind."""
    if kind == "memory":
        from voltrl.store.memory import InMemoryStore

        return InMemoryStore()
    if kind == "sqlite":
        from voltrl.store.sql import SQLStore

        return SQLStore(tmp_path / "store.sqlite")
    if kind == "sqlite-grouped":  # what ``voltrl serve`` uses: concurrent writes commit together
        from voltrl.store.sql import SQLStore

        grouped = SQLStore(tmp_path / "store.sqlite")
        grouped.group_commits()
        return grouped
    if kind == "postgres":  # a fresh database on a real server (tests/pg.py), one per session
        from pg import new_database_url

        from voltrl.store.sql import SQLStore

        return SQLStore(new_database_url())
    if kind == "http":  # a real server on loopback, an in-memory store behind it
        from voltrl._http.serving import serve_in_thread
        from voltrl.store.http.endpoints import store_app
        from voltrl.store.memory import InMemoryStore

        return ServedHTTPStore(serve_in_thread(store_app(InMemoryStore(), token=HTTP_STORE_TOKEN)))
    raise ValueError(kind)


@pytest.fixture(scope="session", autouse=True)
def _stop_postgres() -> Iterator[None]:
    """Stop the PostgreSQL server of tests/pg.py, if a test started one, when the session ends."""
    yield
    from pg import stop_cluster

    stop_cluster()


@pytest.fixture(autouse=True)
def _forget_modules_of_temporary_directories(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[None]:
    """A test that runs ``voltrl train DIR/agents.py:...`` in this process leaves the file in
    ``sys.modules`` (as ``agents``) and DIR on ``sys.path``; a later test here that imports a
    package of that name (the OpenAI Agents SDK is ``agents``) got the file. After each test,
    modules loaded from the temporary directories and those directories on the path go."""
    modules = sys.modules.copy()
    yield
    base = str(tmp_path_factory.getbasetemp())
    sys.path[:] = [p for p in sys.path if not p.startswith(base)]
    # names only: a list of (name, module) pairs made GC sweep the whole heap, 15 ms a test
    loaded = [name for name, module in sys.modules.items() if modules.get(name) is not module]
    for name in loaded:
        if (getattr(sys.modules[name], "__file__", None) or "").startswith(base):
            if name in modules:
                sys.modules[name] = modules[name]
            else:
                del sys.modules[name]


@pytest.fixture(params=STORE_KINDS)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    s = await make_store(request.param, tmp_path)
    yield s
    await s.close()


@pytest.fixture
def store_factory(tmp_path: Path) -> Callable[[str], Awaitable[Store]]:
    """Build more stores of a given kind in this test's temporary directory."""
    return lambda kind: make_store(kind, tmp_path)
