"""What only the PostgreSQL store promises: several processes on one database, durability of
acknowledged writes, the schema created on first open, a lost connection opened again, and
clear errors for bad URLs and unreachable servers. The store semantics shared with the other
stores are in ``tests/store/test_store.py`` (the ``postgres`` kind of the ``store`` fixture).

Every test runs against a real server on loopback (``tests/pg.py``), each on a fresh database.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from typing import Any

import psycopg
import pytest
from pg import new_database_url

from voltrl.errors import StoreError
from voltrl.store import open_store
from voltrl.store.sql import SQLStore
from voltrl.store.sql.dialects import PostgresDialect
from voltrl.types import LLMCall, Reward, Task

WRITER = textwrap.dedent(
    """
    import asyncio, sys
    from voltrl.store.sql import SQLStore
    from voltrl.types import AttemptResult, LLMCall, Span, Task

    async def main(url: str) -> None:
        store = SQLStore(url)
        i = 0
        while True:
            [r] = await store.enqueue([Task(input={"i": i})])
            c = await store.claim("writer")
            aid = c.attempt.attempt_id
            call = LLMCall(rollout_id=r.rollout_id, attempt_id=aid, prompt_token_ids=[i])
            await store.add_llm_calls([call])
            span = Span(rollout_id=r.rollout_id, attempt_id=aid, name=f"s{i}")
            await store.complete(aid, AttemptResult(status="succeeded", reward=i, spans=[span]))
            print(r.rollout_id, flush=True)
            i += 1

    asyncio.run(main(sys.argv[1]))
    """
)

CLAIMER = textwrap.dedent(
    """
    import asyncio, json, sys
    from voltrl.store.sql import SQLStore

    async def claim_all(store: SQLStore, name: str) -> list[str]:
        got = []
        while (c := await store.claim(name)) is not None:
            got.append(c.rollout.rollout_id)
        return got

    async def main(url: str, name: str) -> None:
        stores = [SQLStore(url) for _ in range(2)]  # two connections in this process
        print("ready", flush=True)
        sys.stdin.readline()  # all processes start claiming at once
        workers = [claim_all(s, f"{name}-{i}-{j}") for i, s in enumerate(stores) for j in (0, 1)]
        got = await asyncio.gather(*workers)
        for s in stores:
            await s.close()
        print(json.dumps([rid for ids in got for rid in ids]), flush=True)

    asyncio.run(main(*sys.argv[1:]))
    """
)

ONE_CHANGE = textwrap.dedent(
    """
    import asyncio, sys
    from voltrl.store.sql import SQLStore
    from voltrl.types import AttemptResult, Task

    async def main(url: str, attempt_id: str) -> None:
        store = SQLStore(url)
        if attempt_id == "-":
            [r] = await store.enqueue([Task(input={})])
            print(r.rollout_id, flush=True)
        else:
            await store.complete(attempt_id, AttemptResult(status="succeeded", reward=2))
        await store.close()

    asyncio.run(main(*sys.argv[1:]))
    """
)

PROCESS_LIMIT_S = 90  # far longer than any of these processes takes
WAKE_LIMIT_S = 20.0  # far longer than any wake-up takes; reaching it means no wake-up came


def python(script: str, *args: str, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", script, *args], text=True, **kw)


def tables_of(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
        )
        return {row[0] for row in rows}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
async def test_processes_claiming_from_one_database_never_get_the_same_rollout() -> None:
    url = new_database_url()
    store = SQLStore(url)
    rollouts = await store.enqueue([Task(input={"i": i}) for i in range(120)])
    claimers = [
        python(CLAIMER, url, f"p{i}", stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        for i in range(3)
    ]
    try:
        for claimer in claimers:  # all open their stores, then all start claiming at once
            assert await asyncio.to_thread(claimer.stdout.readline) == "ready\n"  # type: ignore[union-attr]
        for claimer in claimers:
            claimer.stdin.write("go\n")  # type: ignore[union-attr]
            claimer.stdin.flush()  # type: ignore[union-attr]
        claimed: list[str] = []
        for claimer in claimers:
            out, _ = await asyncio.to_thread(claimer.communicate, timeout=PROCESS_LIMIT_S)
            assert claimer.returncode == 0
            claimed += json.loads(out)
    finally:
        for claimer in claimers:
            claimer.kill()
            claimer.communicate()
    assert len(claimed) == len(set(claimed)) == 120
    assert set(claimed) == {r.rollout_id for r in rollouts}
    for r in await store.query_rollouts():  # one attempt each: no claim was ever made twice
        assert r.status == "running" and r.attempt_count == 1
        assert len(await store.get_attempts(r.rollout_id)) == 1
    await store.close()


@pytest.mark.slow
async def test_acknowledged_writes_survive_sigkill_of_the_writer() -> None:
    url = new_database_url()
    writer = python(WRITER, url, stdout=subprocess.PIPE)
    assert writer.stdout is not None
    timer = threading.Timer(PROCESS_LIMIT_S, writer.kill)  # a stuck writer ends the reads
    timer.start()
    try:
        acked = [await asyncio.to_thread(writer.stdout.readline) for _ in range(30)]
        os.kill(writer.pid, signal.SIGKILL)  # most likely in the middle of a transaction
        rest, _ = writer.communicate()
    finally:
        timer.cancel()
    assert writer.returncode == -signal.SIGKILL
    acked = [line.strip() for line in acked] + rest.split()
    assert all(acked) and len(acked) >= 30

    store = SQLStore(url)
    rollouts = {r.rollout_id: r for r in await store.query_rollouts(rollout_ids=acked)}
    assert list(rollouts) == acked
    for i, rollout_id in enumerate(acked):
        r = rollouts[rollout_id]
        assert r.status == "succeeded" and r.reward == i
        [call] = await store.get_llm_calls(rollout_id)
        assert call.prompt_token_ids == [i] and call.sequence_id == 0
        assert [s.name for s in await store.get_spans(rollout_id)] == [f"s{i}"]
    # the server dropped the killed writer's transaction and its locks: everything still works
    # (the writer may have died between an enqueue and its claim: cancel what it left behind)
    for r in await store.query_rollouts(status=["running", "queued"]):
        await store.cancel(r.rollout_id)
    [r] = await store.enqueue([Task(input={})])
    assert (await store.claim("w")).rollout.rollout_id == r.rollout_id  # type: ignore[union-attr]
    await store.close()


@pytest.mark.slow
async def test_waiters_wake_when_another_process_commits_a_change() -> None:
    url = new_database_url()
    store = SQLStore(url)
    claim = asyncio.create_task(store.claim("w", lease_s=600, wait_s=600))
    enqueuer = python(ONE_CHANGE, url, "-", stdout=subprocess.PIPE)
    out, _ = await asyncio.to_thread(enqueuer.communicate, timeout=PROCESS_LIMIT_S)
    c = await asyncio.wait_for(claim, WAKE_LIMIT_S)
    assert c is not None and c.rollout.rollout_id == out.strip()

    waiter = asyncio.create_task(store.wait_for_rollouts([c.rollout.rollout_id], timeout_s=600))
    completer = python(ONE_CHANGE, url, c.attempt.attempt_id)
    await asyncio.to_thread(completer.communicate, timeout=PROCESS_LIMIT_S)
    assert completer.returncode == 0
    [done] = await asyncio.wait_for(waiter, WAKE_LIMIT_S)
    assert done.status == "succeeded" and done.reward == 2
    await store.close()


async def test_schema_is_created_on_first_open_and_reopening_keeps_everything() -> None:
    url = new_database_url()
    assert tables_of(url) == set()
    store = SQLStore(url)
    assert {"schema_version", "counters", "runs", "resources", "rollouts", "attempts"} <= (
        tables_of(url)
    )
    assert {"llm_calls", "spans", "rewards"} <= tables_of(url)
    [r] = await store.enqueue([Task(input={"q": 1})])
    c = await store.claim("w")
    assert c is not None
    aid = c.attempt.attempt_id
    await store.add_llm_calls([LLMCall(rollout_id=r.rollout_id, attempt_id=aid)])
    await store.add_rewards([Reward(rollout_id=r.rollout_id, attempt_id=aid, value=0.5)])
    await store.close()

    reopened = SQLStore(url)
    assert (await reopened.get_rollout(r.rollout_id)).status == "running"
    [again] = await reopened.add_llm_calls([LLMCall(rollout_id=r.rollout_id, attempt_id=aid)])
    assert again.sequence_id == 1  # the counters carry on
    assert [rw.value for rw in await reopened.get_rewards(r.rollout_id)] == [0.5]
    await reopened.close()
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(2,)]
        conn.execute("UPDATE schema_version SET version = 99")
    with pytest.raises(StoreError, match="schema version 99"):
        SQLStore(url)


async def test_stores_opening_a_new_database_at_once_create_the_schema_once() -> None:
    url = new_database_url()
    stores = await asyncio.gather(*(asyncio.to_thread(SQLStore, url) for _ in range(4)))
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(2,)]
    for store in stores:
        await store.close()


async def test_transaction_aborted_to_break_a_deadlock_runs_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = new_database_url()
    store = SQLStore(url)
    await store.enqueue([Task(input={})])
    c = await store.claim("w")
    assert c is not None
    aborted: list[BaseException | None] = []
    retryable = PostgresDialect.retryable

    def spy(self: PostgresDialect, error: BaseException | None) -> bool:
        aborted.append(error)
        return retryable(self, error)

    monkeypatch.setattr(PostgresDialect, "retryable", spy)
    # cancel locks the rollout, then its attempt; another transaction holds the attempt and
    # then asks for the rollout. A waiting transaction looks for a deadlock once, its
    # deadlock_timeout after its wait began: the store's (1 s, the default) only asks for the
    # attempt once the other one waits for the rollout, so the deadlock is there when it looks,
    # and PostgreSQL breaks it by aborting the store's transaction (the other one would look
    # only after 60 s); the store runs it again.
    rollout_locked, ask_for_attempt = threading.Event(), threading.Event()
    one = SQLStore._one

    def paused(conn: Any, sql: str, params: tuple, cls: type) -> Any:
        if sql == store._sql.running_attempt_of and not rollout_locked.is_set():
            rollout_locked.set()  # the first run of cancel holds the rollout's lock
            assert ask_for_attempt.wait(PROCESS_LIMIT_S)
        return one(conn, sql, params, cls)

    monkeypatch.setattr(SQLStore, "_one", staticmethod(paused))
    with psycopg.connect(url) as other:
        try:
            other.execute("SET deadlock_timeout = '60s'")
            other.execute(
                "SELECT 1 FROM attempts WHERE attempt_id = %s FOR UPDATE", [c.attempt.attempt_id]
            )
            cancel = asyncio.create_task(store.cancel(c.rollout.rollout_id))
            assert await asyncio.to_thread(rollout_locked.wait, PROCESS_LIMIT_S)
            sql = "SELECT 1 FROM rollouts WHERE rollout_id = %s FOR UPDATE"
            grab = asyncio.create_task(
                asyncio.to_thread(other.execute, sql, [c.rollout.rollout_id])
            )
            while not await asyncio.to_thread(lock_waiters, url):  # the other one waits
                await asyncio.sleep(0.01)
            ask_for_attempt.set()  # the store's transaction asks for the attempt: a deadlock
            await asyncio.wait_for(grab, PROCESS_LIMIT_S)  # the rollout's lock, once it is broken
            other.commit()
        finally:
            ask_for_attempt.set()
    r = await asyncio.wait_for(cancel, PROCESS_LIMIT_S)
    assert r.status == "cancelled"
    assert aborted and all(isinstance(e, psycopg.errors.DeadlockDetected) for e in aborted)
    assert (await store.get_attempts(r.rollout_id))[0].status == "cancelled"
    await store.close()


def lock_waiters(url: str) -> int:
    """How many connections to this database wait for a row lock."""
    with psycopg.connect(url) as conn:
        sql = (
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return int(conn.execute(sql).fetchone()[0])  # type: ignore[index]


async def test_lost_connection_is_opened_again_on_the_next_call() -> None:
    url = new_database_url()
    store = SQLStore(url)
    [r] = await store.enqueue([Task(input={})])
    with psycopg.connect(url, autocommit=True) as admin:  # as when the server restarts
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    with pytest.raises(StoreError):  # the call that finds the connection gone fails...
        await store.get_rollout(r.rollout_id)
    assert (await store.get_rollout(r.rollout_id)).status == "queued"  # ...the next reconnects
    await store.close()


async def test_open_store_takes_postgresql_urls_and_never_shows_the_password() -> None:
    url = new_database_url()
    with_password = url.replace("voltrl@", "voltrl:s3cret@")  # the test server trusts loopback
    for spec in (with_password, with_password.replace("postgresql://", "postgres://")):
        store = open_store(spec)
        assert isinstance(store, SQLStore) and store.path is None
        assert "s3cret" not in repr(store) and "***" in repr(store)
        await store.enqueue([Task(input={})])
        await store.close()
    with pytest.raises(StoreError, match="is closed"):
        await store.query_rollouts()


async def test_unreachable_server_or_bad_url_is_a_clear_store_error() -> None:
    port = free_port()  # nothing listens there
    with pytest.raises(
        StoreError, match=f"cannot connect to PostgreSQL at 127.0.0.1:{port}/db"
    ) as info:
        open_store(f"postgresql://voltrl:s3cret@127.0.0.1:{port}/db")
    assert "s3cret" not in str(info.value) and info.value.__cause__ is None
    with pytest.raises(StoreError, match="bad PostgreSQL URL"):
        open_store("postgresql://voltrl:s3cret@127.0.0.1:notaport/db")
    missing = new_database_url().rsplit("/", 1)[0] + "/no_such_database"
    with pytest.raises(StoreError, match='database "no_such_database" does not exist'):
        open_store(missing)


async def test_missing_psycopg_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as if it were not installed
    with pytest.raises(StoreError, match=r"pip install 'voltrl\[postgres\]'"):
        open_store("postgresql://voltrl@127.0.0.1:5432/db")
