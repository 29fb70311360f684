"""Signals read as of when they happened: the estimators, and the controller against the
queueing model with Envoy's default 1 s access-log flush and no Triton metrics."""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from sitsmesh.chains.pipeline import pipeline_from
from sitsmesh.pressure import estimate
from sitsmesh.pressure.queueing import chance_queue
from sitsmesh.pressure.signals import PipelineSignals
from sitsmesh.pressure.simulate import InvalidProfile, profile_from, simulate, summary
from sitsmesh.pressure.thresholds import thresholds_from

# A plain HTTP stage: no Triton metrics, one worker, 20 ms a request (capacity 50/s).
PLAIN = pipeline_from("plain", {"stages": [
    {"name": "svc", "match": {"upstream_cluster": "svc"}, "sla_p99_ms": 250}]})
# Exponential service times at 70 % of capacity put a single server's p99 at 307 ms
# (M/M/1: ln(100) / (mu - lambda)): past a 250 ms SLA with no overload at all. The same
# stage with an SLA it meets at that load.
PLAIN_400 = pipeline_from("plain", {"stages": [
    {"name": "svc", "match": {"upstream_cluster": "svc"}, "sla_p99_ms": 400}]})
ONLY_PARALLELISM = thresholds_from({"stages": {"svc": {"parallelism": 1}}})


def _profile(steps: list[tuple[float, float]], duration: float, *, service: str,
             flush: float, seed: int, pipeline: Any = PLAIN) -> Any:
    return profile_from({"duration_s": duration,
                         "steps": [{"at_s": t, "rps": r} for t, r in steps],
                         "priorities": {0: 0.7, 9: 0.3}, "service_ms": {"svc": 20},
                         "service": service, "log_flush_s": flush, "seed": seed}, pipeline)


# --- the estimators ----------------------------------------------------------

def test_survival_reads_the_recent_latencies() -> None:
    ordered = [0.01, 0.02, 0.03, 0.04]
    assert estimate.survival(ordered, 0.0) == 1.0
    assert estimate.survival(ordered, 0.025) == 0.5
    assert estimate.survival(ordered, 1.0) == 0.0
    assert estimate.survival([], 5.0) == 1.0  # nothing seen yet: assume it still runs


def test_held_requests_whose_logs_are_on_the_way_count_as_ended() -> None:
    # 20 requests admitted 0.5 s ago; every recent request took 20-40 ms; the log
    # entries seen so far run up to 0.9 s behind (a 1 s flush).
    bins = {int(9.5 // estimate.BIN_S): 20}
    latencies = sorted([0.02, 0.03, 0.04] * 10)
    expected = estimate.in_flight(bins, now=10.0, watermark=9.1, latencies=latencies)
    assert expected == 0.0
    # Admitted before the watermark and still open after 0.4 s, when recent requests
    # took 40 ms at most: an entry that never came (an Envoy gone), not a queue.
    bins = {int(8.7 // estimate.BIN_S): 3}
    assert estimate.in_flight(bins, now=10.0, watermark=9.1, latencies=latencies) == 0.0
    # Seen running at the watermark (25 ms old), now 35 ms old: of the requests that
    # run past 25 ms, half run past 35 ms, so half of these still count.
    bins = {int(9.08 // estimate.BIN_S): 10}
    weighed = estimate.in_flight(bins, now=9.11, watermark=9.1, latencies=latencies)
    assert weighed == pytest.approx(5.0)


def test_with_no_latency_seen_every_held_request_counts() -> None:
    assert estimate.in_flight({1: 2, 5: 3}, now=1.0, watermark=0.0, latencies=[]) == 5.0


def test_a_fluid_backlog_grows_at_arrivals_past_capacity_and_drains_when_they_stop() -> None:
    # 100/s admitted for 1 s into a 50/s stage that held 2 at the start.
    admits = {i: 1 for i in range(100, 200)}  # one per 10 ms bin from t=1.0 to t=2.0
    grown = estimate.backlog(1.0, 2.0, admits, now=2.0, rate=50.0)
    assert grown == pytest.approx(2 + 100 - 50, abs=1.5)
    drained = estimate.backlog(1.0, 2.0, admits, now=4.0, rate=50.0)
    assert drained == 0.0


def test_present_at_the_watermark_counts_open_and_spanning_requests() -> None:
    open_bins = {int(1.0 // estimate.BIN_S): 2, int(3.0 // estimate.BIN_S): 5}
    ended = [(0.5, 2.5), (0.5, 1.5), (2.1, 2.2)]
    # At t=2: the 2 open ones admitted at 1.0, and the one that spanned 0.5-2.5.
    assert estimate.present_at(2.0, open_bins, ended) == 3


def test_occupancy_gives_the_service_time_queue_or_not() -> None:
    # One server, 20 ms each, ten requests arriving at once: they queue, and the
    # intervals overlap; busy time is still 10 x 20 ms.
    hops = [([(0.0, 0.02 * (i + 1))], 0.02 * (i + 1), False) for i in range(10)]
    work = estimate.occupancy(hops, 0.0, 1.0, servers=1)
    assert work.completions == 10
    assert work.busy == pytest.approx(0.2)
    assert work.services == (0.02,)  # only the first found the server free
    # Two servers: twice the work in the same span.
    assert estimate.occupancy(hops, 0.0, 1.0, servers=2).busy == pytest.approx(0.38)


def test_own_segments_leave_out_the_stages_a_stage_waited_on() -> None:
    assert estimate.own_segments(0.0, 1.0, [(0.2, 0.5), (0.4, 0.7)]) == [(0.0, 0.2),
                                                                        (0.7, 1.0)]
    assert estimate.own_segments(0.0, 1.0, [(2.0, 3.0)]) == [(0.0, 1.0)]  # not nested


def test_a_fanned_out_stage_is_judged_by_all_its_calls_not_their_overlap() -> None:
    """feat calls model twice at once per request; model has two workers and 20 ms a
    call, so 100 calls/s. The sibling calls run in parallel: neither is nested in the
    other, whichever started first (the old reading took one as the other's child)."""
    from sitsmesh.pressure.controller import Controller
    from sitsmesh.pressure.signals import Signals

    pipeline = pipeline_from("fan", {"stages": [
        {"name": "feat", "match": {"upstream_cluster": "feat"}},
        {"name": "model", "match": {"upstream_cluster": "model"}, "sla_p99_ms": 250}]})
    thresholds = thresholds_from({"stages": {"feat": {"parallelism": 8},
                                             "model": {"parallelism": 2, "fanout": 2}}})
    signals, clock = Signals(), [0.0]
    controller = Controller(signals, lambda: clock[0])
    controller.configure({"fan": pipeline}, {"fan": thresholds})
    feat, model = signals.stage("fan", "feat"), signals.stage("fan", "model")
    for n in range(200):  # 40 requests/s, 80 calls/s: 80 % busy
        t0 = n * 0.025
        clock[0] = t0 + 0.05
        rid = f"r{n}"
        # The second call starts 0.2 ms later and ends 0.1 ms sooner: "nested" in time.
        model.complete(rid, t0 + 0.001, 0.0200, failed=False, arrived=clock[0])
        model.complete(rid, t0 + 0.0012, 0.0197, failed=False, arrived=clock[0])
        feat.complete(rid, t0, 0.023, failed=False, arrived=clock[0])
        if n % 2:
            controller.tick()
    view = {v.name: v for v in controller.tick().decisions["fan"].stages}["model"]
    assert view.capacity == pytest.approx(100, rel=0.05)


def test_each_signal_says_how_old_it_is_and_late_by_design_is_not_stale() -> None:
    from sitsmesh.pressure.controller import Controller
    from sitsmesh.pressure.signals import EnvoySample, Signals

    signals, clock = Signals(), [0.0]
    controller = Controller(signals, lambda: clock[0])
    controller.configure({"plain": PLAIN}, {"plain": ONLY_PARALLELISM})
    entry, stage = signals.pipeline("plain"), signals.stage("plain", "svc")

    def ages() -> dict[str, tuple[float, bool]]:
        [view] = controller.tick().decisions["plain"].stages
        return {a.source: (a.age_s, a.stale) for a in view.signals}

    assert ages() == {}  # nothing came yet, and nothing is expected
    n = 0
    for second in range(4):  # 20 requests/s, their entries flushed once a second
        for i in range(20):
            clock[0] = second + i / 20
            entry.arrive(0)
            entry.admitted += 1
            if i % 5 == 0:
                ages()
        flushed = clock[0] + 0.05
        for i in range(20):
            started = second + i / 20
            stage.complete(f"r{n}", started, 0.02, failed=False, arrived=flushed)
            n += 1
        stage.envoy["envoy-1"] = EnvoySample(flushed, 1.0, 0.0)
    clock[0] = 4.6  # 0.6 s after the last flush: a log a flush behind, as designed
    age, stale = ages()["access_log"]
    assert age == pytest.approx(4.6 - 3.97, abs=0.01) and not stale
    age, stale = ages()["envoy_stats"]
    assert age == pytest.approx(0.6, abs=0.01) and not stale
    for i in range(40):  # traffic goes on, but no entry and no stats for 2 s
        clock[0] = 4.6 + i * 0.05
        entry.arrive(0)
        entry.admitted += 1
        found = ages()
    assert found["access_log"][1] and found["envoy_stats"][1]


def test_a_direct_view_of_the_queue_anchors_the_in_flight_estimate() -> None:
    """The stage served 10 ms requests all minute (100/s); now it takes 20 ms, and a surge
    comes. Logs flushed every second still drain the surge at 100/s; Envoy's gauge, a
    quarter second old, shows the queue it really holds, and the estimate starts there."""
    from sitsmesh.pressure.controller import Controller
    from sitsmesh.pressure.signals import EnvoySample, Signals

    def run(gauge: bool) -> float:
        signals, clock = Signals(), [0.0]
        controller = Controller(signals, lambda: clock[0])
        controller.configure({"plain": PLAIN}, {"plain": ONLY_PARALLELISM})
        entry, stage = signals.pipeline("plain"), signals.stage("plain", "svc")
        held: list[float] = []
        for tick in range(400):  # 20 s at 40 requests/s: 10 ms each, logged 1 s late
            clock[0] = tick * 0.05
            for _ in range(2):
                entry.arrive(0)
                entry.admitted += 1
                entry.hold(clock[0])
                held.append(clock[0])
            for i in range(2 if tick >= 20 else 0):
                admitted = held[(tick - 20) * 2 + i]
                started = admitted + i * 0.01
                entry.unhold(admitted, started + 0.01, clock[0])
                stage.complete(f"r{tick}-{i}", started, 0.01, failed=False,
                               arrived=clock[0])
            controller.tick()
        for tick in range(10):  # then 0.5 s at 200 requests/s, nothing logged yet
            clock[0] = 20.0 + tick * 0.05
            for _ in range(10):
                entry.arrive(0)
                entry.admitted += 1
                entry.hold(clock[0])
            if gauge and tick == 5:  # 0.25 s ago: 45 on the stage's cluster
                stage.envoy["e1"] = EnvoySample(clock[0], 45.0, 0.0)
            decision = controller.tick().decisions["plain"]
        return decision.in_flight

    blind, anchored = run(gauge=False), run(gauge=True)
    assert anchored >= 45 + 40 - 100 * 0.25 - 1  # 45 then, 40 admitted since, 25 served
    assert anchored > blind + 10


def test_unhold_keeps_latency_and_lag_of_each_end() -> None:
    signals = PipelineSignals()
    signals.hold(10.0)
    signals.hold(10.001)
    assert signals.in_flight == 2
    signals.unhold(10.0, ended=10.05, arrived=11.0)
    signals.unhold(10.001, ended=None, arrived=70.0)  # timed out: no sample
    assert signals.in_flight == 0 and signals.open_bins == {}
    assert list(signals.ended) == [(10.0, 10.05)]
    assert list(signals.lags) == [pytest.approx(0.95)]


def test_chance_queues_are_longer_for_varied_service_times() -> None:
    fixed, exponential = chance_queue(0.0, 0.001), chance_queue(1.0, 0.001)
    assert 10 < fixed < 15 and exponential == pytest.approx(2 * fixed)


def test_a_fan_out_of_two_doubles_the_chance_queue_and_the_bound_holds() -> None:
    """Calls that come in pairs (a fan-out of 2) to a stage of two 20 ms workers at 75 %:
    the queue a pair finds passes chance_queue(0, tail, batch=2) at most `tail` of the
    time, while the Poisson bound is passed far more often."""
    import random

    assert chance_queue(0.0, 0.001, 2) == pytest.approx(2 * chance_queue(0.0, 0.001))
    rng = random.Random(7)
    free = [0.0, 0.0]
    waiting: list[float] = []
    seen: list[int] = []
    t = 0.0
    for _ in range(30_000):
        t += rng.expovariate(0.75 * 100 / 2)  # pairs/s: 75 calls/s of 100
        waiting = [start for start in waiting if start > t]
        seen.append(len(waiting))
        for _ in range(2):
            server = min(range(2), key=free.__getitem__)
            start = max(t, free[server])
            free[server] = start + 0.02
            if start > t:
                waiting.append(start)
    def passed(bound: float) -> float:
        return sum(q > bound for q in seen) / len(seen)
    assert passed(chance_queue(0.0, 0.001, 2)) <= 0.001
    assert passed(chance_queue(0.0, 0.001)) > 0.005


# --- the controller with the delays of real meshes ----------------------------

@pytest.mark.parametrize("service", ["fixed", "exp"])
@pytest.mark.parametrize("flush", [0.02, 1.0])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_no_false_sheds_at_70_percent_of_capacity(service: str, flush: float,
                                                  seed: int) -> None:
    """Poisson arrivals at 0.7x: chance queues, not overload. At most 0.5 % is shed,
    with only the pipeline, its SLA and `parallelism` set, and the access log flushed
    every 20 ms or every second (Envoy's and Istio's default). The SLA is one the stage
    meets at that load (see PLAIN_400): where it does not, a queue past it is lateness,
    and shedding there is the controller's job."""
    pipeline = PLAIN if service == "fixed" else PLAIN_400
    profile = _profile([(0, 35)], 60, service=service, flush=flush, seed=seed,
                       pipeline=pipeline)
    result = summary(simulate(pipeline, ONLY_PARALLELISM, profile))
    assert result["shed_fraction"] <= 0.005, result


@pytest.mark.parametrize("flush", [0.02, 1.0])
def test_a_step_to_twice_capacity_keeps_goodput_and_high_priority(flush: float) -> None:
    profile = _profile([(0, 25), (9.99, 25), (10, 100), (20, 100), (20.01, 25)], 30,
                       service="fixed", flush=flush, seed=1)
    seconds = simulate(PLAIN, ONLY_PARALLELISM, profile)
    overload = [s for s in seconds if 11 <= s.at < 20]
    assert statistics.mean(s.good for s in overload) >= 0.9 * 50
    high = [s.by_priority.get(9, [0, 0]) for s in seconds]
    assert sum(g for _, g in high) / sum(o for o, _ in high) >= 0.999
    # Back at 0.5x: nothing shed from 2 s after the drop.
    assert all(s.shed == 0 for s in seconds if s.at >= 22)


def test_simulate_profiles_take_the_signal_delays() -> None:
    profile = profile_from({"steps": [{"at_s": 0, "rps": 10}], "service_ms": {"svc": 20},
                            "log_flush_s": 1, "scrape_s": 0.5, "stats_flush_s": 0.25}, PLAIN)
    assert (profile.log_flush_s, profile.scrape_s, profile.stats_flush_s) == (1.0, 0.5, 0.25)
    with pytest.raises(InvalidProfile, match="log_flush_s must be a number from 0 to 60"):
        profile_from({"steps": [{"at_s": 0, "rps": 10}], "service_ms": {"svc": 20},
                      "log_flush_s": -1}, PLAIN)


def test_a_stage_that_fails_fast_under_load_is_overloaded_not_idle() -> None:
    """5xx answered in 2 ms look like a stage with room to spare; they are overload."""
    from sitsmesh.pressure.controller import Controller
    from sitsmesh.pressure.signals import Signals

    signals, clock = Signals(), [0.0]
    controller = Controller(signals, lambda: clock[0])
    controller.configure({"plain": PLAIN}, {"plain": ONLY_PARALLELISM})
    entry, stage = signals.pipeline("plain"), signals.stage("plain", "svc")
    decision = None
    for tick in range(60):
        clock[0] += 0.05
        for i in range(5):  # 100 requests/s, 40 % of them failing in 2 ms
            entry.arrive(0)
            entry.admitted += 1
            failed = i < 2
            took = 0.002 if failed else 0.02
            stage.complete(f"r{tick}-{i}", clock[0] - took, took, failed=failed,
                           arrived=clock[0])
        decision = controller.tick().decisions["plain"]
    assert decision is not None
    [view] = decision.stages
    assert view.level == "overloaded" and view.reason == "errors"
    assert decision.fraction < 1.0  # what it answered well is what it gets
