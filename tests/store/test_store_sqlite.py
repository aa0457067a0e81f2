"""What only the SQLite store promises: durability, several connections and processes on one
file, schema versioning, and how store specs are opened."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from voltrl.errors import StoreError
from voltrl.resources import LLM, Resources
from voltrl.store import open_store
from voltrl.store.memory import InMemoryStore
from voltrl.store.sql import SQLStore, sqlite_path
from voltrl.types import AttemptResult, LLMCall, Reward, Run, Span, Task

WAKE_LIMIT_S = 20.0  # far longer than any wake-up takes; reaching it means no wake-up came

WRITER = textwrap.dedent(
    """
    import asyncio, sys
    from voltrl.store.sql import SQLStore
    from voltrl.types import AttemptResult, LLMCall, Span, Task

    async def main(path: str, limit: int) -> None:
        store = SQLStore(path)
        i = 0
        while limit < 0 or i < limit:
            [r] = await store.enqueue([Task(input={"i": i})])
            c = await store.claim("writer")
            aid = c.attempt.attempt_id
            call = LLMCall(rollout_id=r.rollout_id, attempt_id=aid, prompt_token_ids=[i])
            await store.add_llm_calls([call])
            span = Span(rollout_id=r.rollout_id, attempt_id=aid, name=f"s{i}")
            await store.complete(aid, AttemptResult(status="succeeded", reward=i, spans=[span]))
            print(r.rollout_id, flush=True)
            i += 1
        await store.close()

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
    """
)

FINISHER = textwrap.dedent(
    """
    import asyncio, sys
    from voltrl.store.sql import SQLStore
    from voltrl.types import AttemptResult

    async def main(path: str) -> None:
        store = SQLStore(path)
        c = await store.claim("other-process")
        await store.complete(c.attempt.attempt_id, AttemptResult(status="succeeded", reward=7))
        await store.close()

    asyncio.run(main(sys.argv[1]))
    """
)

CLAIMER = textwrap.dedent(
    """
    import asyncio, os, sys, time
    from voltrl.store.sql import SQLStore

    async def main(path: str, name: str, go: str) -> None:
        store = SQLStore(path)
        print("ready", flush=True)
        while not os.path.exists(go):
            time.sleep(0.005)
        while (c := await store.claim(name)) is not None:
            print(c.rollout.rollout_id, flush=True)
            time.sleep(0.0005)
        await store.close()

    asyncio.run(main(*sys.argv[1:]))
    """
)


def python(script: str, *args: str, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", script, *args], text=True, **kw)


async def snapshot(store: SQLStore) -> dict[str, Any]:
    """Everything the store holds, as plain data."""
    rollouts = await store.query_rollouts()
    out: dict[str, Any] = {
        "runs": await store.list_runs(),
        "resources": [await store.get_resources(v) for v in (1, 2)],
        "rollouts": rollouts,
    }
    for r in rollouts:
        out[r.rollout_id] = (
            await store.get_attempts(r.rollout_id),
            await store.get_llm_calls(r.rollout_id),
            await store.get_spans(r.rollout_id),
            await store.get_rewards(r.rollout_id),
        )
    return out


async def populate(store: SQLStore) -> None:
    """Records of every kind, with rollouts in every state."""
    await store.add_run(Run(name="fit-1", kind="fit", config={"lr": 1e-6}))
    llm = LLM(endpoint="http://127.0.0.1:9/v1", model="tiny")
    await store.add_resources(Resources(items={"main_llm": llm}))
    await store.add_resources(Resources(items={"main_llm": llm.model_copy(update={"model": "2"})}))
    rollouts = await store.enqueue([Task(input={"q": str(i)}) for i in range(5)], run_id="r")
    done, _failed, _running, cancelled, _queued = rollouts
    c = await store.claim("w")
    assert c is not None and c.rollout.rollout_id == done.rollout_id
    aid = c.attempt.attempt_id
    await store.add_llm_calls(
        [LLMCall(rollout_id=done.rollout_id, attempt_id=aid, response_token_ids=[5, 6])]
    )
    await store.add_rewards([Reward(rollout_id=done.rollout_id, attempt_id=aid, value=0.5)])
    span = Span(rollout_id=done.rollout_id, attempt_id=aid, name="tool", attributes={"x": 1})
    await store.complete(aid, AttemptResult(status="succeeded", reward=1.0, spans=[span]))
    c = await store.claim("w")
    assert c is not None
    await store.complete(c.attempt.attempt_id, AttemptResult(status="failed", error="boom"))
    assert (await store.claim("w", lease_s=300)) is not None
    await store.cancel(cancelled.rollout_id)


async def test_everything_acknowledged_survives_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "store.sqlite"
    store = SQLStore(path)
    await populate(store)
    before = await snapshot(store)
    await store.close()

    reopened = SQLStore(f"sqlite:///{path}")
    assert await snapshot(reopened) == before
    statuses = [r.status for r in before["rollouts"]]
    assert statuses == ["succeeded", "queued", "running", "cancelled", "queued"]
    # the queue order (the retried rollout went to the back) and the sequence counters carry on
    c = await reopened.claim("w")
    assert c is not None and c.rollout.rollout_id == before["rollouts"][4].rollout_id
    done = before["rollouts"][0]
    [again] = await reopened.add_llm_calls(
        [LLMCall(rollout_id=done.rollout_id, attempt_id=before[done.rollout_id][0][0].attempt_id)]
    )
    assert again.sequence_id == 1
    assert (await reopened.get_resources()).version == 2  # type: ignore[union-attr]
    await reopened.close()


async def test_acknowledged_writes_survive_sigkill_of_the_writer(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite"
    writer = python(WRITER, str(path), "-1", stdout=subprocess.PIPE)
    assert writer.stdout is not None
    acked = [writer.stdout.readline().strip() for _ in range(40)]
    os.kill(writer.pid, signal.SIGKILL)
    rest, _ = writer.communicate()
    assert writer.returncode == -signal.SIGKILL
    acked += rest.split()

    store = SQLStore(path)
    rollouts = {r.rollout_id: r for r in await store.query_rollouts(rollout_ids=acked)}
    assert list(rollouts) == acked
    for i, rollout_id in enumerate(acked):
        r = rollouts[rollout_id]
        assert r.status == "succeeded" and r.reward == i
        [call] = await store.get_llm_calls(rollout_id)
        assert call.prompt_token_ids == [i] and call.sequence_id == 0
        assert [s.name for s in await store.get_spans(rollout_id)] == [f"s{i}"]
    # the store still works after recovering from the crash; the writer may have died between
    # an enqueue and its claim, leaving one unacknowledged rollout queued ahead of ours
    leftover = await store.query_rollouts(status="queued")
    assert len(leftover) <= 1
    [r] = await store.enqueue([Task(input={})])
    claims = [await store.claim("w") for _ in range(len(leftover) + 1)]
    assert claims[-1] is not None and claims[-1].rollout.rollout_id == r.rollout_id
    await store.close()


@pytest.mark.slow
async def test_processes_claiming_from_one_file_never_get_the_same_rollout(
    tmp_path: Path,
) -> None:
    path = tmp_path / "store.sqlite"
    store = SQLStore(path)
    rollouts = await store.enqueue([Task(input={"i": i}) for i in range(300)])
    go = tmp_path / "go"
    claimers = [
        python(CLAIMER, str(path), f"p{i}", str(go), stdout=subprocess.PIPE) for i in range(3)
    ]
    for claimer in claimers:  # all open the store, then all start claiming at once
        assert await asyncio.to_thread(claimer.stdout.readline) == "ready\n"  # type: ignore[union-attr]
    go.touch()
    claimed = []
    for claimer in claimers:
        out, _ = await asyncio.to_thread(claimer.communicate)
        assert claimer.returncode == 0
        claimed += out.split()
    assert len(claimed) == len(set(claimed)) == 300
    assert set(claimed) == {r.rollout_id for r in rollouts}
    await store.close()


@pytest.mark.slow
async def test_reader_in_another_process_sees_only_whole_reports(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite"
    await SQLStore(path).close()  # create the file before the writer starts
    writer = python(WRITER, str(path), "-1", stdout=subprocess.PIPE)
    assert writer.stdout is not None
    reader = SQLStore(path)
    try:
        writer.stdout.readline()
        seen = 0
        for _ in range(30):
            finished = await reader.query_rollouts(status="succeeded")
            assert len(finished) >= seen
            seen = len(finished)
            for r in finished[-3:]:
                assert len(await reader.get_spans(r.rollout_id)) == 1
                assert len(await reader.get_llm_calls(r.rollout_id)) == 1
            await asyncio.sleep(0.01)
        assert seen > 0
    finally:
        writer.kill()
        writer.communicate()
        await reader.close()


async def test_second_store_on_the_same_file_reads_writes_and_wakes_waiters(
    tmp_path: Path,
) -> None:
    writer, reader = SQLStore(tmp_path / "s.sqlite"), SQLStore(tmp_path / "s.sqlite")
    [r] = await writer.enqueue([Task(input={"a": 1})])
    assert (await reader.get_rollout(r.rollout_id)).status == "queued"
    waiter = asyncio.create_task(reader.wait_for_rollouts([r.rollout_id], timeout_s=60.0))
    claimed = asyncio.create_task(reader.claim("reader", wait_s=60.0))
    c = await asyncio.wait_for(claimed, WAKE_LIMIT_S)
    assert c is not None and c.rollout.rollout_id == r.rollout_id
    await asyncio.sleep(0.02)
    assert not waiter.done()
    await writer.complete(c.attempt.attempt_id, AttemptResult(status="succeeded", reward=3))
    [done] = await asyncio.wait_for(waiter, WAKE_LIMIT_S)
    assert done.reward == 3
    await writer.close()
    await reader.close()


async def test_store_file_uses_wal_journal_and_records_schema_version(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite"
    await SQLStore(path).close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("SELECT version FROM schema_version").fetchall() == [(2,)]
    conn.execute("UPDATE schema_version SET version = 99")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="schema version 99"):
        SQLStore(path)


async def test_closed_store_raises_store_error(tmp_path: Path) -> None:
    store = SQLStore(tmp_path / "s.sqlite")
    await store.close()
    await store.close()
    with pytest.raises(StoreError, match="closed"):
        await store.query_rollouts()


def test_sqlite_urls_and_paths_name_the_file(tmp_path: Path) -> None:
    assert sqlite_path("sqlite:///runs/s.db") == Path("runs/s.db")
    assert sqlite_path("sqlite:////tmp/s.db") == Path("/tmp/s.db")
    assert sqlite_path(tmp_path / "s.db") == tmp_path / "s.db"
    for bad in ("sqlite://host/s.db", "sqlite:///"):
        with pytest.raises(StoreError, match="bad SQLite URL"):
            sqlite_path(bad)


async def test_open_store_picks_the_implementation_from_the_spec(tmp_path: Path) -> None:
    assert isinstance(open_store("memory"), InMemoryStore)
    assert isinstance(open_store(None), InMemoryStore)
    for spec in (tmp_path / "a.sqlite", str(tmp_path / "b.sqlite"), f"sqlite:///{tmp_path}/c"):
        store = open_store(spec)
        assert isinstance(store, SQLStore) and store.path.exists()
        await store.close()
    with pytest.raises(StoreError, match=r"cannot connect to PostgreSQL at 127\.0\.0\.1:1/"):
        open_store("postgresql://user:secret@127.0.0.1:1/voltrl")  # see test_store_postgres.py
    with pytest.raises(StoreError, match="unknown store"):
        open_store("redis://localhost")


def test_open_store_uses_the_http_client_for_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    from voltrl.store.http import client

    monkeypatch.setenv("VOLTRL_TOKEN", "tok")
    store = open_store("http://127.0.0.1:1")
    assert isinstance(store, client.HTTPStore)
