"""The hop bus's wire form: what one replica publishes, every other reads back the same;
a malformed entry costs that entry only."""

from __future__ import annotations

import json
from typing import Any, cast

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
    from sitsmesh.shared import hopbus

    seen: list[Hop] = []
    bus = hopbus.HopBus(cast(Any, None), deliver=seen.append, release=lambda r, e: True)
    hop = Hop("r", 1.0, 0.1, upstream_cluster="pre")
    for _ in range(hopbus.MAX_PENDING + 5):
        bus.add(hop)
    assert len(seen) == 5 and bus.overflowed == 5  # nothing published is lost either


def _quiet_bus(clock: list[float]) -> Any:
    from sitsmesh.shared import hopbus

    return hopbus.HopBus(cast(Any, None), deliver=lambda hop: None,
                         release=lambda r, e: True, quiet_s=30.0, clock=lambda: clock[0])


def _released(bus: Any) -> list[str]:
    return [e[1] for e in bus.pending_events() if e[0] == "r"]


def test_while_no_process_holds_requests_releases_are_kept_not_sent() -> None:
    clock = [100.0]
    bus = _quiet_bus(clock)
    for n in range(3):
        assert bus.release(f"r{n}", 1.0)
    assert _released(bus) == [] and bus.kept == 3


def test_a_hold_reported_sends_the_recent_kept_releases_and_the_next_ones() -> None:
    from sitsmesh.shared import hopbus

    clock = [100.0]
    bus = _quiet_bus(clock)
    bus.release("old", 1.0)
    clock[0] += hopbus.UNSENT_S + 1
    bus.release("recent", 2.0)  # it may end a hold whose report is on its way
    clock[0] += 0.1
    bus.holds_seen()
    assert _released(bus) == ["recent"]
    bus.release("next", 3.0)
    clock[0] += 29.0
    bus.release("still", 4.0)
    assert _released(bus) == ["recent", "next", "still"]
    # A hold lives at most quiet_s: past it with no new one reported, quiet again.
    clock[0] += 1.5
    bus.release("quiet", 5.0)
    assert _released(bus) == ["recent", "next", "still"] and bus.kept == 3
    bus.holds_seen()
    assert _released(bus)[-1] == "quiet"


def test_kept_releases_are_bounded() -> None:
    from sitsmesh.shared import hopbus

    clock = [100.0]
    bus = _quiet_bus(clock)
    for n in range(hopbus.MAX_UNSENT + 10):
        bus.release(f"r{n}", None)
    bus.holds_seen()
    sent = _released(bus)
    assert len(sent) == hopbus.MAX_UNSENT and sent[0] == "r10"  # the oldest went


def test_without_quiet_s_every_release_is_sent() -> None:
    from sitsmesh.shared import hopbus

    bus = hopbus.HopBus(cast(Any, None), deliver=lambda hop: None, release=lambda r, e: True)
    bus.release("r1", 1.0)
    bus.holds_seen()  # no effect
    assert _released(bus) == ["r1"]


def test_an_event_whose_handler_fails_costs_that_event_not_the_reader() -> None:
    from sitsmesh.shared import hopbus

    seen: list[Hop] = []

    def deliver(hop: Hop) -> None:
        if hop.request_id == "bad":
            raise RuntimeError("a fault in the assembler")
        seen.append(hop)

    bus = hopbus.HopBus(cast(Any, None), deliver=deliver, release=lambda r, e: True)
    events = [encode_hop(Hop(rid, 1.0, 0.1, upstream_cluster="pre"))
              for rid in ("a", "bad", "b")]
    bus.apply_raw({b"b": json.dumps(events).encode()})
    assert [h.request_id for h in seen] == ["a", "b"]
    assert (bus.failed, bus.applied, bus.malformed) == (1, 2, 0)
