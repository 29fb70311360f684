"""Check latency of a well-behaved caller while other work shares the data plane (issue 26).

One `sitsmesh serve` (1 worker, started and stopped by this script on free
127.0.0.1 ports, `--ratelimit-config` with a per-tenant rule of 6 000 a minute
on domain `edge`, so RLQS buckets share rates across streams). Tenant `bench`
(models `*`) and one API key are created with the admin CLI. The caller is a
gRPC client on one connection sending `--checks` sequential Checks (POST
/v2/models/llama/infer with the key) paced at `--rate` a second (2 400 at 200/s:
12 s, over two report intervals); every answer must be OK. Scenarios:

- **idle**: nothing else;
- **N RLQS streams** (`--streams`, default 30 and 100): a subprocess opens N
  streams of `--buckets` buckets each (`{name, tenant: tenant-<i % 100>,
  priority: <i // 100>, model: llama}`, so each tenant's rate is shared by every
  stream), reports all of them every `--report-s` seconds like Envoy (staggered
  across streams, 5 s of usage each) and reads every reply. The Checks start once
  every stream got its first reply, and run while the reports go on; every
  stream must then have had a reply to each report but the last;
- **N RLQS streams, RLQS process** (after each N, unless `--no-rlqs-process`): the
  same, to a second measured server started with `--rlqs-addr`, which serves RLQS from
  a child process of its own: the streams go to that address, the Checks to its data
  port (same config, a tenant and key of its own made the same way);
- **40 000-glob pipeline**: a pipeline with `--globs` model globs that match
  nothing the caller asks, applied through the admin API; then Checks naming a
  new model each time (`/v2/models/unseen-<i>/infer`), as many as fit in
  `--glob-budget-s`. If the apply is refused, the row says so.

- **pinning** (unless `--no-pin`, on a machine of 2 cores or more): the measured
  servers run on core 0 alone (one is measured at a time, the other idles); this
  script (the caller), the load generator and the control server share the others.
  As in a cluster, where the Envoys and the RLQS clients are not on sitsmesh's
  cores: what the RLQS rows add is then sitsmesh's own RLQS work on its loop, not
  the load generator's CPU. Unpinned, the control alone put the p99 at 1.1-3.9x
  idle on 2 shared cores. The `--rlqs-addr` server's RLQS process (every thread of
  it) is moved to the other cores, its data process stays on core 0: as in a pod of
  2 CPUs, where the OS runs the RLQS process on the core Check is not using.
- **control** (before each N, unless `--no-control`): the same N streams aimed at a
  second `sitsmesh serve` while the Checks go to the first. The measured server
  does no RLQS work, so this row is the machine's contention alone (server, load
  generator and caller share the cores); an RLQS row's p99 over its control's is
  what RLQS costs sitsmesh.

Reported per scenario: p50, p99 and max of the Check round trip, the ratio of
p99 to idle p99 (goal <= 1.5), and for RLQS the buckets held, the reports
answered, the RSS of the process holding them, and the CPU of the measured server
and of the process doing the RLQS work. In the RLQS process row the counts come from
the parent's /metrics, where the child publishes them once a second. Exit status 1 if
a server fails to start, a Check is not OK, or an RLQS stream is not answered.

    .venv/bin/python bench/dataplane_isolation.py [--checks 2000] [--streams 30 100]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import multiprocessing.synchronize
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from envoy.service.auth.v3 import attribute_context_pb2, external_auth_pb2, external_auth_pb2_grpc
from envoy.service.rate_limit_quota.v3 import rlqs_pb2
from google.protobuf import duration_pb2

from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.dev import harness

RLQS_METHOD = "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas"
RATELIMIT_CONFIG = """\
domain: edge
descriptors:
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 6000}
"""
GOAL = 1.5


class BenchError(Exception):
    pass


def check_request(key: str, model: str = "llama") -> Any:
    ctx = attribute_context_pb2.AttributeContext
    http = ctx.HttpRequest(method="POST", path=f"/v2/models/{model}/infer",
                           headers={"x-api-key": key, "x-request-id": "bench"})
    return external_auth_pb2.CheckRequest(attributes=ctx(request=ctx.Request(http=http)))


def provision(node: harness.Sitsmesh) -> str:
    for argv in (("tenants", "create", "bench", "--models", "*"),):
        done = node.cli(*argv)
        if done.returncode != 0:
            raise BenchError(f"sitsmesh {' '.join(argv[:2])}: {done.stderr.strip()}")
    done = node.cli("apikeys", "create", "--tenant", "bench", "--output", "json")
    if done.returncode != 0:
        raise BenchError(f"apikeys create: {done.stderr.strip()}")
    key: str = json.loads(done.stdout)["key"]
    return key


def measure(stub: Any, key: str, count: int, *, unique_models: bool = False,
            budget_s: float = 600.0, rate: float = 0.0) -> list[float]:
    """Round trips (ms) of up to `count` sequential Checks, within `budget_s`, paced at
    `rate` a second (0: back to back)."""
    times: list[float] = []
    end = time.monotonic() + budget_s
    began = time.monotonic()
    for i in range(count):
        if rate:
            wait = began + i / rate - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        request = check_request(key, f"unseen-{i}-{time.monotonic_ns()}" if unique_models
                                else "llama")
        start = time.perf_counter()
        reply = stub.Check(request, timeout=max(5.0, budget_s))
        times.append((time.perf_counter() - start) * 1e3)
        if reply.status.code != 0:
            raise BenchError(f"Check {i} not OK: {reply.status}")
        if time.monotonic() > end:
            break
    return times


def percentile(values: Sequence[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


def report_bytes(buckets: int) -> bytes:
    usage = rlqs_pb2.RateLimitQuotaUsageReports.BucketQuotaUsage
    body: bytes = rlqs_pb2.RateLimitQuotaUsageReports(domain="edge", bucket_quota_usages=[
        usage(bucket_id=rlqs_pb2.BucketId(bucket={
            "name": "sitsmesh", "tenant": f"tenant-{i % 100}", "priority": str(i // 100 % 10),
            "model": "llama"}), num_requests_allowed=25,
            time_elapsed=duration_pb2.Duration(seconds=5))
        for i in range(buckets)]).SerializeToString()
    return body


def rlqs_load(addr: str, streams: int, buckets: int, report_s: float,
              stop: multiprocessing.synchronize.Event, ready: Any, stats: Any) -> None:
    """The subprocess: `streams` RLQS streams like Envoys, each reporting every bucket
    every `report_s` (staggered) and reading every reply. stats: [reports, replies,
    streams answered at least once]."""
    import asyncio

    from grpc import aio

    body = report_bytes(buckets)

    async def one(channel: aio.Channel, index: int) -> None:
        call: Any = channel.stream_stream(RLQS_METHOD)()
        answered = False

        async def read() -> None:
            nonlocal answered
            async for _ in call:
                with stats.get_lock():
                    stats[1] += 1
                    if not answered:
                        stats[2] += 1
                answered = True

        reader = asyncio.ensure_future(read())
        await asyncio.sleep(index * report_s / streams)
        try:
            while not stop.is_set():
                await call.write(body)
                with stats.get_lock():
                    stats[0] += 1
                await asyncio.sleep(report_s)
        finally:
            call.cancel()
            reader.cancel()

    async def main() -> None:
        # A few connections, as Envoys would have their own.
        channels = [aio.insecure_channel(addr, options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(min(streams, 10))]
        tasks = [asyncio.ensure_future(one(channels[i % len(channels)], i))
                 for i in range(streams)]
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.2)
        await asyncio.sleep(0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for channel in channels:
            await channel.close()

    asyncio.run(main())


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metric(node: harness.Sitsmesh, name: str) -> float:
    return harness.metric_value(node.metrics(), name)


def rlqs_child(node: harness.Sitsmesh) -> int:
    """The pid of the server's RLQS process: its log's last "rlqs started" (the server
    has another child, multiprocessing's resource tracker)."""
    pids = [event["pid"] for event in map(json.loads, (
        line for line in node.output().splitlines() if line.startswith("{")))
        if event.get("event") == "rlqs started"]
    if not pids:
        raise BenchError("the --rlqs-addr server logged no \"rlqs started\"")
    pid: int = pids[-1]
    return pid


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of a running process onto `cpus`: sched_setaffinity moves one thread,
    and a thread started meanwhile by one not yet moved would stay where it was, so
    until none is left behind (bounded)."""
    for _ in range(5):
        tasks = [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()]
        if all(os.sched_getaffinity(task) == cpus for task in tasks):
            return
        for task in tasks:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended
                os.sched_setaffinity(task, cpus)
    raise BenchError(f"could not move every thread of {pid} onto {sorted(cpus)}")


@dataclass
class Rlqs:
    """Where a scenario's RLQS streams go: the address, the server whose /metrics count
    them, the process doing the work, and how the note names it (empty: the measured
    server itself)."""

    addr: str
    node: harness.Sitsmesh
    pid: int
    where: str = ""


def rlqs_scenario(measured: harness.Sitsmesh, stub: Any, key: str, args: argparse.Namespace,
                  streams: int, rlqs: Rlqs) -> dict[str, Any]:
    """Checks to `measured` while `streams` RLQS streams report to `rlqs`. Aimed at a
    second server, the measured server does no RLQS work: what is left is the machine's
    contention (the load generator and the other server on the same cores), the control
    for the RLQS rows."""
    node = rlqs.node
    ctx = multiprocessing.get_context("spawn")
    stop, ready = ctx.Event(), ctx.Event()
    stats = ctx.Array("l", 3)
    proc = ctx.Process(target=rlqs_load, args=(rlqs.addr, streams, args.buckets,
                                               args.report_s, stop, ready, stats))
    proc.start()
    try:
        ready.wait(30)
        deadline = time.monotonic() + args.report_s * 3 + 30
        while stats[2] < streams:
            if time.monotonic() > deadline:
                raise BenchError(f"{streams} streams: only {stats[2]} got a reply")
            time.sleep(0.2)
        first_reply_s = time.monotonic() - (deadline - args.report_s * 3 - 30)
        # Every stream reports again: steady state (and the RLQS process's metrics,
        # published once a second, have caught up).
        time.sleep(args.report_s)
        held = metric(node, "sitsmesh_rlqs_buckets")
        open_streams = metric(node, "sitsmesh_rlqs_streams")
        before = (stats[0], stats[1])
        assert proc.pid is not None
        cpu_before = (cpu_s(measured.proc.pid), cpu_s(rlqs.pid), cpu_s(proc.pid),
                      time.monotonic())
        times = measure(stub, key, args.checks, rate=args.rate)
        wall = time.monotonic() - cpu_before[3]
        server_cores = (cpu_s(measured.proc.pid) - cpu_before[0]) / wall
        rlqs_cores = (cpu_s(rlqs.pid) - cpu_before[1]) / wall
        load_cores = (cpu_s(proc.pid) - cpu_before[2]) / wall
        sent, answered = stats[0] - before[0], stats[1] - before[1]
        rss = rss_mb(rlqs.pid)
        pending = metric(node, "sitsmesh_rlqs_pending_work")
        ended = metric(node, "sitsmesh_rlqs_streams_not_reading_total")
        refused = metric(node, "sitsmesh_rlqs_buckets_refused_total")
    finally:
        stop.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    harness.wait_until(lambda: metric(node, "sitsmesh_rlqs_streams") == 0, 30,
                       "RLQS streams to be freed")
    # A reply per report, and pushes on top: fewer replies than reports (minus the ones
    # in flight at the end) means reports went unanswered.
    if answered < sent - streams:
        raise BenchError(f"{streams} streams: {answered} replies to {sent} reports")
    where = f"RLQS {rlqs.where} ({rlqs_cores:.2f} cores busy); " if rlqs.where else ""
    return {"times": times, "note": (
        f"{where}{open_streams:.0f} streams, {held:.0f} buckets held ({refused:.0f} refused, "
        f"{ended:.0f} streams ended not reading); {sent} reports, {answered} replies "
        f"during the Checks; "
        f"all streams answered in {first_reply_s:.1f} s; pending work {pending:.0f}; "
        f"RSS {rss:.0f} MB; measured server {server_cores:.2f} cores busy, load generator "
        f"{load_cores:.2f}")}


def glob_scenario(node: harness.Sitsmesh, stub: Any, key: str,
                  args: argparse.Namespace) -> dict[str, Any]:
    globs = "\n".join(f"  - 'glob-{i}-*-model'" for i in range(args.globs))
    yaml = ("name: globs\nstages:\n  - {name: model, match: {upstream_cluster: model}}\n"
            f"models:\n{globs}\n")
    start = time.monotonic()
    try:
        with grpc.insecure_channel(node.admin_addr, options=[
                ("grpc.max_send_message_length", 64 << 20)]) as channel:
            admin_pb2_grpc.AdminServiceStub(channel).ApplyPipeline(
                admin_pb2.ApplyPipelineRequest(yaml=yaml, source="globs.yaml"),
                metadata=node.admin_metadata(), timeout=120)
    except grpc.RpcError as exc:
        return {"times": [], "note": f"refused: {exc.code().name} {exc.details()}"[:300]}
    applied_s = time.monotonic() - start
    time.sleep(2)  # the catalog reaches the gate
    times = measure(stub, key, args.checks, unique_models=True, budget_s=args.glob_budget_s)
    return {"times": times, "note": (
        f"{args.globs} globs applied in {applied_s:.1f} s ({len(yaml) / 1024:.0f} KiB); "
        f"{len(times)} Checks, each naming a new model, in the {args.glob_budget_s:.0f} s budget")}


def row(name: str, result: dict[str, Any], idle_p99: float | None,
        control_p99: float | None = None) -> str:
    times = result["times"]
    if not times:
        return f"| {name} | 0 | - | - | - | - | - | {result['note']} |"
    p50, p99 = percentile(times, 50), percentile(times, 99)
    ratio = f"{p99 / idle_p99:.2f}" if idle_p99 else "1.00"
    versus = f"{p99 / control_p99:.2f}" if control_p99 else "-"
    return (f"| {name} | {len(times)} | {p50:.2f} | {p99:.2f} | {max(times):.1f} | {ratio} | "
            f"{versus} | {result['note']} |")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checks", type=int, default=2400)
    p.add_argument("--rate", type=float, default=200.0,
                   help="Checks a second (the caller is paced, so the Checks span "
                        "several report intervals); 0: back to back")
    p.add_argument("--streams", type=int, nargs="*", default=[30, 100])
    p.add_argument("--buckets", type=int, default=1000)
    p.add_argument("--report-s", type=float, default=5.0)
    p.add_argument("--globs", type=int, default=40_000)
    p.add_argument("--glob-budget-s", type=float, default=60.0)
    p.add_argument("--no-globs", action="store_true")
    p.add_argument("--no-pin", action="store_true",
                   help="leave every process on every core (see the docstring)")
    p.add_argument("--no-control", action="store_true",
                   help="skip the control rows (the same RLQS load on a second server)")
    p.add_argument("--no-rlqs-process", action="store_true",
                   help="skip the rows of RLQS served by a process of its own (--rlqs-addr)")
    args = p.parse_args(argv)
    # (name, result, the control's p99 for an RLQS row)
    results: list[tuple[str, dict[str, Any], float | None]] = []
    servers: list[harness.Sitsmesh] = []
    with tempfile.TemporaryDirectory(prefix="sitsmesh-isolation-") as tmp:
        work = Path(tmp)
        config = work / "edge.yaml"
        config.write_text(RATELIMIT_CONFIG)

        def serve(name: str, *extra: str) -> harness.Sitsmesh:
            servers.append(harness.start_sitsmesh(work, "--ratelimit-config", str(config),
                                                  *extra, name=name))
            return servers[-1]

        cores = sorted(os.sched_getaffinity(0))
        pinned = not args.no_pin and len(cores) >= 2
        try:
            if pinned:  # the measured servers, and every thread they start, inherit core 0
                os.sched_setaffinity(0, {cores[0]})
            node = serve("measured")
            apart: Rlqs | None = None
            if not args.no_rlqs_process:
                rlqs_addr = f"127.0.0.1:{harness.free_port()}"
                server = serve("rlqs-process", "--rlqs-addr", rlqs_addr)
                apart = Rlqs(rlqs_addr, server, rlqs_child(server), "in the RLQS process")
            if pinned:
                os.sched_setaffinity(0, set(cores[1:]))
                if apart is not None:
                    pin(apart.pid, set(cores[1:]))
                print(f"measured servers on core {cores[0]}; caller, load, control and the "
                      f"RLQS process on {cores[1:]}", file=sys.stderr)
            other = None if args.no_control else serve("control")
            with contextlib.ExitStack() as stack:
                def caller(server: harness.Sitsmesh) -> tuple[Any, str]:
                    channel = stack.enter_context(grpc.insecure_channel(server.data_addr))
                    stub = external_auth_pb2_grpc.AuthorizationStub(channel)
                    key = provision(server)
                    measure(stub, key, 200)  # warm-up
                    return stub, key

                stub, key = caller(node)
                apart_stub, apart_key = caller(apart.node) if apart else (None, "")
                idle: dict[str, Any] = {"times": measure(stub, key, args.checks,
                                                         rate=args.rate),
                                        "note": f"RSS {rss_mb(node.proc.pid):.0f} MB"}
                results.append(("idle", idle, None))
                print(row("idle", idle, None), file=sys.stderr)
                idle_p99 = percentile(idle["times"], 99)
                for streams in args.streams:
                    control_p99 = None
                    if other is not None:
                        name = f"control: {streams} RLQS streams on a second server"
                        result = rlqs_scenario(node, stub, key, args, streams, Rlqs(
                            other.data_addr, other, other.proc.pid, "on the second server"))
                        results.append((name, result, None))
                        print(row(name, result, idle_p99), file=sys.stderr)
                        control_p99 = percentile(result["times"], 99)
                    name = f"{streams} RLQS streams x {args.buckets} buckets"
                    result = rlqs_scenario(node, stub, key, args, streams,
                                           Rlqs(node.data_addr, node, node.proc.pid))
                    results.append((name, result, control_p99))
                    print(row(name, result, idle_p99, control_p99), file=sys.stderr)
                    if apart is not None:
                        name = f"{streams} RLQS streams, RLQS process"
                        result = rlqs_scenario(apart.node, apart_stub, apart_key, args,
                                               streams, apart)
                        results.append((name, result, control_p99))
                        print(row(name, result, idle_p99, control_p99), file=sys.stderr)
                again: dict[str, Any] = {
                    "times": measure(stub, key, args.checks, rate=args.rate),
                    "note": "idle again, after the RLQS streams: the machine's noise; "
                            f"RSS {rss_mb(node.proc.pid):.0f} MB"}
                results.append(("idle (after)", again, None))
                print(row("idle (after)", again, idle_p99), file=sys.stderr)
                if not args.no_globs:
                    name = f"{args.globs}-glob pipeline, unseen models"
                    results.append((name, glob_scenario(node, stub, key, args), None))
                    print(row(name, results[-1][1], idle_p99), file=sys.stderr)
        except (BenchError, grpc.RpcError, TimeoutError, RuntimeError) as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            return 1
        finally:
            for started in servers:
                started.kill()
    print("| scenario | Checks | p50 ms | p99 ms | max ms | p99 / idle p99 "
          "| p99 / control p99 | notes |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    idle_p99 = percentile(results[0][1]["times"], 99)
    for name, result, control in results:
        print(row(name, result, idle_p99 if name != "idle" else None, control))
    for where, suffix in (("in the data process", " buckets"),
                          ("from the RLQS process", ", RLQS process")):
        rlqs = [(percentile(r["times"], 99), c) for n, r, c in results[1:]
                if r["times"] and n[0].isdigit() and n.endswith(suffix)]
        if not rlqs:
            continue
        worst = max(p99 / idle_p99 for p99, _ in rlqs)
        print(f"\nRLQS {where}, goal (p99 <= {GOAL}x idle): "
              f"{'met' if worst <= GOAL else 'missed'} (worst {worst:.2f}x)")
        controlled = [p99 / c for p99, c in rlqs if c]
        if controlled:
            print(f"Against the control (same load on a second server): worst "
                  f"{max(controlled):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
