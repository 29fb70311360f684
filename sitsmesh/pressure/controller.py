"""The controller: every tick, signals -> per-stage pressure -> one admission decision per
pipeline, published as an immutable snapshot that Check and ShouldRateLimit read.

The decision is an admitted fraction of arrivals, turned into a DAGOR-like
admission level over priorities (lowest shed first, with a fractional part so
shedding grows smoothly inside one priority), an admitted concurrency, and a
retry-after from the estimated drain time. Overload lowers the fraction by at
most 20 % a tick; underload must last `hysteresis_ticks` before it rises.
A stage whose signals went stale counts as saturated.

Every signal is read as of when it happened: access-log hops by their own
start and end, Envoy's and Triton's gauges by their timestamps. A signal that
is late by design (a log flush, a stats flush) is not stale; one that stopped
coming while traffic flows is. Overload is judged over a window against the
capacity learned from the stage's own work, so a chance queue at moderate load
sheds nothing: the tight concurrency cap applies only while arrivals exceed
capacity, a queue stands, or the stage fails under load.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from sitsmesh.chains.pipeline import Pipeline
from sitsmesh.pressure import entryqueue, headroom
from sitsmesh.pressure.inflight import still_running
from sitsmesh.pressure.queueing import chance_queue, ewma, seed_depth
from sitsmesh.pressure.signals import PipelineSignals, Signals
from sitsmesh.pressure.stages import (
    CALM_TAIL,
    HIGH,
    OK,
    OVERLOADED,
    STALE,
    SURGE,
    TAU_S,
    WINDOW_S,
    PipelineState,
    StageJudge,
    StagePressure,
    Tick,
    elsewhere,
    stage_sla_s,
)
from sitsmesh.pressure.thresholds import PRIORITIES, Thresholds

# Re-exported: the decision's parts and levels are read by the gate, the admin API, tests.
__all__ = ["HIGH", "OK", "OVERLOADED", "STALE", "Controller", "Decision", "Snapshot",
           "StagePressure", "cutoff_for"]

TAU_SLOW_S = 2.0         # memory of the slower arrival rate that judges sustained overload
DECREASE_FLOOR = 0.8     # overload cuts the admitted fraction by at most 20 % a tick
INCREASE_STEP = 0.1
OVERSHOOT = 1.15         # admitted-rate aim over capacity (see _decide)
SLA_SHARE = 0.4          # of the SLA that queueing may take under pressure (concurrency cap)
ROOM_TAIL = 0.005        # the calm cap stops at the SLA's room if chance passes it this rarely


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
    # Held requests that have most likely ended, their access-log entries still on the
    # way: Check subtracts them from its in-flight count before it meets the cap.
    in_flight_offset: int = 0
    in_flight: float = 0.0   # the estimate itself, for reports
    # Pipeline requests/s the bottleneck can take: the budget a shedding level spends
    # (see admit.Budget); 0 = none, the level sheds its share of every arrival.
    admit_rate: float = 0.0
    # Arrivals/s by priority: RLQS turns the level into a rate per priority.
    priority_rates: tuple[float, ...] = ()
    # How long Check holds a request at the in-flight cap for room before refusing it
    # (pressure.entryqueue); 0 = refused at once.
    wait_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Snapshot:
    decisions: Mapping[str, Decision] = field(default_factory=dict)
    at: float = 0.0


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
        self._judge = StageJudge(signals, stale_after_s)
        self._states: dict[str, PipelineState] = {}
        self.pipelines: Mapping[str, Pipeline] = {}
        self.thresholds: Mapping[str, Thresholds] = {}
        self.snapshot = Snapshot()

    def configure(self, pipelines: Mapping[str, Pipeline],
                  thresholds: Mapping[str, Thresholds]) -> None:
        self.pipelines = dict(pipelines)
        self.thresholds = dict(thresholds)
        for gone in set(self._states) - set(self.pipelines):
            del self._states[gone]

    def set_capacity(self, pipeline: str, stage: str, rate: float, service_s: float) -> None:
        """A stage's capacity known from outside (a batching change with its measured
        curve): taken at once instead of being learned again over the next windows."""
        state = self._states.get(pipeline)
        own = state.stages.get(stage) if state is not None else None
        if own is not None and rate > 0 and service_s > 0:
            own.mu, own.triton_service_s = rate, service_s

    def tick(self) -> Snapshot:
        now = self._clock()
        decisions = {}
        for name, pipeline in self.pipelines.items():
            thresholds = self.thresholds.get(name, Thresholds())
            decisions[name] = self._decide(pipeline, thresholds, now)
        self.snapshot = Snapshot(decisions, now)
        return self.snapshot

    def expected_in_flight(self, name: str, signals: PipelineSignals, now: float) -> float:
        """How many of `signals`' held requests are most likely still running: one
        replica's own holds (its gate's live counts), judged by what this controller
        learned of the pipeline's stages and latencies."""
        state = self._states.get(name)
        if state is None:
            return float(signals.in_flight)
        watermark = now - max(signals.lags, default=0.0)
        return still_running(state, signals, self.thresholds.get(name, Thresholds()), now,
                          watermark, views=[])

    # --- one pipeline ----------------------------------------------------

    def _decide(self, pipeline: Pipeline, thresholds: Thresholds, now: float) -> Decision:
        state = self._states.setdefault(pipeline.name, PipelineState())
        signals = self.signals.pipeline(pipeline.name)
        dt, state.last = (now - state.last) if state.last is not None else 0.0, now
        arrived = _count(state, signals, dt)
        # Every end up to the watermark has arrived: the log delay seen lately says how far
        # behind now that is.
        watermark = now - max(signals.lags, default=0.0)
        # Over the same window as the stages' own times (see StageJudge.windows).
        recent = [ended - admitted for admitted, ended in signals.ended
                  if watermark - WINDOW_S <= ended < watermark]
        if recent:
            state.e2e_s = sum(recent) / len(recent)
        expected = still_running(state, signals, thresholds, now, watermark,
                                 views=self._direct_views(pipeline, thresholds))
        tick = Tick(pipeline, thresholds, state, now, dt, expected,
                    max(0, round(signals.in_flight - expected)))
        self._judge.windows(tick)
        limits: list[tuple[float, str, float]] = []   # (pipeline rate, stage, drain seconds)
        for stage in pipeline.stages:
            view, rate, drain = self._judge.judge(tick, stage)
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
        # A surge alone only tightens the cap, which sheds a request only once the queue
        # is there; the fraction (shedding whole priorities) waits for overload that lasts.
        lasting = any(v.level == STALE or (v.level == OVERLOADED and v.reason != "surge")
                      for v in tick.views)
        calm = all(v.level == OK for v in tick.views)
        # Aim a little over capacity: the concurrency cap trims the rest per request, so
        # the stage never idles for want of admitted work.
        target = (1.0 if state.lam <= 0 or math.isinf(rate)
                  else min(1.0, OVERSHOOT * rate / state.lam))
        if lasting:
            # Toward what the bottleneck can take (its queue's excess already counted in),
            # down by at most 20 % a tick; up gently while arrivals still exceed capacity
            # but the shedding has left room.
            if target < state.fraction:
                state.calm_ticks = 0
                state.fraction = max(state.fraction * DECREASE_FLOOR, target)
            elif all(v.reason in ("", "full", "surge")
                     and v.queue_fill <= thresholds.stage(v.name).queue_fill_high
                     for v in tick.views):
                # Arrivals still exceed capacity but no queue is past its mark: the
                # shedding left room. Up gently, after the hysteresis, toward what the
                # stage can take.
                state.calm_ticks += 1
                if state.calm_ticks >= thresholds.hysteresis_ticks:
                    state.fraction = min(target, state.fraction + INCREASE_STEP)
            else:
                state.calm_ticks = 0
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
        # Under overload the cap keeps most of the SLA free of queueing. Otherwise a queue
        # is chance, not overload, and the cap sits past the chance queues at moderate
        # load: a request is shed there for a surge, never for a burst.
        # The cap stays tight through the hysteresis too: a surge that pauses for a tick
        # has not ended.
        state.since_overload = 0 if overloaded else state.since_overload + 1
        # Arrivals well past a stage's capacity on the fast rate: a surge most likely (at
        # 70 % load, chance gets there about never). The loose cap would let it queue up
        # to the cap before the surge is confirmed, so the cap tightens at once.
        arriving = any(0 < SURGE * v.capacity <= state.lam * thresholds.stage(v.name).fanout
                       for v in tick.views)
        # The cap sized to the service times' tail is for arrivals past capacity; a queue
        # that one long service left behind at moderate load drains by itself, and the
        # mean-sized cap sheds less of the low priority that came meanwhile.
        # (The step detector runs every tick, calm or not: it sums over ticks.)
        wait_s = entryqueue.wait_for(thresholds.entry_wait_ms, signals.lags)
        concurrency = self._concurrency(
            tick, SLA_SHARE, calm=(not _stepped(tick, arrived) and not arriving
                                   and state.since_overload >= thresholds.hysteresis_ticks),
            surge=arriving, wait_s=wait_s)
        return self._publish(tick, fraction=state.fraction,
                             cutoff=cutoff_for(state.fraction, state.shares,
                                               thresholds.protected_from),
                             concurrency=concurrency, protected_from=thresholds.protected_from,
                             admit_rate=0.0 if math.isinf(rate) else OVERSHOOT * rate,
                             wait_s=wait_s)

    def _direct_views(self, pipeline: Pipeline, thresholds: Thresholds
                      ) -> list[tuple[float, float, str]]:
        """(when, pipeline requests at the stage then, stage) from each stage's freshest
        direct view: Triton's pending gauge (plus the instances busy when there is a
        queue) or Envoy's requests active on the stage's cluster. A quarter second old
        where a log entry may be a second old."""
        views = []
        for stage in pipeline.stages:
            signals = self.signals.stage(pipeline.name, stage.name)
            limits = thresholds.stage(stage.name)
            if signals.triton:
                sample = signals.triton[-1]
                queued = float(sample.pending)
                held = queued + (limits.parallelism if queued else 0)
                views.append((sample.at, held / limits.fanout, stage.name))
            elif signals.envoy:
                at = max(e.at for e in signals.envoy.values())
                held = sum(e.active + e.pending for e in signals.envoy.values())
                views.append((at, held / limits.fanout, stage.name))
        return views

    @staticmethod
    def _concurrency(tick: Tick, share: float, *, calm: bool, surge: bool,
                     wait_s: float = 0.0) -> int:
        """Little's law on the bottleneck: in flight = capacity x the time the SLA leaves
        for waiting, so an admitted request is not queued past its SLA. The count it
        meets is the whole pipeline's, so what the other stages hold is added."""
        view = next((v for v in tick.views if v.name == tick.bottleneck), None)
        stage = next((s for s in tick.pipeline.stages if s.name == tick.bottleneck), None)
        if view is None or stage is None or not view.capacity or view.stale:
            return tick.thresholds.min_concurrency if view is not None and view.stale else 0
        limits = tick.thresholds.stage(stage.name)
        sla_s = stage_sla_s(stage, limits) or 1.0
        others = elsewhere(tick, stage.name)
        own = tick.state.stages[stage.name]
        # Under pressure the queue that fits the SLA at the tail of the service times,
        # the spread taken as wide as its samples leave possible (see headroom).
        # A request may wait `wait_s` at the entry first: that comes out of its queueing.
        queued = view.capacity * max(0.0, sla_s * share - wait_s)
        if surge or 0 < view.capacity <= tick.state.lam_slow * limits.fanout:
            queued = headroom.tail_queue(queued,
                                         headroom.cautious_spread(own.spread, own.samples))
        if calm:
            # Past the chance queues of moderate load: a request is shed there for a
            # surge, never for a burst the stage had room for. But not past the queue the
            # SLA has room for where chance reaches that only rarely (fixed service times):
            # a request waiting longer misses its SLA anyway, and a surge that is not yet
            # confirmed fills the cap before it tightens.
            spread = own.spread
            room = view.capacity * sla_s - limits.parallelism
            queued = max(queued, min(chance_queue(spread, CALM_TAIL, limits.fanout),
                                     max(room, chance_queue(spread, ROOM_TAIL,
                                                            limits.fanout))))
        cap = (queued + limits.parallelism) / limits.fanout + others
        return int(max(tick.thresholds.min_concurrency,
                       min(tick.thresholds.max_concurrency, cap)))

    def _seed(self, tick: Tick) -> Decision:
        """The seed design: a queue-depth cap on the fullest stage, priority-blind."""
        fullest = max(tick.views, key=lambda v: v.queue_fill)
        stage = next(s for s in tick.pipeline.stages if s.name == fullest.name)
        limits = tick.thresholds.stage(stage.name)
        sla_s = stage_sla_s(stage, limits)
        depth = seed_depth(limits.queue_capacity, rt99_s=fullest.rt99_ms / 1000, sla_s=sla_s,
                           fill=fullest.queue_fill, qps=fullest.arrival_rate,
                           capacity=fullest.capacity)
        tick.bottleneck = fullest.name
        return self._publish(tick, fraction=1.0, cutoff=0.0,
                             concurrency=int(depth) + limits.parallelism,
                             protected_from=PRIORITIES)

    @staticmethod
    def _publish(tick: Tick, *, fraction: float, cutoff: float, concurrency: int,
                 protected_from: int, admit_rate: float = 0.0, wait_s: float = 0.0
                 ) -> Decision:
        return Decision(tick.pipeline.name, tick.thresholds.policy, round(fraction, 4),
                        round(cutoff, 4), concurrency, protected_from, tick.retry_after,
                        tick.bottleneck, tick.level, round(tick.state.lam, 3),
                        tuple(tick.views), tick.now, tick.offset, round(tick.in_flight, 2),
                        round(admit_rate, 3), tuple(round(r, 3) for r in tick.state.shares),
                        wait_s)

    # --- one stage -------------------------------------------------------


def _count(state: PipelineState, signals: PipelineSignals, dt: float) -> int:
    """Arrival and admission rates since the last tick, overall and by priority; the
    arrivals counted."""
    arrived = max(signals.arrivals - state.arrivals, signals.rl_arrivals - state.rl_arrivals)
    if dt > 0:
        state.lam = ewma(state.lam, arrived / dt, dt, TAU_S)
        state.lam_slow = ewma(state.lam_slow, arrived / dt, dt, TAU_SLOW_S)
        state.admitted_rate = ewma(state.admitted_rate,
                                   (signals.admitted - state.admitted) / dt, dt, TAU_S)
        for p in range(PRIORITIES):
            state.shares[p] = ewma(state.shares[p],
                                   (signals.by_priority[p] - state.by_priority[p]) / dt, dt, TAU_S)
    state.arrivals, state.admitted = signals.arrivals, signals.admitted
    state.rl_arrivals = signals.rl_arrivals
    state.by_priority = list(signals.by_priority)
    return arrived


def _stepped(tick: Tick, arrived: int) -> bool:
    """Whether Check's arrivals have stepped past what the stages may serve (see
    headroom.cusum): the pipeline rate of the tightest stage, as high as its samples
    leave possible."""
    state, thresholds = tick.state, tick.thresholds
    capacity = min((headroom.capacity_bound(v.capacity, state.stages[v.name].spread,
                                            state.stages[v.name].samples)
                    / thresholds.stage(v.name).fanout for v in tick.views if v.capacity),
                   default=0.0)
    if not capacity or tick.dt <= 0:
        # (The first tick's count runs from the process's start: not a step.)
        state.cusum = 0.0
        return False
    alarm_s = thresholds.step_alarm_s
    state.cusum = headroom.cusum(state.cusum, arrived, capacity, tick.dt, alarm_s)
    return state.cusum >= headroom.alarm(capacity, alarm_s)
