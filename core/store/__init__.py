"""Stores: in-memory, SQL (SQLite or PostgreSQL), and the HTTP client.

:func:`open_store` turns a user's store spec (a CLI flag, a config value) into a store; see
:mod:`voltrl.store.spec`, the one place specs are resolved.
"""

from voltrl.store.base import Store
from voltrl.store.spec import StoreSpec, open_store, parse_store

__all__ = ["Store", "StoreSpec", "open_store", "parse_store"]
