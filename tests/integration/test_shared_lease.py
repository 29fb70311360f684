"""The controller's lease on a real redis-server: one leader, failover within a second,
and a stale leader's writes refused by its fencing token."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from sitsmesh.dev.redis import RedisServer, redis_server
from sitsmesh.shared.lease import Lease


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as running:
        yield running


@pytest.fixture
async def client(server: RedisServer) -> AsyncIterator[Redis]:
    redis = Redis(host="127.0.0.1", port=server.port)
    yield redis
    await redis.aclose()


async def test_one_leader_and_failover_within_a_second(client: Redis) -> None:
    a, b = Lease(client, "ctl", holder="a"), Lease(client, "ctl", holder="b")
    task_a = asyncio.create_task(a.run())
    await asyncio.sleep(0.05)
    task_b = asyncio.create_task(b.run())
    try:
        for _ in range(10):
            await asyncio.sleep(0.1)
            assert a.leading and not b.leading
        task_a.cancel()  # the leader dies: no more renewals, and no release either
        await asyncio.gather(task_a, return_exceptions=True)
        await client.set("sitsmesh:lease:ctl", "a", px=600)  # as if it died mid-term
        started = time.monotonic()
        while not b.leading:
            assert time.monotonic() - started < 1.0, "b took over within a second"
            await asyncio.sleep(0.02)
        assert b.token > 1
    finally:
        task_b.cancel()
        await asyncio.gather(task_b, return_exceptions=True)


async def test_a_stale_leader_cannot_overwrite_its_successor(client: Redis) -> None:
    a, b = Lease(client, "ctl", holder="a"), Lease(client, "ctl", holder="b")
    assert await a.step() and not await b.step()
    assert await a.publish("sitsmesh:decision", "from a", 5000)
    await client.delete("sitsmesh:lease:ctl")  # a stalled past its TTL
    assert await b.step()
    assert await b.publish("sitsmesh:decision", "from b", 5000)
    # a still believes it leads (it has not stepped since), but its token is old.
    assert a.leading
    assert not await a.publish("sitsmesh:decision", "late from a", 5000)
    assert await client.get("sitsmesh:decision") == b"from b"
    assert not await a.step()  # and on its next step it learns it lost
    assert not a.leading


async def test_redis_down_means_nobody_leads(server: RedisServer, client: Redis) -> None:
    lease = Lease(client, "ctl", holder="a")
    assert await lease.step()
    server.kill()
    assert not await lease.step()
    server.start()
    # Back up without the old key (no persistence here): the lease is free again.
    for _ in range(50):
        if await lease.step():
            break
        await asyncio.sleep(0.05)
    assert lease.leading
