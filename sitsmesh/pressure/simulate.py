"""Offline: the controller against a queueing model of the pipeline, on a simulated clock.

Stages are queues in series with `parallelism` servers each and fixed, exponential,
log-normal or bimodal service times (SERVICE_KINDS); a stage with `fanout` f takes f
calls per request, in parallel, and the request moves on when the last one ends.
Arrivals are Poisson at a rate that follows the load profile, with priorities drawn
from its mix. Every arrival meets the same
shedding rule Check applies; the controller ticks on the simulated clock and
reads signals fed as production feeds them, with their delays: access-log
entries arrive in batches every `log_flush_s` (Envoy's default is 1 s), Triton
stages are scraped every `scrape_s`, and Envoy's per-cluster gauges come every
`stats_flush_s` when that is set. An SRE sees what a setting costs before
changing it.

Each protected request (never shed) is also followed through the stages as if only
protected work came, with the service times it met: one late in the simulation but in
time there was made late by the work admitted ahead of it (`late_by_others`), the share
of lateness a controller answers for.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Any

from sitsmesh.chains.histogram import Histogram
from sitsmesh.chains.pipeline import Pipeline
from sitsmesh.pressure.admit import CONCURRENCY, Budget, admitted, shed_reason
from sitsmesh.pressure.controller import Controller, Decision
from sitsmesh.pressure.loadprofile import (
    SERVICE_KINDS,
    InvalidProfile,
    LoadProfile,
    profile_from,
    service_time,
)
from sitsmesh.pressure.signals import EnvoySample, Signals, TritonSample
from sitsmesh.pressure.thresholds import Thresholds

# Re-exported: the CLI, the benchmarks and the tests build profiles from here.
__all__ = ["SERVICE_KINDS", "InvalidProfile", "LoadProfile", "Second", "profile_from",
           "service_time", "simulate", "summary"]


@dataclass(slots=True)
class Second:
    """What happened in one simulated second."""

    at: int
    offered: int = 0
    admitted: int = 0
    shed: int = 0
    good: int = 0             # of the requests that arrived this second, finished in SLA
    late: int = 0             # finished, too late to count
    latency: Histogram = field(default_factory=Histogram)
    fraction: float = 1.0
    cutoff: float = 0.0
    by_priority: dict[int, list[int]] = field(default_factory=dict)  # p -> [offered, good]
    # Protected requests (never shed) late although the stage alone would have served
    # them in time: late because of the other work admitted ahead of them. Those late
    # even alone (their own service times, the other protected requests) are not the
    # controller's to save on a FIFO stage, and are counted apart.
    protected: int = 0
    late_by_others: int = 0
    late_alone: int = 0

    @property
    def p99_ms(self) -> float:
        return self.latency.quantile(0.99) * 1000 if self.latency.total else 0.0


@dataclass(slots=True)
class _Request:
    id: int
    priority: int
    arrived: float
    services: list[list[float]]      # per stage, one service time per call (fan-out)
    alone: float = 0.0               # latency with only protected work in the stages
    stage: int = 0
    entered: float = 0.0
    pending: int = 0                 # calls of the current stage not done yet
    admitted: float = 0.0            # let in (later than `arrived` after a wait at the entry)


class _Stage:
    def __init__(self, name: str, servers: int, service_s: float, fanout: float) -> None:
        self.name = name
        self.servers = servers
        self.free = servers
        self.service_s = service_s
        self.fanout = fanout
        self.queue: list[tuple[_Request, float]] = []
        # When each server would be free if only protected requests came: the stage as
        # high priority would see it with every other request shed.
        self.alone = [0.0] * servers

    def calls(self, rng: random.Random) -> int:
        """Calls one request makes to this stage: `fanout` on average."""
        whole = int(self.fanout)
        return whole + (1 if rng.random() < self.fanout - whole else 0)

    def alone_through(self, at: float, services: list[float]) -> float:
        """When a protected request entering at `at` would leave, FIFO over the servers,
        had the stage served protected requests only."""
        ended = at
        for s in services:
            start = max(at, self.alone[0])
            heapq.heapreplace(self.alone, start + s)
            ended = max(ended, start + s)
        return ended


def simulate(pipeline: Pipeline, thresholds: Thresholds, profile: LoadProfile) -> list[Second]:
    return _Simulation(pipeline, thresholds, profile).run()


class _Simulation:
    def __init__(self, pipeline: Pipeline, thresholds: Thresholds,
                 profile: LoadProfile) -> None:
        # A seeded generator on purpose: a simulation must be repeatable.
        self.rng = random.Random(profile.seed)  # noqa: S311
        self.now = 0.0
        self.pipeline, self.thresholds, self.profile = pipeline, thresholds, profile
        self.signals = Signals()
        self.controller = Controller(self.signals, lambda: self.now)
        self.controller.configure({pipeline.name: pipeline}, {pipeline.name: thresholds})
        self.stages = [_Stage(s.name, thresholds.stage(s.name).parallelism,
                              profile.service_ms[s.name] / 1000,
                              thresholds.stage(s.name).fanout) for s in pipeline.stages]
        # Service times come from their own generator, drawn at arrival: every policy
        # compared on one seed serves the same work, and the stage-alone latency of a
        # protected request uses the very times it met.
        self.work_rng = random.Random(profile.seed * 1_000_003 + 17)  # noqa: S311
        self.draws = random.Random(profile.seed * 1_000_003 + 29)  # noqa: S311
        sla_ms = profile.sla_ms or sum(s.sla_p99_ms or 0 for s in pipeline.stages)
        self.sla_s = sla_ms / 1000 if sla_ms else math.inf
        self.entry = self.signals.pipeline(pipeline.name)
        self.seconds = [Second(i) for i in range(math.ceil(profile.duration_s))]
        self.events: list[tuple[float, int, str, Any]] = []
        self.sequence = 0
        self.next_id = 0
        self.decision: Decision | None = None
        self.budget = Budget()
        # Requests held at the entry for room (entry_wait_ms): (-priority, order, until,
        # priority, services, arrived), as the gate's queue orders them.
        self.waiting: list[tuple[int, int, float, int, list[list[float]], float]] = []

    def run(self) -> list[Second]:
        self.push(0.0, "tick")
        self.push(0.0, "scrape")
        if self.profile.stats_flush_s:
            self.push(0.0, "stats")
        self.push(_next_arrival(self.rng, self.profile, 0.0), "arrive")
        handlers = {"tick": self.tick, "scrape": self.scrape, "arrive": self.arrive,
                    "done": self.done, "log": self.log, "stats": self.stats}
        # Arrivals stop at the end; the requests already in flight are followed until they
        # finish (or for as long again), so each one counts by the second it arrived in.
        end = self.profile.duration_s
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if now >= 2 * end:
                break
            if now >= end and kind not in ("done", "log"):
                continue
            self.now = now
            second = self.seconds[min(int(now), len(self.seconds) - 1)]
            handlers[kind](second, payload)
            if self.decision is not None:
                second.fraction, second.cutoff = self.decision.fraction, self.decision.cutoff
        return self.seconds

    def push(self, at: float, kind: str, payload: Any = None) -> None:
        self.sequence += 1
        heapq.heappush(self.events, (at, self.sequence, kind, payload))

    def tick(self, second: Second, payload: Any) -> None:
        self.decision = self.controller.tick().decisions[self.pipeline.name]
        self.push(self.now + self.thresholds.tick_ms / 1000, "tick")
        self.wake()

    def wake(self) -> None:
        """The gate's queue: waiters past their time are shed (in the second they came),
        then the best go in while the cap has room."""
        decision, entry, waiting = self.decision, self.entry, self.waiting
        if not waiting or decision is None:
            return
        for item in [w for w in waiting if w[2] < self.now]:
            waiting.remove(item)
            self.seconds[int(item[5])].shed += 1
            entry.shed += 1
        heapq.heapify(waiting)
        while waiting and (not decision.concurrency or entry.in_flight
                           - decision.in_flight_offset < decision.concurrency):
            _, _, _, priority, services, arrived = heapq.heappop(waiting)
            self.admit(self.seconds[int(arrived)], priority, services, arrived)

    def scrape(self, second: Second, payload: Any) -> None:
        """Triton's pending gauge, for the stages that are Triton models."""
        for stage, spec in zip(self.stages, self.pipeline.stages, strict=True):
            if spec.triton_model:
                self.signals.stage(self.pipeline.name, stage.name).scraped(
                    TritonSample(self.now, len(stage.queue), 0, 0, 0))
        self.push(self.now + self.profile.scrape_s, "scrape")

    def stats(self, second: Second, payload: Any) -> None:
        """Envoy's gauge of requests active on each stage's cluster, stamped now."""
        for stage in self.stages:
            active = len(stage.queue) + stage.servers - stage.free
            self.signals.stage(self.pipeline.name, stage.name).envoy["sim"] = EnvoySample(
                self.now, float(active), 0.0)
        self.push(self.now + self.profile.stats_flush_s, "stats")

    def flushed(self) -> float:
        """When an entry logged now reaches sitsmesh: at Envoy's next buffer flush."""
        every = self.profile.log_flush_s
        return (math.floor(self.now / every) + 1) * every if every > 0 else self.now

    def log(self, second: Second, payload: Any) -> None:
        stage_name, request, entered, ended, last = payload
        self.signals.stage(self.pipeline.name, stage_name).complete(
            str(request.id), entered, ended - entered, failed=False, arrived=self.now)
        if last:
            self.entry.unhold(request.admitted, ended, self.now)
            self.wake()

    def arrive(self, second: Second, payload: Any) -> None:
        rng, entry = self.rng, self.entry
        self.push(_next_arrival(rng, self.profile, self.now), "arrive")
        priority = rng.choices([p for p, _ in self.profile.priorities],
                               [w for _, w in self.profile.priorities])[0]
        second.offered += 1
        second.by_priority.setdefault(priority, [0, 0])[0] += 1
        entry.arrive(priority)
        # Every arrival draws its work, shed or not: the arrivals, priorities and work of
        # a seed are the same whatever a policy decides.
        work, kind = self.work_rng, self.profile.service
        services = [[service_time(work, kind, s.service_s) for _ in range(s.calls(work))]
                    for s in self.stages]
        decision = self.decision
        in_flight = entry.in_flight - (decision.in_flight_offset if decision else 0)
        reason = shed_reason(decision, priority, self.draws.random(), in_flight,
                             budget=self.budget, now=self.now)
        if reason == CONCURRENCY and decision is not None and decision.wait_s > 0:
            self.sequence += 1
            heapq.heappush(self.waiting, (-priority, self.sequence, self.now + decision.wait_s,
                                          priority, services, self.now))
            return
        if reason:
            second.shed += 1
            entry.shed += 1
            return
        self.admit(second, priority, services, self.now)

    def admit(self, second: Second, priority: int, services: list[list[float]],
              arrived: float) -> None:
        entry = self.entry
        admitted(self.decision, self.budget, self.now)
        entry.admitted += 1
        entry.hold(self.now)
        second.admitted += 1
        self.next_id += 1
        request = _Request(self.next_id, priority, arrived, services, admitted=self.now)
        # The priorities the thresholds protect, whatever the policy: every policy is
        # judged on the same requests.
        if priority >= self.thresholds.protected_from:
            second.protected += 1
            ended = self.now
            for stage, calls in zip(self.stages, request.services, strict=True):
                ended = stage.alone_through(ended, calls)
            request.alone = ended - self.now
        self.enter(request, 0)

    def enter(self, request: _Request, index: int) -> None:
        while index < len(self.stages) and not request.services[index]:
            index += 1   # a fractional fan-out that makes no call this time
        if index == len(self.stages):
            self.finish(request)
            return
        stage = self.stages[index]
        request.stage, request.entered = index, self.now
        request.pending = len(request.services[index])
        for service_s in request.services[index]:
            if stage.free > 0:
                stage.free -= 1
                self.push(self.now + service_s, "done", request)
            else:
                stage.queue.append((request, service_s))

    def start(self, stage: _Stage) -> None:
        """A server of the stage freed up: the next queued call starts."""
        if stage.queue:
            request, service_s = stage.queue.pop(0)
            self.push(self.now + service_s, "done", request)
        else:
            stage.free += 1

    def done(self, second: Second, request: _Request) -> None:
        stage = self.stages[request.stage]
        request.pending -= 1
        last = request.pending == 0 and not any(request.services[request.stage + 1:])
        self.push(self.flushed(), "log", (stage.name, request, request.entered, self.now,
                                          last))
        self.start(stage)
        if request.pending == 0:
            self.enter(request, request.stage + 1)

    def finish(self, request: _Request) -> None:
        took = self.now - request.arrived
        if not any(request.services):
            self.entry.unhold(request.admitted, self.now, self.now)  # no hop to log it
        arrived = self.seconds[int(request.arrived)]
        arrived.latency.add(took)
        if took <= self.sla_s:
            arrived.good += 1
            arrived.by_priority.setdefault(request.priority, [0, 0])[1] += 1
        else:
            arrived.late += 1
            if request.alone > self.sla_s:
                arrived.late_alone += 1
            elif request.alone > 0:
                arrived.late_by_others += 1


def _next_arrival(rng: random.Random, profile: LoadProfile, now: float) -> float:
    rate = profile.rate(now)
    if rate <= 0:
        return now + 0.01
    return now + rng.expovariate(rate)


def summary(seconds: list[Second]) -> dict[str, Any]:
    offered = sum(s.offered for s in seconds)
    good = sum(s.good for s in seconds)
    latency = Histogram()
    for s in seconds:
        latency.merge(s.latency)
    per_priority: dict[int, list[int]] = {}
    for s in seconds:
        for p, (o, g) in s.by_priority.items():
            tally = per_priority.setdefault(p, [0, 0])
            tally[0] += o
            tally[1] += g
    return {"offered": offered, "goodput_rps": good / max(1, len(seconds)),
            "shed_fraction": sum(s.shed for s in seconds) / offered if offered else 0.0,
            "p99_ms": latency.quantile(0.99) * 1000 if latency.total else 0.0,
            "protected_late_by_others": (sum(s.late_by_others for s in seconds)
                                         / max(1, sum(s.protected for s in seconds))),
            "success_by_priority": {p: (g / o if o else 0.0)
                                    for p, (o, g) in sorted(per_priority.items())}}
