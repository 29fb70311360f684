"""Replicas' chain tallies through a real redis-server: each second a replica reads the
others' slots around now, and all of them every FULL_READ_EVERY reads."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from sitsmesh.chains.assembler import Assembler, Hop
from sitsmesh.chains.pipeline import pipeline_from
from sitsmesh.dev.redis import RedisServer, redis_server
from sitsmesh.shared.chainshares import FULL_READ_EVERY, PREFIX, ChainShares

DEMO = pipeline_from("demo", {"stages": [
    {"name": "pre", "match": {"upstream_cluster": "pre"}},
    {"name": "model", "match": {"upstream_cluster": "model"}},
]})


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as server:
        yield server


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _chain(assembler: Assembler, rid: str, at: float) -> None:
    assembler.add(Hop(rid, at, 0.02, upstream_cluster="pre"))
    assembler.add(Hop(rid, at + 0.005, 0.01, upstream_cluster="model"))


def _chains(shares: ChainShares, current: int) -> int:
    return sum(t.chains for _, t in shares.shares("demo", current - 40, current + 1))


async def _write(shares: ChainShares, client: Redis) -> None:
    snapshot = shares.snapshot()
    async with client.pipeline(transaction=True) as pipe:
        shares.write(pipe, snapshot)
        await pipe.execute()
    shares.written(snapshot)


def test_the_others_slots_around_now_are_read_each_time_and_the_rest_in_full_reads(
        redis: RedisServer) -> None:
    async def run() -> None:
        clock = Clock()
        client = Redis.from_url(redis.url)
        mine = Assembler({"demo": DEMO}, clock=clock)
        theirs = Assembler({"demo": DEMO}, clock=clock)
        writer = ChainShares(client, "w", mine, clock=clock)
        reader = ChainShares(client, "r", theirs, clock=clock)
        _chain(mine, "a", clock.now - 0.1)
        await _write(writer, client)
        current = mine.slot_index()
        await reader.read_others(current)  # a full read
        assert _chains(reader, current) == 1
        # A chain in the current slot is seen at the next read, a partial one.
        _chain(mine, "b", clock.now - 0.05)
        await _write(writer, client)
        await reader.read_others(current)
        assert _chains(reader, current) == 2
        # A slot written late (the writer was away from Redis) far behind now: not
        # among the slots read each time, but the next full read has it.
        late = await client.hget(PREFIX + "w", str(current))
        assert late is not None
        await client.hset(PREFIX + "w", str(current - 5), late)
        seen = []
        for _ in range(FULL_READ_EVERY):
            await reader.read_others(current)
            seen.append(_chains(reader, current))
        assert seen[0] == 2 and seen[-1] == 4, seen
        await client.aclose()

    asyncio.run(run())
