"""Every SQL statement the store runs, written once, and the columns it writes per row."""

from __future__ import annotations

from typing import Any, ClassVar

from voltrl.store.browse import RolloutQuery
from voltrl.store.sql.dialects import Dialect
from voltrl.types import Attempt, Rollout


class Statements:
    """Every SQL statement the store runs, written once with ``?`` placeholders and
    ``{tokens}``; an instance holds them rendered for one dialect."""

    bump = (
        "INSERT INTO counters (name, value) VALUES (?, ?) ON CONFLICT (name) "
        "DO UPDATE SET value = counters.value + excluded.value RETURNING value"
    )
    upsert_run = (
        "INSERT INTO runs (run_id, created_at, data) VALUES (?, ?, ?) ON CONFLICT (run_id) "
        "DO UPDATE SET created_at = excluded.created_at, data = excluded.data"
    )
    list_runs = "SELECT data FROM runs ORDER BY created_at, seq"
    last_resources_version = "SELECT COALESCE(MAX(version), 0) FROM resources"
    insert_resources = "INSERT INTO resources (version, created_at, data) VALUES (?, ?, ?)"
    get_resources = "SELECT data FROM resources WHERE version = ?"
    latest_resources = "SELECT data FROM resources ORDER BY version DESC LIMIT 1"
    insert_rollout = (
        "INSERT INTO rollouts (rollout_id, run_id, mode, created_at, task_id, status, "
        "queue_seq, data, resources_version, reward, attempt_count, started_at, finished_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    )
    update_rollout = (
        "UPDATE rollouts SET status = ?, queue_seq = ?, data = ?, resources_version = ?, "
        "reward = ?, attempt_count = ?, started_at = ?, finished_at = ? WHERE rollout_id = ?"
    )
    get_rollout = "SELECT data FROM rollouts WHERE rollout_id = ?{row_lock}"
    read_rollout = "SELECT data FROM rollouts WHERE rollout_id = ?"
    rollout_exists = "SELECT 1 FROM rollouts WHERE rollout_id = ?"
    next_queued = (
        "SELECT data FROM rollouts WHERE status = 'queued' ORDER BY queue_seq LIMIT 1{claim_lock}"
    )
    insert_attempt = (
        "INSERT INTO attempts (attempt_id, rollout_id, idx, status, lease_expires_at, data) "
        "VALUES (?, ?, ?, ?, ?, ?)"
    )
    update_attempt = (
        "UPDATE attempts SET status = ?, lease_expires_at = ?, data = ? WHERE attempt_id = ?"
    )
    get_attempt = "SELECT data FROM attempts WHERE attempt_id = ?{row_lock}"
    running_attempt_of = (
        "SELECT data FROM attempts WHERE rollout_id = ? AND status = 'running'{row_lock}"
    )
    attempts_of = "SELECT data FROM attempts WHERE rollout_id = ? ORDER BY idx"
    any_due = "SELECT 1 FROM attempts WHERE status = 'running' AND lease_expires_at <= ? LIMIT 1"
    due_attempts = (
        "SELECT data FROM attempts WHERE status = 'running' AND lease_expires_at <= ? "
        "ORDER BY lease_expires_at, attempt_id{row_lock}"
    )
    next_expiry = "SELECT MIN(lease_expires_at) FROM attempts WHERE status = 'running'"
    insert_call = (
        "INSERT INTO llm_calls (rollout_id, attempt_id, sequence_id, data) VALUES (?, ?, ?, ?)"
    )
    insert_span = (
        "INSERT INTO spans (rollout_id, attempt_id, sequence_id, data) VALUES (?, ?, ?, ?)"
    )
    insert_reward = "INSERT INTO rewards (rollout_id, attempt_id, data) VALUES (?, ?, ?)"

    BROWSE_FILTERS: ClassVar[dict[str, str]] = {  # RolloutQuery field -> its condition
        "run_id": "run_id = ?",
        "mode": "mode = ?",
        "reward_min": "reward >= ?",
        "reward_max": "reward <= ?",
        "resources_version": "resources_version = ?",
        "task_id": "task_id = ?",
        "min_attempts": "attempt_count >= ?",
    }

    FILTERS: ClassVar[dict[str, str]] = {
        "run_id": "run_id = ?",
        "mode": "mode = ?",
        "since": "created_at >= ?",
        "until": "created_at < ?",
    }

    def __init__(self, dialect: Dialect) -> None:
        self._render = dialect.render
        self._dialect = dialect
        for name, sql in vars(Statements).items():
            if isinstance(sql, str) and not name.startswith("_"):
                setattr(self, name, dialect.render(sql))
        self.records_of = {
            (table, by_attempt): dialect.render(
                f"SELECT data FROM {table} WHERE rollout_id = ?"
                + (" AND attempt_id = ?" if by_attempt else "")
                + " ORDER BY seq"
            )
            for table in ("llm_calls", "spans", "rewards")
            for by_attempt in (False, True)
        }

    def query_rollouts(self, filters: dict[str, Any], limit: int | None) -> tuple[str, list]:
        """The rollout query for the filters of :meth:`Store.query_rollouts`, by name (None,
        or an empty status list, does not filter), oldest first."""
        where, params = [], []
        for name, value in filters.items():
            if value is None or (name == "status" and not value):
                continue
            if name in ("status", "rollout_ids"):
                column = "status" if name == "status" else "rollout_id"
                where.append(f"{column} IN ({', '.join(['?'] * len(value))})")
                params.extend(value)
            else:
                where.append(self.FILTERS[name])
                params.append(value)
        sql = "SELECT created_at, seq, data FROM rollouts"
        sql += f" WHERE {' AND '.join(where)}" if where else ""
        sql += " ORDER BY created_at, seq" + (" LIMIT ?" if limit is not None else "")
        return self._render(sql), params if limit is None else [*params, limit]

    def browse_rollouts(self, query: RolloutQuery) -> tuple[str, str, list[Any]]:
        """The page query and the (capped) count query of :meth:`Store.browse_rollouts`,
        and their shared parameters: the page query then takes ``limit, offset``, the count
        query ``COUNT_CAP + 1``. The filters mean what :func:`voltrl.store.browse.matches`
        says."""
        d = self._dialect

        def num(path: str, column: str = "data") -> str:
            return d.json_value(column, path, number=True)

        where: list[str] = []
        params: list[Any] = []

        def add(sql: str, *values: Any) -> None:
            where.append(sql)
            params.extend(values)

        q = query
        for name, condition in self.BROWSE_FILTERS.items():
            value = getattr(q, name)
            if value is not None:
                add(condition, value)
        if q.status:
            add(f"status IN ({', '.join('?' * len(q.status))})", *q.status)
        if q.text:
            escaped = q.text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            add(f"{d.json_text('data', 'task')} {d.like} ? ESCAPE '\\'", f"%{escaped}%")
        if q.agent is not None:
            agent = d.json_value("c.data", "agent_name")  # as indexed (llm_calls_agent)
            add(
                "EXISTS (SELECT 1 FROM llm_calls c WHERE c.rollout_id = rollouts.rollout_id "
                f"AND {agent} = ?)",
                q.agent,
            )
        sort = {
            "created_at": "created_at",
            "status": "status",
            "reward": "reward",
            "attempts": "attempt_count",
            "resources_version": "resources_version",
            "duration": "(finished_at - started_at)",
        }[q.sort]
        way = "DESC" if q.descending else "ASC"
        filters = f" WHERE {' AND '.join(where)}" if where else ""
        nulls = "" if q.sort in ("created_at", "status") else f"({sort}) IS NULL, "  # NOT NULL
        page = (
            f"SELECT data FROM rollouts{filters} ORDER BY {nulls}{sort} {way}, "
            f"created_at {way}, rollout_id {way} LIMIT ? OFFSET ?"
        )
        count = f"SELECT COUNT(*) FROM (SELECT 1 FROM rollouts{filters} LIMIT ?) AS matched"
        mark = d.placeholder
        return page.replace("?", mark), count.replace("?", mark), params

    def rollout_counts(self) -> str:
        """The query of :meth:`Store.rollout_counts` (one parameter: the run id): rows of
        mode, resources version, status, count, rewarded, reward sum, sum of squares."""
        d = self._dialect
        ok = "status = 'succeeded' AND reward IS NOT NULL"
        sql = (
            "SELECT mode, resources_version, status, COUNT(*), "
            f"SUM(CASE WHEN {ok} THEN 1 ELSE 0 END), "
            f"SUM(CASE WHEN {ok} THEN reward ELSE 0 END), "
            f"SUM(CASE WHEN {ok} THEN reward * reward ELSE 0 END) "
            "FROM rollouts WHERE run_id = ? GROUP BY mode, resources_version, status"
        )
        return sql.replace("?", d.placeholder)


def rollout_row(r: Rollout, queue_seq: int | None) -> tuple[Any, ...]:
    """A rollout's columns in the order of ``Statements.insert_rollout``; the last eight
    are the ones ``Statements.update_rollout`` sets."""
    return (
        r.rollout_id,
        r.run_id,
        r.mode,
        r.created_at,
        r.task.task_id,
        r.status,
        queue_seq,
        r.model_dump_json(),
        r.resources_version,
        r.reward,
        r.attempt_count,
        r.started_at,
        r.finished_at,
    )


def attempt_row(a: Attempt) -> tuple[Any, ...]:
    """An attempt's columns after its id, in the order of ``Statements.insert_attempt``; the
    last three are the ones ``Statements.update_attempt`` sets."""
    return (a.rollout_id, a.index, a.status, a.lease_expires_at, a.model_dump_json())
