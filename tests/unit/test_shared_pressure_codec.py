"""The published decision's wire form and each replica's share of it (pure logic)."""

from __future__ import annotations

import json
from typing import Any, cast

import pytest

from sitsmesh.chains.pipeline import pipeline_from
from sitsmesh.pressure.controller import Decision, Snapshot
from sitsmesh.pressure.runtime import PressureRuntime
from sitsmesh.pressure.stages import SignalAge, StagePressure
from sitsmesh.shared.pressure import (
    SharedPressure,
    cap_parts,
    decode_snapshot,
    encode_snapshot,
    share_of,
)

PIPELINE = pipeline_from("demo", {"models": ["m*"], "stages": [
    {"name": "model", "match": {"upstream_cluster": "triton"}, "sla_p99_ms": 250}]})


def _snapshot() -> Snapshot:
    stage = StagePressure("model", "overloaded", 1.4, 120.0, 80.0, 1.0, 12.0, 1.2, 340.0,
                          310.0, 0.0, False, "full",
                          (SignalAge("access_log", 0.8, False), SignalAge("triton", -1, False)))
    decision = Decision("infer", "shed", 0.6, 1.4, 24, 3, 1, "model", "overloaded", 120.0,
                        (stage,), 100.5, in_flight_offset=5, in_flight=30.0, admit_rate=72.0)
    return Snapshot({"infer": decision}, 100.5)


def test_a_decision_crosses_replicas_in_wall_clock_time() -> None:
    # Published where monotonic = wall - 1000; read where monotonic = wall - 4000.
    raw = encode_snapshot(_snapshot(), 1000.0)
    read = decode_snapshot(raw, 4000.0)
    want = _snapshot()
    assert read.at == pytest.approx(want.at - 3000.0)
    assert read.decisions["infer"].at == pytest.approx(want.decisions["infer"].at - 3000.0)
    assert read.decisions["infer"].stages == want.decisions["infer"].stages
    assert read.decisions["infer"].fraction == 0.6


@pytest.mark.parametrize("raw", ["{}", "[]", '{"at": 1, "decisions": {"p": {"x": 1}}}',
                                 "not json"])
def test_a_malformed_decision_is_refused(raw: str) -> None:
    with pytest.raises(ValueError):
        decode_snapshot(raw, 0.0)


def test_a_replica_applies_its_share_of_what_a_decision_counts() -> None:
    mine = share_of(_snapshot(), {"infer": 0.25}).decisions["infer"]
    assert (mine.concurrency, mine.admit_rate, mine.in_flight_offset) == (6, 18.0, 1)
    assert (mine.fraction, mine.cutoff) == (0.6, 1.4)  # ratios hold for every replica
    tiny = share_of(_snapshot(), {"infer": 0.001}).decisions["infer"]
    assert tiny.concurrency == 1  # a cap never rounds down to "no cap"


class _Bus:
    """Stands in for the hop bus: what one replica publishes, another applies."""

    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}
        self.published: list[Any] = []
        self.holds_reported = 0

    def holds_seen(self) -> None:
        self.holds_reported += 1

    def on(self, kind: str, handler: Any) -> None:
        self.handlers[kind] = handler

    def publish(self, event: Any) -> None:
        self.published.append(json.loads(json.dumps(event)))  # as it crosses Redis


def _replica(wall_minus_mono: float, clock: list[float]
             ) -> tuple[SharedPressure, _Bus, PressureRuntime]:
    runtime = PressureRuntime(None, clock=lambda: clock[0],
                              wall=lambda: clock[0] + wall_minus_mono, shared=True)
    runtime.set_pipelines({"demo": PIPELINE})
    runtime.gate.wall_offset = wall_minus_mono
    bus = _Bus()
    lease = type("Lease", (), {"holder": f"replica-{wall_minus_mono}",
                               "key": lambda self, suffix: f"sitsmesh:{{t}}:{suffix}"})()
    shared = SharedPressure(runtime, cast(Any, bus), cast(Any, None), cast(Any, lease))
    return shared, bus, runtime


def test_holds_and_ends_from_another_replica_leave_no_hold_open() -> None:
    """Found by the 2-replica overload bench: a reported hold was opened in its wall
    clock bin's middle and closed at its exact time, which often fell in the next local
    bin, so it stayed open for good (237-314 of 1000) and the controller saw a queue."""
    clock = [100.0]
    sender, sent, sending = _replica(5000.123456, clock)
    receiver, receiver_bus, receiving = _replica(9000.987654, clock)
    local = sending.local.pipeline("demo")  # what the sender's gate counts
    for i in range(1000):
        clock[0] = 100.0 + i * 0.0437
        local.hold(clock[0])
        if i % 50 == 49:
            sender.report()
    for i in range(1000):
        clock[0] = 200.0 + i * 0.01
        local.unhold(100.0 + i * 0.0437, clock[0] - 0.2, clock[0])
        if i % 50 == 49:
            sender.report()
    clock[0] = 220.0
    for event in sent.published:
        receiver.apply_report(event)
    target = receiving.signals.pipeline("demo")
    assert target.in_flight == 0
    assert target.open_bins == {}, f"{sum(target.open_bins.values())} holds left open"
    # The reports that held requests tell the receiver's bus to send releases.
    holding = sum(1 for e in sent.published if e[1]["demo"][5])
    assert holding and receiver_bus.holds_reported >= holding
    # Ends are learned when the report is applied, not when the sender learned them.
    assert min(target.lags) >= 220.0 - 210.0 - 0.01


def test_the_replicas_parts_of_a_cap_add_up_to_it() -> None:
    """Each rounding its own share up gave two replicas 3 + 3 of a cap of 5."""
    assert cap_parts(5, {"a": 0.5, "b": 0.5}) == {"a": 3, "b": 2}  # ties by name
    assert sum(cap_parts(5, {"a": 0.52, "b": 0.48}).values()) == 5
    parts = cap_parts(12, {"a": 0.7, "b": 0.2, "c": 0.1})
    assert sum(parts.values()) == 12
    assert all(abs(parts[r] - 12 * s) < 1 for r, s in {"a": 0.7, "b": 0.2, "c": 0.1}.items())
    assert cap_parts(2, {"a": 0.9, "b": 0.05, "c": 0.05}) == {"a": 1, "b": 1, "c": 1}
    assert cap_parts(0, {"a": 1.0}) == {}
    # A replica's own part, as share_of applies it.
    mine = share_of(_snapshot(), {"infer": 0.5}, {"infer": 2}).decisions["infer"]
    assert mine.concurrency == 2
