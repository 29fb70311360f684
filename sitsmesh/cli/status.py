"""`sitsmesh status` and `sitsmesh health`: how a running sitsmesh is doing."""

from __future__ import annotations

import argparse
import json

from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.cli.common import (
    EXIT_FAILED,
    Subcommands,
    add_common_admin,
    add_tls_flags,
    admin_channel,
    call_admin,
    die,
    message_dict,
)


def add_commands(sub: Subcommands) -> None:
    status = sub.add_parser("status", help="show a running sitsmesh's status (admin API)")
    add_common_admin(status)
    status.set_defaults(func=cmd_status)

    health = sub.add_parser("health", help="gRPC health check; exit 0 only when SERVING")
    health.add_argument("--addr", default="127.0.0.1:50051", help="data-plane HOST:PORT")
    health.add_argument("--service", default="", help="service name ('' = whole server)")
    health.add_argument("--timeout", type=float, default=3.0)
    add_tls_flags(health, "data plane")
    health.set_defaults(func=cmd_health)


def cmd_status(args: argparse.Namespace) -> int:
    reply = call_admin(args, "GetStatus", admin_pb2.GetStatusRequest())
    if args.output == "json":
        print(json.dumps(message_dict(reply, all_fields=True), indent=2, sort_keys=True))
        return 0
    names = {v: k for k, v in admin_pb2.ServingState.items()}
    print(f"sitsmesh {reply.version}   uptime {reply.uptime_seconds:.1f}s   "
          f"config {reply.config_version}   state revision {reply.state_revision}")
    print(f"data {reply.data_addr}   admin {reply.admin_addr}   metrics {reply.metrics_addr}")
    print()
    rows = [("SERVICE", "SERVER", "STATE")]
    rows += [(s.name or "(server)", s.server, names[s.state]) for s in reply.services]
    width = max(len(r[0]) for r in rows)
    for name, server_name, state in rows:
        print(f"{name:<{width}}  {server_name:<6}  {state}")
    if reply.workers:
        print()
        print("WORKER  PID      ALIVE  RESTARTS")
        for w in reply.workers:
            print(f"{w.index:<6}  {w.pid:<7}  {'yes' if w.alive else 'no':<5}  {w.restarts}")
    return 0


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
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else EXIT_FAILED
