"""The one place that turns the state_url setting into a StateStore."""

from __future__ import annotations

from pathlib import Path

from sitsmesh.state.contract import StateStore
from sitsmesh.state.sqlite import SqliteStore

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


async def open_store(state_url: str, state_dir: Path) -> StateStore:
    """postgresql://... -> PostgresStore (migrated); sqlite:///PATH -> SqliteStore there;
    empty -> SQLite at STATE_DIR/state.db."""
    if state_url.startswith(POSTGRES_SCHEMES):
        # Imported here: psycopg is only loaded by processes that use it.
        from sitsmesh.state.postgres import PostgresStore

        return await PostgresStore.open(state_url)
    if state_url:
        return SqliteStore(Path(state_url.removeprefix("sqlite://")))
    return SqliteStore(state_dir / "state.db")
