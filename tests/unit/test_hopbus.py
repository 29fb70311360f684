"""The hop bus's wire form: what one replica publishes, every other reads back the same;
a malformed entry costs that entry only."""

from __future__ import annotations

import json

import pytest

from sitsmesh.chains.assembler import Hop
from sitsmesh.shared.hopbus import decode, encode_hop


def test_a_hop_round_trips_through_json() -> None:
    hop = Hop("r1", 1_700_000_000.25, 0.125, ttfb=0.01, queue=None, upstream_cluster="pre",
              route_name="rt", stage_header="", pipeline="p", stage="s", failed=True)
    assert decode(json.loads(json.dumps(encode_hop(hop)))) == hop
    assert decode(["r", "r1", 1.5]) == ("r1", 1.5)
    assert decode(["r", "r1", None]) == ("r1", None)


@pytest.mark.parametrize("event", [
    [], "h", ["x", 1], ["r", 5, 1.0], ["r", "id", "soon"], ["r", "id"],
    ["h", "r", "start", 0.1, None, None, "", "", "", "", "", False],
    ["h", "r", 1.0, float("nan"), None, None, "", "", "", "", "", False],
    ["h", "r", 1.0, 0.1, None, None, "", "", "", "", "", "yes"],
    ["h", "r", 1.0, 0.1, None, None, "", "", "", "", ""],
])
def test_malformed_events_are_refused(event: object) -> None:
    with pytest.raises(ValueError):
        decode(event)


def test_past_its_buffer_the_bus_applies_events_here_instead_of_dropping_them() -> None:
    from typing import Any, cast

    from sitsmesh.shared import hopbus

    seen: list[Hop] = []
    bus = hopbus.HopBus(cast(Any, None), deliver=seen.append, release=lambda r, e: True)
    hop = Hop("r", 1.0, 0.1, upstream_cluster="pre")
    for _ in range(hopbus.MAX_PENDING + 5):
        bus.add(hop)
    assert len(seen) == 5 and bus.overflowed == 5  # nothing published is lost either
