"""Each replica's chain tallies for the others, so any replica reports on every chain.

A replica assembles only the chains of its partitions (sitsmesh.shared.partbus).
Every second it writes its tallies (per time slot, per pipeline; sitsmesh.chains.tally)
into a hash of its own, together with where it has read its partitions to
(PartitionedBus.checkpoint), and reads the other replicas' back; the assembler merges them
per slot when it reports. A replica's hash outlives it by the report window: the
chains it assembled before it died or left still count, as they would in one process.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from sitsmesh import logs
from sitsmesh.chains.assembler import Assembler
from sitsmesh.chains.tally import Tally, decode, encode

PREFIX = "sitsmesh:{chains}:tallies:"
INDEX = "sitsmesh:{chains}:replicas"
MAX_REPLICAS = 1_000
# A replica writes only the slots that changed since its last write: the current one (and
# the one before, just after a slot turns). So each second the others' slots around now
# are read, and all of them every FULL_READ_EVERY reads, which also picks up a replica's
# older slots written late (after Redis was away) and any replica seen for the first time.
FULL_READ_EVERY = 10
_log = logs.get("sitsmesh.shared.chainshares")


@dataclass(frozen=True, slots=True)
class Snapshot:
    written: dict[str, str]  # slot index -> its tallies, JSON
    current: int             # the slot index then
    at: float                # wall clock then


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
        self._reads = 0
        self.malformed = 0
        self.bytes_written = 0

    def shares(self, pipeline: str, oldest: int, newest: int) -> list[tuple[int, Tally]]:
        """The other replicas' tallies of `pipeline` in slots oldest..newest."""
        return [(index, tally) for slots in self._theirs.values()
                for index, (_, pipes) in slots.items() if oldest <= index <= newest
                for tally in (pipes.get(pipeline),) if tally is not None]

    def snapshot(self) -> Snapshot:
        """This replica's slots changed since the last write, as of now (no I/O): taken
        at the instant its partitions' cursors are, so that what Redis holds of both
        always agrees (see PartitionedBus.checkpoint)."""
        written = {str(index): json.dumps({name: encode(t) for name, t in pipes.items()},
                                          separators=(",", ":"))
                   for index, pipes in self._assembler.tallies(self._from)}
        return Snapshot(written, self._assembler.slot_index(), self._clock())

    def write(self, pipe: Any, snapshot: Snapshot) -> None:
        """Queue the snapshot's writes on `pipe` (executed by the caller)."""
        key = PREFIX + self.replica
        if snapshot.written:
            pipe.hset(key, mapping=snapshot.written)
        pipe.pexpire(key, int(self._keep_s * 1000))
        pipe.zadd(INDEX, {self.replica: snapshot.at + self._keep_s})

    def written(self, snapshot: Snapshot) -> None:
        """The snapshot reached Redis."""
        self.bytes_written += sum(len(v) for v in snapshot.written.values())
        self._from = snapshot.current  # closes land in the current slot only

    async def read_others(self, current: int) -> None:
        """Let this replica's old slots go, and read every other replica's."""
        now = self._clock()
        horizon = current - self._assembler.slot_count()
        key = PREFIX + self.replica
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.hkeys(key)
            pipe.zremrangebyscore(INDEX, 0, now)
            pipe.zrange(INDEX, 0, MAX_REPLICAS - 1)
            fields, _, replicas = await pipe.execute()
        stale = [f for f in fields if int(f) <= horizon]
        if stale:
            await self._client.hdel(key, *stale)
        others = [r.decode() if isinstance(r, bytes) else str(r) for r in replicas]
        others = [r for r in others if r != self.replica]
        full = self._reads % FULL_READ_EVERY == 0
        self._reads += 1
        # Around now: a replica's clock a slot ahead or behind of this one's still reads.
        near = [str(i) for i in range(current - 1, current + 2)]
        async with self._client.pipeline(transaction=False) as pipe:
            for replica in others:
                if full or replica not in self._theirs:
                    pipe.hgetall(PREFIX + replica)
                else:
                    pipe.hmget(PREFIX + replica, near)
            replies = await pipe.execute()
        theirs = {}
        for replica, reply in zip(others, replies, strict=True):
            before = self._theirs.get(replica, {})
            if isinstance(reply, dict):
                theirs[replica] = self._read(before, reply, horizon)
                continue
            fields = {index: raw for index, raw in zip(near, reply, strict=True)
                      if raw is not None}
            slots = {i: v for i, v in before.items() if i > horizon}
            slots.update(self._read(before, fields, horizon))
            theirs[replica] = slots
        self._theirs = theirs

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
