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
from collections.abc import Callable, Sequence
from typing import Any

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from sitsmesh import __version__, logs
from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.app import admincreds, admintoken, budgets, compose, tls
from sitsmesh.app.background import DataService
from sitsmesh.app.components import RateLimitComponent
from sitsmesh.app.metrics import (
    MULTIPROC_ENV,
    BudgetMetrics,
    RpcMetrics,
    ServingStates,
    admin_auth_failures,
    new_registry,
)
from sitsmesh.app.workers import WorkerPool
from sitsmesh.chains.metrics import StageSlas
from sitsmesh.config import Address, Settings, describe
from sitsmesh.errors import StartupError
from sitsmesh.ratelimit import refnames
from sitsmesh.state.open import open_store
from sitsmesh.status import ServiceState, Serving, StatusBoard
from sitsmesh.transport.accesslog import SERVICE_NAME as ACCESSLOG_SERVICE
from sitsmesh.transport.admin import AdminServicer
from sitsmesh.transport.admin.config import SERVICE_NAME as CONFIG_NAME
from sitsmesh.transport.admin.config import ConfigServicer
from sitsmesh.transport.adminaccess import AdminAccess
from sitsmesh.transport.auth import CallerGate
from sitsmesh.transport.authz import SERVICE_NAME as AUTHZ_SERVICE
from sitsmesh.transport.budget import MIB, ByteBudget, tune_allocator
from sitsmesh.transport.budgetwrap import BudgetedRegistrar
from sitsmesh.transport.metrics import SERVICE_NAME as METRICS_SERVICE
from sitsmesh.transport.ratelimit import SERVICE_NAME as RATELIMIT_SERVICE
from sitsmesh.transport.rlqs import SERVICE_NAME as RLQS_SERVICE
from sitsmesh.transport.streams import OpenStreams

_log = logs.get("sitsmesh.server")
HEALTH_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
ADMIN_NAME = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name
_HEALTH = {Serving.SERVING: health_pb2.HealthCheckResponse.SERVING}


def _health_listener(servicer: health_aio.HealthServicer, server: str) -> Any:
    def on_change(service: ServiceState) -> None:
        if service.server != server:
            return
        status = _HEALTH.get(service.state, health_pb2.HealthCheckResponse.NOT_SERVING)
        # set() is a coroutine in the aio servicer; it only notifies watchers.
        asyncio.get_running_loop().create_task(servicer.set(service.name, status))

    return on_change


def _bind(server: aio.Server, name: str, addr: Address, side: str, settings: Settings) -> str:
    """Listen on `addr`, with TLS (mTLS with a client CA) when `side`'s files are set;
    return the bound address. TLS material follows rotated files (see tls.CertFiles)."""
    files = tls.cert_files(settings, side)
    try:
        if files is None:
            port = server.add_insecure_port(str(addr))
        else:
            port = server.add_secure_port(str(addr), files.credentials())
    except RuntimeError as exc:
        raise StartupError(f"{name} {addr}: cannot bind: {exc}") from None
    if addr.is_unix:
        return str(addr)
    if port == 0:
        raise StartupError(f"{name} {addr}: cannot bind")
    return f"{_host(str(addr))}:{port}"


def _host(addr: str) -> str:
    return addr.rpartition(":")[0]


# BDP probing grows HTTP/2 windows to megabytes on a fast link, and gRPC then reads
# ahead that much per stream: 50 streams of 3.7 MB held 329 MB with it, 183 MB
# without (measured, grpcio 1.85). Within a cluster 64 KiB windows lose nothing.
HTTP2_WINDOWS = (("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 64 << 10))


# gRPC's own default, named because the hostile tests send the largest admin message
# the port takes: a whole envoyproxy/ratelimit config file travels in one request
# (several MB for large ones), documents in the other kinds up to MAX_YAML_BYTES.
ADMIN_MESSAGE_BYTES = 4 * MIB


def _server_options(settings: Settings, reuseport: bool) -> dict[str, Any]:
    """The data server's bounds: gRPC refuses a bigger message before Python sees a byte
    of it (the per-service limits below this one are checked by each deserializer), and
    RPCs past the concurrency cap are refused with RESOURCE_EXHAUSTED, not queued."""
    largest = max(settings.max_message_bytes, settings.max_check_message_bytes,
                  settings.max_ratelimit_message_bytes)
    return {"options": [("grpc.so_reuseport", int(reuseport)),
                        ("grpc.max_receive_message_length", largest),
                        # gRPC takes a unary call's whole message before Python can refuse
                        # it, so what one connection makes the server hold is its open
                        # streams x the message limit: the hostile soak's RSS peaked at
                        # 517-524 MB (20 s) without this cap, 364 MB with 32. Envoy opens
                        # another connection when one is full.
                        ("grpc.max_concurrent_streams", settings.max_streams_per_connection),
                        *HTTP2_WINDOWS],
            "maximum_concurrent_rpcs": settings.max_concurrent_rpcs}
def _gated(settings: Settings, services: list[DataService],
           registry: CollectorRegistry | None) -> list[DataService]:
    """`services`, each answering only the callers `data_callers` names for it. The gate
    registers inside the metrics wrapper, so refusals show in the RPC series too."""
    if not settings.data_callers:
        return services
    names = {"authz": AUTHZ_SERVICE, "ratelimit": RATELIMIT_SERVICE,
             "accesslog": ACCESSLOG_SERVICE, "metrics": METRICS_SERVICE,
             "quota": RLQS_SERVICE}
    short = {full: key for key, full in names.items()}
    refused = tls.refused_calls(registry)
    gate = CallerGate({names[k]: ids for k, ids in settings.data_callers.items()},
                      on_refuse=lambda service: refused.labels(short[service]).inc())

    def add(service: DataService) -> Callable[[aio.Server], None]:
        def register(server: aio.Server) -> None:
            registrar: Any = gate.registrar(server)  # stands in for the server meanwhile
            service.add_to_server(registrar)

        return register

    return [DataService(s.name, add(s)) for s in services]


async def _start_data(settings: Settings, board: StatusBoard, metrics: RpcMetrics,
                      reuseport: bool, services: list[DataService]
                      ) -> tuple[aio.Server, str]:
    server = aio.server(**_server_options(settings, reuseport))
    # The hot path: handlers are instrumented as they register, not intercepted per call.
    registrar: Any = metrics.registrar(server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, registrar)
    board.add_listener(_health_listener(health, "data"))
    for service in services:
        service.add_to_server(registrar)
    names: Sequence[str] = [s.name for s in services]
    # Reflection picks its async servicer by the server's type: give it the real one.
    reflection.enable_server_reflection([*names, HEALTH_NAME, reflection.SERVICE_NAME],
                                        server)
    board.register("", "data")
    for name in names:
        board.register(name, "data")
    bound = _bind(server, "data_addr", settings.data_addr, "data", settings)
    await server.start()
    return server, bound


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
    board.add_listener(_health_listener(health, "admin"))
    reflection.enable_server_reflection(
        [ADMIN_NAME, CONFIG_NAME, HEALTH_NAME, reflection.SERVICE_NAME], server)
    board.register(ADMIN_NAME, "admin")
    bound = _bind(server, "admin_addr", settings.admin_addr, "admin", settings)
    await server.start()
    return server, bound


def _stop_event(on_hup: Callable[[], None] | None = None) -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if on_hup is not None:
        loop.add_signal_handler(signal.SIGHUP, on_hup)

    def on_signal(signame: str) -> None:
        if stop.is_set():
            _log.warning("already shutting down", signal=signame)
            return
        _log.info("shutdown requested", signal=signame)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)
    return stop


async def _drain_and_stop(settings: Settings, board: StatusBoard,
                          servers: list[aio.Server], streams: OpenStreams) -> None:
    board.set_all(Serving.DRAINING)
    _log.info("draining", drain_seconds=settings.drain_seconds)
    await asyncio.sleep(settings.drain_seconds)
    board.set_all(Serving.NOT_SERVING)
    # Envoy never ends these itself: left open they held stop() for the whole grace.
    ended = streams.end_all()
    if ended:
        _log.info("ended Envoy streams", streams=ended)
    await asyncio.gather(*(s.stop(settings.grace_seconds) for s in servers))


def _reload_on_hup(component: RateLimitComponent) -> Callable[[], None]:
    tasks: set[asyncio.Task[bool]] = set()

    def on_hup() -> None:
        task = asyncio.get_running_loop().create_task(component.config.reload("SIGHUP"))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    return on_hup


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
    stop = _stop_event(_reload_on_hup(graph.ratelimit))
    await graph.start()
    budget = budgets.budget(settings)
    services = budgets.budgeted(settings, budget, graph.data_services())
    server, data = await _start_data(settings, board, RpcMetrics(None), reuseport=True,
                                     services=_gated(settings, services, None))
    board.set_all(Serving.SERVING)
    await graph.ratelimit.probe()
    on_ready()
    _log.info("worker serving", data_addr=data, **structlog_ctx)
    await stop.wait()
    await _drain_and_stop(settings, board, [server], graph.streams)
    await budget.lag.stop()
    await graph.stop()
    await state.close()
    _log.info("worker stopped", **structlog_ctx)
    return 0


def _start_metrics(settings: Settings, registry: CollectorRegistry) -> tuple[Any, str]:
    try:
        httpd, _ = start_http_server(settings.metrics_addr.port, settings.metrics_addr.host,
                                     refnames.exposed(registry, settings.ratelimit_metric_names))
    except OSError as exc:
        raise StartupError(f"metrics_addr {settings.metrics_addr}: cannot bind: "
                           f"{exc.strerror or exc}") from None
    return httpd, f"{_host(str(settings.metrics_addr))}:{httpd.server_port}"


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


def _reload_everywhere(component: RateLimitComponent, pools: list[WorkerPool],
                       also: Callable[[], None]) -> Callable[[], None]:
    reload_here = _reload_on_hup(component)

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


def _registries() -> tuple[CollectorRegistry, CollectorRegistry | None]:
    """(registry to serve, registry for live metrics). In multiprocess mode the
    collector reads every process's files, this one's too, so registering live
    metrics as well would export each series twice."""
    registry = new_registry()
    return registry, None if os.environ.get(MULTIPROC_ENV) else registry


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
    pools: list[WorkerPool] = []
    stop = _stop_event(_reload_everywhere(graph.ratelimit, pools,
                                          lambda: admincreds.reload(settings, access)))

    servers: list[aio.Server] = []
    bound: dict[str, str] = {}
    pool: WorkerPool | None = None
    httpd = None
    try:
        await graph.start()
        credentials_watch.start()
        await compose.check_workers(graph, settings)
        if role is compose.Role.SINGLE:
            data_server, bound["data"] = await _start_data(
                settings, board, rpc_metrics, reuseport=False,
                services=_gated(settings, budgets.budgeted(settings, budget, graph.data_services()),
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
        if role is compose.Role.SUPERVISOR:
            pool = _start_pool(settings, board)
            pools.append(pool)
        board.set_all(Serving.SERVING)
        await graph.ratelimit.probe()
        _log.info("serving", version=__version__, pid=os.getpid(), bound=bound,
                  workers=settings.workers, config_version=settings.config_version,
                  settings=describe(settings))
        await stop.wait()
        if pool is not None:
            pool.terminate()
        await _drain_and_stop(settings, board, servers, graph.streams)
        clean = True
        if pool is not None:
            clean = await pool.wait(settings.drain_seconds + settings.grace_seconds + 5)
    finally:
        await _close(servers, httpd, budget)
        await credentials_watch.stop()
        await graph.stop()
        await store.close()
    _log.info("stopped", clean=clean)
    return 0 if clean else 1
