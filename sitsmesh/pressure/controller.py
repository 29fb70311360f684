"""The controller: every tick, signals -> per-stage pressure -> one admission decision per
pipeline, published as an immutable snapshot that Check and ShouldRateLimit read.

The decision is an admitted fraction of arrivals, turned into a DAGOR-like
admission level over priorities (lowest shed first, with a fractional part so
shedding grows smoothly inside one priority), an admitted concurrency, and a
retry-after from the estimated drain time. Overload lowers the fraction by at
most 20 % a tick; underload must last `hysteresis_ticks` before it rises.
A stage whose signals went stale counts as saturated.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from sitsmesh.chains.histogram import Histogram
from sitsmesh.chains.pipeline import Pipeline, Stage
from sitsmesh.pressure.queueing import ewma, mm1_p99, rate_for_p99, seed_depth
from sitsmesh.pressure.signals import Signals, StageSignals
from sitsmesh.pressure.thresholds import PRIORITIES, StageThresholds, Thresholds

TAU_S = 0.3              # memory of the rate estimates
LATENCY_TICKS = 5        # rt99 over the last this many ticks
MIN_RT_SAMPLES = 5       # and only once that window holds this many requests
DECREASE_FLOOR = 0.8     # overload cuts the admitted fraction by at most 20 % a tick
DECREASE_MIN = 0.95      # and by at least 5 %
INCREASE_STEP = 0.1
MIN_SERVICE_S = 1e-4     # a floor on service time estimates: 10,000 requests/s an instance
OVERSHOOT = 1.15         # admitted-rate aim over capacity (see _decide)
SLA_SHARE = 0.4         # of the SLA that queueing may take under pressure (concurrency cap)
CALM_SLA_SHARE = 0.8    # and when calm: room for protected requests that skip the cap
TARGET_UTILISATION = 0.95  # the queue-drain term below keeps the queue short at this load
OK, HIGH, OVERLOADED, STALE = "ok", "high", "overloaded", "stale"


@dataclass(frozen=True, slots=True)
class StagePressure:
    name: str
    level: str
    pressure: float          # max of utilisation, queue fill / high mark, rt99 / SLA
    arrival_rate: float      # lambda, requests/s reaching the stage
    capacity: float          # mu, requests/s it can serve (0 when not known yet)
    utilisation: float
    queue: float
    queue_fill: float
    rt99_ms: float
    predicted_p99_ms: float  # M/M/1 at the current lambda and mu
    headroom_rps: float      # more arrivals before the M/M/1 p99 passes the SLA
    stale: bool


@dataclass(frozen=True, slots=True)
class Decision:
    pipeline: str
    policy: str
    fraction: float          # of arrivals to admit
    cutoff: float            # admission level: priority + u < cutoff is shed
    concurrency: int         # admitted requests in flight; 0 = no cap
    protected_from: int      # priorities at or above this are never shed
    retry_after_s: int
    bottleneck: str
    level: str
    arrival_rate: float
    stages: tuple[StagePressure, ...]
    at: float


@dataclass(frozen=True, slots=True)
class Snapshot:
    decisions: Mapping[str, Decision] = field(default_factory=dict)
    at: float = 0.0


@dataclass(slots=True)
class _StageState:
    mu: float | None = None
    service_s: float | None = None          # from access logs: hop time past the queue
    triton_service_s: float | None = None   # from Triton's counters, one scrape window
    completions: int = 0
    recent: list[Histogram] = field(default_factory=list)


@dataclass(slots=True)
class _PipelineState:
    fraction: float = 1.0
    calm_ticks: int = 0
    arrivals: int = 0
    rl_arrivals: int = 0
    admitted: int = 0
    lam: float = 0.0
    admitted_rate: float = 0.0
    by_priority: list[int] = field(default_factory=lambda: [0] * PRIORITIES)
    shares: list[float] = field(default_factory=lambda: [0.0] * PRIORITIES)
    last: float | None = None
    stages: dict[str, _StageState] = field(default_factory=dict)


@dataclass(slots=True)
class _Tick:
    """One pipeline's tick: what every step of the decision reads."""

    pipeline: Pipeline
    thresholds: Thresholds
    state: _PipelineState
    now: float
    dt: float
    in_flight: int
    views: list[StagePressure] = field(default_factory=list)
    bottleneck: str = ""
    level: str = OK
    retry_after: int = 1


def cutoff_for(fraction: float, shares: list[float], protected_from: int) -> float:
    """The admission level that admits `fraction` of arrivals, lowest priorities shed first.

    A request of priority p with its own uniform u in [0, 1) is admitted when
    p + u >= cutoff, so a level inside a priority sheds part of it.
    """
    total = sum(shares)
    if fraction >= 1.0 or total <= 0:
        return 0.0
    to_shed = (1.0 - fraction) * total
    for priority in range(min(protected_from, PRIORITIES)):
        share = shares[priority]
        if to_shed <= share:
            return priority + (to_shed / share if share > 0 else 0.0)
        to_shed -= share
    return float(min(protected_from, PRIORITIES))


class Controller:
    def __init__(self, signals: Signals, clock: Callable[[], float], *,
                 stale_after_s: float = 1.0) -> None:
        self.signals = signals
        self._clock = clock
        self._stale_after = stale_after_s
        self._states: dict[str, _PipelineState] = {}
        self.pipelines: Mapping[str, Pipeline] = {}
        self.thresholds: Mapping[str, Thresholds] = {}
        self.snapshot = Snapshot()

    def configure(self, pipelines: Mapping[str, Pipeline],
                  thresholds: Mapping[str, Thresholds]) -> None:
        self.pipelines = dict(pipelines)
        self.thresholds = dict(thresholds)
        for gone in set(self._states) - set(self.pipelines):
            del self._states[gone]

    def tick(self) -> Snapshot:
        now = self._clock()
        decisions = {}
        for name, pipeline in self.pipelines.items():
            thresholds = self.thresholds.get(name, Thresholds())
            decisions[name] = self._decide(pipeline, thresholds, now)
        self.snapshot = Snapshot(decisions, now)
        return self.snapshot

    # --- one pipeline ----------------------------------------------------

    def _decide(self, pipeline: Pipeline, thresholds: Thresholds, now: float) -> Decision:
        state = self._states.setdefault(pipeline.name, _PipelineState())
        signals = self.signals.pipeline(pipeline.name)
        dt = (now - state.last) if state.last is not None else 0.0
        state.last = now
        if dt > 0:
            arrived = max(signals.arrivals - state.arrivals,
                          signals.rl_arrivals - state.rl_arrivals)
            state.lam = ewma(state.lam, arrived / dt, dt, TAU_S)
            state.admitted_rate = ewma(state.admitted_rate,
                                       (signals.admitted - state.admitted) / dt, dt, TAU_S)
            for p in range(PRIORITIES):
                state.shares[p] = ewma(state.shares[p],
                                       (signals.by_priority[p] - state.by_priority[p]) / dt,
                                       dt, TAU_S)
        state.arrivals, state.admitted = signals.arrivals, signals.admitted
        state.rl_arrivals = signals.rl_arrivals
        state.by_priority = list(signals.by_priority)

        tick = _Tick(pipeline, thresholds, state, now, dt, signals.in_flight)
        limits: list[tuple[float, str, float]] = []   # (pipeline rate, stage, drain seconds)
        for stage in pipeline.stages:
            view, rate, drain = self._stage(tick, stage)
            tick.views.append(view)
            limits.append((rate, stage.name, drain))
        rate, tick.bottleneck, drain = min(limits) if limits else (math.inf, "", 0.0)
        if tick.views:
            tick.level = max(tick.views, key=lambda v: v.pressure).level
        tick.retry_after = max(1, math.ceil(drain))

        if thresholds.policy == "off":
            return self._publish(tick, fraction=1.0, cutoff=0.0, concurrency=0,
                                 protected_from=PRIORITIES)
        if thresholds.policy == "seed":
            return self._seed(tick)

        overloaded = any(v.level in (OVERLOADED, STALE) for v in tick.views)
        calm = all(v.level == OK for v in tick.views)
        # Aim a little over capacity: the concurrency cap trims the rest per request, so
        # the stage never idles for want of admitted work.
        target = (1.0 if state.lam <= 0 or math.isinf(rate)
                  else min(1.0, OVERSHOOT * rate / state.lam))
        if overloaded:
            state.calm_ticks = 0
            state.fraction = max(state.fraction * DECREASE_FLOOR,
                                 min(target, state.fraction * DECREASE_MIN))
        elif calm or target > state.fraction:
            # Not overloaded, and either calm or the model sees room: after the hysteresis,
            # step up gently, and all the way once the load fits (it dropped).
            state.calm_ticks += 1
            if state.calm_ticks >= thresholds.hysteresis_ticks:
                if calm and target >= 1.0:
                    state.fraction = 1.0
                else:
                    state.fraction = min(1.0, state.fraction + INCREASE_STEP,
                                         max(target, state.fraction))
        else:
            state.calm_ticks = 0
        state.fraction = max(0.0, min(1.0, state.fraction))
        # Calm, the cap only stops requests that would wait past the whole SLA; under
        # pressure it keeps most of the SLA free of queueing.
        calm_cap = calm and state.fraction >= 1.0
        concurrency = self._concurrency(tick, CALM_SLA_SHARE if calm_cap else SLA_SHARE)
        cutoff = cutoff_for(state.fraction, state.shares, thresholds.protected_from)
        return self._publish(tick, fraction=state.fraction, cutoff=cutoff,
                             concurrency=concurrency, protected_from=thresholds.protected_from)

    @staticmethod
    def _concurrency(tick: _Tick, share: float) -> int:
        """Little's law on the bottleneck: in flight = capacity x the time the SLA leaves
        for waiting, so an admitted request is not queued past its SLA."""
        view = next((v for v in tick.views if v.name == tick.bottleneck), None)
        stage = next((s for s in tick.pipeline.stages if s.name == tick.bottleneck), None)
        if view is None or stage is None or not view.capacity or view.stale:
            return tick.thresholds.min_concurrency if view is not None and view.stale else 0
        limits = tick.thresholds.stage(stage.name)
        sla_s = _sla_s(stage, limits) or 1.0
        cap = view.capacity / limits.fanout * sla_s * share + limits.parallelism
        return int(max(tick.thresholds.min_concurrency,
                       min(tick.thresholds.max_concurrency, cap)))

    def _seed(self, tick: _Tick) -> Decision:
        """The seed design: a queue-depth cap on the fullest stage, priority-blind."""
        fullest = max(tick.views, key=lambda v: v.queue_fill)
        stage = next(s for s in tick.pipeline.stages if s.name == fullest.name)
        limits = tick.thresholds.stage(stage.name)
        sla_s = _sla_s(stage, limits)
        depth = seed_depth(limits.queue_capacity, rt99_s=fullest.rt99_ms / 1000, sla_s=sla_s,
                           fill=fullest.queue_fill, qps=fullest.arrival_rate,
                           capacity=fullest.capacity)
        tick.bottleneck = fullest.name
        return self._publish(tick, fraction=1.0, cutoff=0.0,
                             concurrency=int(depth) + limits.parallelism,
                             protected_from=PRIORITIES)

    @staticmethod
    def _publish(tick: _Tick, *, fraction: float, cutoff: float, concurrency: int,
                 protected_from: int) -> Decision:
        return Decision(tick.pipeline.name, tick.thresholds.policy, round(fraction, 4),
                        round(cutoff, 4), concurrency, protected_from, tick.retry_after,
                        tick.bottleneck, tick.level, round(tick.state.lam, 3),
                        tuple(tick.views), tick.now)

    # --- one stage -------------------------------------------------------

    def _stage(self, tick: _Tick, stage: Stage) -> tuple[StagePressure, float, float]:
        """The stage's pressure, the pipeline rate it can take, and its drain time."""
        limits = tick.thresholds.stage(stage.name)
        signals = self.signals.stage(tick.pipeline.name, stage.name)
        own = tick.state.stages.setdefault(stage.name, _StageState())
        done = signals.completions - own.completions
        own.completions = signals.completions
        rt99 = self._rt99(own, signals, tick.dt)
        queue, stale = self._queue(tick, signals, limits)
        lam = tick.state.admitted_rate * limits.fanout
        served, triton_service = _triton_rates(signals)
        if triton_service and tick.dt > 0:
            own.triton_service_s = ewma(own.triton_service_s, triton_service, tick.dt, TAU_S)
        # Triton's own service time where it is scraped: the access-log hop includes the
        # wait in Triton's queue, and subtracting two averages taken over different
        # windows can come out near zero (an absurd capacity).
        service = own.triton_service_s or own.service_s
        if tick.dt > 0:
            if queue >= 2 * limits.parallelism and (done or served):
                # Clearly saturated all tick long: what finished is what the stage can do
                # (Triton's own count where it is scraped: it includes every caller).
                own.mu = ewma(own.mu, served if served else done / tick.dt, tick.dt, TAU_S)
            elif service:
                own.mu = ewma(own.mu, limits.parallelism / max(service, MIN_SERVICE_S),
                              tick.dt, TAU_S)
        mu = own.mu or 0.0
        sla_s = _sla_s(stage, limits)
        # A queue is full when waiting in it would use up the SLA, or at its capacity.
        room = float(limits.queue_capacity)
        if sla_s and mu:
            room = max(1.0, min(room, sla_s * mu - limits.parallelism))
        fill = queue / room
        # Overload is what callers feel: a queue past its high mark or a p99 past the SLA.
        # Utilisation near 1 alone is where a well-run stage should be, so it only warns.
        felt = max(fill / limits.queue_fill_high, rt99 / sla_s if sla_s else 0.0)
        rho = lam / mu if mu else 0.0
        pressure = max(rho, felt)
        if stale:
            level = STALE
        elif felt >= 1.0:
            level = OVERLOADED
        elif felt >= 0.8 or rho >= 0.9 or fill > limits.queue_fill_low:
            level = HIGH
        else:
            level = OK
        if stale:
            rate = 0.0
        elif mu <= 0:
            rate = math.inf
        else:
            # Above the low mark, admit less than capacity so the queue drains in a second.
            excess = max(0.0, queue - limits.queue_fill_low * room)
            rate = max(0.0, TARGET_UTILISATION * mu - excess) / limits.fanout
        drain = queue / mu if mu > 0 else (1.0 if queue else 0.0)
        # M/M/1 headroom: how much more arrival rate before the predicted p99 passes the
        # SLA. Reported, not acted on: with steady service times it is pessimistic.
        headroom = rate_for_p99(mu, sla_s) - lam if sla_s and mu else 0.0
        view = StagePressure(stage.name, level, round(pressure, 4), round(lam, 3),
                             round(mu, 3), round(lam / mu, 4) if mu else 0.0, queue,
                             round(fill, 4), round(rt99 * 1000, 3),
                             round(min(mm1_p99(lam, mu), 3600.0) * 1000, 3),
                             round(headroom, 3), stale)
        return view, rate, drain

    @staticmethod
    def _rt99(own: _StageState, signals: StageSignals, dt: float) -> float:
        """p99 of the latencies finished over the last LATENCY_TICKS ticks."""
        hist, signals.latency = signals.latency, Histogram()
        own.recent = [*own.recent[-(LATENCY_TICKS - 1):], hist]
        if hist.total:
            own.service_s = ewma(own.service_s, max(1e-6, signals.service / hist.total),
                                 dt or TAU_S, TAU_S)
        signals.service = 0.0
        merged = Histogram()
        for item in own.recent:
            merged.merge(item)
        # A p99 of a handful of requests is one slow request (a cold start): not a tail.
        return merged.quantile(0.99) if merged.total >= MIN_RT_SAMPLES else 0.0

    def _queue(self, tick: _Tick, signals: StageSignals,
               limits: StageThresholds) -> tuple[float, bool]:
        """(queued requests, stale). Triton's pending gauge where the stage is a Triton
        model; otherwise what is in flight beyond what the stage serves at once."""
        if signals.expects_triton and not signals.triton:
            return 0.0, True  # scraped, but nothing came back yet: fail safe
        if signals.triton:
            sample = signals.triton[-1]
            # The gauge counts queued requests, not the ones executing.
            return (float(sample.pending),
                    tick.now - sample.at > self._stale_after)
        queue = max(0.0, tick.in_flight * limits.fanout - limits.parallelism)
        waiting = tick.state.admitted_rate > 0 or tick.in_flight > 0
        stale = waiting and signals.completions > 0 and (
            tick.now - signals.last_completion > self._stale_after)
        return queue, stale


def _sla_s(stage: Stage, limits: StageThresholds) -> float | None:
    """The stage's p99 SLA in seconds as the thresholds stretch it; None without one."""
    if stage.sla_p99_ms is None:
        return None
    return stage.sla_p99_ms / 1000 * limits.sla_multiplier


def _triton_rates(signals: StageSignals) -> tuple[float, float]:
    """(requests finished per second, mean service seconds past the queue) between the
    last two scrapes, both from Triton's counters over the same window; zeros when there
    are not two samples, nothing finished, or Triton restarted in between."""
    if len(signals.triton) < 2:
        return 0.0, 0.0
    older, newer = signals.triton
    span = newer.at - older.at
    finished = (newer.success + newer.failure) - (older.success + older.failure)
    queued_us = newer.queue_us - older.queue_us
    total_us = newer.request_us - older.request_us
    if span <= 0 or finished <= 0 or queued_us < 0:
        return 0.0, 0.0
    service = (total_us - queued_us) / finished / 1e6 if total_us > queued_us else 0.0
    return finished / span, service
