"""Stores: in-memory, SQL (SQLite; PostgreSQL-ready), and the HTTP client.

:func:`open_store` turns a user's store spec (a CLI flag, a config value) into a store.
"""

from __future__ import annotations

import os
from pathlib import Path

from voltrl.errors import StoreError
from voltrl.store.base import Store


def open_store(spec: str | Path | None) -> Store:
    """The store a spec names: ``"memory"`` (or None) for an in-memory store; a file path or
    ``sqlite:///PATH`` for SQLite; ``http://``/``https://`` for a store server (bearer token
    from ``VOLTRL_TOKEN``). ``postgresql://`` is reserved and not supported yet."""
    text = "memory" if spec is None else str(spec)
    if text == "memory":
        from voltrl.store.memory import InMemoryStore

        return InMemoryStore()
    if text.startswith(("http://", "https://")):
        from voltrl.store.client import HTTPStore

        return HTTPStore(text, token=os.environ.get("VOLTRL_TOKEN"))
    if text.startswith(("postgresql:", "postgres:")):
        raise StoreError(
            f"cannot open {text.split('@')[-1]!r}: PostgreSQL support is not available yet; "
            "use a SQLite file (a path or sqlite:///PATH) or a store server (http://...)"
        )
    if "://" in text and not text.startswith("sqlite:"):
        raise StoreError(
            f"unknown store {text!r}: expected 'memory', a file path, sqlite:///PATH, "
            "http(s)://HOST:PORT"
        )
    from voltrl.store.sql import SQLStore

    return SQLStore(text)
