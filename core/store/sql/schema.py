"""The SQL store's tables and indexes, their version, and the upgrade from version 1.

Rows hold the pydantic model as JSON in ``data``, next to real, indexed columns for what the
store filters and orders on (ids, status, mode, times, lease expiry, queue position, and
since version 2 what browsing filters and sorts on).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from voltrl.errors import StoreError
from voltrl.store.sql.dialects import Dialect

if TYPE_CHECKING:
    from voltrl.store.sql.connection import Database

SCHEMA_VERSION = 2
"""Version 2 added the rollout columns that browsing filters and sorts on (reward, resources
version, attempts, task id, start and end times), filled from each row's JSON on upgrade."""

TABLES = (
    "CREATE TABLE IF NOT EXISTS schema_version (version {int} NOT NULL)",
    "CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value {int} NOT NULL)",
    "CREATE TABLE IF NOT EXISTS runs (seq {id}, run_id TEXT NOT NULL UNIQUE, "
    "created_at {float} NOT NULL, data TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS resources (version {int} PRIMARY KEY, "
    "created_at {float} NOT NULL, data TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS rollouts (seq {id}, rollout_id TEXT NOT NULL UNIQUE, "
    "run_id TEXT, status TEXT NOT NULL, mode TEXT NOT NULL, created_at {float} NOT NULL, "
    "queue_seq {int}, data TEXT NOT NULL, task_id TEXT, resources_version {int}, "
    "reward {float}, attempt_count {int}, started_at {float}, finished_at {float})",
    "CREATE INDEX IF NOT EXISTS rollouts_queue ON rollouts (status, queue_seq)",
    "CREATE INDEX IF NOT EXISTS rollouts_created ON rollouts (created_at)",
    "CREATE INDEX IF NOT EXISTS rollouts_run ON rollouts (run_id, created_at)",
    "CREATE TABLE IF NOT EXISTS attempts (attempt_id TEXT PRIMARY KEY, "
    "rollout_id TEXT NOT NULL REFERENCES rollouts (rollout_id), idx {int} NOT NULL, "
    "status TEXT NOT NULL, lease_expires_at {float} NOT NULL, data TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS attempts_rollout ON attempts (rollout_id, idx)",
    "CREATE INDEX IF NOT EXISTS attempts_lease ON attempts (status, lease_expires_at)",
    *(
        f"CREATE TABLE IF NOT EXISTS {table} (seq {{id}}, "
        "rollout_id TEXT NOT NULL REFERENCES rollouts (rollout_id), "
        f"attempt_id TEXT NOT NULL, {extra}data TEXT NOT NULL)"
        for table, extra in (
            ("llm_calls", "sequence_id {int} NOT NULL, "),
            ("spans", "sequence_id {int}, "),
            ("rewards", ""),
        )
    ),
    *(
        f"CREATE INDEX IF NOT EXISTS {t}_rollout ON {t} (rollout_id, attempt_id)"
        for t in ("llm_calls", "spans", "rewards")
    ),
)
"""Every table and index, written with ``{tokens}`` for the dialect's types."""

ROLLOUT_COLUMNS = {  # added by version 2: name -> JSON path
    "task_id": "task.task_id",
    "resources_version": "resources_version",
    "reward": "reward",
    "attempt_count": "attempt_count",
    "started_at": "started_at",
    "finished_at": "finished_at",
}


class Schema:
    """The schema's statements rendered for one dialect."""

    def __init__(self, dialect: Dialect) -> None:
        self.version = dialect.render("SELECT version FROM schema_version")
        self.set_version = dialect.render("INSERT INTO schema_version (version) VALUES (?)")
        # Browsing by agent (``RolloutQuery.agent``) finds a rollout's calls of an agent
        # through this index, without reading each call's JSON.
        agent = dialect.json_value("data", "agent_name")
        agent_index = (
            f"CREATE INDEX IF NOT EXISTS llm_calls_agent ON llm_calls (rollout_id, {agent})"
        )
        self.create = (
            *(dialect.render(sql) for sql in TABLES),
            agent_index,
            *dialect.schema_extra,
        )
        """Statements that create whatever of the schema is missing."""
        types = {"task_id": "TEXT", "resources_version": dialect.int_type}
        self.upgrade_to_2 = (
            *(
                f"ALTER TABLE rollouts ADD COLUMN {c} {types.get(c, dialect.float_type)}"
                for c in ROLLOUT_COLUMNS
            ),
            "UPDATE rollouts SET "
            + ", ".join(
                f"{c} = {dialect.json_value('data', path, number=c != 'task_id')}"
                for c, path in ROLLOUT_COLUMNS.items()
            ),
            agent_index,
            "UPDATE schema_version SET version = 2",
        )
        """Statements that bring a version 1 store to version 2."""


def ensure_schema(db: Database) -> None:
    """Create the schema of a new database, upgrade a version 1 one; refuse other versions.
    A read-only database is only checked: it must hold this version's schema."""
    schema, dialect = Schema(db.dialect), db.dialect
    with db.read() as conn:
        try:
            row = conn.execute(schema.version).fetchone()
        except dialect.error as e:  # no schema yet (for a reader: or a file it cannot read)
            if db.read_only:
                raise StoreError(
                    f"store {db.location} cannot be read as a VoltRL store: {e}"
                ) from None
            row = None
    if db.read_only and (row is None or row[0] != SCHEMA_VERSION):
        found = "no schema version" if row is None else f"schema version {row[0]}"
        hint = (
            ": a store of an older VoltRL, upgraded when a writer next opens it (a run on "
            "it, or `voltrl serve --store` with its path or URL)"
            if row is not None and row[0] < SCHEMA_VERSION
            else ""
        )
        raise StoreError(
            f"store {db.location} has {found}; this VoltRL reads version {SCHEMA_VERSION}{hint}"
        )
    if row is None:
        with db.write() as conn:
            if dialect.schema_lock:
                conn.execute(dialect.schema_lock)
            for statement in schema.create:
                conn.execute(statement)
            row = conn.execute(schema.version).fetchone()
            if row is None:
                conn.execute(schema.set_version, (SCHEMA_VERSION,))
                row = (SCHEMA_VERSION,)
    if row[0] == 1:
        row = _upgrade_to_2(db, schema)
    if row[0] != SCHEMA_VERSION:
        raise StoreError(
            f"store {db.location} has schema version {row[0]}; this VoltRL reads version "
            f"{SCHEMA_VERSION}"
        )


def _upgrade_to_2(db: Database, schema: Schema) -> tuple[int]:
    """Add version 2's rollout columns to a version 1 store, filled from each rollout's
    JSON (once: a store another process upgraded meanwhile is left as it is)."""
    with db.write() as conn:
        if db.dialect.schema_lock:
            conn.execute(db.dialect.schema_lock)
        row = conn.execute(schema.version).fetchone()
        if row[0] == 1:
            for statement in schema.upgrade_to_2:
                conn.execute(statement)
            row = (2,)
    return row
