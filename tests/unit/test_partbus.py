"""The partitioned bus without Redis: a hop goes to its partition and to no other
replica, and what it cannot publish is applied here."""

from __future__ import annotations

import json
from typing import Any, cast

from sitsmesh.chains.assembler import Assembler, Hop
from sitsmesh.chains.pipeline import pipeline_from
from sitsmesh.shared import hopbus
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
