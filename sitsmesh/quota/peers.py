"""What the other replicas' Envoys ask of each shared rate, through Redis.

Each Envoy's RLQS stream reaches one replica, so a replica alone would split a
global rate among its own Envoys and N replicas would admit N times the rate.
Every second each replica writes the demand of its buckets, by group, into a hash
of its own (expiring, so a dead replica's Envoys drop out) and reads the others';
the split then runs over every Envoy of the fleet. Demand changes on Envoy's 5 s
reports, so a second of lag costs nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from sitsmesh import logs

PREFIX = "sitsmesh:rlqs:demand:"
INDEX = "sitsmesh:rlqs:replicas"
TTL_S = 15
MAX_MEMBERS = 100_000  # read from the others, in all: bounds what a bad peer can cost
_log = logs.get("sitsmesh.quota.peers")

# group -> member -> demand (requests/s; None: not known yet)
Members = Mapping[str, Mapping[str, float | None]]


class QuotaPeers:
    def __init__(self, client: Redis | RedisCluster, replica: str) -> None:
        self._client = client
        self._replica = replica
        self.failures = 0

    async def close(self) -> None:
        await self._client.aclose()

    async def sync(self, mine: Members) -> dict[str, dict[str, float | None]]:
        """Publish this replica's members and return every other replica's."""
        now = time.time()
        key = PREFIX + self._replica
        body = {group: json.dumps(members) for group, members in mine.items()}
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.delete(key)
            if body:
                pipe.hset(key, mapping=body)  # type: ignore[arg-type]
                pipe.expire(key, TTL_S)
            pipe.zadd(INDEX, {self._replica: now + TTL_S})
            pipe.zremrangebyscore(INDEX, 0, now)
            pipe.zrange(INDEX, 0, -1)
            *_, replicas = await pipe.execute()
        others: dict[str, dict[str, float | None]] = {}
        count = 0
        for raw in replicas:
            replica = raw.decode() if isinstance(raw, bytes) else str(raw)
            if replica == self._replica:
                continue
            for group, text in (await self._client.hgetall(PREFIX + replica)).items():
                try:
                    members = json.loads(text)
                except ValueError:
                    continue
                if not isinstance(members, dict):
                    continue
                name = group.decode() if isinstance(group, bytes) else str(group)
                into = others.setdefault(name, {})
                for member, demand in members.items():
                    if count >= MAX_MEMBERS:
                        return others
                    if demand is None or isinstance(demand, int | float):
                        into[f"{replica}\x1f{member}"] = (None if demand is None
                                                          else max(0.0, float(demand)))
                        count += 1
        return others
