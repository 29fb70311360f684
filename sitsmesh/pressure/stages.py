"""One stage of a pipeline, judged each tick: its capacity from its own work, its queue
from the freshest direct view, and whether it is overloaded.

Every signal is read as of when it happened: access-log hops by their own start and end,
Envoy's and Triton's gauges by their timestamps. A signal that is late by design (a log
flush, a stats flush) is not stale; one that stopped coming while traffic flows is.
Overload is judged over a window against the capacity learned from the stage's own
work, so a chance queue at moderate load is not overload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sitsmesh.chains.histogram import Histogram
from sitsmesh.chains.pipeline import Pipeline, Stage
from sitsmesh.pressure import work
from sitsmesh.pressure.queueing import chance_queue, ewma, mm1_p99, rate_for_p99
from sitsmesh.pressure.signals import Signals, StageSignals
from sitsmesh.pressure.thresholds import PRIORITIES, StageThresholds, Thresholds

TAU_S = 0.3              # memory of the rate estimates
TAU_MU_S = 2.0           # memory of a stage's capacity learned from its own work
WINDOW_S = 2.0           # stage work and completions are read over this window
MIN_WINDOW_DONE = 3      # completions a window needs before its service time counts
MIN_SERVICE_SAMPLES = 10  # unqueued requests a window needs before their spread counts
OWNER_TTL_S = 2.0        # a partition owner's sums count this long after they came
# Poisson arrivals at 70 % of capacity put the fast rate (0.3 s) 20 % above its mean
# now and then, and a capacity learned from a few dozen service times is off by
# 10 %; the margins keep such chance from reading as overload.
SURGE = 1.3              # arrivals this far over capacity (fast rate): overloaded now
SUSTAINED = 1.0          # or over it on the slow rate
STANDING_S = 0.3         # a queue over its mark this long stands
SURGE_S = 0.2            # a fast rate past SURGE this long is a surge
STANDING_LOAD = 0.8      # (and only counts with the slow rate at this share of capacity)
LATE_FACTOR = 1.5        # a p90 this far past the SLA is overload at any load
ERROR_SHARE = 0.1        # a stage failing this share of its requests under load is overloaded
MIN_ERRORS = 5
LATENCY_TICKS = 10       # rt99 over the last this many ticks (0.5 s at the default tick)
MIN_RT_SAMPLES = 5       # and only once that window holds this many requests
CALM_TAIL = 0.001        # where the cap sits when no overload is seen
BUILDING_TAIL = 0.02     # past this, with arrivals past capacity, a queue is building
MIN_SERVICE_S = 1e-4     # a floor on service time estimates: 10,000 requests/s an instance
TARGET_UTILISATION = 0.95  # the queue-drain term keeps the queue short at this load
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
    reason: str = ""         # why it is overloaded: surge, full, standing, errors or late
    signals: tuple[SignalAge, ...] = ()
    # How far the capacity is to be trusted: the service times behind its last window
    # and their squared coefficient of variation (1 is exponential; see headroom).
    capacity_samples: int = 0
    service_cs2: float = 1.0


@dataclass(frozen=True, slots=True)
class SignalAge:
    """How old the newest sample of one signal source is, as of its own timestamp.

    An access-log view is as old as its newest request end (a flush interval behind by
    design); Envoy's stats and Triton's metrics as old as their last sample. `stale`
    is the controller's verdict: late past what the source's own cadence explains."""

    source: str              # access_log, envoy_stats or triton_metrics
    age_s: float             # -1 when none came yet
    stale: bool


@dataclass(slots=True)
class StageState:
    mu: float | None = None
    triton_service_s: float | None = None   # from Triton's counters, one scrape window
    completions: int = 0
    recent: list[Histogram] = field(default_factory=list)
    standing: float = 0.0                   # seconds running with the queue over its mark
    surging: float = 0.0                    # seconds running with arrivals past SURGE
    # Over the last window before the watermark (see estimate.occupancy):
    done: int = 0
    failed: int = 0
    mean_s: float = 0.0                     # a hop's mean duration, queueing included
    # Squared coefficient of variation of the service time (1 for exponential, 0 for
    # fixed), None until measured: then the long chance queues of exponential times
    # are assumed (see `spread`).
    cs2: float | None = None
    samples: int = 0                        # service times behind the last cs2 window

    @property
    def spread(self) -> float:
        return self.cs2 if self.cs2 is not None else 1.0


@dataclass(slots=True)
class PipelineState:
    fraction: float = 1.0
    calm_ticks: int = 0
    since_overload: int = 1_000_000  # ticks since any stage was last overloaded
    arrivals: int = 0
    rl_arrivals: int = 0
    admitted: int = 0
    lam: float = 0.0
    lam_slow: float = 0.0
    cusum: float = 0.0        # arrivals' excess over capacity (see headroom.cusum)
    e2e_s: float = 0.0        # mean time from Check to the end, recent requests
    admitted_rate: float = 0.0
    by_priority: list[int] = field(default_factory=lambda: [0] * PRIORITIES)
    shares: list[float] = field(default_factory=lambda: [0.0] * PRIORITIES)
    last: float | None = None
    stages: dict[str, StageState] = field(default_factory=dict)


@dataclass(slots=True)
class Tick:
    """One pipeline's tick: what every step of the decision reads."""

    pipeline: Pipeline
    thresholds: Thresholds
    state: PipelineState
    now: float
    dt: float
    in_flight: float      # estimated: see estimate.in_flight
    offset: int           # held requests counted as ended already
    views: list[StagePressure] = field(default_factory=list)
    bottleneck: str = ""
    level: str = OK
    retry_after: int = 1


class StageJudge:
    """Reads the signals of a pipeline's stages for the controller's tick."""

    def __init__(self, signals: Signals, stale_after_s: float) -> None:
        self.signals = signals
        self._stale_after = stale_after_s

    def windows(self, tick: Tick) -> None:
        """Each stage's work over the last window before its watermark: every hop that
        ended in it has arrived, whatever the log flush interval. A stage's own time
        excludes the stages it called. Shared: the owners' sums (see pressure.work)."""
        stages = tick.pipeline.stages
        found = [self.signals.stage(tick.pipeline.name, stage.name) for stage in stages]
        windows = (self._shared_windows(tick, found) if any(s.owners for s in found)
                   else self._own_windows(tick, found))
        for stage, window in zip(stages, windows, strict=True):
            self._learn(tick, stage, window)

    def _own_windows(self, tick: Tick, found: list[StageSignals]) -> list[work.Window]:
        stages = tick.pipeline.stages
        ends = {s.name: tick.now - signals.lag() for s, signals in zip(stages, found, strict=True)}
        rows = work.segmented([stage.name for stage in stages],
                              lambda name: self.signals.stage(tick.pipeline.name, name).hops,
                              lambda name: ends[name] - WINDOW_S)
        return [work.exact(rows[stage.name], ends[stage.name] - WINDOW_S, ends[stage.name],
                           tick.thresholds.stage(stage.name).parallelism) for stage in stages]

    def _shared_windows(self, tick: Tick, found: list[StageSignals]) -> list[work.Window]:
        windows = []
        for stage, signals in zip(tick.pipeline.stages, found, strict=True):
            owners, merged = signals.owners, signals.merged
            for gone in [r for r, o in owners.items() if tick.now - o.received > OWNER_TTL_S]:
                work.replace_from(owners.pop(gone).bins, merged, 0, {}, whole=True)  # left
            if not owners:
                windows.append(work.read({}, 0.0, 0.0, 1))
                continue
            # Every end up to here reached its owner, and a busy owner's sums reached us.
            busy = [o.until for o in owners.values() if not o.quiet]
            watermark = min([tick.now - signals.lag(), *busy])
            shift = next(iter(owners.values())).shift
            horizon = work.bin_of(tick.now + shift - work.KEEP_S)
            for index in [i for i in merged if i < horizon]:
                del merged[index]
            windows.append(work.read(merged, watermark - WINDOW_S + shift, watermark + shift,
                                     tick.thresholds.stage(stage.name).parallelism))
        return windows

    @staticmethod
    def _learn(tick: Tick, stage: Stage, window: work.Window) -> None:
        own = tick.state.stages.setdefault(stage.name, StageState())
        own.done, own.failed = window.done, window.failed
        if window.done < MIN_WINDOW_DONE:
            return
        if window.samples >= MIN_SERVICE_SAMPLES and tick.dt > 0 and window.mean > 0:
            own.cs2 = ewma(own.cs2, window.variance / window.mean**2, tick.dt, TAU_MU_S)
            own.samples = window.samples
        own.mean_s = window.own_mean
        if tick.dt > 0 and window.busy > 0 and own.triton_service_s is None:
            # Busy server-seconds per completion is the service time, queue or none.
            # (Where Triton's own counters move, they are fresher and count every
            # caller: they win.)
            parallelism = tick.thresholds.stage(stage.name).parallelism
            own.mu = ewma(own.mu, parallelism * window.done / window.busy, tick.dt, TAU_MU_S)

    def judge(self, tick: Tick, stage: Stage) -> tuple[StagePressure, float, float]:
        """The stage's pressure, the pipeline rate it can take, and its drain time."""
        limits = tick.thresholds.stage(stage.name)
        signals = self.signals.stage(tick.pipeline.name, stage.name)
        own = tick.state.stages[stage.name]
        own.completions = signals.completions
        rt90, rt99 = self._latency(own, signals)
        queue, stale = self._queue(tick, stage, signals, limits)
        lam = tick.state.admitted_rate * limits.fanout
        if tick.dt > 0 and signals.triton:
            # Triton's own gauge says whether its queue stands, not the inferred queue,
            # which would feed the capacity it is derived from back into itself.
            _triton_capacity(own, signals, float(signals.triton[-1].pending), limits,
                             tick.dt)
        mu = own.mu or 0.0
        sla_s = stage_sla_s(stage, limits)
        # A queue is full when waiting in it would use up the SLA, or at its capacity.
        room = float(limits.queue_capacity)
        if sla_s and mu:
            room = max(1.0, min(room, sla_s * mu - limits.parallelism))
        fill = queue / room
        standing = max(limits.queue_fill_high * room,
                       chance_queue(own.spread, BUILDING_TAIL, limits.fanout))
        own.standing = own.standing + tick.dt if queue >= standing else 0.0
        errors = own.failed / own.done if own.done >= MIN_ERRORS else 0.0
        overloaded = _overloaded(tick, own, limits, mu=mu, queue=queue, fill=fill, rt90=rt90,
                                 sla_s=sla_s, errors=errors)
        felt = max(fill / limits.queue_fill_high, rt99 / sla_s if sla_s else 0.0,
                   errors / ERROR_SHARE)
        rho = lam / mu if mu else 0.0
        pressure = max(rho, felt)
        if stale:
            level = STALE
        elif overloaded:
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
            if errors >= ERROR_SHARE and own.failed >= MIN_ERRORS:
                # Failing fast looks like capacity; admit what it answered well.
                rate = min(rate, (own.done - own.failed) / WINDOW_S / limits.fanout)
        drain = queue / mu if mu > 0 else (1.0 if queue else 0.0)
        # M/M/1 headroom: how much more arrival rate before the predicted p99 passes the
        # SLA. Reported, not acted on: with steady service times it is pessimistic.
        headroom = rate_for_p99(mu, sla_s) - lam if sla_s and mu else 0.0
        view = StagePressure(stage.name, level, round(pressure, 4), round(lam, 3),
                             round(mu, 3), round(lam / mu, 4) if mu else 0.0, queue,
                             round(fill, 4), round(rt99 * 1000, 3),
                             round(min(mm1_p99(lam, mu), 3600.0) * 1000, 3),
                             round(headroom, 3), stale, overloaded,
                             self._ages(tick, signals), own.samples, round(own.spread, 3))
        return view, rate, drain

    def _ages(self, tick: Tick, signals: StageSignals) -> tuple[SignalAge, ...]:
        """Each source's age, for reports: the same rules `_queue` applies."""
        ages = []
        newest = signals.newest()
        if newest is not None:
            waiting = tick.state.admitted_rate > 0 or tick.in_flight >= 1
            late = tick.now - signals.last_arrival > self._stale_after + signals.lag()
            ages.append(SignalAge("access_log", round(max(0.0, tick.now - newest), 3),
                                  waiting and late))
        if signals.envoy:
            age = tick.now - max(e.at for e in signals.envoy.values())
            ages.append(SignalAge("envoy_stats", round(max(0.0, age), 3),
                                  age > self._stale_after))
        if signals.triton:
            age = tick.now - signals.triton[-1].at
            ages.append(SignalAge("triton_metrics", round(max(0.0, age), 3),
                                  age > self._stale_after))
        elif signals.expects_triton:
            ages.append(SignalAge("triton_metrics", -1.0, True))
        return tuple(ages)

    @staticmethod
    def _latency(own: StageState, signals: StageSignals) -> tuple[float, float]:
        """(p90, p99) of the latencies that arrived over the last LATENCY_TICKS ticks.
        A p99 of a few dozen requests is their slowest one, so the decision reads the
        p90; the p99 is reported."""
        hist, signals.latency = signals.latency, Histogram()
        own.recent = [*own.recent[-(LATENCY_TICKS - 1):], hist]
        merged = Histogram()
        for item in own.recent:
            merged.merge(item)
        # A p99 of a handful of requests is one slow request (a cold start): not a tail.
        if merged.total < MIN_RT_SAMPLES:
            return 0.0, 0.0
        return merged.quantile(0.9), merged.quantile(0.99)

    def _queue(self, tick: Tick, stage: Stage, signals: StageSignals,
               limits: StageThresholds) -> tuple[float, bool]:
        """(queued requests now, stale). Inferred from the pipeline's in-flight estimate
        less what the other stages hold (Little's law on their recent durations), which
        follows admissions at once; a direct view (Triton's pending gauge, Envoy's
        requests active on the stage's cluster), a flush interval old, where there is
        one. The larger of the two: each can lag the other."""
        held = max(0.0, tick.in_flight - elsewhere(tick, stage.name)) * limits.fanout
        inferred = max(0.0, held - limits.parallelism)
        if signals.expects_triton and not signals.triton:
            return inferred, True  # scraped, but nothing came back yet: fail safe
        if signals.triton:
            sample = signals.triton[-1]
            # The gauge counts queued requests, not the ones executing.
            return (max(inferred, float(sample.pending)),
                    tick.now - sample.at > self._stale_after)
        fresh = [e for e in signals.envoy.values() if tick.now - e.at <= self._stale_after]
        if fresh:
            active = sum(e.active + e.pending for e in fresh)
            return max(inferred, active - limits.parallelism), False
        # Late by design is not stale: an entry may take as long as the slowest recent
        # one did to arrive. Stale is when none came for longer while traffic flows.
        waiting = tick.state.admitted_rate > 0 or tick.in_flight >= 1
        expected_lag = signals.lag()
        stale = waiting and signals.completions > 0 and (
            tick.now - signals.last_arrival > self._stale_after + expected_lag)
        return inferred, stale


def elsewhere(tick: Tick, stage: str) -> float:
    """Pipeline requests in flight but not at `stage` (Little's law): the admitted rate
    times the part of their time spent outside it, in other stages and in the proxies
    between them, which no stage's own time counts."""
    own = tick.state.stages[stage]
    outside = max(0.0, tick.state.e2e_s - own.mean_s) if own.mean_s else 0.0
    return tick.state.admitted_rate * outside


def _triton_capacity(own: StageState, signals: StageSignals, queue: float,
                     limits: StageThresholds, dt: float) -> None:
    """Capacity from Triton's own counters where it is scraped: they count every caller,
    and they are fresher than the access logs."""
    served, service = triton_rates(signals)
    if service:
        if own.triton_service_s is None:
            own.mu = None  # Triton's counters replace what the access logs suggested
        own.triton_service_s = ewma(own.triton_service_s, service, dt, TAU_S)
    if not own.triton_service_s:
        return
    capacity = limits.parallelism / max(own.triton_service_s, MIN_SERVICE_S)
    # What it served is at most its capacity, and equal to it only while a queue stood
    # the whole window: a model that batches serves more than its per-request compute
    # time says. A queue seen at one scrape does not make the window busy, so the served
    # rate only ever raises the estimate.
    if queue >= 2 * limits.parallelism and served > capacity:
        capacity = served
    own.mu = ewma(own.mu, capacity, dt, TAU_S)


def stage_sla_s(stage: Stage, limits: StageThresholds) -> float | None:
    """The stage's p99 SLA in seconds as the thresholds stretch it; None without one."""
    if stage.sla_p99_ms is None:
        return None
    return stage.sla_p99_ms / 1000 * limits.sla_multiplier


def triton_rates(signals: StageSignals) -> tuple[float, float]:
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


def _overloaded(tick: Tick, own: StageState, limits: StageThresholds, *, mu: float,
                queue: float, fill: float, rt90: float, sla_s: float | None,
                errors: float) -> str:
    """Why the stage is overloaded ('' if it is not), judged over a window against its
    capacity, lasting reasons first: failures under load, a queue that stands while
    the stage is busy, a p99 past the SLA at full load, the slow rate past capacity;
    then a surge (a fast rate well past capacity that lasts a moment, or a queue past
    chance while arrivals exceed capacity), which only tightens the cap."""
    # Offered, not admitted: while shedding, admitted is about capacity by design.
    offered = tick.state.lam * limits.fanout
    sustained = tick.state.lam_slow * limits.fanout
    busy = sustained >= STANDING_LOAD * mu if mu else True
    own.surging = own.surging + tick.dt if mu and offered >= SURGE * mu else 0.0
    # A fast rate well past capacity that lasts, or a queue longer than chance makes at
    # moderate load while arrivals run past capacity: a queue is building.
    surge = own.surging >= SURGE_S
    building = bool(mu) and offered >= mu and queue >= chance_queue(own.spread, BUILDING_TAIL,
                                                                   limits.fanout)
    # Past capacity on the slow rate, unless the fast one says the load has dropped: the
    # slow rate takes a second and more to follow, and nothing stands in between.
    full = bool(mu) and min(sustained, offered) >= SUSTAINED * mu
    if errors >= ERROR_SHARE and own.failed >= MIN_ERRORS:
        return "errors"
    if own.standing >= STANDING_S and busy:
        return "standing"
    # Most requests far past the SLA: moderate load with varied service times puts a few
    # past it by chance (the p99 of exponential times at 70 % is just over), not a tenth
    # of them half as far again.
    if sla_s and rt90 > LATE_FACTOR * sla_s:
        return "late"
    if full:
        return "full"
    return "surge" if surge or building else ""
