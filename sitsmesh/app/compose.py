"""The composition root: the one place that builds the object graph from settings.

Three roles share it. A single process (`--workers 1`) serves everything. With
workers, the supervisor keeps configs and answers the admin API while each worker
serves the data plane; the backpressure controller and swaps run only where the
Check and access-log signals of one process meet, so workers run neither. With
rlqs_addr a fourth process serves RLQS alone (build_quota).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from sitsmesh import workerguard
from sitsmesh.app.background import DataService
from sitsmesh.app.components import (
    AuthzComponent,
    ChainsComponent,
    PressureComponent,
    RateLimitComponent,
    SwapsComponent,
)
from sitsmesh.app.quota import QuotaComponent
from sitsmesh.app.streamchecks import StreamChecksComponent
from sitsmesh.app.telemetry import TelemetryComponent
from sitsmesh.app.tokenbudgets import TokenBudgetsComponent
from sitsmesh.app.tokens import TokensComponent
from sitsmesh.config import Settings
from sitsmesh.errors import StartupError
from sitsmesh.pressure.gate import PressureGate
from sitsmesh.pressure.signals import Signals
from sitsmesh.state import StateStore
from sitsmesh.status import StatusBoard
from sitsmesh.transport.admin import AdminServicer
from sitsmesh.transport.admin.batching import BatchingAdmin
from sitsmesh.transport.admin.chains import ChainAdmin
from sitsmesh.transport.admin.config import ConfigServicer
from sitsmesh.transport.admin.paging import PageTokens
from sitsmesh.transport.admin.pressure import PressureAdmin
from sitsmesh.transport.admin.ratelimit import RateLimitAdmin
from sitsmesh.transport.admin.status import StatusAdmin
from sitsmesh.transport.admin.swaps import SwapAdmin
from sitsmesh.transport.admin.tenants import TenantAdmin
from sitsmesh.transport.adminaccess import AdminAccess
from sitsmesh.transport.streams import OpenStreams

if TYPE_CHECKING:
    from sitsmesh.telemetry.tracing import Tracing


class Role(enum.Enum):
    SINGLE = "single"
    SUPERVISOR = "supervisor"
    WORKER = "worker"


@dataclass(frozen=True, slots=True)
class Graph:
    """Every component of one process, in start order (stopped in the same order)."""

    ratelimit: RateLimitComponent
    authz: AuthzComponent
    chains: ChainsComponent
    pressure: PressureComponent | None
    swaps: SwapsComponent | None
    quota: QuotaComponent
    telemetry: TelemetryComponent
    tokens: TokensComponent
    checks: StreamChecksComponent
    budgets: TokenBudgetsComponent
    # Envoy's access-log and stats streams, ended when the drain window closes.
    streams: OpenStreams = field(default_factory=OpenStreams)
    # OpenTelemetry, when otlp_endpoint is set: flushed after every part has stopped.
    tracing: Tracing | None = None

    @property
    def parts(self) -> tuple[RateLimitComponent | AuthzComponent | ChainsComponent
                             | PressureComponent | SwapsComponent | QuotaComponent
                             | TokensComponent | StreamChecksComponent
                             | TokenBudgetsComponent | TelemetryComponent, ...]:
        # Telemetry last: its final flush follows every decision.
        return tuple(p for p in (self.ratelimit, self.authz, self.chains, self.pressure,
                                 self.swaps, self.quota, self.tokens, self.checks,
                                 self.budgets, self.telemetry)
                     if p is not None)

    def data_services(self) -> list[DataService]:
        """The Envoy-facing services this process serves (none in a supervisor)."""
        pressure = self.pressure.services(self.streams) if self.pressure is not None else []
        return [*self.authz.services(), *self.ratelimit.services(),
                *self.chains.services(self.streams, self.tokens.timed_in_envoy), *pressure,
                *self.quota.services(self.streams),
                *self.tokens.services(self.streams, self.checks.servicer)]

    async def start(self) -> None:
        for part in self.parts:
            await part.start()

    async def stop(self) -> None:
        for part in self.parts:
            await part.stop()
        if self.tracing is not None:
            await self.tracing.shutdown()


def build(settings: Settings, store: StateStore, registry: CollectorRegistry | None,
          board: StatusBoard, role: Role) -> Graph:
    """`registry` None: metric values go only to the multiprocess files (workers)."""
    serve = role is not Role.SUPERVISOR
    # With shared runtime state every process sees every request's signals, so workers
    # run a gate and the supervisor follows the controller and chains for the admin API.
    shared = settings.shared_runtime == "redis"
    pressure = (PressureComponent(settings, store, registry, serve=serve or shared)
                if role is not Role.WORKER or shared else None)
    gate = pressure.gate if pressure is not None and serve else None
    def pipeline_of(model: str, tenant: str) -> str:
        # The pipeline the request entered: only one that governs its tenant.
        return gate.pipeline_of("", model, tenant) if gate is not None else ""

    telemetry = TelemetryComponent(settings, registry, serve=serve, pipeline_of=pipeline_of)
    ratelimit = RateLimitComponent(settings, store, registry, board, serve=serve, gate=gate,
                                   telemetry=telemetry.telemetry)
    authz = AuthzComponent(settings, store, serve=serve, gate=gate,
                           telemetry=telemetry.telemetry)
    # An access-log entry marks the end of its request: it frees the admission hold.
    chains = ChainsComponent(settings, store, registry, serve=serve or shared,
                             release=authz.release)
    if chains.bus is not None:
        authz.share(chains.bus)
    swaps = None
    if pressure is not None:
        pressure.attach(chains)
    if pressure is not None and role is not Role.WORKER:
        coordinated = pressure.shared
        swaps = SwapsComponent(settings, store, registry, pressure.runtime,
                               leads=(lambda: coordinated.lease.leading) if coordinated else None)
    quota = QuotaComponent(settings, ratelimit, gate, serve=serve, registry=registry)
    quota.attach(chains)
    tracing = tracing_for(settings, role)
    if tracing is not None:
        tracing.pipeline_of = pipeline_of
        if telemetry.telemetry is not None:  # where Check and ShouldRateLimit are served
            telemetry.telemetry.tracer = tracing
        # Swaps and the controller's decisions live where the admin API does.
        if swaps is not None and role is not Role.WORKER:
            swaps.manager.on_end = tracing.swap
        if pressure is not None and pressure.runtime is not None and role is not Role.WORKER:
            pressure.runtime.on_decisions = tracing.decisions
    tokens = TokensComponent(registry, serve=serve)
    tokens.attach(chains)
    if tracing is not None and tokens.joined is not None:
        tokens.joined.listen(tracing.token_streams)
    # Token budgets: Check reserves, each finished stream settles (before the services
    # are built from authz and tokens).
    budgets = TokenBudgetsComponent(settings, authz, tokens, registry, serve=serve,
                                    telemetry=telemetry.telemetry)
    return Graph(ratelimit, authz, chains, pressure, swaps, quota, telemetry, tokens,
                 StreamChecksComponent(settings, authz, registry), budgets, tracing=tracing)


@dataclass(frozen=True, slots=True)
class QuotaGraph:
    """The RLQS process's parts (rlqs_addr): the rate-limit config and the pipelines
    followed in the state store, as workers follow them; the controller's decisions,
    which live in the data process, set on `gate` as they arrive (app/quotaproc.py)."""

    ratelimit: RateLimitComponent
    chains: ChainsComponent
    quota: QuotaComponent
    gate: PressureGate
    streams: OpenStreams = field(default_factory=OpenStreams)

    def data_services(self) -> list[DataService]:
        return self.quota.services(self.streams)

    async def start(self) -> None:
        for part in (self.ratelimit, self.chains, self.quota):
            await part.start()

    async def stop(self) -> None:
        for part in (self.ratelimit, self.chains, self.quota):
            await part.stop()


def build_quota(settings: Settings, store: StateStore, board: StatusBoard) -> QuotaGraph:
    ratelimit = RateLimitComponent(settings, store, None, board, serve=False)
    chains = ChainsComponent(settings, store, None, serve=False,
                             release=lambda _request, _at: False)
    gate = PressureGate(Signals())
    chains.pipelines.on_change(gate.set_pipelines)  # before the quota's: it reads the gate
    quota = QuotaComponent(settings, ratelimit, gate, serve=True, own_process=True)
    quota.attach(chains)
    return QuotaGraph(ratelimit, chains, quota, gate)


def tracing_for(settings: Settings, role: Role) -> Tracing | None:
    if not settings.otlp_endpoint:
        return None  # tracing off: the SDK is not even imported
    try:
        from sitsmesh.telemetry import tracing
    except ImportError as exc:
        # xds-protos ships an old copy of opentelemetry/proto; installed after
        # opentelemetry-proto, it replaces modules the OTLP exporter needs.
        raise StartupError(
            f"otlp_endpoint: OpenTelemetry's OTLP exporter does not load ({exc}); if "
            "xds-protos overwrote opentelemetry-proto's modules, reinstall it last: pip "
            "install --force-reinstall --no-deps opentelemetry-proto") from None
    return tracing.build(settings, role.value)


async def check_workers(graph: Graph, settings: Settings) -> None:
    """Refuse to start workers over state that needs one process (see workerguard)."""
    tenants = await graph.authz.directory.list_tenants()
    workerguard.check_budgets(settings.workers, settings.ratelimit_store == "memory",
                              graph.authz.directory.budgets)
    if settings.shared_runtime == "redis":
        return  # every worker sees every request's Check and end through the hop bus
    workerguard.check_state(settings.workers, graph.chains.pipelines.pipelines,
                            [(t.name, t.max_concurrency) for t in tenants])


def admin_servicer(graph: Graph, settings: Settings, board: StatusBoard, store: StateStore,
                   bound: Mapping[str, str]) -> AdminServicer:
    """The Admin API over this process's graph (a supervisor's or a single process's)."""
    if graph.pressure is None or graph.swaps is None:
        raise ValueError("the admin API is served where pressure and swaps are composed")
    # Shared runtime state lifts what --workers N otherwise refuses (see workerguard).
    workers = 1 if settings.shared_runtime == "redis" else settings.workers
    tokens = PageTokens(store)
    return AdminServicer(
        StatusAdmin(board, store, config_version=settings.config_version, bound=bound),
        RateLimitAdmin(graph.ratelimit.config),
        TenantAdmin(graph.authz.directory, tokens, workers=workers,
                    ledger=graph.budgets.admin_ledger),
        ChainAdmin(graph.chains.pipelines, graph.chains.assembler, tokens, workers=workers,
                   report=graph.chains.report, streams=graph.tokens.windows,
                   reported=graph.tokens.reported, joined=graph.tokens.joined),
        SwapAdmin(graph.swaps.manager, tokens),
        BatchingAdmin(graph.swaps.batching, tokens, pipelines=graph.chains.pipelines),
        PressureAdmin(graph.pressure.thresholds, graph.pressure.runtime, tokens),
    )


def config_servicer(graph: Graph, settings: Settings, store: StateStore,
                    access: AdminAccess) -> ConfigServicer:
    """The declarative ConfigService over the same views the Admin RPCs write through,
    each call checked against the same credentials."""
    if graph.pressure is None:
        raise ValueError("the admin API is served where pressure and swaps are composed")
    workers = 1 if settings.shared_runtime == "redis" else settings.workers
    return ConfigServicer(store, graph.authz.directory, graph.chains.pipelines,
                          graph.pressure.thresholds, graph.ratelimit.config, access=access,
                          workers=workers,
                          budget_workers=settings.workers
                          if settings.ratelimit_store == "memory" else 1)
