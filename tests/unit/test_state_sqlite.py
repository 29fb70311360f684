from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sitsmesh.errors import ConflictError, NotFoundError, StartupError
from sitsmesh.state import Delete, Put, SqliteStore


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    s = SqliteStore(tmp_path / "state.db")
    yield s
    await s.close()


async def test_create_get_list_put_delete_bump_the_revision(store: SqliteStore) -> None:
    assert await store.revision() == 0
    a = await store.create("tenant", "acme", {"priority": 1})
    assert (a.revision, a.body) == (1, {"priority": 1})
    await store.create("tenant", "beta", {})
    await store.create("pipeline", "demo", {"stages": []})
    assert [r.name for r in await store.list("tenant")] == ["acme", "beta"]
    updated = await store.put("tenant", "acme", {"priority": 2})
    assert updated.revision == 4
    got = await store.get("tenant", "acme")
    assert got is not None and got.body == {"priority": 2} and got.revision == 4
    assert await store.delete("tenant", "acme") is True
    assert await store.delete("tenant", "acme") is False
    assert await store.get("tenant", "acme") is None
    assert await store.revision() == 5


async def test_create_refuses_an_existing_record_and_changes_nothing(store: SqliteStore) -> None:
    await store.create("tenant", "acme", {"v": 1})
    with pytest.raises(ConflictError, match="tenant 'acme' already exists"):
        await store.create("tenant", "acme", {"v": 2})
    got = await store.get("tenant", "acme")
    assert got is not None and got.body == {"v": 1}
    assert await store.revision() == 1


async def test_put_with_expected_revision_is_compare_and_swap(store: SqliteStore) -> None:
    first = await store.create("tenant", "acme", {"v": 1})
    await store.put("tenant", "acme", {"v": 2}, expect_revision=first.revision)
    with pytest.raises(ConflictError, match="is at revision 2, not at revision 1"):
        await store.put("tenant", "acme", {"v": 3}, expect_revision=first.revision)
    with pytest.raises(ConflictError, match="is absent"):
        await store.put("tenant", "ghost", {}, expect_revision=1)
    got = await store.get("tenant", "acme")
    assert got is not None and got.body == {"v": 2}


async def test_apply_writes_all_or_nothing(store: SqliteStore) -> None:
    acme = await store.create("tenant", "acme", {"v": 1})
    key = await store.create("apikey", "k1", {"tenant": "acme"})
    revision = await store.apply([Delete("tenant", "acme"),
                                  Put("apikey", "k1", {"tenant": "acme", "revoked": True},
                                      expect_revision=key.revision)])
    assert revision == await store.revision() == 3  # one transaction, one revision
    assert await store.get("tenant", "acme") is None
    got = await store.get("apikey", "k1")
    assert got is not None and got.body["revoked"] and got.revision == 3
    # A failed write undoes the ones before it in the same batch.
    await store.create("tenant", "acme", {"v": 2})
    with pytest.raises(ConflictError, match="not at revision 1"):
        await store.apply([Delete("tenant", "acme"),
                           Put("apikey", "k1", {}, expect_revision=acme.revision)])
    with pytest.raises(NotFoundError, match="tenant 'ghost' does not exist"):
        await store.apply([Put("apikey", "k2", {}), Delete("tenant", "ghost")])
    assert await store.get("tenant", "acme") is not None
    assert await store.get("apikey", "k2") is None
    assert await store.revision() == 4


async def test_survives_reopen_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    s = SqliteStore(path)
    await s.create("tenant", "acme", {"v": 1})
    await s.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    s2 = SqliteStore(path)
    got = await s2.get("tenant", "acme")
    await s2.close()
    assert got is not None and got.body == {"v": 1}


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA user_version=99")
    with pytest.raises(StartupError, match="schema version 99 is newer"):
        SqliteStore(path)


WRITER = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from sitsmesh.state import SqliteStore

    async def main() -> None:
        store = SqliteStore(Path(sys.argv[1]))
        i = 0
        while True:
            await store.put("item", f"k{i}", {"i": i})
            print(i, flush=True)   # acknowledged only after the commit returned
            i += 1

    asyncio.run(main())
""")


def test_kill_9_loses_no_acknowledged_write(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    acked = -1
    with subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE,
                          text=True) as proc:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                acked = int(line)
                if acked >= 200:
                    break
        finally:
            os.kill(proc.pid, signal.SIGKILL)  # no chance to flush or close anything
            proc.wait(10)
    assert acked >= 200
    with sqlite3.connect(path) as conn:
        names = {row[0] for row in conn.execute("SELECT name FROM objects WHERE kind='item'")}
    missing = [i for i in range(acked + 1) if f"k{i}" not in names]
    assert missing == []


def test_opening_waits_for_another_process_writing(tmp_path: Path) -> None:
    """Workers open the database while the supervisor writes: they wait, not fail."""
    path = tmp_path / "state.db"
    first = SqliteStore(path)
    first._executor.submit(first._conn.execute, "BEGIN IMMEDIATE").result()
    release = threading.Timer(0.5, lambda: first._executor.submit(
        first._conn.execute, "COMMIT").result())
    release.start()
    try:
        second = SqliteStore(path)  # needs the write lock to set WAL/schema if new
        second._executor.submit(second._conn.close).result()
        second._executor.shutdown()
    finally:
        release.join()
        first._executor.submit(first._conn.close).result()
        first._executor.shutdown()
