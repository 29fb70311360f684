"""`sitsmesh status` and `sitsmesh health`: how a running sitsmesh is doing."""

from __future__ import annotations

import argparse

from sitsmesh.admin.enums import word
from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.cli.common import (
    EXIT_FAILED,
    Subcommands,
    add_common_admin,
    add_output,
    add_tls_flags,
    admin_channel,
    call_admin,
    die,
    env_argument,
    examples,
    message_dict,
    render,
    table,
)


def add_commands(sub: Subcommands) -> None:
    status = sub.add_parser("status", help="show a running sitsmesh's status (admin API)",
                            **examples("sitsmesh status",
                                       "sitsmesh status --admin 10.0.0.7:50052 --token-file "
                                       "admin-token -o yaml"))
    add_common_admin(status)
    status.set_defaults(func=cmd_status)

    health = sub.add_parser("health", help="gRPC health check; exit 0 only when SERVING",
                            **examples("sitsmesh health",
                                       "SITSMESH_DATA_ADDR=10.0.0.7:50051 sitsmesh health",
                                       "sitsmesh health --service envoy.service.auth.v3."
                                       "Authorization"))
    env_argument(health, "--addr", default="127.0.0.1:50051", metavar="HOST:PORT",
                 env="SITSMESH_DATA_ADDR", help="data-plane address (default 127.0.0.1:50051)")
    health.add_argument("--service", default="", help="service name ('' = whole server)")
    env_argument(health, "--timeout", type=float, default=3.0, env="SITSMESH_TIMEOUT",
                 help="seconds (default 3)")
    add_tls_flags(health, "data plane")
    add_output(health)
    health.set_defaults(func=cmd_health)


def cmd_status(args: argparse.Namespace) -> int:
    reply = call_admin(args, "GetStatus", admin_pb2.GetStatusRequest())
    render(args, message_dict(reply, all_fields=True), lambda: _status_text(reply),
           sort_keys=True)
    return 0


def _status_text(reply: admin_pb2.GetStatusResponse) -> str:
    lines = [f"sitsmesh {reply.version}   uptime {reply.uptime_seconds:.1f}s   "
             f"config {reply.config_version}   state revision {reply.state_revision}",
             f"data {reply.data_addr}   admin {reply.admin_addr}   metrics {reply.metrics_addr}",
             "", table([("SERVICE", "SERVER", "STATE"),
                        *((s.name or "(server)", word(admin_pb2.Listener, s.server),
                           word(admin_pb2.ServingState, s.state).upper())
                          for s in reply.services)])]
    if reply.workers:
        lines += ["", table([("WORKER", "PID", "ALIVE", "RESTARTS"),
                             *((str(w.index), str(w.pid), "yes" if w.alive else "no",
                                str(w.restarts)) for w in reply.workers)])]
    return "\n".join(lines)


def cmd_health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with admin_channel(args, args.addr) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as exc:
            return die(f"health check on {args.addr}: {exc.code().name}: {exc.details()}",
                       EXIT_FAILED)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    render(args, {"addr": args.addr, "service": args.service, "status": status}, status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else EXIT_FAILED
