"""Process lifecycle of `sitsmesh serve`: start the listeners, serve, drain, stop.

Roles: a single process hosts data plane, admin and metrics; with --workers N
a supervisor hosts admin and metrics and N workers host the data plane. What
each role holds is built by `compose`; this module only runs it.
Shutdown order on SIGTERM/SIGINT: health NOT_SERVING, drain window, stop(grace).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from typing import Any

from grpc import aio
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from sitsmesh import __version__, logs
from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.app import admincreds, admintoken, budgets, compose, stopbound, tls
from sitsmesh.app.components import RateLimitComponent
from sitsmesh.app.dataserver import (
    HEALTH_NAME,
    HTTP2_WINDOWS,
    bind,
    drain_and_stop,
    gated,
    health_listener,
    host_of,
    reload_on_hup,
    start_data,
    stop_event,
)
from sitsmesh.app.metrics import (
    MULTIPROC_ENV,
    BudgetMetrics,
    LiveCollectors,
    RpcMetrics,
    ServingStates,
    admin_auth_failures,
    new_registry,
)
from sitsmesh.app.quotaproc import QuotaProcess
from sitsmesh.app.workers import WorkerPool
from sitsmesh.chains.metrics import StageSlas
from sitsmesh.config import Settings, describe
from sitsmesh.errors import StartupError
from sitsmesh.ratelimit import refnames
from sitsmesh.state.open import open_store
from sitsmesh.status import Serving, StatusBoard
from sitsmesh.transport.admin import AdminServicer
from sitsmesh.transport.admin.config import SERVICE_NAME as CONFIG_NAME
from sitsmesh.transport.admin.config import ConfigServicer
from sitsmesh.transport.adminaccess import AdminAccess
from sitsmesh.transport.auth import CallerGate
from sitsmesh.transport.budget import MIB, ByteBudget, tune_allocator
from sitsmesh.transport.budgetwrap import BudgetedRegistrar
from sitsmesh.transport.rlqs import SERVICE_NAME as RLQS_SERVICE

_log = logs.get("sitsmesh.server")
QUOTA_START_S = 30.0
ADMIN_NAME = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name


# gRPC's own default, named because the hostile tests send the largest admin message
# the port takes: a whole envoyproxy/ratelimit config file travels in one request
# (several MB for large ones), documents in the other kinds up to MAX_YAML_BYTES.
ADMIN_MESSAGE_BYTES = 4 * MIB


async def _start_admin(settings: Settings, board: StatusBoard, *, metrics: RpcMetrics,
                       servicer: AdminServicer, config: ConfigServicer,
                       access: AdminAccess, budget: ByteBudget) -> tuple[aio.Server, str]:
    server = aio.server(
        interceptors=[metrics.interceptor()],
        options=[("grpc.so_reuseport", 0), *HTTP2_WINDOWS,
                 ("grpc.max_receive_message_length", ADMIN_MESSAGE_BYTES)],
    )
    registrar: Any = server
    if settings.admin_clients:  # mTLS identities allowed to call, on top of the token
        registrar = CallerGate({ADMIN_NAME: settings.admin_clients,
                                CONFIG_NAME: settings.admin_clients}).registrar(server)
    # Admin requests draw on the data plane's budget too: a refused 4 MiB write is
    # bytes held all the same. Its large YAML is parsed off the loop, so it is not
    # paced for the loop's time as the data plane's large messages are.
    registrar = BudgetedRegistrar(registrar, budget, loop_share=False)
    # Each RPC is authenticated and authorized inside its handler: the check needs the
    # request, which an interceptor never sees.
    access.add_to_server(servicer, registrar)
    config.add_to_server(registrar)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    board.add_listener(health_listener(health, "admin"))
    reflection.enable_server_reflection(
        [ADMIN_NAME, CONFIG_NAME, HEALTH_NAME, reflection.SERVICE_NAME], server)
    board.register(ADMIN_NAME, "admin")
    bound = bind(server, "admin_addr", settings.admin_addr, "admin", settings)
    await server.start()
    return server, bound


def worker_main(settings: Settings, index: int, ready: Any) -> None:
    """A worker process's entry (the pool spawns it); `ready` is set once it serves."""
    logs.configure(settings.log_level, settings.log_format)
    tune_allocator()
    raise SystemExit(asyncio.run(run_worker(settings, index, ready.set)))


async def run_worker(settings: Settings, index: int,
                     on_ready: Callable[[], None] = lambda: None) -> int:
    """A data-plane worker: the data server only, sharing the port with its siblings."""
    structlog_ctx = {"worker": index, "pid": os.getpid()}
    board = StatusBoard()
    # Reads the configs the supervisor's admin API persists (SQLite: WAL lets both open it).
    state = await open_store(settings.state_url, settings.state_dir)
    # Values go to the multiprocess files the supervisor's /metrics aggregates.
    graph = compose.build(settings, state, None, board, compose.Role.WORKER)
    stop = stop_event(reload_on_hup(graph.ratelimit))
    await graph.start()
    budget = budgets.budget(settings)
    services = budgets.budgeted(settings, budget, graph.data_services())
    server, data = await start_data(settings, board, RpcMetrics(None), reuseport=True,
                                     services=gated(settings, services, None))
    board.set_all(Serving.SERVING)
    await graph.ratelimit.probe()
    on_ready()
    _log.info("worker serving", data_addr=data, **structlog_ctx)
    await stop.wait()
    stopbound.arm(settings)
    await drain_and_stop(settings, board, [server], graph.streams)
    await budget.lag.stop()
    await graph.stop()
    await state.close()
    await stopbound.end_leftovers()
    _log.info("worker stopped", **structlog_ctx)
    return 0


def _start_metrics(settings: Settings, registry: CollectorRegistry) -> tuple[Any, str]:
    try:
        httpd, _ = start_http_server(settings.metrics_addr.port, settings.metrics_addr.host,
                                     refnames.exposed(registry, settings.ratelimit_metric_names))
    except OSError as exc:
        raise StartupError(f"metrics_addr {settings.metrics_addr}: cannot bind: "
                           f"{exc.strerror or exc}") from None
    return httpd, f"{host_of(str(settings.metrics_addr))}:{httpd.server_port}"


def _start_pool(settings: Settings, board: StatusBoard) -> WorkerPool:
    if settings.ratelimit_store == "memory":
        _log.warning("memory counter store counts in each worker: every limit applies "
                     "per worker; use --ratelimit-store redis to share counts",
                     workers=settings.workers)
    def on_workers(all_alive: bool) -> None:
        board.set_all(Serving.SERVING if all_alive else Serving.NOT_SERVING, "data")

    pool = WorkerPool(settings, on_workers, worker_main)
    board.workers = pool.snapshot
    pool.start()
    return pool


async def _start_children(settings: Settings, board: StatusBoard, graph: compose.Graph,
                          role: compose.Role, *, pools: list[WorkerPool | QuotaProcess],
                          bound: dict[str, str]) -> None:
    """The worker processes and the RLQS process, as configured, added to `pools`."""
    if settings.workers > 1:
        pools.append(_start_pool(settings, board))
    if settings.rlqs_addr is not None:
        try:
            pools.append(await _start_quota(settings, board, graph, role))
        except StartupError:
            for running in pools:
                running.terminate()
                await running.wait(settings.grace_seconds)
            raise
        bound["rlqs"] = str(settings.rlqs_addr)


async def _start_quota(settings: Settings, board: StatusBoard, graph: compose.Graph,
                       role: compose.Role) -> QuotaProcess:
    """The RLQS process, fed the decisions of this process's controller (none in a
    supervisor without shared runtime: its workers run no controller either). A single
    process sends what its own gate applies, as RLQS served in it would read (with
    replicas, its share); a supervisor serves no traffic, so it has no share of its own:
    the decision as made."""
    runtime = graph.pressure.runtime if graph.pressure is not None else None
    # sitsmesh_serving{server="rlqs"}: 0 while the process is down and being restarted.
    board.register(RLQS_SERVICE, "rlqs")

    def on_change(alive: bool) -> None:
        board.set(RLQS_SERVICE, Serving.SERVING if alive else Serving.NOT_SERVING)

    if runtime is not None and role is compose.Role.SINGLE:
        gate = runtime.gate
        quota = QuotaProcess(settings, lambda _made: gate.snapshot, on_change)
    else:
        quota = QuotaProcess(settings, on_change=on_change)
    quota.start(runtime.watch() if runtime is not None else None)
    if not await quota.ready(QUOTA_START_S):
        quota.terminate()
        await quota.wait(settings.grace_seconds)
        raise StartupError(f"rlqs_addr {settings.rlqs_addr}: the RLQS process did not "
                           f"start serving within {QUOTA_START_S:.0f} s (see its log above)")
    return quota


def _reload_everywhere(component: RateLimitComponent, pools: list[WorkerPool | QuotaProcess],
                       also: Callable[[], None]) -> Callable[[], None]:
    reload_here = reload_on_hup(component)

    def on_hup() -> None:
        reload_here()
        also()
        for running in pools:  # each worker reloads its own snapshot
            running.signal(signal.SIGHUP)

    return on_hup


async def _close(servers: list[aio.Server], httpd: Any, budget: ByteBudget) -> None:
    for server in servers:
        await server.stop(0)
    await budget.lag.stop()
    if httpd is not None:
        httpd.shutdown()
        httpd.server_close()


def _admin_token(settings: Settings) -> str:
    token, created = admintoken.load_or_create(settings.token_path, os.environ)
    if created:
        _log.info("admin token created", path=str(settings.token_path))
    tls.warn_weak_secrets(settings, token)
    return token


def _registries() -> tuple[CollectorRegistry, CollectorRegistry]:
    """(registry to serve, registry the components register with). In multiprocess mode
    the collector reads every process's files, this one's too: components then register
    only their live collectors (see LiveCollectors)."""
    registry = new_registry()
    return registry, LiveCollectors(registry) if os.environ.get(MULTIPROC_ENV) else registry


def _register_state_metrics(registry: CollectorRegistry, board: StatusBoard,
                            graph: compose.Graph, budget: ByteBudget) -> None:
    """Read at scrape time from this process's state, so registered where /metrics serves
    (the supervisor's registry with workers)."""
    registry.register(ServingStates(board))
    registry.register(BudgetMetrics(budget))
    registry.register(StageSlas(lambda: graph.chains.pipelines.pipelines))


async def run(settings: Settings) -> int:
    """Run until SIGTERM/SIGINT; return the exit code. Preflight has already passed."""
    board = StatusBoard()
    registry, metric_registry = _registries()
    rpc_metrics = RpcMetrics(metric_registry)
    auth_failures = admin_auth_failures(metric_registry)

    store = await open_store(settings.state_url, settings.state_dir)
    access = admincreds.build(settings, store, lambda: _admin_token(settings),
                              on_reject=auth_failures.inc)
    credentials_watch = admincreds.Watch(settings, access)
    role = compose.Role.SINGLE if settings.workers == 1 else compose.Role.SUPERVISOR
    graph = compose.build(settings, store, metric_registry, board, role)
    _register_state_metrics(registry, board, graph, budget := budgets.budget(settings))
    pools: list[WorkerPool | QuotaProcess] = []
    stop = stop_event(_reload_everywhere(graph.ratelimit, pools,
                                          lambda: admincreds.reload(settings, access)))

    servers: list[aio.Server] = []
    bound: dict[str, str] = {}
    httpd = None
    try:
        await graph.start()
        credentials_watch.start()
        await compose.check_workers(graph, settings)
        if role is compose.Role.SINGLE:
            data_server, bound["data"] = await start_data(
                settings, board, rpc_metrics, reuseport=False,
                services=gated(settings, budgets.budgeted(settings, budget, graph.data_services()),
                                metric_registry))
            servers.append(data_server)
        else:
            bound["data"] = str(settings.data_addr)
            board.register("", "data")
        admin_server, bound["admin"] = await _start_admin(
            settings, board, metrics=rpc_metrics,
            servicer=compose.admin_servicer(graph, settings, board, store, bound),
            config=compose.config_servicer(graph, settings, store, access),
            access=access, budget=budget)
        servers.append(admin_server)
        httpd, bound["metrics"] = _start_metrics(settings, registry)
        await _start_children(settings, board, graph, role, pools=pools, bound=bound)
        board.set_all(Serving.SERVING)
        await graph.ratelimit.probe()
        _log.info("serving", version=__version__, pid=os.getpid(), bound=bound,
                  workers=settings.workers, config_version=settings.config_version,
                  settings=describe(settings))
        await stop.wait()
        stopbound.arm(settings, children=bool(pools))
        for running in pools:
            running.terminate()
        await drain_and_stop(settings, board, servers, graph.streams)
        clean = True
        for running in pools:
            clean = await running.wait(settings.drain_seconds + settings.grace_seconds + 5) \
                and clean
    finally:
        await _close(servers, httpd, budget)
        await credentials_watch.stop()
        await graph.stop()
        await store.close()
    await stopbound.end_leftovers()
    _log.info("stopped", clean=clean)
    return 0 if clean else 1
