"""The hop bus split by request id: each replica assembles only the chains it owns.

A hop goes to its request's partition stream (sitsmesh.shared.partitions), read by
that partition's one owner. Nothing of a hop goes to every replica: the controller
takes each owner's sums of its stages' work (sitsmesh.pressure.work), which ride on
the broadcast stream of HopBus with hold releases and the replicas' reports.

Ownership: every second each replica renews its heartbeat, computes the owners from
the live replicas (the same on each), gives up the partitions it no longer owns and
takes those it does. One lease per partition (in the stream's hash slot) makes the
reader exactly one even while two replicas disagree on the members: the old owner
stops reading, writes where it stopped (fenced by the lease) and frees the lease;
the new owner takes the lease and resumes there. A chain open at a move is split
(counted incomplete on both sides); one open at a crash is lost, and counted by the
successor from the open count each owner saves with its place.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client import Counter as Counter_
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from sitsmesh import logs, redisclients
from sitsmesh.chains.assembler import Assembler, Hop
from sitsmesh.chains.pipeline import Pipeline, Stage
from sitsmesh.shared.chainshares import ChainShares
from sitsmesh.shared.hopbus import (
    MAX_BATCH,
    MAX_PENDING,
    READ_BLOCK_MS,
    READ_COUNT,
    RETRY_S,
    STREAM_LENGTH,
    HopBus,
    encode_hop,
)
from sitsmesh.shared.lease import Lease, holder_id
from sitsmesh.shared.partitions import PARTITIONS, Membership, owned, partition_of, stream_key
from sitsmesh.tasks import run_together

BEAT_S = 1.0
LEASE_TTL_MS = 4_000
CURSOR_TTL_MS = 3_600_000  # where a partition's last owner stopped, for its next one
LEAVE_S = 2.0
_log = logs.get("sitsmesh.shared.partbus")

Match = Callable[[Hop], "tuple[Pipeline, Stage] | None"]


class PartitionedBus(HopBus):
    @classmethod
    def for_assembler(cls, url: str, assembler: Assembler,
                      release: Callable[[str, float | None], bool],
                      registry: CollectorRegistry | None,
                      quiet_s: float | None = None) -> PartitionedBus:
        """The bus of `assembler`, which then reports on every replica's chains;
        `quiet_s`: the admission hold timeout (see HopBus)."""
        client = redisclients.connect(url, protocol=2)
        replica = holder_id()
        shares = ChainShares(client, replica, assembler)
        assembler.shares = shares.shares
        lost = Counter_("sitsmesh_chains_lost_total", "Chains open on a replica that died "
                        "(as of its last save, a second before), taken over here; their later "
                        "hops show up as incomplete chains", registry=registry)
        bus = cls(client, deliver=assembler.add, release=release, match=assembler.match,
                  membership=Membership(client, replica), shares=shares,
                  open_ids=assembler.open_request_ids, on_lost=lost.inc, quiet_s=quiet_s)
        if registry is not None:
            registry.register(_KeptReleases(bus))
        Gauge("sitsmesh_hop_partitions_owned", "Hop partitions whose chains this process "
              "assembles", registry=registry).set_function(lambda: len(bus.owned))
        Gauge("sitsmesh_hop_partition_replicas", "Live replicas the hop partitions are "
              "split over, as this process sees them",
              registry=registry).set_function(lambda: len(bus.members))
        return bus

    def __init__(self, client: Redis | RedisCluster, *, deliver: Callable[[Hop], None],
                 release: Callable[[str, float | None], bool], match: Match,
                 membership: Membership, shares: ChainShares | None = None,
                 partitions: int = PARTITIONS,
                 open_ids: Callable[[], Iterable[str]] | None = None,
                 on_lost: Callable[[int], None] | None = None,
                 quiet_s: float | None = None) -> None:
        super().__init__(client, deliver=deliver, release=release, quiet_s=quiet_s)
        self.shares = shares
        self._open_ids = open_ids  # the request ids of the chains open here
        self._on_lost = on_lost
        self.lost = 0  # chains open on a replica that died, as its last save counted
        self._match = match
        self._membership = membership
        self._partitions = partitions
        self._parts: list[list[Hop]] = [[] for _ in range(partitions)]
        self._queued = 0
        self._parts_wake = asyncio.Event()
        self._leases = [Lease(client, f"hops:{p}", ttl_ms=LEASE_TTL_MS,
                              holder=membership.replica, announce=False)
                        for p in range(partitions)]
        # The partitions read now, each with the id of its last entry applied.
        self._cursors: dict[int, str] = {}
        self._taken = asyncio.Event()
        # One XREAD over every partition on one Redis; on a cluster a reader per partition,
        # since a command's keys must share a slot there.
        self._groups: list[frozenset[int]] = (
            [frozenset([p]) for p in range(partitions)] if isinstance(client, RedisCluster)
            else [frozenset(range(partitions))])
        self._key_partition = {stream_key(p): p for p in range(partitions)}
        # Replicas from before the controller took sums sent each hop's completion:
        # ignored during a rolling upgrade, not counted as malformed.
        self.on("C", lambda _event: None)
        self.unmatched = 0
        self.moves = 0  # partitions taken or given up

    @property
    def members(self) -> tuple[str, ...]:
        return self._membership.members

    @property
    def owned(self) -> frozenset[int]:
        """The partitions this replica reads now."""
        return frozenset(self._cursors)

    # --- the ingestion path: no I/O -----------------------------------------

    def add(self, hop: Hop) -> None:
        if self._match(hop) is None or not hop.request_id:
            self.unmatched += 1  # the owner could not place it either
            return
        if self._queued >= MAX_PENDING:
            self.overflowed += 1
            self._deliver(hop)  # as HopBus does: this process stays right, and counts it
            return
        self._parts[partition_of(hop.request_id, self._partitions)].append(hop)
        self._queued += 1
        self._parts_wake.set()

    def queued(self) -> int:
        return super().queued() + self._queued

    # --- background ------------------------------------------------------------

    async def run(self) -> None:
        try:
            # Not asyncio.gather: a part that failed left the others running on, past
            # the handover below and past the stop, where asyncio.run's one cancel at
            # its end could be lost (see sitsmesh.tasks) and the process never exit.
            await run_together(super().run(), self._publish_parts(), self._own_forever(),
                               *(self._read_owned(group) for group in self._groups))
        finally:
            await self._leave()

    async def _publish_parts(self) -> None:
        while True:
            await self._parts_wake.wait()
            self._parts_wake.clear()
            while self._queued:
                batches: list[tuple[int, list[Hop]]] = []
                for p, part in enumerate(self._parts):
                    if part:
                        batches.append((p, part[:MAX_BATCH]))
                        del part[:MAX_BATCH]
                sent = sum(len(b) for _, b in batches)
                self._queued -= sent
                try:
                    async with self._client.pipeline(transaction=False) as pipe:
                        for p, batch in batches:
                            pipe.xadd(stream_key(p),
                                      {"b": json.dumps([encode_hop(h) for h in batch])},
                                      maxlen=STREAM_LENGTH, approximate=True)
                        await pipe.execute()
                    self.published += sent
                    self.caught_up()
                except Exception as exc:  # Redis down or slow: keep this process right
                    self.fallbacks += sent
                    _log.warning("hop bus publish failed; applying here only",
                                 events=sent, error=str(exc))
                    for _, batch in batches:
                        for hop in batch:
                            self._deliver(hop)
                    self.caught_up()

    async def _read_owned(self, group: frozenset[int]) -> None:
        """Apply the entries of the partitions of `group` that this replica owns. A
        partition given up while an XREAD is out is skipped when its reply comes (it is
        checked before every batch), so giving up never waits for this reader."""
        cursors = self._cursors
        while True:
            keys: dict[Any, Any] = {stream_key(p): cursors[p] for p in group if p in cursors}
            if not keys:
                self._taken.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._taken.wait(), BEAT_S)
                continue
            try:
                replies: Any = await self._client.xread(keys, count=READ_COUNT,
                                                        block=READ_BLOCK_MS)
            except Exception as exc:
                _log.warning("hop partition read failed; retrying", error=str(exc))
                await asyncio.sleep(RETRY_S)
                continue
            for key, entries in replies or ():
                p = self._key_partition.get(_id(key))
                for entry_id, fields in entries:
                    if p is None or p not in cursors:
                        break  # given up meanwhile: its next owner applies the rest
                    self.apply_raw(fields)
                    cursors[p] = _id(entry_id)

    # --- ownership -------------------------------------------------------------

    async def _own_forever(self) -> None:
        while True:
            try:
                members = await self._membership.beat()
                await self.rebalance(owned(self._membership.replica, members,
                                           self._partitions))
            except Exception as exc:
                # Redis down: keep reading what we own (the readers retry on their own).
                _log.warning("hop partition heartbeat failed", error=str(exc))
            await asyncio.sleep(BEAT_S)

    def _open_by_partition(self) -> Counter[int]:
        if self._open_ids is None or not self._cursors:
            return Counter()
        n = self._partitions
        return Counter(partition_of(rid, n) for rid in self._open_ids())

    async def rebalance(self, desired: frozenset[int]) -> None:
        """Give up what is no longer ours, take what is (once its lease is free), then
        checkpoint what we read."""
        for p in sorted(set(self._cursors) - desired):
            # This process goes on: the chains it has open there expire here, counted
            # incomplete, and are not the next owner's to count as lost.
            await self._give_up(p, 0)
        for p in sorted(desired):
            if not await self._leases[p].step():
                # Lost it (Redis lapsed): another may read it now.
                self._cursors.pop(p, None)
                continue
            if p not in self._cursors:
                await self._take(p)
        await self.checkpoint()

    async def checkpoint(self) -> None:
        """Where this replica has read each of its partitions to, how many chains it has
        open in each (the next owner's count of the lost, should it die before its next
        checkpoint), and its chain tallies: taken at one instant and written in one
        transaction (on a cluster, one pipeline), so that what Redis holds of them always
        agrees. A successor resumes at those cursors, and what the hops before them
        completed is in those tallies: after a crash no chain is counted twice, nor
        missed except those open then."""
        opened = self._open_by_partition()
        cursors = dict(self._cursors)
        shares = self.shares
        snapshot = shares.snapshot() if shares is not None else None
        single = not isinstance(self._client, RedisCluster)
        async with self._client.pipeline(transaction=single) as pipe:
            if shares is not None and snapshot is not None:
                shares.write(pipe, snapshot)
            for p, last in cursors.items():
                lease = self._leases[p]
                lease.publish_on(pipe, lease.key("cursor"), f"{last} {opened[p]}",
                                 CURSOR_TTL_MS)
            await pipe.execute()
        if shares is not None and snapshot is not None:
            shares.written(snapshot)
            await shares.read_others(snapshot.current)

    async def _take(self, p: int) -> None:
        raw = await self._client.get(self._leases[p].key("cursor"))
        start, _, opened = (raw.decode() if isinstance(raw, bytes) else raw or "").partition(" ")
        if opened.isdigit() and int(opened):
            # Its last owner died with these chains open (as of its last save): their hops
            # read so far died with it. Later hops of theirs show up as incomplete chains.
            self.lost += int(opened)
            if self._on_lost is not None:
                self._on_lost(int(opened))
            _log.warning("chains lost with a replica", partition=p, chains=int(opened))
        if not start:
            # No owner before: the stream's end now, named, so that giving the partition
            # up before a hop arrives still hands over this place and not a later "$".
            newest = await self._client.xrevrange(stream_key(p), count=1)
            start = _id(newest[0][0]) if newest else "0-0"
        self.moves += 1
        _log.info("hop partition taken", partition=p, resume=start)
        self._cursors[p] = start
        self._taken.set()

    async def _save(self, p: int, opened: int, last: str) -> None:
        """Where this replica stopped reading `p`, and how many of its chains it had open
        there (lost, on the way out)."""
        lease = self._leases[p]
        await lease.publish(lease.key("cursor"), f"{last} {opened}", CURSOR_TTL_MS)

    async def _give_up(self, p: int, opened: int) -> None:
        last = self._cursors.pop(p, None)  # from here on the reader skips it
        self.moves += 1
        if last is not None:
            try:
                await self._save(p, opened, last)
            except Exception as exc:  # the next owner resumes from the last saved cursor
                _log.warning("hop partition cursor not saved", partition=p, error=str(exc))
        await self._leases[p].release()
        _log.info("hop partition given up", partition=p)

    async def _leave(self) -> None:
        """Shutting down: hand every partition over now, not when the leases lapse. A
        Redis that does not answer holds the stop for LEAVE_S at most: what is not
        handed over by then goes when its lease lapses."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(LEAVE_S):
                with contextlib.suppress(Exception):
                    await self._membership.leave()
                opened = self._open_by_partition()  # they end with this process: lost
                for p in list(self._cursors):
                    with contextlib.suppress(Exception):
                        await self._give_up(p, opened[p])


def _id(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _KeptReleases(Collector):
    """A counter read off the bus when scraped: the release path stays lock-free."""

    def __init__(self, bus: PartitionedBus) -> None:
        self._bus = bus

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "sitsmesh_hop_bus_releases_kept", "Access-log entries whose hold release was "
            "not sent to the other replicas, as none of them held requests (kept a few "
            "seconds, and sent if a hold shows up)", value=self._bus.kept)
