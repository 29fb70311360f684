"""The parts of the object graph, each with what it serves and the background work it runs.

A component is built for one role: `serve=True` where the data plane runs (it gets
the request-path objects), `serve=False` in a supervisor that only keeps configs
and answers the admin API.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from envoy.service.accesslog.v3 import als_pb2_grpc
from prometheus_client import CollectorRegistry

from sitsmesh import logs
from sitsmesh.app.background import HOUSEKEEPING_S, Background, DataService
from sitsmesh.app.tls import redis_url
from sitsmesh.authz.admission import Admission, AdmissionPolicy
from sitsmesh.authz.check import Authorizer, AuthzSettings, AuthzSnapshot
from sitsmesh.authz.directory import TenantDirectory
from sitsmesh.authz.gie import GieSettings
from sitsmesh.batching.service import AUTO_EVERY_S, BatchingService
from sitsmesh.budgets.gate import BudgetGate
from sitsmesh.chains.assembler import Assembler, Hop
from sitsmesh.chains.catalog import PipelineCatalog
from sitsmesh.chains.metrics import ChainMetrics
from sitsmesh.config import Settings
from sitsmesh.pressure.gate import PressureGate
from sitsmesh.pressure.instances import learn_instances
from sitsmesh.pressure.ledger import ThresholdLedger
from sitsmesh.pressure.runtime import PressureRuntime
from sitsmesh.ratelimit.config import Algorithm
from sitsmesh.ratelimit.limiter import RateLimiter, RequestLimits
from sitsmesh.ratelimit.memory import MemoryStore
from sitsmesh.ratelimit.metrics import RuleMetrics, StoreCounters, store_up_gauge
from sitsmesh.ratelimit.reload import ConfigManager
from sitsmesh.ratelimit.store import CounterStore, Hit
from sitsmesh.shared.admission import SharedAdmission
from sitsmesh.shared.lease import Lease
from sitsmesh.shared.partbus import PartitionedBus
from sitsmesh.shared.pressure import SharedPressure
from sitsmesh.state import StateStore
from sitsmesh.status import Serving, StatusBoard
from sitsmesh.swap.manager import SwapManager
from sitsmesh.swap.record import SwapHistory
from sitsmesh.telemetry.decisions import Telemetry
from sitsmesh.transport.accesslog import SERVICE_NAME as ACCESSLOG_SERVICE
from sitsmesh.transport.accesslog import AccessLogServicer, HopSink
from sitsmesh.transport.authz import SERVICE_NAME as AUTHZ_SERVICE
from sitsmesh.transport.authz import AuthorizationServicer
from sitsmesh.transport.authz import add_to_server as add_authz
from sitsmesh.transport.checklimits import CheckLimits
from sitsmesh.transport.metrics import SERVICE_NAME as METRICS_SERVICE
from sitsmesh.transport.metrics import MetricsServicer
from sitsmesh.transport.metrics import add_to_server as add_metrics
from sitsmesh.transport.ratelimit import SERVICE_NAME as RATELIMIT_SERVICE
from sitsmesh.transport.ratelimit import RateLimitServicer
from sitsmesh.transport.ratelimit import add_to_server as add_ratelimit
from sitsmesh.transport.streams import OpenStreams

STORE_HEALTH = "sitsmesh.ratelimit.store"
class RateLimitComponent:
    """Config snapshots for every process; counting only where the data plane runs."""

    def __init__(self, settings: Settings, state: StateStore,
                 registry: CollectorRegistry | None, board: StatusBoard, *,
                 serve: bool, gate: PressureGate | None = None,
                 telemetry: Telemetry | None = None) -> None:
        self._settings = settings
        self._board = board
        self._telemetry = telemetry
        self._config_healthy: bool | None = None
        self.config = ConfigManager(settings.ratelimit_config, state, registry,
                                    merge=settings.ratelimit_merge_domain_config)
        self.store: CounterStore | None = None
        self.limiter: RateLimiter | None = None
        self._metrics: RuleMetrics | None = None
        self._background = Background()
        if serve:
            self.store = _counter_store(settings, registry, board)
            self._metrics = RuleMetrics(registry, settings.ratelimit_near_limit_ratio)
            self.limiter = RateLimiter(
                self.config.holder, self.store, self._metrics,
                global_shadow=settings.ratelimit_shadow_mode,
                gate=gate, cache_bytes=settings.ratelimit_cache_bytes, limits=RequestLimits(
                    settings.ratelimit_max_descriptors, settings.ratelimit_max_entries,
                    settings.ratelimit_max_key_length, settings.ratelimit_max_value_length,
                    settings.ratelimit_max_hits_addend),
                quota_mode=settings.ratelimit_quota_mode,
                stop_increment_when_over=settings.ratelimit_stop_increment_when_over)

    def services(self) -> list[DataService]:
        if self.limiter is None:
            return []
        servicer = RateLimitServicer(self.limiter, self._settings.max_ratelimit_message_bytes,
                                     limit_headers=self._settings.ratelimit_response_headers,
                                     dynamic_metadata=(
                                         self._settings.ratelimit_response_dynamic_metadata),
                                     header_names=(self._settings.ratelimit_limit_header,
                                                   self._settings.ratelimit_remaining_header,
                                                   self._settings.ratelimit_reset_header),
                                     telemetry=self._telemetry)
        services = [DataService(RATELIMIT_SERVICE,
                                lambda server: add_ratelimit(servicer, server))]
        if self._settings.ratelimit_store == "redis":
            services.append(DataService(STORE_HEALTH, lambda server: None))
        return services

    async def start(self) -> None:
        self.config.on_live = self._config_health
        await self.config.reload("startup")
        self._background.spawn(self.config.watch(self._settings.reload_interval_seconds))
        if self._metrics is not None:
            self._background.every(HOUSEKEEPING_S, self._metrics.flush)

    def _config_health(self) -> None:
        """HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED: NOT_SERVING while no domain is live.
        It only undoes its own NOT_SERVING, never a drain's."""
        if self.limiter is None or not self._settings.ratelimit_healthy_requires_config:
            return
        healthy = bool(self.config.holder.current.domains)
        if healthy is self._config_healthy:
            return
        self._config_healthy = healthy
        for name in ("", RATELIMIT_SERVICE):
            state = self._board.state(name)
            if not healthy and state is Serving.SERVING:
                self._board.set(name, Serving.NOT_SERVING)
            elif healthy and state is Serving.NOT_SERVING:
                self._board.set(name, Serving.SERVING)

    async def probe(self) -> None:
        """One read-only call, so a store that is down shows in health before traffic does
        (and a missing config, where health waits for one)."""
        self._config_healthy = None
        self._config_health()
        if self.store is not None and self._settings.ratelimit_store != "memory":
            await self.store.hit([Hit("sitsmesh:probe", Algorithm.FIXED_WINDOW, 1, 1, 0)],
                                 time.time())

    async def stop(self) -> None:
        await self._background.stop()
        if self._metrics is not None:
            self._metrics.flush()
        if self.store is not None:
            await self.store.close()

_log = logs.get("sitsmesh.app")


def _counter_store(settings: Settings, registry: CollectorRegistry | None,
                   board: StatusBoard) -> CounterStore:
    if settings.ratelimit_store == "memory":
        return MemoryStore(max_bytes=settings.ratelimit_store_bytes,
                           count_rejected=settings.ratelimit_count_rejected_hits)
    # Imported here: redis-py loads only where the shared store is configured.
    from sitsmesh.ratelimit.redis_store import RedisStore
    from sitsmesh.ratelimit.resilient import ResilientStore, StoreErrorPolicy

    up = store_up_gauge(registry)

    def on_health(healthy: bool) -> None:
        up.set(1 if healthy else 0)
        board.set(STORE_HEALTH, Serving.SERVING if healthy else Serving.NOT_SERVING)

    timeout = settings.redis_timeout_ms / 1000
    # The Redis store bounds each batch itself, so the wrapper adds no timer per call.
    redis = RedisStore.from_url(redis_url(settings), timeout_s=timeout,
                                count_rejected=settings.ratelimit_count_rejected_hits,
                                jitter_s=settings.ratelimit_expiration_jitter_seconds)
    store = ResilientStore(redis,
                           StoreErrorPolicy(settings.on_store_error), timeout_s=None,
                           replicas=settings.store_replicas, on_health=on_health,
                           count_rejected=settings.ratelimit_count_rejected_hits)
    if registry is not None:  # live counters; worker processes report store_up only
        registry.register(StoreCounters(store))
    return store


class PressureComponent:
    """Thresholds everywhere; the controller, its tick and the Triton scrape where the data
    plane runs (it needs the Check and access-log signals of that process)."""

    def __init__(self, settings: Settings, state: StateStore,
                 registry: CollectorRegistry | None, *, serve: bool) -> None:
        self._settings = settings
        self.thresholds = ThresholdLedger(state)
        self.runtime: PressureRuntime | None = None
        self.shared: SharedPressure | None = None
        self._background = Background()
        if serve:
            self.runtime = PressureRuntime(
                registry, scrape_interval_s=settings.pressure_scrape_seconds,
                stale_after_s=settings.pressure_stale_seconds,
                shared=settings.shared_runtime == "redis")
            # RLQS sheds in Envoy: Check still counts arrivals and holds for the controller.
            self.runtime.gate.enforce = settings.admission != "rlqs"
            self.thresholds.on_change(self.runtime.set_thresholds)
            self.runtime.scraping = any(e.metrics_url for e in settings.triton_endpoints)

    @property
    def gate(self) -> PressureGate | None:
        return self.runtime.gate if self.runtime is not None else None

    def services(self, streams: OpenStreams) -> list[DataService]:
        """Envoy's stats sink, where the controller runs: each stage's queue as Envoy
        sees it."""
        if self.runtime is None:
            return []
        servicer = MetricsServicer(self.shared.envoy if self.shared is not None
                                   else self.runtime.on_envoy, streams)
        return [DataService(METRICS_SERVICE, lambda server: add_metrics(servicer, server))]

    def attach(self, chains: ChainsComponent) -> None:
        """The controller learns pipelines from the catalog and hops from the assembler."""
        if self.runtime is None:
            return
        chains.pipelines.on_change(self.runtime.set_pipelines)
        if chains.assembler is not None:  # shared: the chains this replica owns
            chains.assembler.on_hop = self.runtime.on_hop
        if chains.bus is not None:  # every replica's stage work and reports
            self.shared = SharedPressure(self.runtime, chains.bus, chains.bus.client,
                                         Lease(chains.bus.client, "pressure"))

    async def start(self) -> None:
        await self.thresholds.refresh()
        self._background.spawn(self.thresholds.watch(self._settings.reload_interval_seconds))
        if self.shared is not None:
            self._background.spawn(self.shared.run())
            self._background.spawn(self.shared.lease.run())
        elif self.runtime is not None:
            self._background.spawn(self.runtime.run())
        if self.runtime is not None:
            urls = [e.metrics_url for e in self._settings.triton_endpoints if e.metrics_url]
            if urls:
                self._background.spawn(self.runtime.scrape(urls))
            if self._settings.triton_endpoints:
                self._background.spawn(learn_instances(self.runtime,
                                                       self._settings.triton_endpoints))

    async def stop(self) -> None:
        await self._background.stop()


class AuthzComponent:
    """Tenants and keys for every process; the Check service where the data plane runs."""

    def __init__(self, settings: Settings, state: StateStore, *, serve: bool,
                 gate: PressureGate | None = None, telemetry: Telemetry | None = None) -> None:
        self._settings = settings
        self._telemetry = telemetry
        self.directory = TenantDirectory(state)
        self.authorizer: Authorizer | None = None
        self.budgets: BudgetGate | None = None  # token budgets (app/tokenbudgets.py)
        self.shared: SharedAdmission | None = None
        self._background = Background()
        if serve:
            admission = Admission(AdmissionPolicy(), hold_s=settings.admission_hold_seconds,
                                  gate=gate)
            authorizer = Authorizer(AuthzSnapshot(), AuthzSettings(
                api_key_headers=settings.authz_api_key_headers,
                peer_tenants=dict(settings.authz_peer_tenants),
                jwt_header=settings.authz_jwt_header,
                jwt_tenant_claim=settings.authz_jwt_tenant_claim,
                priority_header=settings.authz_priority_header,
                jwt_trusted_principals=frozenset(settings.authz_jwt_trusted_principals),
                trust_pipeline_hint=settings.authz_trust_pipeline_hint,
                open_paths=frozenset(settings.authz_open_paths),
                per_message_paths=frozenset(settings.stream_check_methods),
                jwt_metadata_key=settings.authz_jwt_metadata_key,
                methods=dict(settings.authz_methods),
                gie=GieSettings(settings.gie_headers, settings.gie_objective_header,
                                settings.gie_fairness_header, settings.gie_objective_label,
                                dict(settings.gie_priority_objectives))), admission)

            def swap(snapshot: AuthzSnapshot, policy: AdmissionPolicy) -> None:
                authorizer.snapshot = snapshot
                admission.policy = policy

            self.directory.on_change(swap)
            self.authorizer = authorizer

    def release(self, request_id: str, ended_wall: float | None) -> bool:
        """End a request's admission hold: its access-log entry arrived, saying when it
        ended (wall clock)."""
        if self.authorizer is None:
            return False
        return self.authorizer.admission.release(request_id, ended_wall)

    def services(self) -> list[DataService]:
        if self.authorizer is None:
            return []
        servicer = AuthorizationServicer(self.authorizer, CheckLimits(
            self._settings.max_check_message_bytes, self._settings.check_max_headers,
            self._settings.check_max_header_bytes), self._telemetry, self.budgets)
        return [DataService(AUTHZ_SERVICE, lambda server: add_authz(servicer, server))]

    async def start(self) -> None:
        await self.directory.refresh()
        self._background.spawn(self.directory.watch(self._settings.reload_interval_seconds))
        if self.authorizer is not None:
            self._background.every(HOUSEKEEPING_S, self.authorizer.admission.expire)
        if self.shared is not None:
            self._background.spawn(self.shared.run())

    def share(self, bus: PartitionedBus) -> None:
        """Count tenant caps over every process that reports on `bus`."""
        if self.authorizer is not None:
            self.shared = SharedAdmission(self.authorizer.admission, bus)

    async def stop(self) -> None:
        await self._background.stop()


class ChainsComponent:
    """Pipelines everywhere; access-log ingestion and chains where the data plane runs."""

    def __init__(self, settings: Settings, state: StateStore,
                 registry: CollectorRegistry | None, *, serve: bool,
                 release: Callable[[str, float | None], bool]) -> None:
        self._settings = settings
        self.pipelines = PipelineCatalog(state)
        self.assembler: Assembler | None = None
        self._release = release
        self._background = Background()
        self._metrics: ChainMetrics | None = None
        self.bus: PartitionedBus | None = None
        if serve:
            shared = settings.shared_runtime == "redis"  # slots on the wall clock, aligned
            metrics = self._metrics = ChainMetrics(registry)
            assembler = Assembler({}, on_chain=metrics.observe, on_evict=metrics.evicted,
                                  ttl_s=settings.chain_ttl_seconds,
                                  max_bytes=settings.chain_max_bytes,
                                  clock=time.time if shared else time.monotonic)
            self.pipelines.on_change(assembler.set_pipelines)
            self.assembler = assembler
            if shared:
                self.bus = PartitionedBus.for_assembler(
                    redis_url(settings), assembler, release, registry,
                    quiet_s=settings.admission_hold_seconds)

    @property
    def report(self) -> Callable[[Hop], None] | None:
        """Where stage reports go: the shared bus, or this process's assembler."""
        sink = self.bus or self.assembler
        return sink.add if sink is not None else None

    def services(self, streams: OpenStreams,
                 tokens: Callable[[Any, Any], None] | None = None) -> list[DataService]:
        """`tokens`: where entries that carry Envoy-timed token streams go."""
        if self.assembler is None:
            return []
        sink: HopSink = self.bus if self.bus is not None else self.assembler
        release = self.bus.release if self.bus is not None else self._release
        servicer = AccessLogServicer(
            sink, release, max_request_id=self._settings.request_id_max_length,
            on_drop=self._metrics.dropped if self._metrics is not None else None,
            pace=self.bus.room if self.bus is not None else None, streams=streams,
            tokens=tokens)
        return [DataService(ACCESSLOG_SERVICE, lambda server: (
            als_pb2_grpc.add_AccessLogServiceServicer_to_server(servicer, server)))]

    async def start(self) -> None:
        await self.pipelines.refresh()
        self._background.spawn(self.pipelines.watch(self._settings.reload_interval_seconds))
        if self.assembler is not None:
            self._background.every(HOUSEKEEPING_S, self.assembler.expire)
        if self.bus is not None:
            self._background.spawn(self.bus.run())

    async def stop(self) -> None:
        await self._background.stop()


class SwapsComponent:
    """Model hot swaps against the configured Triton endpoints (admin process only)."""

    def __init__(self, settings: Settings, state: StateStore,
                 registry: CollectorRegistry | None,
                 pressure: PressureRuntime | None = None,
                 leads: Callable[[], bool] | None = None) -> None:
        # Imported here: tritonclient and numpy load only where swaps are wired.
        from sitsmesh.triton.client import TritonServer

        self.manager = SwapManager(settings.triton_endpoints, SwapHistory(state),
                                   TritonServer, registry,
                                   pressure=pressure.model_pressure if pressure else None)
        self.batching = BatchingService(self.manager, state, pressure)
        self._pressure = pressure
        # With replicas, only the one leading the controller re-tunes automatically: each
        # sees the same rates and would otherwise start the same change.
        self._leads = leads or (lambda: True)
        self._background = Background()

    def services(self) -> list[DataService]:
        return []

    async def start(self) -> None:
        await self.manager.start()
        pressure = self._pressure
        if pressure is not None:
            # Automatic batching: a look a second at the pipelines that opted in.
            self._background.spawn(self._auto(pressure))

    async def _auto(self, pressure: PressureRuntime) -> None:
        while True:
            await asyncio.sleep(AUTO_EVERY_S)
            if not self._leads():
                continue
            try:
                await self.batching.auto_step(pressure.triton_models())
            except Exception as exc:
                _log.warning("automatic batching look failed", error=str(exc))

    async def stop(self) -> None:
        await self._background.stop()
        await self.manager.stop()
