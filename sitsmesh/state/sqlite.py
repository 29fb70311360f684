"""SQLite-backed StateStore: WAL journal, synchronous=FULL, one writer thread.

sqlite3 blocks, so every statement runs on a dedicated single thread; that
also serialises writers without a lock on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from sitsmesh.errors import ConflictError, NotFoundError, StartupError
from sitsmesh.state.changes import ChangeSignal
from sitsmesh.state.contract import Delete, Put, Record, check_expected

SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 10.0
# Other processes' writes are only seen by reading the revision; 0.2 s keeps a change
# made through another process within the 1 s every view promises, for one cheap query.
POLL_S = 0.2
_SCHEMA = """
CREATE TABLE IF NOT EXISTS objects (
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    body TEXT NOT NULL,
    revision INTEGER NOT NULL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (kind, name)
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta (key, value) VALUES ('revision', 0);
"""

T = TypeVar("T")


class SqliteStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-state")
        self._conn = self._executor.submit(self._open).result()
        # Writes through this object wake its waiters at once; other processes are polled.
        self._changes = ChangeSignal()
        self._closed = False

    def _open(self) -> sqlite3.Connection:
        try:
            # The timeout (busy_timeout) comes first: worker processes open the same
            # database while the supervisor may be writing, and every statement below
            # may need a lock for a moment.
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                                   timeout=BUSY_TIMEOUT_S)
            if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                conn.execute("PRAGMA journal_mode=WAL")
            # FULL: a commit is on disk before it is acknowledged, even across power loss.
            conn.execute("PRAGMA synchronous=FULL")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StartupError(
                    f"{self.path}: state schema version {version} is newer than this "
                    f"sitsmesh supports ({SCHEMA_VERSION}); upgrade sitsmesh"
                )
            if version < SCHEMA_VERSION:  # only the first opener writes the schema
                conn.executescript(
                    f"BEGIN IMMEDIATE;{_SCHEMA}PRAGMA user_version={SCHEMA_VERSION};COMMIT;")
        except sqlite3.Error as exc:
            raise StartupError(f"{self.path}: cannot open state database: {exc}") from None
        return conn

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    @staticmethod
    def _record(row: tuple[str, str, str, int, float]) -> Record:
        return Record(row[0], row[1], json.loads(row[2]), row[3], row[4])

    def _get(self, kind: str, name: str) -> Record | None:
        row = self._conn.execute(
            "SELECT kind, name, body, revision, updated_at FROM objects WHERE kind=? AND name=?",
            (kind, name),
        ).fetchone()
        return self._record(row) if row else None

    def _list(self, kind: str) -> list[Record]:
        rows = self._conn.execute(
            "SELECT kind, name, body, revision, updated_at FROM objects WHERE kind=? "
            "ORDER BY name", (kind,),
        ).fetchall()
        return [self._record(r) for r in rows]

    def _write(self, kind: str, name: str, body: dict[str, Any], mode: str,
               expect_revision: int | None) -> Record:
        blob = json.dumps(body, sort_keys=True, separators=(",", ":"))
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            row = conn.execute(
                "SELECT revision FROM objects WHERE kind=? AND name=?", (kind, name)
            ).fetchone()
            if mode == "create" and row is not None:
                raise ConflictError(f"{kind} '{name}' already exists")
            check_expected(kind, name, row[0] if row is not None else None, expect_revision)
            revision = self._bump()
            now = time.time()
            conn.execute(
                "INSERT INTO objects (kind, name, body, revision, updated_at) VALUES (?,?,?,?,?) "
                "ON CONFLICT(kind, name) DO UPDATE SET body=excluded.body, "
                "revision=excluded.revision, updated_at=excluded.updated_at",
                (kind, name, blob, revision, now),
            )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return Record(kind, name, json.loads(blob), revision, now)

    def _bump(self) -> int:
        self._conn.execute("UPDATE meta SET value = value + 1 WHERE key='revision'")
        row = self._conn.execute("SELECT value FROM meta WHERE key='revision'").fetchone()
        return int(row[0])

    def _delete(self, kind: str, name: str) -> bool:
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            cur = conn.execute("DELETE FROM objects WHERE kind=? AND name=?", (kind, name))
            if cur.rowcount:
                self._bump()
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return cur.rowcount > 0

    def _apply(self, writes: Sequence[Put | Delete]) -> int:
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            revision = self._bump()
            now = time.time()
            for write in writes:
                row = conn.execute("SELECT revision FROM objects WHERE kind=? AND name=?",
                                   (write.kind, write.name)).fetchone()
                if isinstance(write, Delete):
                    if row is None:
                        raise NotFoundError(f"{write.kind} '{write.name}' does not exist")
                    conn.execute("DELETE FROM objects WHERE kind=? AND name=?",
                                 (write.kind, write.name))
                    continue
                check_expected(write.kind, write.name, row[0] if row is not None else None,
                               write.expect_revision)
                conn.execute(
                    "INSERT INTO objects (kind, name, body, revision, updated_at) "
                    "VALUES (?,?,?,?,?) ON CONFLICT(kind, name) DO UPDATE SET "
                    "body=excluded.body, revision=excluded.revision, "
                    "updated_at=excluded.updated_at",
                    (write.kind, write.name,
                     json.dumps(write.body, sort_keys=True, separators=(",", ":")), revision,
                     now))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return revision

    def _revision(self) -> int:
        row = self._conn.execute("SELECT value FROM meta WHERE key='revision'").fetchone()
        return int(row[0])

    async def get(self, kind: str, name: str) -> Record | None:
        result: Record | None = await self._run(self._get, kind, name)
        return result

    async def list(self, kind: str) -> list[Record]:
        result: list[Record] = await self._run(self._list, kind)
        return result

    async def create(self, kind: str, name: str, body: dict[str, Any]) -> Record:
        result: Record = await self._run(self._write, kind, name, body, "create", None)
        self._changes.notify()
        return result

    async def put(
        self, kind: str, name: str, body: dict[str, Any], *, expect_revision: int | None = None
    ) -> Record:
        result: Record = await self._run(self._write, kind, name, body, "put", expect_revision)
        self._changes.notify()
        return result

    async def delete(self, kind: str, name: str) -> bool:
        result: bool = await self._run(self._delete, kind, name)
        self._changes.notify()
        return result

    async def apply(self, writes: Sequence[Put | Delete]) -> int:
        result: int = await self._run(self._apply, list(writes))
        self._changes.notify()
        return result

    async def revision(self) -> int:
        result: int = await self._run(self._revision)
        return result

    async def wait_for_change(self, after: int, within_s: float) -> int:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while True:
            revision = await self.revision()
            remaining = deadline - loop.time()
            if revision != after or remaining <= 0:
                return revision
            await self._changes.wait(min(remaining, POLL_S))

    async def close(self) -> None:
        """Idempotent: shutdown paths may reach it twice."""
        if self._closed:
            return
        self._closed = True
        await self._run(self._conn.close)
        self._executor.shutdown(wait=True)
