"""Which replica assembles which request's chain: partitions by request id, owners by
rendezvous hashing with bounded loads over the live replicas.

A request's hops go to one of PARTITIONS streams, chosen by a hash of its request id
that every process computes alike (crc32, not Python's salted `hash`). Each
partition has one owner, chosen by the hashes of (replica, partition) with no replica
past its fair share (see `owners`). Every replica that knows the same members
computes the same owners, and when one joins or leaves few partitions move besides
the ones it wins or held, which is what lets ownership move without a coordinator. Replicas announce
themselves in a sorted set scored by when their heartbeat expires, as the RLQS
peers do (sitsmesh.quota.peers).
"""

from __future__ import annotations

import hashlib
import time
import zlib
from collections.abc import Callable, Iterable

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

PARTITIONS = 16
MEMBERS_KEY = "sitsmesh:{hops}:members"
HEARTBEAT_TTL_S = 5.0  # beats every second: a dead replica drops out within 5 s
MAX_MEMBERS = 1_000  # read back, at most: bounds what a bad entry can cost


def partition_of(request_id: str, partitions: int = PARTITIONS) -> int:
    return zlib.crc32(request_id.encode("utf-8", "surrogatepass")) % partitions


def stream_key(partition: int) -> str:
    """One hash tag per partition: on a Redis Cluster the streams spread over the masters,
    and each stream's commands stay in one slot."""
    return f"sitsmesh:{{hops:{partition}}}"


def _weight(member: str, partition: int) -> int:
    digest = hashlib.blake2b(f"{member}\x1f{partition}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def owners(members: Iterable[str], partitions: int = PARTITIONS) -> list[str]:
    """Each partition's owner, by partition; empty when there are no members.

    Rendezvous hashing with bounded loads: the (partition, replica) pairs in order of
    their hash, highest first, and a pair wins when its partition has no owner yet and
    its replica less than its fair share (partitions / replicas, rounded down, and rounded
up for as many replicas as the remainder). Plain
    rendezvous gave 4 replicas 16 partitions like 3/4/4/5, and the one with 5 spent a
    quarter more than the others on assembly; a replica that joins or leaves still
    moves only a few partitions besides the ones it wins or held."""
    live = sorted(set(members))
    if not live:
        return []
    base, bonus = divmod(partitions, len(live))  # `bonus` replicas take one more
    # Ties (astronomically rare) go to the smaller name, so every replica agrees.
    ranked = sorted(((_weight(m, p), [-ord(c) for c in m], p, m)
                     for p in range(partitions) for m in live), reverse=True)
    found: list[str | None] = [None] * partitions
    load = dict.fromkeys(live, 0)
    left = partitions
    for _, _, p, m in ranked:
        if found[p] is not None or load[m] > base or (load[m] == base and not bonus):
            continue
        if load[m] == base:
            bonus -= 1
        found[p] = m
        load[m] += 1
        left -= 1
        if not left:
            break
    return [m for m in found if m is not None]


def owned(member: str, members: Iterable[str], partitions: int = PARTITIONS) -> frozenset[int]:
    return frozenset(p for p, owner in enumerate(owners(members, partitions))
                     if owner == member)


class Membership:
    """This replica's heartbeat and the live replicas it sees."""

    def __init__(self, client: Redis | RedisCluster, replica: str, *,
                 ttl_s: float = HEARTBEAT_TTL_S,
                 clock: Callable[[], float] = time.time) -> None:
        self._client = client
        self.replica = replica
        self._ttl_s = ttl_s
        self._clock = clock
        self.members: tuple[str, ...] = (replica,)

    async def beat(self) -> tuple[str, ...]:
        """Renew this replica's heartbeat, drop the expired ones; the live replicas."""
        now = self._clock()
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.zadd(MEMBERS_KEY, {self.replica: now + self._ttl_s})
            pipe.zremrangebyscore(MEMBERS_KEY, 0, now)
            pipe.zrange(MEMBERS_KEY, 0, MAX_MEMBERS - 1)
            *_, raw = await pipe.execute()
        live = {r.decode() if isinstance(r, bytes) else str(r) for r in raw}
        live.add(self.replica)
        self.members = tuple(sorted(live))
        return self.members

    async def leave(self) -> None:
        """Hand this replica's partitions over now rather than when its heartbeat expires."""
        await self._client.zrem(MEMBERS_KEY, self.replica)
