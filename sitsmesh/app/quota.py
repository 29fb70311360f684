"""RLQS (Envoy's rate_limit_quota filter): quotas from the rate-limit config and the
backpressure decisions, enforced by Envoy with no call per request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Mapping

from envoy.service.rate_limit_quota.v3 import rlqs_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sitsmesh import logs, redisclients
from sitsmesh.app.background import Background, DataService
from sitsmesh.app.components import ChainsComponent, RateLimitComponent
from sitsmesh.app.tls import redis_url
from sitsmesh.config import Settings
from sitsmesh.pressure.controller import Decision
from sitsmesh.pressure.gate import PressureGate
from sitsmesh.quota.peers import TTL_S, QuotaPeers
from sitsmesh.quota.service import QuotaService
from sitsmesh.ratelimit.config import Node
from sitsmesh.shared.lease import holder_id
from sitsmesh.transport.rlqs import (
    REFRESH_S,
    SERVICE_NAME,
    RateLimitQuotaServicer,
    ServedElsewhere,
)
from sitsmesh.transport.streams import OpenStreams

_log = logs.get("sitsmesh.app.quota")
_NO_DECISIONS: Mapping[str, Decision] = {}
PEERS_S = 1.0
PENDING_S = 0.002
PUBLISH_S = 1.0


# name -> help: gauges, then counters (whose exposed names end in _total).
_GAUGES = {
    "sitsmesh_rlqs_streams": "Open RLQS streams.",
    "sitsmesh_rlqs_buckets": "Buckets kept across RLQS streams.",
    "sitsmesh_rlqs_bucket_id_bytes": "Bytes counted for the bucket ids kept, all streams.",
    "sitsmesh_rlqs_pending_work": "Buckets and groups waiting to be matched, recomputed, "
                                  "settled or pushed.",
}
_COUNTERS = {
    "sitsmesh_rlqs_buckets_refused": "New buckets abandoned because the bucket-id byte "
                                     "bound of their stream or of all streams was reached.",
    "sitsmesh_rlqs_streams_not_reading": "RLQS streams ended because their caller did not "
                                         "read its replies.",
}


def _values(service: QuotaService, servicer: RateLimitQuotaServicer) -> list[float]:
    """_GAUGES' values, then _COUNTERS', in their order."""
    return [len(service.streams), sum(len(s.buckets) for s in service.streams.values()),
            service.id_bytes, service.pending, service.refused_ids, servicer.not_reading]


class QuotaMetrics(Collector):
    """What RLQS holds and what its bounds refused, read at scrape time."""

    def __init__(self, service: QuotaService, servicer: RateLimitQuotaServicer) -> None:
        self._service = service
        self._servicer = servicer

    def collect(self) -> Iterator[Metric]:
        values = iter(_values(self._service, self._servicer))
        for name, text in _GAUGES.items():
            yield GaugeMetricFamily(name, text, value=next(values))
        for name, text in _COUNTERS.items():
            yield CounterMetricFamily(name, text, value=next(values))


class QuotaGauges:
    """QuotaMetrics' values where RLQS has a process of its own: written to the
    multiprocess files every PUBLISH_S, where the data process's /metrics reads them."""

    def __init__(self) -> None:
        self._gauges = [Gauge(name, text, multiprocess_mode="livemax")
                        for name, text in _GAUGES.items()]
        self._counters = [Counter(name, text) for name, text in _COUNTERS.items()]
        self._counted = [0.0] * len(_COUNTERS)

    def publish(self, service: QuotaService, servicer: RateLimitQuotaServicer) -> None:
        values = _values(service, servicer)
        for gauge, value in zip(self._gauges, values, strict=False):
            gauge.set(value)
        totals = values[len(self._gauges):]
        for counter, total, counted in zip(self._counters, totals, self._counted, strict=True):
            counter.inc(total - counted)
        self._counted = totals


class QuotaComponent:
    """Served by one process only: with worker processes each would split the same
    global rate among the Envoys it happens to hold. That is the RLQS process when
    rlqs_addr is set (see app/quotaproc.py), else a single data process. Workers without
    it serve no RLQS (Envoy falls back to its filter's no_assignment_behavior, and the
    start-up log says why)."""

    def __init__(self, settings: Settings, ratelimit: RateLimitComponent,
                 gate: PressureGate | None, *, serve: bool,
                 registry: CollectorRegistry | None = None, own_process: bool = False) -> None:
        self._settings = settings
        self._background = Background()
        self.servicer: RateLimitQuotaServicer | None = None
        self.peers: QuotaPeers | None = None
        self._published: QuotaGauges | None = None
        # A data process beside the RLQS process: told, on its port, where RLQS is.
        self._elsewhere = (str(settings.rlqs_addr) if serve and not own_process
                           and settings.rlqs_addr is not None else "")
        if not serve or self._elsewhere:
            return
        if settings.workers > 1 and not own_process:
            _log.warning("RLQS is not served by worker processes: each would split the "
                         "global rates on its own; set rlqs_addr to serve it from a "
                         "process of its own", workers=settings.workers)
            return
        holder = ratelimit.config.holder

        def domains() -> Mapping[str, Node]:
            return holder.current.domains

        def decisions() -> Mapping[str, Decision]:
            return gate.snapshot.decisions if gate is not None else _NO_DECISIONS

        def pipeline_for(hint: str, model: str, tenant: str) -> str:
            # Only a pipeline governing the bucket's tenant holds it to its decisions.
            return gate.pipeline_of(hint, model, tenant) if gate is not None else ""

        self.service = QuotaService(domains, decisions, pipeline_for)
        self.servicer = RateLimitQuotaServicer(self.service, settings.rlqs_assignment_ttl_s)
        if registry is not None:
            registry.register(QuotaMetrics(self.service, self.servicer))
        if own_process:
            self._published = QuotaGauges()
        # Replicas split each global rate over every Envoy of the fleet, through the
        # Redis the rate limits or the shared runtime already use.
        if settings.shared_runtime == "redis" or settings.ratelimit_store == "redis":
            self.peers = QuotaPeers(redisclients.connect(redis_url(settings)), holder_id())

    def attach(self, chains: ChainsComponent) -> None:
        """Buckets are matched to pipelines once; again (a step at a time) when the
        pipelines change. Registered after the gate's listener, so it sees the new ones."""
        if self.servicer is not None:
            service = self.service
            chains.pipelines.on_change(lambda _pipelines: service.pipelines_changed())

    def services(self, streams: OpenStreams) -> list[DataService]:
        servicer = self.servicer
        if servicer is None:
            if not self._elsewhere:
                return []
            elsewhere = ServedElsewhere(self._elsewhere)
            return [DataService(SERVICE_NAME, lambda server: (
                rlqs_pb2_grpc.add_RateLimitQuotaServiceServicer_to_server(elsewhere, server)),
                health=False)]
        servicer.streams = streams
        return [DataService(SERVICE_NAME, lambda server: (
            rlqs_pb2_grpc.add_RateLimitQuotaServiceServicer_to_server(servicer, server)))]

    async def start(self) -> None:
        if self.servicer is not None:
            # Decisions move every controller tick, and one Envoy's report moves the
            # others' shares: what changed goes out without waiting for their reports.
            self._background.spawn(self._refresh(self.servicer))
        if self.peers is not None:
            self._background.spawn(self._share())
        published = self._published
        if published is not None and self.servicer is not None:
            servicer, service = self.servicer, self.service
            self._background.every(PUBLISH_S, lambda: published.publish(service, servicer))

    async def _refresh(self, servicer: RateLimitQuotaServicer) -> None:
        """Push what changed every REFRESH_S; while work is pending (a step is kept
        short, for Check's sake), the next step follows as soon as the loop is free."""
        while True:
            await asyncio.sleep(PENDING_S if self.service.pending else REFRESH_S)
            await servicer.turns.take()
            servicer.push()

    async def _share(self) -> None:
        """Every second: this replica's members out, the others' in. Redis down: after
        its TTL each replica splits among its own Envoys (the fleet then admits up to
        replicas x the rate: open, as on_store_error=allow), and says so."""
        assert self.peers is not None
        failing_since: float | None = None
        while True:
            await asyncio.sleep(PEERS_S)
            try:
                self.service.remote = await self.peers.sync(self.service.local_members)
                failing_since = None
            except Exception as exc:  # Redis down or slow: keep serving from what we had
                now = time.monotonic()
                if failing_since is None:
                    failing_since = now
                    _log.warning("RLQS demand not shared: splitting from the last known",
                                 error=str(exc))
                if now - failing_since > TTL_S and self.service.remote:
                    _log.warning("RLQS demand of other replicas expired: splitting among "
                                 "this replica's Envoys only")
                    self.service.remote = {}

    async def stop(self) -> None:
        await self._background.stop()
        if self.peers is not None:
            await self.peers.close()
