"""The controller's lease on a real redis-server and on a real Redis Cluster: one
leader, failover within a second, a stale leader's writes refused by its fencing token
and by the lease itself (a token a failover repeated), and a failover of the cluster
master that holds the lease never lets two leaders write."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from sitsmesh import redisclients
from sitsmesh.dev import rediscluster
from sitsmesh.dev.redis import RedisServer, redis_server
from sitsmesh.dev.rediscluster import RedisClusterNodes
from sitsmesh.shared.lease import Lease
from tests.redisfixtures import (  # noqa: F401 - fixtures
    cluster_fixture,
    redis_cluster_fixture,
    shared_redis_fixture,
)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as running:
        yield running


@pytest.fixture
async def client(server: RedisServer) -> AsyncIterator[Redis]:
    redis = Redis(host="127.0.0.1", port=server.port)
    yield redis
    await redis.aclose()


@pytest.fixture
async def either(shared_redis: RedisServer | RedisClusterNodes
                 ) -> AsyncIterator[Redis | RedisCluster]:
    """A client on one redis-server, or on a Redis Cluster."""
    redis = redisclients.connect(shared_redis.url)
    yield redis
    await redis.aclose()


async def test_one_leader_and_failover_within_a_second(either: Redis | RedisCluster) -> None:
    client = either
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
        await client.set(a.key("lease"), "a", px=600)  # as if it died mid-term
        started = time.monotonic()
        while not b.leading:
            assert time.monotonic() - started < 1.0, "b took over within a second"
            await asyncio.sleep(0.02)
        assert b.token > 1
    finally:
        task_b.cancel()
        await asyncio.gather(task_b, return_exceptions=True)


async def test_a_stale_leader_cannot_overwrite_its_successor(
        either: Redis | RedisCluster) -> None:
    client = either
    a, b = Lease(client, "ctl", holder="a"), Lease(client, "ctl", holder="b")
    decision = a.key("decision")
    assert await a.step() and not await b.step()
    assert await a.publish(decision, "from a", 5000)
    await client.delete(a.key("lease"))  # a stalled past its TTL
    assert await b.step()
    assert await b.publish(decision, "from b", 5000)
    # a still believes it leads (it has not stepped since), but its token is old.
    assert a.leading
    assert not await a.publish(decision, "late from a", 5000)
    assert await client.get(decision) == b"from b"
    assert not await a.step()  # and on its next step it learns it lost
    assert not a.leading


async def test_a_token_a_failover_repeated_does_not_let_the_old_leader_write(
        client: Redis) -> None:
    """A failover that lost the newest writes (replication is asynchronous) can hand
    the next leader the token the old one still holds: the lease key decides then."""
    a, b = Lease(client, "ctl", holder="a"), Lease(client, "ctl", holder="b")
    decision = a.key("decision")
    assert await a.step() and a.token == 1
    await client.delete(a.key("lease"), a.key("lease:token"))  # both writes lost
    assert await b.step() and b.token == 1
    assert await b.publish(decision, "from b", 5000)
    assert not await a.publish(decision, "late from a", 5000)
    assert await client.get(decision) == b"from b"


async def test_publishing_outside_the_lease_slot_is_refused(client: Redis) -> None:
    lease = Lease(client, "ctl", holder="a")
    assert await lease.step()
    with pytest.raises(ValueError, match="outside the lease's slot"):
        await lease.publish("sitsmesh:decision", "x", 5000)
    with pytest.raises(ValueError, match="braces"):
        Lease(client, "a{b}")


async def test_a_failover_of_the_lease_master_never_lets_two_leaders_write(
        tmp_path: Path) -> None:
    """Two replicas' leases on a 3-master cluster; the master holding the lease's slot is
    killed and its replica takes over. Every write that got through is recorded with its
    token: tokens never go back, and one token is only ever one holder's."""
    with rediscluster.redis_cluster(tmp_path / "cluster") as nodes:
        clients = [redisclients.connect(nodes.url, socket_timeout=0.5,
                                        socket_connect_timeout=0.5) for _ in range(2)]
        leases = [Lease(c, "ctl", holder=h) for c, h in zip(clients, "ab", strict=True)]
        written: list[tuple[int, str]] = []
        done = asyncio.Event()

        async def write(lease: Lease) -> None:
            while not done.is_set():
                token = lease.token
                with contextlib.suppress(Exception):  # the cluster is failing over
                    if token and await lease.publish(lease.key("decision"), lease.holder,
                                                     5000):
                        written.append((token, lease.holder))
                await asyncio.sleep(0.01)

        tasks = [asyncio.create_task(t) for lease in leases
                 for t in (lease.run(), write(lease))]
        try:
            started = time.monotonic()
            while len(written) < 20:
                assert time.monotonic() - started < 10, "nobody wrote"
                await asyncio.sleep(0.05)
            before = len(written)
            nodes.kill(nodes.master_of(leases[0].key("lease")))
            killed = time.monotonic()
            while len(written) < before + 20:
                assert time.monotonic() - killed < 30, \
                    f"no writes after the failover: {written[before - 3:]}"
                await asyncio.sleep(0.05)
        finally:
            done.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for c in clients:
                await c.aclose()
        tokens = [token for token, _ in written]
        assert tokens == sorted(tokens), written
        holders: dict[int, set[str]] = {}
        for token, holder in written:
            holders.setdefault(token, set()).add(holder)
        assert all(len(h) == 1 for h in holders.values()), holders


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
