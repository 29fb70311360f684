"""ShouldRateLimit throughput: sitsmesh (memory store, Redis store) vs a no-op grpc.aio service.

Every process is started (and stopped) by this script on free 127.0.0.1 ports:

- **no-op**: a grpc.aio `RateLimitService` (a subprocess of this script) that
  answers OK with one OK status per descriptor and counts nothing: the Python
  ceiling;
- `sitsmesh serve --ratelimit-store memory` (1 worker);
- `sitsmesh serve --ratelimit-store redis` (1 worker) against a redis-server
  started here (`--save "" --appendonly no`), with `--on-store-error deny`, so
  a Redis failure or timeout during the run turns into OVER_LIMIT and fails the
  round instead of being silently allowed.

The load generator is h2load (Debian: nghttp2-client) speaking gRPC unary to
`envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit` with a
pre-serialized, gRPC-framed `RateLimitRequest` (domain `bench`, one descriptor
`[("user", "bench")]`). The sitsmesh config gives that descriptor 10^9
requests per second, so every answer is OK.

Before any load, each target is checked with a real gRPC client: overall_code
OK, exactly one status, and for sitsmesh the status carries the configured
limit (so the rule matched and the store counted). Each sitsmesh target also
proves that it counts: a second domain `bench-tiny` allows 1 request a day,
and its second call must be OVER_LIMIT.

Each round must report requests == 2xx and the expected DATA bytes (a gRPC
error is a trailers-only HTTP 200 with no DATA). Because sitsmesh's replies
vary by a few bytes (remaining count, time to reset), its rounds are also
checked exactly on the server's own counters: the per-RPC handled counter
(`grpc_code="OK"`) and the rule's `within_limit` hits must each grow by exactly
the number of requests, `over_limit` by 0, and for Redis the server's EVALSHA
call count by exactly the number of requests (every hit reached Redis).

Latency p50 and p99 come from h2load's `--log-file` (one line per request with
its duration), so they are per-request under the full load (`-c` x `-m`
streams in flight), not an unloaded round trip.

Rounds interleave the targets (order rotated each round); the table reports
medians per target and the ratio to the no-op median. The exit status is 1 if
any target fails to start, verify, finish a round, or stop cleanly. The
per-worker goals (memory >= 0.85 and Redis >= 0.60 of the no-op) are reported
in the table; missing one does not fail the run.

    .venv/bin/python bench/ratelimit_throughput.py --rounds 3 --requests 10000

The process, h2load and table helpers are in benchlib.py; ratelimit_envoy.py
also uses the rate-limit pieces here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import benchlib as bl
import grpc

METHOD = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
DOMAIN = "bench"
TINY_DOMAIN = "bench-tiny"
HUGE_LIMIT = 1_000_000_000
NOOP = "no-op grpc.aio RateLimitService"
MEMORY = "sitsmesh serve, memory store"
REDIS = "sitsmesh serve, redis store"
REDIS_WORKERS = "sitsmesh serve --workers 2, redis store"
REDIS_REPLICAS = "2 x sitsmesh serve (replicas), redis store"
GOALS = {MEMORY: 0.85, REDIS: 0.60}
# Slack on each sitsmesh reply's size: limit_remaining and duration_until_reset are varints.
SIZE_SLACK = 8


def sitsmesh_expectations(domain: str, key: str, requests: int) -> dict[str, float]:
    """Counter deltas of a sitsmesh whose every ShouldRateLimit in a round was within limit."""
    stats_key = f"{domain}.{key}"
    return {
        bl.sample_key("grpc_server_handled_total",
                      grpc_service="envoy.service.ratelimit.v3.RateLimitService",
                      grpc_method="ShouldRateLimit", grpc_code="OK",
                      grpc_type="unary"): requests,
        bl.sample_key("sitsmesh_ratelimit_hits_total", key=stats_key,
                      outcome="total_hits"): requests,
        bl.sample_key("sitsmesh_ratelimit_hits_total", key=stats_key,
                      outcome="within_limit"): requests,
        bl.sample_key("sitsmesh_ratelimit_hits_total", key=stats_key, outcome="over_limit"): 0,
    }


# --------------------------------------------------------------------------- gRPC targets

def rls_request(domain: str, value: str) -> Any:
    from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
    from envoy.service.ratelimit.v3 import rls_pb2

    entry = ratelimit_pb2.RateLimitDescriptor.Entry(key="user", value=value)
    return rls_pb2.RateLimitRequest(
        domain=domain, descriptors=[ratelimit_pb2.RateLimitDescriptor(entries=[entry])])


def should_rate_limit(addr: str, domain: str, value: str, timeout: float = 5.0) -> Any:
    """One ShouldRateLimit with a real gRPC client; raises grpc.RpcError."""
    from envoy.service.ratelimit.v3 import rls_pb2_grpc

    with grpc.insecure_channel(addr) as channel:
        return rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit(
            rls_request(domain, value), timeout=timeout)


def _answers(addr: str) -> bool:
    with contextlib.suppress(grpc.RpcError):
        should_rate_limit(addr, DOMAIN, "ready", timeout=1.0)
        return True
    return False


def _check_reply(reply: Any, code: int, what: str) -> None:
    from envoy.service.ratelimit.v3 import rls_pb2

    names = rls_pb2.RateLimitResponse.Code.Name
    if reply.overall_code != code or len(reply.statuses) != 1 or reply.statuses[0].code != code:
        raise bl.BenchError(f"{what}: expected {names(code)} with one status, got "
                         f"overall {names(reply.overall_code)}, "
                         f"{[names(s.code) for s in reply.statuses]}")


def verify_sitsmesh_rls(addr: str) -> int:
    """Correctness with a real client; returns the framed size of the bench reply."""
    from envoy.service.ratelimit.v3 import rls_pb2

    ok, over = rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.OVER_LIMIT
    try:
        reply = should_rate_limit(addr, DOMAIN, "bench")
        _check_reply(reply, ok, f"domain {DOMAIN}")
        limit = reply.statuses[0].current_limit
        if limit.requests_per_unit != HUGE_LIMIT:
            raise bl.BenchError(f"domain {DOMAIN}: the reply does not carry the configured "
                             f"limit {HUGE_LIMIT}/s (no rule matched?): {reply}")
        # Counting happens: the tiny domain allows one hit, so the second is over the limit.
        value = f"check-{time.time_ns()}"
        _check_reply(should_rate_limit(addr, TINY_DOMAIN, value), ok,
                     f"domain {TINY_DOMAIN}, 1st call")
        _check_reply(should_rate_limit(addr, TINY_DOMAIN, value), over,
                     f"domain {TINY_DOMAIN}, 2nd call")
    except grpc.RpcError as exc:
        raise bl.BenchError(f"ShouldRateLimit failed: {exc}") from exc
    return len(bl.grpc_frame(reply))


def write_configs(workdir: Path) -> list[str]:
    bench = workdir / "bench.yaml"
    bench.write_text(f"domain: {DOMAIN}\ndescriptors:\n  - key: user\n    rate_limit:\n"
                     f"      unit: second\n      requests_per_unit: {HUGE_LIMIT}\n")
    tiny = workdir / "bench-tiny.yaml"
    tiny.write_text(f"domain: {TINY_DOMAIN}\ndescriptors:\n  - key: user\n    rate_limit:\n"
                    "      unit: day\n      requests_per_unit: 1\n")
    return ["--ratelimit-config", str(bench), "--ratelimit-config", str(tiny)]


def noop_target(workdir: Path, args: argparse.Namespace, body: Path) -> bl.Target:
    addr = f"127.0.0.1:{bl.free_port()}"
    proc = bl.Proc("no-op server", [sys.executable, str(Path(__file__).resolve()),
                                 "--serve-noop", addr], workdir / "noop.log")

    def setup() -> None:
        from envoy.service.ratelimit.v3 import rls_pb2

        def ready() -> bool:
            proc.check_alive()
            return _answers(addr)

        bl.wait_until(ready, args.ready_timeout, f"{NOOP} on {addr}")
        try:
            reply = should_rate_limit(addr, DOMAIN, "bench")
        except grpc.RpcError as exc:
            raise bl.BenchError(f"ShouldRateLimit failed: {exc}") from exc
        _check_reply(reply, rls_pb2.RateLimitResponse.OK, NOOP)
        size = len(bl.grpc_frame(reply))
        target.response_bytes = (size, size)

    target = bl.Target(NOOP, f"http://{addr}{METHOD}", [proc], setup, bl.grpc_args(body))
    return target


def sitsmesh_target(name: str, workdir: Path, args: argparse.Namespace, body: Path,
                    configs: list[str], redis: bool, *, workers: int = 1,
                    replicas: int = 1) -> bl.Target:
    procs: list[bl.Proc] = []
    extra = list(configs)
    redis_port = 0
    if redis:
        redis_port = bl.free_port()
        procs.append(bl.Proc("redis-server", [
            args.redis_server, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(workdir), "--daemonize", "no", "--logfile", ""],
            workdir / "redis.log"))
        extra += ["--ratelimit-store", "redis", "--redis-url",
                  f"redis://127.0.0.1:{redis_port}/0", "--on-store-error", "deny",
                  "--redis-timeout-ms", str(args.redis_timeout_ms)]
    else:
        extra += ["--ratelimit-store", "memory"]
    if workers > 1:
        extra += ["--workers", str(workers)]
    role = f"sitsmesh-{'redis' if redis else 'memory'}-{workers}w{replicas}r"
    servers = [bl.sitsmesh_proc(f"{role}-{n}", workdir, *extra) for n in range(replicas)]
    procs += [proc for proc, _, _ in servers]
    data = servers[0][1]

    most_clients = [0]

    def counters() -> dict[str, float]:
        try:
            out: dict[str, float] = {}
            for _, _, metrics in servers:  # replicas: their counts add up
                for key, value in bl.metric_samples(metrics).items():
                    out[key] = out.get(key, 0.0) + value
            if redis:
                out.update(redis_calls(redis_port))
                most_clients[0] = max(most_clients[0], int(out["redis connected clients"]))
        except OSError as exc:
            raise bl.BenchError(f"cannot read counters: {exc}") from exc
        return out

    def notes() -> list[str]:
        if not most_clients[0]:
            return []
        return [f"redis-server had up to {most_clients[0]} client connections open "
                "(sampled between rounds)"]

    def expected(n: int) -> dict[str, float]:
        want = sitsmesh_expectations(DOMAIN, "user", n)
        if redis:
            want["redis evalsha calls"] = n
        return want

    def setup() -> None:
        def ready() -> bool:
            for p in procs:
                p.check_alive()
            return _answers(data)

        bl.wait_until(ready, args.ready_timeout, f"{name} on {data}")
        size = verify_sitsmesh_rls(data)
        for _, other, _ in servers[1:]:
            bl.wait_until(partial(_answers, other), args.ready_timeout, f"{name} on {other}")
            verify_sitsmesh_rls(other)
        target.response_bytes = (size - SIZE_SLACK, size + SIZE_SLACK)
        if redis and not redis_calls(redis_port)["redis evalsha calls"]:
            raise bl.BenchError("no EVALSHA reached redis-server: the store is not Redis")

    target = bl.Target(name, f"http://{data}{METHOD}", procs, setup, bl.grpc_args(body),
                       counters=counters, expected=expected, goal=GOALS.get(name), notes=notes,
                       extra_urls=[f"http://{addr}{METHOD}" for _, addr, _ in servers[1:]])
    return target


def redis_calls(port: int) -> dict[str, float]:
    """Script calls redis-server has executed (INFO commandstats), and its open connections."""
    import redis as redis_py

    client = redis_py.Redis(host="127.0.0.1", port=port, socket_timeout=5)
    try:
        info: dict[str, Any] = client.info("commandstats")
        clients: dict[str, Any] = client.info("clients")
    except redis_py.RedisError as exc:
        raise bl.BenchError(f"cannot read redis-server INFO: {exc}") from exc
    finally:
        client.close()
    out = {f"redis {cmd} calls": float(info.get(f"cmdstat_{cmd}", {}).get("calls", 0))
           for cmd in ("evalsha", "eval")}
    out["redis connected clients"] = float(clients["connected_clients"]) - 1  # minus this one
    return out


async def serve_noop(addr: str) -> None:
    """The ceiling: OK with one OK status per descriptor, nothing counted, no interceptors."""
    from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

    ok = rls_pb2.RateLimitResponse.OK
    status = rls_pb2.RateLimitResponse.DescriptorStatus

    class Noop(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
        async def ShouldRateLimit(self, request: Any, context: Any) -> Any:
            del context
            return rls_pb2.RateLimitResponse(
                overall_code=ok, statuses=[status(code=ok) for _ in request.descriptors])

    server = grpc.aio.server()
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(Noop(), server)
    await bl.serve_grpc(server, addr)


def bench(args: argparse.Namespace) -> int:
    h2load = bl.find_h2load()
    if h2load is None:
        return 2
    with tempfile.TemporaryDirectory(prefix="sitsmesh-rl-bench-") as tmp:
        workdir = Path(tmp)
        body = workdir / "should-rate-limit.grpc"
        body.write_bytes(bl.grpc_frame(rls_request(DOMAIN, "bench")))
        configs = write_configs(workdir)
        targets = [noop_target(workdir, args, body),
                   sitsmesh_target(MEMORY, workdir, args, body, configs, redis=False)]
        if args.redis_server:
            targets += [
                sitsmesh_target(REDIS, workdir, args, body, configs, redis=True),
                sitsmesh_target(REDIS_WORKERS, workdir, args, body, configs, redis=True,
                                workers=2),
                sitsmesh_target(REDIS_REPLICAS, workdir, args, body, configs, redis=True,
                                replicas=2)]
        code = bl.run_bench(targets, args, workdir, h2load, "ShouldRateLimit, direct gRPC")
        if not args.redis_server:
            print("\nredis-server not found: the Redis target was not run "
                  "(apt-get install -y redis-server)", file=sys.stderr)
            code = 1
        return code


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = bl.load_parser(__doc__, requests=10000)
    p.add_argument("--redis-server", default=shutil.which("redis-server"),
                   help="redis-server binary (default: from PATH)")
    p.add_argument("--redis-timeout-ms", type=int, default=50,
                   help="sitsmesh --redis-timeout-ms for the Redis target (default 50, "
                        "sitsmesh's default)")
    p.add_argument("--serve-noop", metavar="ADDR", help=argparse.SUPPRESS)
    return bl.parse_load_args(p, argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_noop:
        asyncio.run(serve_noop(args.serve_noop))
        return 0
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
