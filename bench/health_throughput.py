"""gRPC health-check throughput: `sitsmesh serve` (1 and 2 workers) vs a bare grpc.aio server.

Every target is a subprocess started (and stopped) by this script, on free
127.0.0.1 ports. The load generator is h2load (Debian: nghttp2-client) speaking
gRPC unary: POST /grpc.health.v1.Health/Check with a 5-byte empty-message
frame. Each target is checked once with a real gRPC client before loading, and
every h2load run must report requests == 2xx and 7 bytes of DATA per response
(the framed HealthCheckResponse{status: SERVING}); an error would arrive as a
trailers-only response with no DATA.

Rounds interleave the targets (order rotated per round); the table reports the
median req/s per target and its ratio to the baseline median.

    .venv/bin/python bench/health_throughput.py --rounds 5 --requests 30000

The process, h2load and table helpers are in benchlib.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import benchlib as bl
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

METHOD = "/grpc.health.v1.Health/Check"
# gRPC frame: 1 byte "not compressed", 4 bytes big-endian length 0 = empty HealthCheckRequest.
REQUEST_FRAME = b"\x00\x00\x00\x00\x00"
# Framed HealthCheckResponse{status: SERVING}: 5-byte header + b"\x08\x01".
RESPONSE_DATA_BYTES = 7
BASELINE = "baseline (bare grpc.aio health)"


def health_status(addr: str, timeout: float = 1.0) -> int | None:
    """Health of the whole server ('' service) via a real gRPC client, or None."""
    with grpc.insecure_channel(addr) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError:
            return None
    status: int = reply.status
    return status


def listening_sockets(port: int) -> int:
    """LISTEN sockets on 127.0.0.1:port (SO_REUSEPORT workers each have one).

    gRPC binds 127.0.0.1 as a dual-stack socket, so look in tcp6 (v4-mapped) too.
    """
    wanted = {f"0100007F:{port:04X}", f"0000000000000000FFFF00000100007F:{port:04X}"}
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[1] in wanted and cols[3] == "0A":  # 0A = TCP_LISTEN
                    count += 1
    return count


def by_kind(role: str, leader: int, pid: int) -> str:
    """CPU-split name of a process: main, worker, resource_tracker or child, with its pid."""
    del role
    if pid == leader:
        return f"main {pid}"
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    if b"spawn_main" in cmdline:
        return f"worker {pid}"
    if b"resource_tracker" in cmdline:
        return f"resource_tracker {pid}"
    return f"child {pid}"


def health_target(name: str, proc: bl.Proc, addr: str, listeners: int,
                  args: argparse.Namespace, body: Path) -> bl.Target:
    """`listeners`: LISTEN sockets expected on the data port once fully up."""
    proc.cpu_name = by_kind
    port = int(addr.rpartition(":")[2])
    serving = health_pb2.HealthCheckResponse.SERVING

    def ready() -> bool:
        proc.check_alive()
        return health_status(addr) == serving and listening_sockets(port) >= listeners

    def setup() -> None:
        bl.wait_until(ready, args.ready_timeout,
                      f"{name} SERVING on {addr} with {listeners} listener(s)")
        # Correctness once per target with a real gRPC client.
        if health_status(addr, timeout=5) != serving:
            raise bl.BenchError("gRPC client did not get SERVING")

    return bl.Target(name, f"http://{addr}{METHOD}", [proc], setup, bl.grpc_args(body),
                     (RESPONSE_DATA_BYTES, RESPONSE_DATA_BYTES))


def sitsmesh_target(name: str, workdir: Path, workers: int, args: argparse.Namespace,
                    body: Path) -> bl.Target:
    extra = ["--workers", str(workers)] if workers > 1 else []
    proc, data, _ = bl.sitsmesh_proc(f"sitsmesh-{workers}w", workdir, *extra)
    return health_target(name, proc, data, workers, args, body)


def baseline_target(workdir: Path, args: argparse.Namespace, body: Path) -> bl.Target:
    addr = f"127.0.0.1:{bl.free_port()}"
    proc = bl.Proc("baseline", [sys.executable, str(Path(__file__).resolve()),
                                "--serve-baseline", addr], workdir / "baseline.log")
    return health_target(BASELINE, proc, addr, 1, args, body)


async def serve_baseline(addr: str) -> None:
    """The baseline: a grpc.aio server with only the standard health service."""
    from grpc_health.v1.health import aio as health_aio

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
    await bl.serve_grpc(server, addr)


def bench(args: argparse.Namespace) -> int:
    h2load = bl.find_h2load()
    if h2load is None:
        return 2
    with tempfile.TemporaryDirectory(prefix="sitsmesh-bench-") as tmp:
        workdir = Path(tmp)
        body = workdir / "health-check.grpc"
        body.write_bytes(REQUEST_FRAME)
        targets = [baseline_target(workdir, args, body),
                   sitsmesh_target("sitsmesh serve (1 worker)", workdir, 1, args, body),
                   sitsmesh_target("sitsmesh serve --workers 2", workdir, 2, args, body)]
        return bl.run_bench(targets, args, workdir, h2load, p99=False)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = bl.load_parser(__doc__, requests=30000, rounds=5, warmup=3000, timeout=120.0,
                       ready_timeout=60.0, ready="SERVING")
    p.add_argument("--serve-baseline", metavar="ADDR", help=argparse.SUPPRESS)
    return bl.parse_load_args(p, argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_baseline:
        asyncio.run(serve_baseline(args.serve_baseline))
        return 0
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
