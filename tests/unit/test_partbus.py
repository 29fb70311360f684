"""The partitioned bus without Redis: a hop goes to its partition, its stage completion
to every replica in columns per stage, and what it cannot publish is applied here."""

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


def _bus(delivered: list[Hop]) -> tuple[PartitionedBus, list[tuple[str, str, Hop]]]:
    assembler = Assembler({"duo": DUO})
    bus = PartitionedBus(cast(Any, None), deliver=delivered.append,
                         release=lambda r, e: True, match=assembler.match,
                         membership=Membership(cast(Any, None), "me"))
    stages: list[tuple[str, str, Hop]] = []
    bus.on_stage = lambda p, s, h: stages.append((p, s, h))
    return bus, stages


def test_stage_completions_travel_as_columns_and_every_reader_gets_each_hop() -> None:
    bus, stages = _bus([])
    hops = [Hop(f"r{i}", 100.0 + i, 0.01 * (i + 1), upstream_cluster=("pre", "model")[i % 2],
                failed=i == 3) for i in range(6)]
    hops.append(Hop("x", 1.0, 0.1, upstream_cluster="unknown"))
    for hop in hops:
        bus.add(hop)
    assert bus.unmatched == 1
    pending = bus.pending_events()
    assert [e[:3] for e in pending] == [["C", "duo", "pre"], ["C", "duo", "model"]]
    # The publisher encodes the batch, then the next hops start new columns.
    body = json.dumps(pending)
    bus.sealed()
    bus.add(Hop("late", 200.0, 0.5, upstream_cluster="pre"))
    assert len(bus.pending_events()) == 3
    bus.apply_raw({b"b": body.encode()})
    assert [(p, s, h.request_id, h.start, h.duration, h.failed) for p, s, h in stages] == sorted(
        (("duo", ("pre", "model")[i % 2], f"r{i}", 100.0 + i, 0.01 * (i + 1), i == 3)
         for i in range(6)), key=lambda t: (t[1] != "pre", t[2]))
    # The hops themselves wait for their partitions, not the broadcast stream.
    assert bus.queued() == 3 + 7  # three column events; six hops and the late one
    assert {partition_of(h.request_id) for h in hops[:6]} <= set(range(16))


def test_malformed_columns_cost_that_event_only() -> None:
    bus, stages = _bus([])
    bad = [["C", "duo", "pre", ["a"], [1.0, 2.0], [0.1], []],
           ["C", "duo", "pre", ["a"], ["soon"], [0.1], []],
           ["C", 5, "pre", ["a"], [1.0], [0.1], []],
           ["C", "duo", "pre", ["a"], [1.0], [0.1]]]
    good = ["C", "duo", "model", ["b"], [2.0], [0.2], [0]]
    bus.apply_raw({"b": json.dumps([*bad, good])})
    assert bus.malformed == len(bad)
    assert [(h.request_id, h.failed) for _, _, h in stages] == [("b", True)]


def test_past_its_buffer_a_hop_is_assembled_here_and_its_completion_still_sent() -> None:
    delivered: list[Hop] = []
    bus, _ = _bus(delivered)
    for i in range(hopbus.MAX_PENDING + 3):
        bus.add(Hop(f"r{i}", 1.0, 0.1, upstream_cluster="pre"))
    assert [h.request_id for h in delivered] == [f"r{hopbus.MAX_PENDING + i}" for i in range(3)]
    assert bus.overflowed == 3
    (columns,) = bus.pending_events()
    assert len(columns[3]) == hopbus.MAX_PENDING + 3
