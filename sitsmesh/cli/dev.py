"""`sitsmesh dev`: sitsmesh with a local Envoy, demo upstream and Triton."""

from __future__ import annotations

import argparse
from pathlib import Path

from sitsmesh.cli.common import Subcommands, UsageError, env_argument, examples


def add_commands(sub: Subcommands) -> None:
    dev = sub.add_parser("dev", help="run sitsmesh with a local Envoy and demo upstream",
                         **examples("sitsmesh dev",
                                    "sitsmesh dev --admission rlqs --listen-port 10080",
                                    "sitsmesh dev -- --log-level debug --decision-log all"))
    dev.add_argument("--run-dir", default=".run", help="state and logs (default .run)")
    dev.add_argument("--filters-dir", default="filters", help="Envoy configs (default filters)")
    dev.add_argument("--listen-port", type=int, default=10000, help="Envoy listener port")
    dev.add_argument("--envoy-admin-port", type=int, default=9901, help="Envoy admin port")
    dev.add_argument("--upstream-port", type=int, default=18080, help="demo upstream port")
    env_argument(dev, "--data-addr", default="127.0.0.1:50051", env="SITSMESH_DATA_ADDR",
                 help="sitsmesh data plane")
    dev.add_argument("--triton-ports", default="18000,18001,18002", metavar="HTTP,GRPC,METRICS",
                     help="the demo Triton's ports")
    dev.add_argument("--admission", choices=("calls", "rlqs"), default="calls",
                     help="calls: Envoy's ratelimit filter asks sitsmesh per request; rlqs: "
                          "Envoy's rate_limit_quota filter enforces quotas sitsmesh assigns")
    dev.add_argument("--rlqs-addr", default="", metavar="HOST:PORT",
                     help="with --admission rlqs: RLQS from a process of its own, there, "
                          "and Envoy's quota stream pointed at it")
    dev.add_argument("serve_args", nargs=argparse.REMAINDER,
                     help="after --: more `sitsmesh serve` flags")
    dev.set_defaults(func=cmd_dev)


def cmd_dev(args: argparse.Namespace) -> int:
    from sitsmesh.dev import devstack

    serve_args = [a for a in args.serve_args if a != "--"]
    try:
        http, grpc_port, metrics = (int(p) for p in args.triton_ports.split(","))
    except ValueError:
        raise UsageError(f"--triton-ports: expected HTTP,GRPC,METRICS port numbers, got "
                         f"{args.triton_ports!r}") from None
    if args.rlqs_addr and args.admission != "rlqs":
        raise UsageError("--rlqs-addr: RLQS is used with --admission rlqs only")
    ports = devstack.DevPorts(args.listen_port, args.envoy_admin_port, args.upstream_port,
                              args.data_addr, http, grpc_port, metrics)
    return devstack.main(Path(args.run_dir), Path(args.filters_dir), ports, serve_args,
                         admission=args.admission, rlqs_addr=args.rlqs_addr)
