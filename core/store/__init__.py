"""Stores: in-memory, SQL (SQLite or PostgreSQL), and the HTTP client.

:func:`open_store` turns a user's store spec (a CLI flag, a config value) into a store.
"""

from __future__ import annotations

import os
from pathlib import Path

from voltrl.errors import StoreError
from voltrl.store.base import Store
from voltrl.store.sql.dialects import redact


def open_store(spec: str | Path | None) -> Store:
    """The store a spec names: ``"memory"`` (or None) for an in-memory store; a file path or
    ``sqlite:///PATH`` for SQLite; ``postgresql://USER:PASSWORD@HOST:PORT/DATABASE`` (or
    ``postgres://``) for PostgreSQL, with the ``postgres`` extra installed; ``http://`` or
    ``https://`` for a store server (bearer token from ``VOLTRL_TOKEN``). Raises
    :class:`~voltrl.errors.StoreError` when the store cannot be opened."""
    text = "memory" if spec is None else str(spec)
    if text == "memory":
        from voltrl.store.memory import InMemoryStore

        return InMemoryStore()
    if text.startswith(("http://", "https://")):
        from voltrl.store.http import HTTPStore

        return HTTPStore(text, token=os.environ.get("VOLTRL_TOKEN"))
    if "://" in text and not text.startswith(("sqlite:", "postgresql://", "postgres://")):
        raise StoreError(
            f"unknown store {redact(text)!r}: expected 'memory', a file path, sqlite:///PATH, "
            "postgresql://HOST:PORT/DATABASE, http(s)://HOST:PORT"
        )
    from voltrl.store.sql import SQLStore

    return SQLStore(text)
