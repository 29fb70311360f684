"""Each replica's chain tallies for the others, so any replica reports on every chain.

A replica assembles only the chains of its partitions (sitsmesh.shared.partbus).
Every second it writes its tallies (per time slot, per pipeline; sitsmesh.chains.tally)
into a hash of its own and reads the other replicas' back; the assembler merges them
per slot when it reports. A replica's hash outlives it by the report window: the
chains it assembled before it died or left still count, as they would in one process.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from sitsmesh import logs
from sitsmesh.chains.assembler import Assembler
from sitsmesh.chains.tally import Tally, decode, encode

PREFIX = "sitsmesh:{chains}:tallies:"
INDEX = "sitsmesh:{chains}:replicas"
EVERY_S = 1.0
MAX_REPLICAS = 1_000
_log = logs.get("sitsmesh.shared.chainshares")


class ChainShares:
    def __init__(self, client: Redis | RedisCluster, replica: str, assembler: Assembler, *,
                 keep_s: float = 330.0, clock: Callable[[], float] = time.time) -> None:
        self._client = client
        self.replica = replica
        self._assembler = assembler
        self._keep_s = keep_s
        self._clock = clock
        self._from = 0  # the oldest slot that may have changed since the last write
        # replica -> slot index -> (its raw JSON, its tallies by pipeline)
        self._theirs: dict[str, dict[int, tuple[bytes, dict[str, Tally]]]] = {}
        self._keep = assembler.kept_limit
        self.failures = 0
        self.malformed = 0
        self.bytes_written = 0

    def shares(self, pipeline: str, oldest: int, newest: int) -> list[tuple[int, Tally]]:
        """The other replicas' tallies of `pipeline` in slots oldest..newest."""
        return [(index, tally) for slots in self._theirs.values()
                for index, (_, pipes) in slots.items() if oldest <= index <= newest
                for tally in (pipes.get(pipeline),) if tally is not None]

    async def run(self) -> None:
        while True:
            try:
                await self.sync()
            except Exception as exc:  # Redis down: report what we have, try again
                self.failures += 1
                _log.warning("chain tallies not shared", error=str(exc))
            await asyncio.sleep(EVERY_S)

    async def sync(self) -> None:
        """Write this replica's changed slots, read the others'."""
        now = self._clock()
        current = self._assembler.slot_index()
        written = {str(index): json.dumps({name: encode(t) for name, t in pipes.items()},
                                          separators=(",", ":"))
                   for index, pipes in self._assembler.tallies(self._from)}
        horizon = current - self._assembler.slot_count()
        key = PREFIX + self.replica
        async with self._client.pipeline(transaction=False) as pipe:
            if written:
                pipe.hset(key, mapping=written)  # type: ignore[arg-type]
            pipe.hkeys(key)
            pipe.pexpire(key, int(self._keep_s * 1000))
            pipe.zadd(INDEX, {self.replica: now + self._keep_s})
            pipe.zremrangebyscore(INDEX, 0, now)
            pipe.zrange(INDEX, 0, MAX_REPLICAS - 1)
            replies = await pipe.execute()
        self.bytes_written += sum(len(v) for v in written.values())
        self._from = current  # closes land in the current slot only
        stale = [f for f in replies[-5] if int(f) <= horizon]
        if stale:
            await self._client.hdel(key, *stale)
        others = [r.decode() if isinstance(r, bytes) else str(r) for r in replies[-1]]
        others = [r for r in others if r != self.replica]
        async with self._client.pipeline(transaction=False) as pipe:
            for replica in others:
                pipe.hgetall(PREFIX + replica)
            hashes = await pipe.execute()
        self._theirs = {replica: self._read(self._theirs.get(replica, {}), fields, horizon)
                        for replica, fields in zip(others, hashes, strict=True)}

    def _read(self, before: dict[int, tuple[bytes, dict[str, Tally]]], fields: Any,
              horizon: int) -> dict[int, tuple[bytes, dict[str, Tally]]]:
        slots: dict[int, tuple[bytes, dict[str, Tally]]] = {}
        for raw_index, raw in fields.items():
            try:
                index = int(raw_index)
                if index <= horizon:
                    continue
                known = before.get(index)
                if known is not None and known[0] == raw:
                    slots[index] = known  # unchanged: not decoded again
                    continue
                value = json.loads(raw)
                slots[index] = (raw, {str(name): decode(tally, self._keep)
                                      for name, tally in value.items()})
            except (AttributeError, TypeError, ValueError):
                self.malformed += 1
        return slots
