"""Shared fixtures. ``store`` runs a test once per store implementation."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from voltrl.store.base import Store

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

STORE_KINDS = ["memory", "sqlite"]


async def make_store(kind: str, tmp_path: Path) -> Store:
    """A fresh, empty store of one kind."""
    if kind == "memory":
        from voltrl.store.memory import InMemoryStore

        return InMemoryStore()
    if kind == "sqlite":
        from voltrl.store.sql import SQLStore

        return SQLStore(tmp_path / "store.sqlite")
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
