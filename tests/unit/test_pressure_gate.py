"""The request-path side of backpressure: gate, admission holds, adaptive rate limits,
Triton metrics parsing, and what the runtime publishes."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from sitsmesh.authz.admission import Admission, AdmissionPolicy
from sitsmesh.chains.pipeline import pipeline_from
from sitsmesh.errors import ConfigError
from sitsmesh.pressure.controller import Decision, Snapshot
from sitsmesh.pressure.gate import UNHELD, PressureGate
from sitsmesh.pressure.runtime import PressureRuntime
from sitsmesh.pressure.scrape import samples_from
from sitsmesh.pressure.signals import Signals
from sitsmesh.ratelimit import config as rlconfig
from sitsmesh.ratelimit.limiter import ConfigHolder, Descriptor, RateLimiter
from sitsmesh.ratelimit.memory import MemoryStore
from sitsmesh.ratelimit.metrics import RuleMetrics

PIPELINE = pipeline_from("demo", {"models": ["resnet*"], "stages": [
    {"name": "model", "match": {"upstream_cluster": "triton"}, "sla_p99_ms": 250,
     "triton_model": "resnet"}]})


def _decision(**changes: Any) -> Decision:
    base = Decision("demo", "sitsmesh", 1.0, 0.0, 0, 5, 3, "model", "overloaded", 10.0, (), 0.0)
    return dataclasses.replace(base, **changes)


def _gate(decision: Decision | None = None) -> PressureGate:
    gate = PressureGate(Signals())
    gate.set_pipelines({"demo": PIPELINE})
    if decision is not None:
        gate.snapshot = Snapshot({"demo": decision}, 0.0)
    return gate


def test_requests_find_their_pipeline_by_hint_or_model() -> None:
    gate = _gate()
    assert gate.pipeline_for("demo", "") == "demo"
    assert gate.pipeline_for("nope", "resnet50") == "demo"  # an unknown hint is ignored
    assert gate.pipeline_for("nope", "") == ""
    assert gate.pipeline_for("", "resnet50") == "demo"
    assert gate.pipeline_for("", "bert") == ""


def test_a_gate_that_does_not_enforce_counts_every_arrival_and_refuses_none() -> None:
    """--admission rlqs: Envoy sheds on its quotas; Check's gate feeds the controller.
    What the level would shed Envoy's quota sheds: counted so, and held nowhere."""
    gate = _gate(_decision(cutoff=0.3, concurrency=1))
    gate.enforce = False
    answers = [gate.admit("demo", 0, f"r{i}", "acme") for i in range(1000)]
    assert all(a is None or a is UNHELD for a in answers)
    signals = gate.signals.pipeline("demo")
    unheld = sum(a is UNHELD for a in answers)
    assert 290 <= unheld <= 310
    assert (signals.arrivals, signals.admitted, signals.shed) == (1000, 1000 - unheld, unheld)
    assert gate.sheds == {}  # nothing refused here: no shed metric, no 429 from Check


def test_the_admission_level_sheds_exactly_its_share_of_a_priority() -> None:
    gate = _gate(_decision(cutoff=0.3))
    outcomes = [gate.admit("demo", 0, f"r{i}", "acme") for i in range(1000)]
    shed = [o for o in outcomes if o is not None]
    assert 290 <= len(shed) <= 310
    assert {s.reason for s in shed} == {"admission_level"}
    assert shed[0].retry_after_s == 3 and "stage model" in shed[0].message
    assert all(gate.admit("demo", 1, f"p{i}", "acme") is None for i in range(100))
    assert gate.sheds == {("demo", "model", 0, "admission_level"): len(shed)}
    signals = gate.signals.pipeline("demo")
    assert (signals.arrivals, signals.admitted, signals.shed) == (1100, 1100 - len(shed),
                                                                  len(shed))


def test_a_shedding_level_spends_a_budget_so_a_drop_in_arrivals_stops_it_at_once() -> None:
    """The level sheds half of priority 0, the bottleneck takes 50 requests/s. At 200
    arrivals/s the budget runs out and the level sheds; once arrivals fall to 20/s every
    request gets in, though the decision (a tick or more old) still says shed."""
    clock = [100.0]
    gate = PressureGate(Signals(), lambda: clock[0])
    gate.set_pipelines({"demo": PIPELINE})
    gate.snapshot = Snapshot({"demo": _decision(cutoff=0.5, admit_rate=50.0)}, 0.0)

    def run(rate: float, seconds: float) -> tuple[int, int]:
        admitted = shed = 0
        for i in range(int(rate * seconds)):
            clock[0] += 1 / rate
            if gate.admit("demo", 0 if i % 10 < 7 else 9, f"r{i}", "acme") is None:
                admitted += 1
            else:
                shed += 1
        return admitted, shed

    # 400 arrivals: 120 protected and 140 of priority 0 above the level get in and spend
    # far more than the 100 the budget gives in 2 s; the 140 under the level are shed
    # but for the first burst's worth.
    admitted, shed = run(200, 2.0)
    assert 130 <= shed <= 140 and admitted == 400 - shed
    admitted, shed = run(20, 2.0)
    assert (admitted, shed) == (40, 0)
    # Without a rate (a stale bottleneck), the level sheds its share as before.
    gate.snapshot = Snapshot({"demo": _decision(cutoff=0.5)}, 0.0)
    assert run(20, 2.0)[1] > 0


def test_admission_holds_count_in_flight_until_the_access_log_ends_them() -> None:
    clock = [0.0]
    gate = _gate(_decision(concurrency=2))
    admission = Admission(AdmissionPolicy(), hold_s=10, clock=lambda: clock[0], gate=gate)
    assert admission.admit("acme", "resnet50", 0, "", "a").admit
    assert admission.admit("acme", "resnet50", 0, "", "b").admit
    third = admission.admit("acme", "resnet50", 0, "", "c")
    assert not third.admit and third.code == "concurrency" and third.retry_after_s == 3
    assert admission.admit("acme", "resnet50", 9, "", "d").admit  # protected priority
    assert gate.signals.pipeline("demo").in_flight == 3
    assert admission.release("a")
    assert not admission.admit("acme", "resnet50", 0, "", "e").admit  # b and d: still 2
    assert admission.release("d")
    assert not admission.release("d")  # a resent access-log entry ends nothing twice
    assert admission.admit("acme", "resnet50", 0, "", "e").admit
    clock[0] = 11
    assert admission.expire() == 2  # b and e never got their access log
    assert gate.signals.pipeline("demo").in_flight == 0
    assert admission.admit("acme", "bert", 0, "", "f").admit  # no pipeline: no pressure


async def test_adaptive_rate_limits_scale_with_the_admitted_fraction() -> None:
    config = rlconfig.build([("c.yaml", """
domain: edge
descriptors:
  - key: tenant
    rate_limit: {unit: hour, requests_per_unit: 10, adaptive: true, pipeline: demo}
""")])
    gate = _gate(_decision(fraction=0.3))
    limiter = RateLimiter(ConfigHolder(config), MemoryStore(), RuleMetrics(CollectorRegistry()),
                          clock=lambda: 1000.0, gate=gate)
    results = [await limiter.check("edge", [Descriptor((("tenant", "acme"),), None)])
               for _ in range(5)]
    assert [r.over for r in results] == [False, False, False, True, True]  # 10 x 0.3 = 3
    assert gate.signals.pipeline("demo").rl_arrivals == 5
    # Two adaptive rules of one pipeline on one request: still one arrival.
    twice = RateLimiter(ConfigHolder(rlconfig.build([("c.yaml", """
domain: edge
descriptors:
  - key: tenant
    rate_limits:
      - {unit: hour, requests_per_unit: 10, adaptive: true, pipeline: demo}
      - {unit: minute, requests_per_unit: 10, adaptive: true, pipeline: demo}
""")])), MemoryStore(), RuleMetrics(CollectorRegistry()), clock=lambda: 1000.0, gate=gate)
    await twice.check("edge", [Descriptor((("tenant", "acme"),), None)])
    assert gate.signals.pipeline("demo").rl_arrivals == 6
    with pytest.raises(ConfigError, match="an adaptive rate limit needs the pipeline"):
        rlconfig.build([("c.yaml", "domain: x\ndescriptors:\n  - key: k\n    rate_limit: "
                                   "{unit: hour, requests_per_unit: 1, adaptive: true}\n")])


TRITON_METRICS = """\
# HELP nv_inference_request_success Number of successful inference requests
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="resnet",version="1"} 120
nv_inference_request_success{model="resnet",version="2"} 30
nv_inference_request_success{model="bert",version="1"} 7
# TYPE nv_inference_request_failure counter
nv_inference_request_failure{model="resnet",version="1"} 2
# TYPE nv_inference_queue_duration_us counter
nv_inference_queue_duration_us{model="resnet",version="1"} 5000
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="resnet",version="1"} 3
nv_inference_pending_request_count{model="resnet",version="2"} 4
"""


def test_triton_metrics_become_one_sample_per_model() -> None:
    samples = samples_from(TRITON_METRICS, at=12.5)
    resnet = samples["resnet"]
    assert (resnet.at, resnet.pending, resnet.success, resnet.failure, resnet.queue_us) == (
        12.5, 7, 150.0, 2.0, 5000.0)
    assert samples["bert"].pending == 0


def test_the_runtime_publishes_metrics_and_a_sampled_log_of_sheds(
        caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    clock = [100.0]
    runtime = PressureRuntime(registry, clock=lambda: clock[0])
    runtime.scraping = True
    runtime.set_pipelines({"demo": PIPELINE})
    runtime.on_triton("resnet", samples_from(TRITON_METRICS, at=clock[0])["resnet"])
    snapshot = runtime.tick()
    assert snapshot.decisions["demo"].stages[0].queue == 7
    runtime.gate.snapshot = Snapshot({"demo": _decision(cutoff=1.0)}, clock[0])
    for i in range(5):
        assert runtime.gate.admit("demo", 0, f"r{i}", "acme") is not None
    with caplog.at_level(logging.INFO):
        runtime.tick()
    assert registry.get_sample_value("sitsmesh_shed_total", {
        "pipeline": "demo", "stage": "model", "priority": "0",
        "reason": "admission_level"}) == 5
    assert registry.get_sample_value("sitsmesh_pipeline_admitted_fraction",
                                     {"pipeline": "demo"}) is not None
    assert runtime.gate.sheds == {}


def test_a_scraped_stage_without_a_sample_is_stale() -> None:
    runtime = PressureRuntime(None, clock=lambda: 5.0)
    runtime.scraping = True
    runtime.set_pipelines({"demo": PIPELINE})
    decision = runtime.tick().decisions["demo"]
    assert decision.stages[0].stale and decision.level == "stale"


def test_an_overloaded_model_stage_holds_back_swaps() -> None:
    from sitsmesh.pressure.controller import StagePressure

    runtime = PressureRuntime(None, clock=lambda: 1.0)
    runtime.set_pipelines({"demo": PIPELINE})
    assert runtime.model_pressure("resnet") == ""  # nothing published yet
    view = StagePressure("model", "overloaded", 1.7, 90.0, 50.0, 1.8, 20.0, 1.2, 400.0,
                         3600.0, -40.0, False)
    runtime.gate.snapshot = Snapshot({"demo": _decision(stages=(view,))}, 1.0)
    assert runtime.model_pressure("resnet") == (
        "stage demo/model is overloaded: pressure 1.70, queue 20, p99 400 ms")
    assert runtime.model_pressure("bert") == ""


def test_triton_counters_give_capacity_and_service_time_over_one_window() -> None:
    from sitsmesh.pressure.signals import StageSignals, TritonSample
    from sitsmesh.pressure.stages import triton_rates as _triton_rates

    signals = StageSignals()
    assert _triton_rates(signals) == (0.0, 0.0)
    signals.scraped(TritonSample(10.0, 5, 100, 0, 1_000_000, 3_000_000))
    # 25 finished in 0.5 s; 1.0 s spent in all, 0.5 s of it queued: 20 ms of service each.
    signals.scraped(TritonSample(10.5, 5, 124, 1, 1_500_000, 4_000_000))
    served, service = _triton_rates(signals)
    assert served == pytest.approx(50.0)
    assert service == pytest.approx(0.02)
    signals.scraped(TritonSample(11.0, 0, 3, 0, 0, 0))  # Triton restarted: counters reset
    assert _triton_rates(signals) == (0.0, 0.0)


@pytest.mark.parametrize(("batched", "capacity"), [(False, 50.0), (True, 80.0)])
def test_a_passing_triton_queue_does_not_read_as_capacity(batched: bool,
                                                          capacity: float) -> None:
    """At 38 requests/s a scrape now and then finds 2 queued; what was served over the
    window (38/s) is not what the model can serve (20 ms a request: 50/s). Only a model
    that serves more than its compute time says, under a standing queue (batching:
    80/s), raises it."""
    from sitsmesh.pressure.signals import TritonSample

    clock = [0.0]
    runtime = PressureRuntime(None, clock=lambda: clock[0])
    runtime.scraping = True
    runtime.set_pipelines({"demo": PIPELINE})
    served = 80.0 if batched else 38.0
    done = request_us = 0.0
    for scrape in range(40):
        clock[0] = scrape * 0.25
        done += served * 0.25
        request_us += served * 0.25 * 20_000
        pending = 4 if batched else 2 if scrape % 4 == 0 else 0
        runtime.on_triton("resnet", TritonSample(clock[0], pending, done, 0, 0, request_us))
        runtime.tick()
        if scrape >= 20:
            [view] = runtime.gate.snapshot.decisions["demo"].stages
            assert view.capacity == pytest.approx(capacity, rel=0.05), scrape


def test_capacity_stays_sane_when_the_windows_disagree() -> None:
    """A queue that empties fast made hop time minus queue time come out near zero, and
    the capacity estimate jump to ~1e6/s; Triton's service time keeps it near 50/s."""
    from sitsmesh.pressure.signals import TritonSample

    runtime = PressureRuntime(None, clock=lambda: clock[0])
    clock = [0.0]
    runtime.scraping = True
    runtime.set_pipelines({"demo": PIPELINE})
    stage = runtime.signals.stage("demo", "model")
    entry = runtime.signals.pipeline("demo")
    success = request_us = queue_us = 0.0
    capacities = []
    queues: list[int] = []
    for tick in range(60):
        clock[0] += 0.1
        entry.arrive(0)
        entry.admitted += 5
        queue_now = min(tick, 30) if tick < 40 else 0  # builds up, then empties at once
        queues.append(queue_now)
        # Access-log hops report the queue as it was when they entered it, ticks ago.
        lagged = queues[max(0, len(queues) - 4)]
        for i in range(5):
            took = 0.02 + lagged * 0.02
            stage.complete(f"r{tick}-{i}", clock[0] - took, took, failed=False,
                           arrived=clock[0])
        success += 5
        queue_us += 5 * queue_now * 20_000
        request_us += 5 * (queue_now * 20_000 + 20_000)
        stage.scraped(TritonSample(clock[0], queue_now, success, 0, queue_us, request_us))
        capacities.append(runtime.tick().decisions["demo"].stages[0].capacity)
    assert max(capacities) < 60
    assert min(capacities[5:]) > 40
