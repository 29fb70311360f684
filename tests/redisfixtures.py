"""A redis-server per test (fixture `redis_server`) and an admin client on it (`admin`),
for the tests of Redis-backed stores (rate-limit counters, token-budget ledgers): import
the two functions; the fixtures keep the short names."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from sitsmesh.dev import redis as redisproc


@pytest.fixture(name="redis_server")
def redis_server_fixture(tmp_path: Path) -> Iterator[redisproc.RedisServer]:
    with redisproc.redis_server(tmp_path / "redis") as server:
        yield server


@pytest.fixture(name="admin")
async def redis_admin_fixture(redis_server: redisproc.RedisServer) -> AsyncIterator[Redis]:
    # Built from host/port, not a URL, so it keeps redis-py's default retries
    # and reconnects by itself after a restart.
    client = Redis(host="127.0.0.1", port=redis_server.port, decode_responses=True)
    yield client
    await client.aclose()
