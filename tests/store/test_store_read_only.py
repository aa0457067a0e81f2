"""A reader's store (``read_only=True``: ``voltrl show``, ``voltrl runs``, the dashboard, SFT's
sources) reads what a writer wrote, beside it, and writes nothing: not its schema, not a WAL
checkpoint, not an upgrade of an older store (SQLite may add an empty WAL and its index
beside the file); a write is refused with a clear error."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from pg import new_database_url

from voltrl.errors import StoreError
from voltrl.store.spec import parse_store
from voltrl.store.sql import SQLStore
from voltrl.types import AttemptResult, Run, Task


def fingerprint(directory: Path) -> str:
    """The database file's content, once nothing is left in a WAL beside it (SQLite may make
    an empty WAL and its index to read a WAL database: they hold nothing)."""
    wal = directory / "store.sqlite-wal"
    assert not wal.exists() or wal.stat().st_size == 0
    return hashlib.sha1((directory / "store.sqlite").read_bytes()).hexdigest()


async def write_run(store: SQLStore) -> str:
    run = await store.add_run(Run(name="written", kind="dev", status="finished"))
    await store.enqueue([Task(input={"q": 1})], run_id=run.run_id)
    claim = await store.claim("w")
    assert claim is not None
    await store.complete(claim.attempt.attempt_id, AttemptResult(status="succeeded", reward=1.0))
    return run.run_id


async def test_a_reader_reads_a_finished_store_and_leaves_every_byte_as_it_was(
    tmp_path: Path,
) -> None:
    writer = SQLStore(tmp_path / "store.sqlite")
    run_id = await write_run(writer)
    await writer.close()
    before = fingerprint(tmp_path)
    reader = parse_store(tmp_path, existing=True).open(threaded=True, read_only=True)
    try:
        [run] = await reader.list_runs()
        assert run.run_id == run_id
        [rollout] = await reader.query_rollouts(run_id=run_id)
        assert rollout.reward == 1.0
        with pytest.raises(StoreError, match="is open read-only: it cannot be written"):
            await reader.add_run(Run(name="sneaked", kind="dev"))
    finally:
        await reader.close()
    assert fingerprint(tmp_path) == before


async def test_a_reader_sees_what_a_writer_commits_beside_it(tmp_path: Path) -> None:
    writer = SQLStore(tmp_path / "store.sqlite")
    reader: SQLStore | None = None
    try:
        await writer.add_run(Run(name="first", kind="dev"))
        reader = SQLStore(tmp_path / "store.sqlite", read_only=True)
        assert [r.name for r in await reader.list_runs()] == ["first"]
        await writer.add_run(Run(name="second", kind="dev"))
        assert [r.name for r in await reader.list_runs()] == ["first", "second"]
    finally:
        if reader is not None:
            await reader.close()
        await writer.close()


def test_a_reader_of_no_store_makes_no_file(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="cannot open SQLite store"):
        SQLStore(tmp_path / "absent.sqlite", read_only=True)
    assert not any(tmp_path.iterdir())


async def test_a_reader_leaves_an_older_store_as_it_is_and_says_how_to_upgrade_it(
    tmp_path: Path,
) -> None:
    writer = SQLStore(tmp_path / "store.sqlite")
    await write_run(writer)
    with writer._db.write() as conn:  # as a store of the first schema says it is
        conn.execute("UPDATE schema_version SET version = 1")
    await writer.close()
    before = fingerprint(tmp_path)
    with pytest.raises(StoreError, match=r"schema version 1; this VoltRL reads version \d") as e:
        SQLStore(tmp_path / "store.sqlite", read_only=True)
    assert "upgraded when a writer next opens it" in str(e.value)
    assert fingerprint(tmp_path) == before


async def test_a_postgresql_reader_cannot_write() -> None:
    url = new_database_url()
    writer = SQLStore(url)
    try:
        await writer.add_run(Run(name="first", kind="dev"))
        reader = SQLStore(url, read_only=True)
        try:
            assert [r.name for r in await reader.list_runs()] == ["first"]
            with pytest.raises(StoreError, match="is open read-only"):
                await reader.add_run(Run(name="sneaked", kind="dev"))
            with reader._db.read() as conn, pytest.raises(Exception, match="read-only"):
                conn.execute("INSERT INTO counters (name, value) VALUES ('x', 1)")
        finally:
            await reader.close()
    finally:
        await writer.close()


async def test_an_older_store_among_run_directories_is_named_and_the_others_are_read(
    tmp_path: Path,
) -> None:
    """``voltrl runs`` lists the runs it can read and names the store it cannot; ``voltrl
    show`` (:func:`find_run`) finds a run beside it, and names it when the run is not found."""
    import subprocess
    import sys

    from voltrl.errors import VoltRLError
    from voltrl.observability.run_views import find_run

    for name in ("new", "old"):
        (tmp_path / name).mkdir()
        writer = SQLStore(tmp_path / name / "store.sqlite")
        await writer.add_run(Run(name=f"{name}-run", kind="dev", status="finished"))
        if name == "old":
            with writer._db.write() as conn:
                conn.execute("UPDATE schema_version SET version = 1")
        await writer.close()
    listed = subprocess.run(
        [sys.executable, "-m", "voltrl.cli", "runs", "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr
    assert "new-run" in listed.stdout and "old-run" not in listed.stdout
    assert "note: not listed:" in listed.stderr and "schema version 1" in listed.stderr
    found = await find_run("new-run", run_dir=tmp_path)
    await found.store.close()
    with pytest.raises(VoltRLError, match=r"no run 'old-run'.*not read: .*schema version 1"):
        await find_run("old-run", run_dir=tmp_path)
