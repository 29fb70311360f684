"""The published decision's wire form and each replica's share of it (pure logic)."""

from __future__ import annotations

import pytest

from sitsmesh.pressure.controller import Decision, Snapshot
from sitsmesh.pressure.stages import SignalAge, StagePressure
from sitsmesh.shared.pressure import decode_snapshot, encode_snapshot, share_of


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
