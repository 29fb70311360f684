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

from sitsmesh.errors import StartupError
from sitsmesh.state import SqliteStore
from sitsmesh.state.open import open_store
from tests.state_contract import OpenStore, StateContract


class TestSqliteContract(StateContract):
    @pytest.fixture
    async def open_store(self, tmp_path: Path) -> AsyncIterator[OpenStore]:
        opened: list[SqliteStore] = []

        async def open_one() -> SqliteStore:
            opened.append(SqliteStore(tmp_path / "state.db"))
            return opened[-1]

        yield open_one
        for store in opened:
            await store.close()


async def test_state_url_picks_the_backend(tmp_path: Path) -> None:
    default = await open_store("", tmp_path)
    assert isinstance(default, SqliteStore) and default.path == tmp_path / "state.db"
    await default.close()
    there = await open_store(f"sqlite://{tmp_path}/elsewhere.db", tmp_path)
    assert isinstance(there, SqliteStore) and there.path == tmp_path / "elsewhere.db"
    await there.close()


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
