"""Requests held at the pipeline's entry for room under the in-flight cap
(sitsmesh.pressure.entryqueue): who goes in first, how long one waits, what it may cost."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from prometheus_client import CollectorRegistry

from sitsmesh.authz.admission import Admission, AdmissionPolicy, Verdict
from sitsmesh.chains.pipeline import pipeline_from
from sitsmesh.pressure.controller import Controller, Decision, Snapshot
from sitsmesh.pressure.entryqueue import Waiter, wait_for
from sitsmesh.pressure.gate import MIN_WAITING, PressureGate
from sitsmesh.pressure.runtime import PressureRuntime
from sitsmesh.pressure.signals import Signals
from sitsmesh.pressure.thresholds import InvalidThresholds, thresholds_from

PIPELINE = pipeline_from("demo", {"models": ["resnet*"], "stages": [
    {"name": "model", "match": {"upstream_cluster": "triton"}, "sla_p99_ms": 250}]})


def _decision(**changes: Any) -> Decision:
    base = Decision("demo", "sitsmesh", 1.0, 0.0, 1, 5, 3, "model", "overloaded", 10.0, (),
                    0.0, wait_s=5.0)
    return dataclasses.replace(base, **changes)


def _admission(**changes: Any) -> tuple[Admission, PressureGate]:
    gate = PressureGate(Signals())
    gate.set_pipelines({"demo": PIPELINE})
    gate.snapshot = Snapshot({"demo": _decision(**changes)}, 0.0)
    return Admission(AdmissionPolicy(), hold_s=60, gate=gate), gate


def _waiter(verdict: Verdict) -> Waiter:
    assert verdict.admit and verdict.waiting is not None, verdict
    return verdict.waiting


async def test_a_request_at_the_cap_waits_and_goes_in_when_one_ends() -> None:
    admission, gate = _admission()
    assert admission.admit("acme", "resnet50", 0, "", "a").waiting is None
    waiter = _waiter(admission.admit("acme", "resnet50", 0, "", "b"))
    signals = gate.signals.pipeline("demo")
    assert not waiter.future.done()
    assert (signals.arrivals, signals.admitted, signals.in_flight) == (2, 1, 1)
    assert admission.release("a")
    assert waiter.future.result() is True
    # Let in means counted: in flight, admitted, and held until its own entry ends it.
    assert (signals.admitted, signals.in_flight, signals.shed) == (2, 1, 0)
    assert admission.held() == 1 and admission.release("b") and signals.in_flight == 0


async def test_waiters_go_in_highest_priority_first_then_oldest() -> None:
    admission, _ = _admission()
    assert admission.admit("acme", "resnet50", 0, "", "first").waiting is None
    waiters = {name: _waiter(admission.admit("acme", "resnet50", priority, "", name))
               for name, priority in (("a", 0), ("b", 2), ("c", 0), ("d", 2))}
    # A protected priority never waits: it counts toward the cap without meeting it.
    assert admission.admit("acme", "resnet50", 9, "", "vip").waiting is None
    order = []
    for ended in ("first", "vip", "b", "d", "a", "c"):
        assert admission.release(ended)
        order += [n for n, w in waiters.items() if w.future.done() and n not in order]
    assert order == ["b", "d", "a", "c"]


async def test_a_waiter_that_waits_its_time_is_refused_and_counted_as_shed() -> None:
    admission, gate = _admission(wait_s=0.02)
    admission.admit("acme", "resnet50", 0, "", "a")
    waiter = _waiter(admission.admit("acme", "resnet50", 0, "req-b", "b"))
    assert await asyncio.wait_for(waiter.future, 1.0) is False
    refusal = waiter.refusal
    assert refusal is not None and getattr(refusal, "reason", "") == "concurrency"
    assert gate.sheds == {("demo", "model", 0, "concurrency"): 1}
    assert gate.samples[("demo", "concurrency")] == ("b", "acme", 0)
    assert gate.queue.waiting == 0 and gate.signals.pipeline("demo").shed == 1
    assert gate.queue.outcomes == {("demo", "waited_out"): 1}
    assert admission.release("a") and admission.held() == 0  # nothing let in late


async def test_the_queue_holds_what_the_wait_can_let_in_and_refuses_the_rest_at_once() -> None:
    # 40 requests/s for 0.1 s: 4 can go in within the wait, plus MIN_WAITING.
    admission, gate = _admission(admit_rate=40.0, wait_s=0.1)
    admission.admit("acme", "resnet50", 0, "", "a")
    verdicts = [admission.admit("acme", "resnet50", 0, "", f"w{i}") for i in range(30)]
    held = [v for v in verdicts if v.waiting is not None]
    refused = [v for v in verdicts if not v.admit]
    assert len(held) == MIN_WAITING + 4 and len(refused) == 30 - len(held)
    assert {v.code for v in refused} == {"concurrency"}
    assert gate.queue.waiting == len(held)
    for waiter in (v.waiting for v in held):
        assert waiter is not None
        waiter.abandon()
    assert gate.queue.waiting == 0


async def test_a_process_wide_limit_bounds_the_waiters_of_every_pipeline() -> None:
    admission, gate = _admission(admit_rate=1e6)
    gate.queue.limit = 3
    admission.admit("acme", "resnet50", 0, "", "a")
    verdicts = [admission.admit("acme", "resnet50", 0, "", f"w{i}") for i in range(5)]
    assert [v.waiting is not None for v in verdicts] == [True] * 3 + [False] * 2


async def test_a_check_that_goes_away_holds_no_slot() -> None:
    admission, gate = _admission()
    admission.admit("acme", "resnet50", 0, "", "a")
    gone = _waiter(admission.admit("acme", "resnet50", 0, "", "gone"))
    kept = _waiter(admission.admit("acme", "resnet50", 0, "", "kept"))
    gone.abandon()  # Envoy's ext_authz timeout while it waited
    assert gate.queue.waiting == 1
    assert admission.release("a")
    assert kept.future.result() is True and not gone.future.done()
    # Let in, then its Check went away before the answer: Envoy never forwards it, so
    # no access-log entry will end its hold; the slot is freed now.
    late = _waiter(admission.admit("acme", "resnet50", 0, "", "late"))
    assert admission.release("kept")
    assert late.future.result() is True and admission.held() == 1
    late.abandon()
    assert admission.held() == 0 and gate.signals.pipeline("demo").in_flight == 0


async def test_a_new_decision_with_room_lets_the_waiters_in() -> None:
    registry = CollectorRegistry()
    runtime = PressureRuntime(registry)
    runtime.set_pipelines({"demo": PIPELINE})
    gate = runtime.gate
    gate.snapshot = Snapshot({"demo": _decision()}, 0.0)
    admission = Admission(AdmissionPolicy(), hold_s=60, gate=gate)
    admission.admit("acme", "resnet50", 0, "", "a")
    waiter = _waiter(admission.admit("acme", "resnet50", 0, "", "b"))
    gone = _waiter(admission.admit("acme", "resnet50", 0, "", "c"))
    gone.abandon()
    runtime.apply(Snapshot({"demo": _decision(concurrency=2)}, 1.0))
    assert waiter.future.result() is True
    runtime.apply(Snapshot({"demo": _decision(concurrency=2)}, 2.0))  # publishes the counts
    for outcome, count in (("let_in", 1), ("gone", 1), ("waited_out", None)):
        assert registry.get_sample_value("sitsmesh_entry_waits_total", {
            "pipeline": "demo", "outcome": outcome}) == count
    assert registry.get_sample_value("sitsmesh_entry_waiting", {"pipeline": "demo"}) == 0


async def test_a_pipeline_that_goes_away_lets_its_waiters_in() -> None:
    admission, gate = _admission()
    admission.admit("acme", "resnet50", 0, "", "a")
    waiter = _waiter(admission.admit("acme", "resnet50", 0, "", "b"))
    gate.set_pipelines({})  # a new catalog without it: nothing caps its requests now
    assert waiter.future.result() is True and gate.queue.waiting == 0
    assert admission.release("b") and admission.release("a")


async def test_without_a_wait_the_cap_refuses_at_once() -> None:
    admission, gate = _admission(wait_s=0.0)
    admission.admit("acme", "resnet50", 0, "", "a")
    verdict = admission.admit("acme", "resnet50", 0, "", "b")
    assert not verdict.admit and verdict.code == "concurrency" and gate.queue.waiting == 0


def test_entry_wait_is_a_threshold_with_bounds() -> None:
    assert thresholds_from({"entry_wait_ms": 120}).entry_wait_ms == 120
    assert thresholds_from({}).to_body()["entry_wait_ms"] == thresholds_from({}).entry_wait_ms
    for bad in (-1, 10_001, 1.5, "x"):
        try:
            thresholds_from({"entry_wait_ms": bad})
        except InvalidThresholds as exc:
            assert "entry_wait_ms" in exc.message
        else:
            raise AssertionError(f"{bad!r} accepted")


def test_requests_wait_only_while_ends_reach_the_gate_soon() -> None:
    assert wait_for(100, []) == 0.1
    assert wait_for(100, [0.02] * 96 + [0.5] * 4) == 0.1  # a few late flushes
    assert wait_for(100, [0.02] * 90 + [0.5] * 10) == 0.0  # Envoy's 1 s flush, or a lag
    assert wait_for(0, [0.0]) == 0.0


def test_the_controller_publishes_the_wait_only_while_ends_come_soon() -> None:
    clock = [100.0]
    signals = Signals()
    controller = Controller(signals, lambda: clock[0])
    controller.configure({"demo": PIPELINE}, {"demo": thresholds_from(
        {"entry_wait_ms": 150, "stages": {"model": {"parallelism": 1}}})})
    signals.pipeline("demo").lags.extend([0.02] * 50)
    decision = controller.tick().decisions["demo"]
    assert decision.wait_s == 0.15
    # Ends a flush behind: the gate would let waiters in on an estimate; none wait.
    signals.pipeline("demo").lags.extend([1.0] * 512)
    clock[0] += 0.1
    assert controller.tick().decisions["demo"].wait_s == 0.0
