"""The controller's loop in a serving process: tick, publish, scrape Triton, flush sheds.

Everything here runs beside the request path, never on it: the tick swaps a
new snapshot into the gate, and shed tallies the gate kept become Prometheus
counters and a sampled log line once per tick.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge

from sitsmesh import logs
from sitsmesh.chains.assembler import Hop
from sitsmesh.chains.pipeline import Pipeline, Stage
from sitsmesh.pressure import scrape
from sitsmesh.pressure.controller import Controller, Snapshot
from sitsmesh.pressure.gate import PressureGate
from sitsmesh.pressure.signals import EnvoySample, Signals, TritonSample
from sitsmesh.pressure.stages import StagePressure
from sitsmesh.pressure.thresholds import Thresholds
from sitsmesh.pressure.work import WorkLedger

_log = logs.get("sitsmesh.pressure")
MIN_TICK_S = 0.01
MAX_ENVOYS = 1024   # Envoys whose latest stats one stage keeps
LOG_EVERY_S = 5.0


class PressureRuntime:
    def __init__(self, registry: CollectorRegistry | None, *, scrape_interval_s: float = 0.25,
                 stale_after_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, shared: bool = False) -> None:
        # What the controller reads. With shared runtime state it is every replica's
        # (sitsmesh.shared.pressure feeds it), and the gate counts this replica's own
        # traffic apart, in `local`, for the next report to the others.
        self.signals = Signals()
        self.local = Signals() if shared else self.signals
        # Shared: the hops of the chains this replica owns, summed for the others
        # (sitsmesh.shared.pressure) instead of sent one by one.
        self.owned = Signals() if shared else self.signals
        self.ledgers: dict[str, WorkLedger] | None = {} if shared else None
        self.gate = PressureGate(self.local, clock)
        self.controller = Controller(self.signals, clock, stale_after_s=stale_after_s)
        self._clock = clock
        self._wall = wall
        self._offset_known = False
        self._envoy_flushes = Counter("sitsmesh_envoy_stats_flushes_total",
                                      "Stats flushes received from Envoys (MetricsService) "
                                      "that reported on a cluster a stage calls.",
                                      registry=registry)
        self._scrape_interval = scrape_interval_s
        self.scraping = False  # set before pipelines arrive when metrics URLs are configured
        self._pipelines: Mapping[str, Pipeline] = {}
        self._thresholds: Mapping[str, Thresholds] = {}
        self._models: dict[str, list[tuple[str, str]]] = {}  # triton model -> stages
        self._clusters: dict[str, list[tuple[str, str]]] = {}  # envoy cluster -> stages
        self._instances: dict[str, int] = {}  # triton model -> instances, as Triton says
        self._watchers: set[asyncio.Queue[Snapshot]] = set()
        # Sees every snapshot made live (tracing: a span when a pipeline's decision changes).
        self.on_decisions: Callable[[Snapshot], None] | None = None
        self._logged: dict[tuple[str, str], float] = {}
        self._sheds = Counter("sitsmesh_shed_total",
                              "Requests shed at a pipeline's entry, by the stage that caused "
                              "it, priority and reason.",
                              ["pipeline", "stage", "priority", "reason"], registry=registry)
        self._waits = Counter("sitsmesh_entry_waits_total",
                              "Requests held at a pipeline's entry for room under its "
                              "in-flight cap (entry_wait_ms), by how the wait ended: let_in, "
                              "waited_out (then refused, also counted as shed) or gone (the "
                              "Check went away first: Envoy's ext_authz timeout).",
                              ["pipeline", "outcome"], registry=registry)
        self._waiting = Gauge("sitsmesh_entry_waiting",
                              "Requests held at a pipeline's entry now.", ["pipeline"],
                              registry=registry)
        self._fraction = Gauge("sitsmesh_pipeline_admitted_fraction",
                               "Fraction of arrivals the controller admits.", ["pipeline"],
                               registry=registry)
        self._pressure = Gauge("sitsmesh_stage_pressure",
                               "Stage pressure (1 = overloaded): max of queue fill over its "
                               "high mark, p99 over SLA, and utilisation.",
                               ["pipeline", "stage"], registry=registry)
        self._ages = Gauge("sitsmesh_stage_signal_age_seconds",
                           "How old the newest sample of each signal source of a stage is "
                           "(access-log entries are a flush interval behind by design); "
                           "-1 until one came.",
                           ["pipeline", "stage", "source"], registry=registry)

    # --- configuration -----------------------------------------------------

    def set_pipelines(self, pipelines: Mapping[str, Pipeline]) -> None:
        self._pipelines = dict(pipelines)
        self.gate.set_pipelines(pipelines)
        if self.local is not self.signals:  # shared: keep this replica's holds for its report
            for name in pipelines:
                local = self.local.pipeline(name)
                local.journal = [] if local.journal is None else local.journal
        self._models = {}
        self._clusters = {}
        for pipeline in pipelines.values():
            for stage in pipeline.stages:
                if stage.match_key == "upstream_cluster":
                    self._clusters.setdefault(stage.match_value, []).append(
                        (pipeline.name, stage.name))
                if not stage.triton_model:
                    continue
                self._models.setdefault(stage.triton_model, []).append(
                    (pipeline.name, stage.name))
                signals = self.signals.stage(pipeline.name, stage.name)
                signals.expects_triton = self.scraping
                if not self.scraping:
                    _log.warning("stage names a Triton model but no Triton metrics_url is "
                                 "configured; its queue is estimated from requests in flight",
                                 pipeline=pipeline.name, stage=stage.name,
                                 model=stage.triton_model)
        self._configure()

    def set_thresholds(self, thresholds: Mapping[str, Thresholds]) -> None:
        self._thresholds = dict(thresholds)
        self._configure()

    @property
    def pipelines(self) -> Mapping[str, Pipeline]:
        return self._pipelines

    def triton_models(self) -> list[str]:
        """The Triton models the pipelines' stages name."""
        return sorted(self._models)

    def set_instances(self, model: str, count: int) -> None:
        """How many instances Triton runs of `model`: the parallelism of its stages where
        the thresholds do not set one."""
        if count > 0 and self._instances.get(model) != count:
            self._instances[model] = count
            _log.info("triton instances", model=model, count=count)
            self._configure()

    def stages_of(self, model: str) -> list[tuple[Pipeline, Stage]]:
        """The pipeline stages a Triton model serves."""
        return [(self._pipelines[p], stage) for p, name in self._models.get(model, ())
                for stage in self._pipelines[p].stages if stage.name == name]

    def stage_view(self, pipeline: str, stage: str) -> StagePressure | None:
        """The live controller's view of one stage (None before its first decision)."""
        decision = self.gate.snapshot.decisions.get(pipeline)
        if decision is None:
            return None
        return next((v for v in decision.stages if v.name == stage), None)

    def set_capacity(self, model: str, slots: int, rate: float, service_s: float) -> None:
        """A batching change took effect: `slots` items execute at once, and every stage
        of the model can serve `rate` items/s, from now, not once relearned."""
        self.set_instances(model, slots)
        for pipeline, stage in self._models.get(model, ()):
            self.controller.set_capacity(pipeline, stage, rate, service_s)

    def _configure(self) -> None:
        effective = dict(self._thresholds)
        for model, count in self._instances.items():
            for pipeline, stage in self._models.get(model, ()):
                effective[pipeline] = effective.get(pipeline, Thresholds()).with_parallelism(
                    stage, count)
        self.controller.configure(self._pipelines, effective)

    def now(self) -> float:
        """This process's monotonic clock, the one its signals are stamped in."""
        return self._clock()

    def on_hop(self, pipeline: str, stage: str, hop: Hop) -> None:
        """A hop as of when it happened: its wall-clock start becomes this process's
        monotonic time, and how late its entry came is kept. (Shared: one of the chains
        this replica owns.)"""
        now = self._clock()
        if not self._offset_known:
            self._refresh_offset()
        self.owned.stage(pipeline, stage).complete(
            hop.request_id, hop.start - self.gate.wall_offset, hop.duration,
            failed=hop.failed, arrived=now)
        if self.ledgers is not None:
            ledger = self.ledgers.get(pipeline)
            if ledger is None:
                ledger = self.ledgers[pipeline] = WorkLedger()
            ledger.add(stage, hop.request_id, hop.start, hop.start + hop.duration, hop.failed)

    def on_envoy(self, node: str, samples: Mapping[str, EnvoySample]) -> None:
        """One Envoy's stats flush: each cluster a stage calls gets that Envoy's sample,
        stamped in this process's monotonic time."""
        if not self._offset_known:
            self._refresh_offset()
        used = False
        for cluster, sample in samples.items():
            for pipeline, stage in self._clusters.get(cluster, ()):
                used = True
                reports = self.signals.stage(pipeline, stage).envoy
                if node not in reports and len(reports) >= MAX_ENVOYS:
                    del reports[next(iter(reports))]  # the longest-known Envoy goes
                reports[node] = EnvoySample(sample.at - self.gate.wall_offset, sample.active,
                                            sample.pending, sample.completed, sample.errors)
        if used:
            self._envoy_flushes.inc()

    def on_triton(self, model: str, sample: TritonSample) -> None:
        for pipeline, stage in self._models.get(model, ()):
            self.signals.stage(pipeline, stage).scraped(sample)

    def model_pressure(self, model: str) -> str:
        """Why a stage serving this Triton model is overloaded now ("" if none is)."""
        snapshot = self.gate.snapshot
        for pipeline, stage in self._models.get(model, ()):
            decision = snapshot.decisions.get(pipeline)
            view = next((v for v in decision.stages if v.name == stage), None) if decision \
                else None
            if view is not None and view.level == "overloaded":
                return (f"stage {pipeline}/{stage} is overloaded: pressure {view.pressure:.2f}, "
                        f"queue {view.queue:.0f}, p99 {view.rt99_ms:.0f} ms")
        return ""

    # --- loops ---------------------------------------------------------------

    def tick_seconds(self) -> float:
        ticks = [t.tick_ms for name, t in self._thresholds.items() if name in self._pipelines]
        return max(MIN_TICK_S, min(ticks, default=100) / 1000)

    def _refresh_offset(self) -> None:
        # Wall clock minus monotonic, refreshed each tick: NTP may slew the wall clock.
        self.gate.wall_offset = self._wall() - self._clock()
        self._offset_known = True

    def tick(self) -> Snapshot:
        snapshot = self.decide()
        self.apply(snapshot)
        return snapshot

    def decide(self) -> Snapshot:
        """The controller's decision on the signals as they are now."""
        self._refresh_offset()
        return self.controller.tick()

    def apply(self, snapshot: Snapshot, gate: Snapshot | None = None) -> None:
        """Make a decision live: the gate applies `gate` (this replica's share of it,
        when several share the traffic), reports and watchers see `snapshot`."""
        self.gate.snapshot = gate or snapshot
        if self.gate.queue.waiting:
            self.gate.queue.wake_all()  # a new cap, or a new estimate of what still runs
        self._flush(snapshot)
        if self.on_decisions is not None:
            self.on_decisions(snapshot)
        for queue in list(self._watchers):
            if queue.qsize() < 100:  # a slow watcher loses ticks, never blocks the loop
                queue.put_nowait(snapshot)

    async def run(self) -> None:
        while True:
            self.tick()
            await asyncio.sleep(self.tick_seconds())

    async def scrape(self, urls: Sequence[str]) -> None:
        await scrape.scrape_forever(urls, self.on_triton, self._scrape_interval, self._clock)

    async def watch(self) -> AsyncIterator[Snapshot]:
        queue: asyncio.Queue[Snapshot] = asyncio.Queue()
        self._watchers.add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self._watchers.discard(queue)

    def _flush(self, snapshot: Snapshot) -> None:
        gate = self.gate
        if gate.sheds:
            sheds, gate.sheds = gate.sheds, {}
            for (pipeline, stage, priority, reason), count in sheds.items():
                self._sheds.labels(pipeline, stage or "-", str(priority), reason).inc(count)
            now = self._clock()
            for (pipeline, reason), (request_id, tenant, priority) in gate.samples.items():
                if now - self._logged.get((pipeline, reason), -LOG_EVERY_S) >= LOG_EVERY_S:
                    self._logged[pipeline, reason] = now
                    decision = snapshot.decisions.get(pipeline)
                    _log.info("shedding", pipeline=pipeline, reason=reason,
                              stage=decision.bottleneck if decision else "",
                              fraction=decision.fraction if decision else 1.0,
                              cutoff=decision.cutoff if decision else 0.0,
                              request_id=request_id, tenant=tenant, priority=priority)
            gate.samples.clear()
        queue = gate.queue
        if queue.outcomes:
            outcomes, queue.outcomes = queue.outcomes, {}
            for (pipeline, outcome), count in outcomes.items():
                self._waits.labels(pipeline, outcome).inc(count)
        for name, decision in snapshot.decisions.items():
            self._waiting.labels(name).set(queue.queued(name))
            self._fraction.labels(name).set(decision.fraction)
            for view in decision.stages:
                self._pressure.labels(name, view.name).set(view.pressure)
                for age in view.signals:
                    self._ages.labels(name, view.name, age.source).set(age.age_s)
