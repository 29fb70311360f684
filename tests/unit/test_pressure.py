"""The backpressure controller with an injected clock and synthetic signals.

Step overload and slow ramp run the controller against the queueing model
(sitsmesh.pressure.simulate: one 20 ms stage, one server, capacity 50/s,
SLA 250 ms, 30 % of requests at priority 9). Flapping and stale signals are
fed by hand.
"""

from __future__ import annotations

import itertools
import statistics
from typing import Any

import pytest

from sitsmesh.chains.pipeline import pipeline_from
from sitsmesh.pressure.admit import CONCURRENCY, LEVEL, shed_reason
from sitsmesh.pressure.controller import Controller, cutoff_for
from sitsmesh.pressure.signals import Signals, TritonSample
from sitsmesh.pressure.simulate import InvalidProfile, profile_from, simulate, summary
from sitsmesh.pressure.thresholds import InvalidThresholds, thresholds_from

PIPELINE = pipeline_from("demo", {"stages": [
    {"name": "model", "match": {"upstream_cluster": "triton"}, "sla_p99_ms": 250,
     "triton_model": "lazy"}]})
STAGE = {"model": {"queue_capacity": 32, "parallelism": 1}}


def _profile(steps: list[tuple[float, float]], duration: float, seed: int = 1,
             log_flush_s: float = 0.02) -> Any:
    return profile_from({"duration_s": duration,
                         "steps": [{"at_s": t, "rps": r} for t, r in steps],
                         "priorities": {0: 0.7, 9: 0.3}, "service_ms": {"model": 20},
                         "sla_ms": 250, "seed": seed, "log_flush_s": log_flush_s}, PIPELINE)


def _run(policy: str, profile: Any) -> list[Any]:
    return simulate(PIPELINE, thresholds_from({"policy": policy, "stages": STAGE}), profile)


def _window(seconds: list[Any], start: int, end: int) -> list[Any]:
    return [s for s in seconds if start <= s.at < end]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_step_overload_keeps_goodput_and_high_priority_and_recovers(seed: int) -> None:
    # 25/s, then 100/s (2x capacity) from t=6 to t=20, then 25/s again.
    profile = _profile([(0, 25), (5.9, 25), (6, 100), (20, 100), (20.1, 25)], 30, seed)
    seconds = _run("sitsmesh", profile)
    overload = _window(seconds, 8, 20)
    goodput = statistics.mean(s.good for s in overload)
    assert goodput >= 0.9 * 50, [s.good for s in overload]
    assert max(s.p99_ms for s in overload) <= 250
    high = [s.by_priority.get(9, [0, 0]) for s in seconds]
    assert sum(g for _, g in high) / sum(o for o, _ in high) >= 0.999
    low = [s.by_priority.get(0, [0, 0]) for s in overload]
    assert sum(g for _, g in low) / sum(o for o, _ in low) < 0.5  # the low priority paid
    # Load drops at t=20: within 2 s nothing is shed and the fraction is back to 1.
    after = _window(seconds, 22, 30)
    assert all(s.shed == 0 and s.fraction == 1.0 for s in after), [
        (s.at, s.shed, s.fraction) for s in after]


def test_the_seed_policy_grows_queues_and_loses_goodput_where_sitsmesh_does_not() -> None:
    profile = _profile([(0, 25), (5.9, 25), (6, 100), (20, 100), (20.1, 25)], 30)
    ours, seed, off = (summary(_run(p, profile)) for p in ("sitsmesh", "seed", "off"))
    assert ours["goodput_rps"] > 2 * seed["goodput_rps"]
    assert seed["goodput_rps"] > off["goodput_rps"]
    assert seed["p99_ms"] > 2 * 250 > ours["p99_ms"]
    # The seed rule is blind to priorities; sitsmesh sheds the low ones first.
    assert abs(seed["success_by_priority"][9] - seed["success_by_priority"][0]) < 0.1
    assert ours["success_by_priority"][9] >= 0.999


def test_a_slow_ramp_sheds_gradually_not_all_at_once() -> None:
    profile = _profile([(0, 20), (40, 120)], 40)
    seconds = _run("sitsmesh", profile)
    shed = [s.shed / s.offered if s.offered else 0.0 for s in seconds]
    assert shed[:6] == [0.0] * 6  # well under capacity (up to 65 %): nothing shed
    assert statistics.mean(shed[-5:]) > 0.4  # far over it: shedding
    # Shedding rises with the load instead of flipping between none and most.
    assert max(b - a for a, b in itertools.pairwise(shed)) < 0.35
    assert max(s.p99_ms for s in seconds) <= 250


def _controller(signals: Signals, clock: list[float], **extra: Any) -> Controller:
    controller = Controller(signals, lambda: clock[0], **extra)
    controller.configure({"demo": PIPELINE}, {"demo": thresholds_from({"stages": STAGE})})
    return controller


def _feed(signals: Signals, clock: list[float], *, arrivals: int, done: int,
          latency_s: float, pending: int, scrape: bool = True) -> None:
    entry = signals.pipeline("demo")
    for i in range(arrivals):
        entry.arrive(9 if i % 10 < 3 else 0)
        entry.admitted += 1
    stage = signals.stage("demo", "model")
    for i in range(done):
        stage.complete(f"r{clock[0]}-{i}", clock[0] - latency_s, latency_s,
                       failed=False, arrived=clock[0])
    if scrape:
        stage.scraped(TritonSample(clock[0], pending, 0, 0, 0))


def test_flapping_signals_do_not_flap_the_decision() -> None:
    """Overload on one tick, calm on the next: the fraction falls, and it waits out the
    hysteresis before it rises, so admission does not oscillate with the signal."""
    signals, clock = Signals(), [0.0]
    controller = _controller(signals, clock)
    fractions = []
    for i in range(40):
        clock[0] += 0.1
        busy = i % 2 == 0
        _feed(signals, clock, arrivals=10, done=5, latency_s=0.3 if busy else 0.02,
              pending=20 if busy else 0)
        fractions.append(controller.tick().decisions["demo"].fraction)
    rises = sum(1 for a, b in itertools.pairwise(fractions) if b > a)
    assert min(fractions) < 1.0  # it did react to the overload
    assert rises == 0, fractions  # and never stepped back up between two bad ticks


def test_a_stale_scrape_counts_as_saturated_and_recovers_when_fresh() -> None:
    signals, clock = Signals(), [0.0]
    controller = _controller(signals, clock, stale_after_s=1.0)
    for _ in range(10):
        clock[0] += 0.1
        _feed(signals, clock, arrivals=3, done=3, latency_s=0.02, pending=0)
        decision = controller.tick().decisions["demo"]
    assert decision.level == "ok" and decision.fraction == 1.0
    for _ in range(15):  # the scrape stops; requests keep coming
        clock[0] += 0.1
        _feed(signals, clock, arrivals=3, done=3, latency_s=0.02, pending=0, scrape=False)
        decision = controller.tick().decisions["demo"]
    assert decision.stages[0].stale and decision.level == "stale"
    assert decision.fraction < 1.0  # fail safe: shedding, not admitting blindly
    assert decision.concurrency == 1  # the minimum
    for _ in range(30):
        clock[0] += 0.1
        _feed(signals, clock, arrivals=3, done=3, latency_s=0.02, pending=0)
        decision = controller.tick().decisions["demo"]
    assert decision.level == "ok" and decision.fraction == 1.0


def test_cutoff_sheds_lowest_priorities_first_and_never_protected_ones() -> None:
    shares = [70.0] + [0.0] * 8 + [30.0]
    assert cutoff_for(1.0, shares, 5) == 0.0
    assert cutoff_for(0.65, shares, 5) == pytest.approx(0.5)  # half of priority 0
    assert cutoff_for(0.3, shares, 5) == pytest.approx(1.0)   # all of priority 0
    assert cutoff_for(0.1, shares, 5) == 5.0                  # as far as it may go
    assert cutoff_for(0.5, [0.0] * 10, 5) == 0.0              # nothing arrived yet


def test_shed_reason_applies_level_then_concurrency() -> None:
    signals, clock = Signals(), [1.0]
    decision = _controller(signals, clock).tick().decisions["demo"]
    assert shed_reason(decision, 0, 0.5, 10_000) == ""  # calm: no cutoff, no cap
    shaped = type(decision)(**{**{f: getattr(decision, f) for f in decision.__slots__},
                               "cutoff": 0.5, "concurrency": 4})
    assert shed_reason(shaped, 0, 0.2, 0) == LEVEL
    assert shed_reason(shaped, 0, 0.7, 0) == ""
    assert shed_reason(shaped, 0, 0.7, 4) == CONCURRENCY
    assert shed_reason(shaped, 9, 0.0, 100) == ""  # protected
    assert shed_reason(None, 0, 0.0, 100) == ""


@pytest.mark.parametrize(("body", "message"), [
    ({"policy": "fast"}, "policy must be one of sitsmesh, seed, off, got 'fast'"),
    ({"tick_ms": 5}, "tick_ms must be between 10 and 10000, got 5"),
    ({"queue_fill_low": 0.8}, "queue_fill_low (0.8) must be below queue_fill_high (0.7)"),
    ({"min_concurrency": 10, "max_concurrency": 5}, "min_concurrency (10) is above "
     "max_concurrency (5)"),
    ({"shed_priorities": [0, 12]}, "shed_priorities must be a list of priorities 0-9"),
    ({"stages": {"model": {"parallelism": 0}}}, "stages.model.parallelism must be between"),
    ({"stages": {"model": {"speed": 1}}}, "stages.model: unknown key 'speed'"),
    ({"tick": 100}, "unknown key 'tick'"),
    ({"step_alarm_s": 0}, "step_alarm_s must be between 0.01 and 10, got 0"),
    ({"step_alarm_s": "fast"}, "step_alarm_s must be a number, got 'fast'"),
])
def test_bad_thresholds_are_named(body: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidThresholds) as caught:
        thresholds_from(body, "t.yaml")
    assert message in caught.value.message
    assert caught.value.message.startswith("t.yaml")


def test_a_bare_yaml_off_means_the_off_policy() -> None:
    import yaml

    assert thresholds_from(yaml.safe_load("policy: off")).policy == "off"
    with pytest.raises(InvalidThresholds, match="got True"):
        thresholds_from(yaml.safe_load("policy: on"))


def test_thresholds_round_trip_and_protect_the_unshed_priorities() -> None:
    body = {"policy": "seed", "sla_multiplier": 1.5, "shed_priorities": [0, 1],
            "step_alarm_s": 0.3, "stages": {"model": {"parallelism": 4}}}
    parsed = thresholds_from(body)
    assert parsed.step_alarm_s == 0.3
    assert parsed.protected_from == 2
    assert parsed.stage("model").parallelism == 4
    assert parsed.stage("model").sla_multiplier == 1.5  # inherits the pipeline's
    assert thresholds_from(parsed.to_body()) == parsed


def test_bad_profiles_are_named() -> None:
    with pytest.raises(InvalidProfile, match="service_ms must give a time for each stage"):
        profile_from({"steps": [{"at_s": 0, "rps": 1}]}, PIPELINE)
    with pytest.raises(InvalidProfile, match="steps must be in time order"):
        profile_from({"steps": [{"at_s": 5, "rps": 1}, {"at_s": 1, "rps": 1}],
                      "service_ms": {"model": 1}}, PIPELINE)


def test_queueing_estimates() -> None:
    from sitsmesh.pressure.queueing import mm1_p99, rate_for_p99, seed_depth

    assert mm1_p99(40, 50) == pytest.approx(0.4605, rel=1e-3)
    assert mm1_p99(50, 50) == float("inf")
    assert rate_for_p99(50, 0.25) == pytest.approx(50 - 18.42, rel=1e-3)
    assert mm1_p99(rate_for_p99(50, 0.25), 50) == pytest.approx(0.25)
    # The seed rule: depth grows with the overload once RT99 > 2 x SLA and the queue is
    # more than 70 % full; otherwise it is the base.
    assert seed_depth(32, rt99_s=0.6, sla_s=0.25, fill=0.8, qps=100, capacity=50) == \
        pytest.approx(32 * 1.6)
    assert seed_depth(32, rt99_s=0.4, sla_s=0.25, fill=0.8, qps=100, capacity=50) == 32
    assert seed_depth(32, rt99_s=0.6, sla_s=0.25, fill=0.5, qps=100, capacity=50) == 32


def test_one_slow_request_is_not_a_tail() -> None:
    signals, clock = Signals(), [0.0]
    controller = _controller(signals, clock)
    clock[0] += 0.1
    _feed(signals, clock, arrivals=1, done=1, latency_s=0.45, pending=0)  # a cold start
    decision = controller.tick().decisions["demo"]
    assert decision.level != "overloaded" and decision.stages[0].rt99_ms == 0.0
    clock[0] += 0.1
    _feed(signals, clock, arrivals=6, done=6, latency_s=0.45, pending=0)  # now it is a tail
    assert controller.tick().decisions["demo"].level == "overloaded"
