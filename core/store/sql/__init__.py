"""The SQL store: durable rollouts, attempts and records in SQLite (default) or PostgreSQL."""

from voltrl.store.sql.store import SQLStore, sqlite_path

__all__ = ["SQLStore", "sqlite_path"]
