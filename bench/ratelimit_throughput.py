"""ShouldRateLimit throughput: sitsmesh (memory store, Redis store) vs a no-op grpc.aio service.

Every process is started (and stopped) by this script on free 127.0.0.1 ports:

- **no-op**: a grpc.aio `RateLimitService` (a subprocess of this script) that
  answers OK with one OK status per descriptor and counts nothing: the Python
  ceiling;
- `sitsmesh serve --ratelimit-store memory` (1 worker);
- `sitsmesh serve --ratelimit-store redis` (1 worker) against a redis-server
  started here (`--save "" --appendonly no`), with `--on-store-error deny`, so
  a Redis failure or timeout during the run turns into OVER_LIMIT and fails the
  round instead of being silently allowed;
- the same against a Redis Cluster of 3 masters with one replica each
  (`redis-cli --cluster create`, `--redis-url redis+cluster://...`), only when
  `--targets` names `redis-cluster`.

`--targets` picks targets and their order (the first is the baseline of the
ratio column); by default every target but the cluster. Each goal is
reported against the baseline it was set for: memory and Redis against the no-op,
the cluster (>= 0.90) against single Redis.

The load generator is h2load (Debian: nghttp2-client) speaking gRPC unary to
`envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit` with a
pre-serialized, gRPC-framed `RateLimitRequest` (domain `bench`, one descriptor
`[("user", "bench")]`). The sitsmesh config gives that descriptor 10^9
requests per second, so every answer is OK. One descriptor is one counter, so on a
cluster every hit goes to one master; `--users N` spreads the load over N values
(one request body, and so one h2load, each: h2load sends a single -d body), chosen
so a 3-master cluster holds an even share of them.

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
call count by exactly the number of requests (every hit reached Redis); on a
cluster the EVALSHA calls summed over the masters, and each master's by exactly
the requests whose counter it holds.

Latency p50 and p99 come from h2load's `--log-file` (one line per request with
its duration), so they are per-request under the full load (`-c` x `-m`
streams in flight), not an unloaded round trip. At HEAD f49e9cd, `-c16 -m10` on
sitsmesh's default 16 streams per connection gets RST_STREAM REFUSED_STREAM for
0.5-2% of Redis-store requests under load (likely: gRPC frees a stream's slot only
after the client has seen it end), which fails the round; `--clients 32 --streams 5`
does not.

Rounds interleave the targets (order rotated each round); the table reports
medians per target and the ratio to the baseline's median. The exit status is 1 if
any target fails to start, verify, finish a round, or stop cleanly. The
per-worker goals (memory >= 0.85 and Redis >= 0.60 of the no-op) are reported
in the table; missing one does not fail the run.

    .venv/bin/python bench/ratelimit_throughput.py --rounds 3 --requests 10000
    .venv/bin/python bench/ratelimit_throughput.py --targets redis,redis-cluster --users 6

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
import redisservers as rs

METHOD = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
DOMAIN = "bench"
TINY_DOMAIN = "bench-tiny"
HUGE_LIMIT = 1_000_000_000
NOOP = "no-op grpc.aio RateLimitService"
MEMORY = "sitsmesh serve, memory store"
REDIS = "sitsmesh serve, redis store"
REDIS_WORKERS = "sitsmesh serve --workers 2, redis store"
REDIS_REPLICAS = "2 x sitsmesh serve (replicas), redis store"
REDIS_CLUSTER = "sitsmesh serve, redis cluster store"
# --targets names, in the default order; the first selected target is the baseline.
TARGETS = {"noop": NOOP, "memory": MEMORY, "redis": REDIS, "redis-workers": REDIS_WORKERS,
           "redis-replicas": REDIS_REPLICAS, "redis-cluster": REDIS_CLUSTER}
DEFAULT_TARGETS = "noop,memory,redis,redis-workers,redis-replicas"
# Wanted ratios (reported only), each against the baseline it was set for.
GOALS = {(NOOP, MEMORY): 0.85, (NOOP, REDIS): 0.60, (REDIS, REDIS_CLUSTER): 0.90}
CLUSTER_SLOTS = 16384
# Slack on each sitsmesh reply's size: limit_remaining and duration_until_reset are varints.
SIZE_SLACK = 8
# h2load's arguments for a target: common ones, and one set per concurrent h2load (bodies).
Load = tuple[list[str], list[list[str]]]


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


def _answers(addr: str, within_limit: bool = False, value: str = "ready") -> bool:
    """Any answer, or with within_limit an OK one (not a store error's deny)."""
    from envoy.service.ratelimit.v3 import rls_pb2

    with contextlib.suppress(grpc.RpcError):
        reply = should_rate_limit(addr, DOMAIN, value, timeout=1.0)
        return not within_limit or reply.overall_code == rls_pb2.RateLimitResponse.OK
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


def noop_target(workdir: Path, args: argparse.Namespace, load: Load) -> bl.Target:
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

    target = bl.Target(NOOP, f"http://{addr}{METHOD}", [proc], setup, load[0],
                       arg_sets=load[1])
    return target


def counter_tag(user: str) -> str:
    """The hash tag of the bench rule's counter for `user`: its cluster slot (the redis
    store's keys are `<prefix>{<domain>_<key>_<value>}...`; a wrong guess here fails the
    per-master EVALSHA check, it cannot skew a number)."""
    return f"{DOMAIN}_user_{user}"


def bench_users(count: int) -> list[str]:
    """Descriptor values for --users: "bench" alone, or `count` values dealt in turn to
    the slot thirds redis-cli gives 3 masters, so a cluster gets an even share each."""
    if count == 1:
        return ["bench"]
    from redis.crc import key_slot

    users: list[str] = []
    candidates = (f"u{n}" for n in range(100 * count))
    for want in range(count):
        third = want % rs.CLUSTER_MASTERS
        users.append(next(u for u in candidates
                          if key_slot(counter_tag(u).encode()) * rs.CLUSTER_MASTERS
                          // CLUSTER_SLOTS == third))
    return users


def sitsmesh_target(name: str, workdir: Path, args: argparse.Namespace, load: Load,
                    configs: list[str], store: str, *, workers: int = 1,
                    replicas: int = 1, users: Sequence[str] = ("bench",)) -> bl.Target:
    """store: memory, redis (one redis-server) or cluster."""
    procs: list[bl.Proc] = []
    extra = list(configs)
    backend: rs.SingleRedis | rs.RedisCluster | None = None
    if store == "memory":
        extra += ["--ratelimit-store", "memory"]
    else:
        backend = (rs.SingleRedis(workdir, args) if store == "redis"
                   else rs.RedisCluster(workdir, args, [counter_tag(u) for u in users]))
        procs += backend.procs
        extra += ["--ratelimit-store", "redis", "--redis-url", backend.url,
                  "--on-store-error", "deny", "--redis-timeout-ms", str(args.redis_timeout_ms)]
    if workers > 1:
        extra += ["--workers", str(workers)]
    role = f"sitsmesh-{store}-{workers}w{replicas}r"
    servers = [bl.sitsmesh_proc(f"{role}-{n}", workdir, *extra) for n in range(replicas)]
    procs += [proc for proc, _, _ in servers]
    data = servers[0][1]

    most_clients = [0]
    calls_and_reads: list[tuple[float, float]] = []  # at every counters() read

    def counters() -> dict[str, float]:
        try:
            out: dict[str, float] = {}
            for _, _, metrics in servers:  # replicas: their counts add up
                for key, value in bl.metric_samples(metrics).items():
                    out[key] = out.get(key, 0.0) + value
            if backend is not None:
                out.update(rs.redis_calls(backend.masters))
                most_clients[0] = max(most_clients[0], int(out["redis connected clients"]))
                calls_and_reads.append((out["redis evalsha calls"], out["redis reads"]))
        except OSError as exc:
            raise bl.BenchError(f"cannot read counters: {exc}") from exc
        return out

    def notes() -> list[str]:
        out = []
        if isinstance(backend, rs.RedisCluster) and backend.masters:
            shares = ", ".join(f":{port} {backend.tag_master.count(port)}"
                               for port in backend.masters)
            out.append(f"descriptor values per master, of {len(users)} (each master's "
                       f"EVALSHA count checked every round): {shares}")
        if len(calls_and_reads) > 1:
            calls = calls_and_reads[-1][0] - calls_and_reads[0][0]
            reads = calls_and_reads[-1][1] - calls_and_reads[0][1]
            if reads > 0:
                out.append(f"{calls / reads:.2f} EVALSHAs per socket read on the Redis "
                           "side over the run (about the store's batch size per node)")
        if most_clients[0]:
            where = "the masters" if isinstance(backend, rs.RedisCluster) else "redis-server"
            out.append(f"{where} had up to {most_clients[0]} client connections open "
                       "(sampled between rounds)")
        return out

    def expected(n: int) -> dict[str, float]:
        want = sitsmesh_expectations(DOMAIN, "user", n)
        if backend is not None:
            want["redis evalsha calls"] = n  # summed over the masters
            want.update(backend.expected(n))
        return want

    def setup() -> None:
        if backend is not None:
            backend.setup(args)

        def ready() -> bool:
            for p in procs:
                p.check_alive()
            # sitsmesh started before the cluster was formed, and denies in its store-error
            # backoff for a while after: wait for it to count.
            return _answers(data, within_limit=isinstance(backend, rs.RedisCluster))

        bl.wait_until(ready, args.ready_timeout, f"{name} on {data}")
        size = verify_sitsmesh_rls(data)
        for _, other, _ in servers[1:]:
            bl.wait_until(partial(_answers, other), args.ready_timeout, f"{name} on {other}")
            verify_sitsmesh_rls(other)
        target.response_bytes = (size - SIZE_SLACK, size + SIZE_SLACK)
        if backend is not None:
            # One call per load's counter first: the warm-up's first batch would otherwise
            # open connections and load the script (on every master) within one batch
            # deadline (50 ms) on a busy machine, miss it, and deny for a second.
            for user in users:
                bl.wait_until(partial(_answers, data, True, user), args.ready_timeout,
                              f"{name}: an OK answer for user {user}")
        if backend is not None and not rs.redis_calls(backend.masters)["redis evalsha calls"]:
            raise bl.BenchError("no EVALSHA reached redis-server: the store is not Redis")

    target = bl.Target(name, f"http://{data}{METHOD}", procs, setup, load[0],
                       counters=counters, expected=expected, notes=notes,
                       extra_urls=[f"http://{addr}{METHOD}" for _, addr, _ in servers[1:]],
                       arg_sets=load[1])
    return target


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
        users = bench_users(args.users)
        bodies = []
        for user in users:
            body = workdir / f"should-rate-limit-{user}.grpc"
            body.write_bytes(bl.grpc_frame(rls_request(DOMAIN, user)))
            bodies.append(body)
        load: Load = ((bl.grpc_args(bodies[0]), []) if len(bodies) == 1
                      else ([], [bl.grpc_args(body) for body in bodies]))
        configs = write_configs(workdir)
        build = {
            NOOP: lambda: noop_target(workdir, args, load),
            MEMORY: lambda: sitsmesh_target(MEMORY, workdir, args, load, configs, "memory"),
            REDIS: lambda: sitsmesh_target(REDIS, workdir, args, load, configs, "redis"),
            REDIS_WORKERS: lambda: sitsmesh_target(REDIS_WORKERS, workdir, args, load,
                                                   configs, "redis", workers=2),
            REDIS_REPLICAS: lambda: sitsmesh_target(REDIS_REPLICAS, workdir, args, load,
                                                    configs, "redis", replicas=2),
            REDIS_CLUSTER: lambda: sitsmesh_target(REDIS_CLUSTER, workdir, args, load,
                                                   configs, "cluster", users=users),
        }
        wanted = [TARGETS[n] for n in args.targets]
        missing = [] if args.redis_server else [n for n in wanted if n not in (NOOP, MEMORY)]
        targets = [build[n]() for n in wanted if n not in missing]
        for t in targets:
            t.goal = GOALS.get((targets[0].name, t.name))
        if users != ["bench"]:
            print(f"{len(users)} descriptor values, one h2load each: {', '.join(users)}",
                  file=sys.stderr)
        code = bl.run_bench(targets, args, workdir, h2load, "ShouldRateLimit, direct gRPC")
        if missing:
            print(f"\nredis-server not found: {', '.join(missing)} not run "
                  "(apt-get install -y redis-server)", file=sys.stderr)
            code = 1
        return code


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = bl.load_parser(__doc__, requests=10000)
    p.add_argument("--redis-server", default=shutil.which("redis-server"),
                   help="redis-server binary (default: from PATH)")
    p.add_argument("--redis-timeout-ms", type=int, default=50,
                   help="sitsmesh --redis-timeout-ms for the Redis targets (default 50, "
                        "sitsmesh's default)")
    p.add_argument("--targets", default=DEFAULT_TARGETS,
                   help=f"comma-separated, the first is the baseline of the ratios; of "
                        f"{', '.join(TARGETS)} (default {DEFAULT_TARGETS})")
    p.add_argument("--users", type=int, default=1,
                   help="distinct descriptor values the load is spread over, one h2load "
                        "each with its own request body (default 1: the one value "
                        "\"bench\", every hit on one counter)")
    p.add_argument("--serve-noop", metavar="ADDR", help=argparse.SUPPRESS)
    args = bl.parse_load_args(p, argv)
    args.targets = [n.strip() for n in args.targets.split(",") if n.strip()]
    unknown = [n for n in args.targets if n not in TARGETS]
    if unknown or not args.targets or len(set(args.targets)) != len(args.targets):
        p.error(f"--targets: expected distinct names of {', '.join(TARGETS)}")
    if args.users < 1 or args.users > args.clients:
        p.error("--users must be between 1 and --clients (each h2load needs a client)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_noop:
        asyncio.run(serve_noop(args.serve_noop))
        return 0
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
