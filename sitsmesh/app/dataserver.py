"""The data-plane gRPC server every serving process runs (a single process, a worker,
the RLQS process): its bounds, caller gate, health, TLS binding, and its drain."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from collections.abc import Callable, Sequence
from typing import Any

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from sitsmesh import logs
from sitsmesh.app import tls
from sitsmesh.app.background import DataService
from sitsmesh.app.components import RateLimitComponent
from sitsmesh.app.metrics import RpcMetrics
from sitsmesh.config import Address, Settings
from sitsmesh.errors import StartupError
from sitsmesh.status import ServiceState, Serving, StatusBoard
from sitsmesh.transport.accesslog import SERVICE_NAME as ACCESSLOG_SERVICE
from sitsmesh.transport.auth import CallerGate
from sitsmesh.transport.authz import SERVICE_NAME as AUTHZ_SERVICE
from sitsmesh.transport.extproc import SERVICE_NAME as EXTPROC_SERVICE
from sitsmesh.transport.metrics import SERVICE_NAME as METRICS_SERVICE
from sitsmesh.transport.ratelimit import SERVICE_NAME as RATELIMIT_SERVICE
from sitsmesh.transport.rlqs import SERVICE_NAME as RLQS_SERVICE
from sitsmesh.transport.streams import OpenStreams

_log = logs.get("sitsmesh.server")
HEALTH_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
_HEALTH = {Serving.SERVING: health_pb2.HealthCheckResponse.SERVING}


def health_listener(servicer: health_aio.HealthServicer, server: str) -> Any:
    def on_change(service: ServiceState) -> None:
        if service.server != server:
            return
        status = _HEALTH.get(service.state, health_pb2.HealthCheckResponse.NOT_SERVING)
        # set() is a coroutine in the aio servicer; it only notifies watchers.
        asyncio.get_running_loop().create_task(servicer.set(service.name, status))

    return on_change



def bind(server: aio.Server, name: str, addr: Address, side: str, settings: Settings) -> str:
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
    return f"{host_of(str(addr))}:{port}"


def host_of(addr: str) -> str:
    return addr.rpartition(":")[0]



# BDP probing grows HTTP/2 windows to megabytes on a fast link, and gRPC then reads
# ahead that much per stream: 50 streams of 3.7 MB held 329 MB with it, 183 MB
# without (measured, grpcio 1.85). Within a cluster 64 KiB windows lose nothing.
HTTP2_WINDOWS = (("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 64 << 10))



def server_options(settings: Settings, reuseport: bool) -> dict[str, Any]:
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
                        # Envoy pings each connection every second (the bootstrap's
                        # connection_keepalive) to notice a frozen sitsmesh; gRPC's
                        # default answers pings that often with GOAWAY.
                        ("grpc.http2.min_ping_interval_without_data_ms", 500),
                        ("grpc.keepalive_permit_without_calls", 1),
                        *HTTP2_WINDOWS],
            "maximum_concurrent_rpcs": settings.max_concurrent_rpcs}

def gated(settings: Settings, services: list[DataService],
           registry: CollectorRegistry | None) -> list[DataService]:
    """`services`, each answering only the callers `data_callers` names for it. The gate
    registers inside the metrics wrapper, so refusals show in the RPC series too."""
    if not settings.data_callers:
        return services
    names = {"authz": AUTHZ_SERVICE, "ratelimit": RATELIMIT_SERVICE,
             "accesslog": ACCESSLOG_SERVICE, "metrics": METRICS_SERVICE,
             "quota": RLQS_SERVICE, "tokens": EXTPROC_SERVICE}
    short = {full: key for key, full in names.items()}
    refused = tls.refused_calls(registry)
    gate = CallerGate({names[k]: ids for k, ids in settings.data_callers.items()},
                      on_refuse=lambda service: refused.labels(short[service]).inc())

    def add(service: DataService) -> Callable[[aio.Server], None]:
        def register(server: aio.Server) -> None:
            registrar: Any = gate.registrar(server)  # stands in for the server meanwhile
            service.add_to_server(registrar)

        return register

    return [dataclasses.replace(s, add_to_server=add(s)) for s in services]



async def start_data(settings: Settings, board: StatusBoard, metrics: RpcMetrics,
                     reuseport: bool, services: list[DataService], *,
                     listen: tuple[str, Address] | None = None) -> tuple[aio.Server, str]:
    """`listen` (setting name, address): where, if not data_addr (the RLQS process)."""
    server = aio.server(**server_options(settings, reuseport))
    # The hot path: handlers are instrumented as they register, not intercepted per call.
    registrar: Any = metrics.registrar(server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, registrar)
    board.add_listener(health_listener(health, "data"))
    for service in services:
        service.add_to_server(registrar)
    names: Sequence[str] = [s.name for s in services]
    # Reflection picks its async servicer by the server's type: give it the real one.
    reflection.enable_server_reflection([*names, HEALTH_NAME, reflection.SERVICE_NAME],
                                        server)
    board.register("", "data")
    for service in services:
        if service.health:
            board.register(service.name, "data")
    name, addr = listen or ("data_addr", settings.data_addr)
    bound = bind(server, name, addr, "data", settings)
    await server.start()
    return server, bound


def stop_event(on_hup: Callable[[], None] | None = None) -> asyncio.Event:
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


async def drain_and_stop(settings: Settings, board: StatusBoard,
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



def reload_on_hup(component: RateLimitComponent) -> Callable[[], None]:
    tasks: set[asyncio.Task[bool]] = set()

    def on_hup() -> None:
        task = asyncio.get_running_loop().create_task(component.config.reload("SIGHUP"))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    return on_hup


