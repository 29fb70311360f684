"""The partitioned bus without Redis: a hop goes to its partition and to no other
replica, and what it cannot publish is applied here."""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

import pytest

from sitsmesh.chains.assembler import Assembler, Hop
from sitsmesh.chains.pipeline import pipeline_from
from sitsmesh.shared import hopbus, partbus
from sitsmesh.shared.partbus import PartitionedBus
from sitsmesh.shared.partitions import Membership, partition_of

DUO = pipeline_from("duo", {"stages": [
    {"name": "pre", "match": {"upstream_cluster": "pre"}},
    {"name": "model", "match": {"upstream_cluster": "model"}},
]})


def _bus(delivered: list[Hop]) -> PartitionedBus:
    assembler = Assembler({"duo": DUO})
    return PartitionedBus(cast(Any, None), deliver=delivered.append,
                          release=lambda r, e: True, match=assembler.match,
                          membership=Membership(cast(Any, None), "me"))


def test_a_hop_waits_for_its_partition_and_nothing_of_it_goes_to_every_replica() -> None:
    bus = _bus([])
    hops = [Hop(f"r{i}", 100.0 + i, 0.01 * (i + 1), upstream_cluster=("pre", "model")[i % 2],
                failed=i == 3) for i in range(6)]
    hops.append(Hop("x", 1.0, 0.1, upstream_cluster="unknown"))
    hops.append(Hop("", 1.0, 0.1, upstream_cluster="pre"))
    for hop in hops:
        bus.add(hop)
    assert bus.unmatched == 2  # no stage, and no request id: no owner could place them
    # The controller takes its owners' sums (shared/pressure.py): the broadcast stream
    # carries nothing per hop.
    assert bus.pending_events() == []
    assert bus.queued() == 6
    assert {partition_of(h.request_id) for h in hops[:6]} <= set(range(16))


def test_completions_from_replicas_before_the_sums_are_ignored_not_malformed() -> None:
    delivered: list[Hop] = []
    bus = _bus(delivered)
    old = ["C", "duo", "model", ["b"], [2.0], [0.2], [0]]
    bus.apply_raw({"b": json.dumps([old, ["?", 1]])})
    assert bus.malformed == 1  # the unknown event only
    assert delivered == []


def test_past_its_buffer_a_hop_is_assembled_here() -> None:
    delivered: list[Hop] = []
    bus = _bus(delivered)
    for i in range(hopbus.MAX_PENDING + 3):
        bus.add(Hop(f"r{i}", 1.0, 0.1, upstream_cluster="pre"))
    assert [h.request_id for h in delivered] == [f"r{hopbus.MAX_PENDING + i}" for i in range(3)]
    assert bus.overflowed == 3
    assert bus.queued() == hopbus.MAX_PENDING


def test_a_redis_that_does_not_answer_holds_the_stop_for_a_bounded_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen once in the scale-out bench: a replica that did not exit within 20 s of
    SIGTERM. Handing partitions over on the way out waits on Redis; it must not forever."""
    monkeypatch.setattr(partbus, "LEAVE_S", 0.05)

    class Stuck:
        async def zrem(self, *args: Any) -> None:
            await asyncio.Event().wait()  # never answers

    bus = PartitionedBus(cast(Any, Stuck()), deliver=lambda hop: None,
                         release=lambda r, e: True, match=Assembler({"duo": DUO}).match,
                         membership=Membership(cast(Any, Stuck()), "me"))
    bus._cursors[3] = "1-0"  # a partition owned at the stop

    async def stop() -> None:
        await asyncio.wait_for(bus._leave(), 10)

    asyncio.run(stop())
    assert bus.owned == frozenset({3})  # not handed over: its lease lapses instead


def test_a_part_of_the_bus_that_fails_leaves_none_of_the_others_running(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under asyncio.gather the other loops ran on after one failed, past the stop;
    asyncio.run cancels what is left once, and a loop that lost that cancellation kept
    the process from ever exiting."""
    monkeypatch.setattr(partbus, "LEAVE_S", 0.05)

    class Fault(BaseException):
        """What no loop of the bus catches: every Exception costs an entry or a retry."""

    class FailingRedis:
        """Redis as the broadcast reader sees it: a fault, and elsewhere nothing ever."""

        async def xrevrange(self, *args: Any, **kwargs: Any) -> list[Any]:
            return []

        async def xread(self, *args: Any, **kwargs: Any) -> list[Any]:
            raise Fault("a fault under the reader")

        async def zrem(self, *args: Any) -> None:
            await asyncio.Event().wait()

    client = FailingRedis()
    bus = PartitionedBus(cast(Any, client), deliver=lambda hop: None,
                         release=lambda r, e: True, match=Assembler({"duo": DUO}).match,
                         membership=Membership(cast(Any, client), "me"))

    async def run() -> set[asyncio.Task[Any]]:
        with pytest.raises(Fault):
            await asyncio.wait_for(bus.run(), 10)
        return asyncio.all_tasks() - {cast(Any, asyncio.current_task())}

    assert asyncio.run(run()) == set()
