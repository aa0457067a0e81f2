"""The store tests' fixtures: ``store`` runs a test once per store implementation (memory,
SQLite, SQLite with grouped commits, PostgreSQL, the HTTP store server); ``store_factory``
builds more of one kind."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from voltrl._http.serving import BackgroundServer
from voltrl.store.base import Store
from voltrl.store.http import HTTPStore

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


@pytest.fixture(params=STORE_KINDS)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    s = await make_store(request.param, tmp_path)
    yield s
    await s.close()


@pytest.fixture
def store_factory(tmp_path: Path) -> Callable[[str], Awaitable[Store]]:
    """Build more stores of a given kind in this test's temporary directory."""
    return lambda kind: make_store(kind, tmp_path)
