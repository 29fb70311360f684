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

The process, h2load and table helpers here are shared with ratelimit_envoy.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SITSMESH = str(BIN / "sitsmesh")
METHOD = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
DOMAIN = "bench"
TINY_DOMAIN = "bench-tiny"
HUGE_LIMIT = 1_000_000_000
NOOP = "no-op grpc.aio RateLimitService"
MEMORY = "sitsmesh serve, memory store"
REDIS = "sitsmesh serve, redis store"
GOALS = {MEMORY: 0.85, REDIS: 0.60}
# Slack on each sitsmesh reply's size: limit_remaining and duration_until_reset are varints.
SIZE_SLACK = 8


COUNTER_SETTLE_S = 3.0  # longer than sitsmesh's 1 s metrics flush
FLUSH_WAIT_S = 1.2  # sitsmesh flushes per-rule sums into Prometheus every second


def settled_counters(target: Any) -> dict[str, float]:
    """Counters once earlier traffic has been flushed, so a baseline includes all of it."""
    if target.expected(1):
        time.sleep(FLUSH_WAIT_S)
    counters: dict[str, float] = target.counters()
    return counters

class BenchError(Exception):
    """A target could not be started, verified, loaded or stopped cleanly."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise BenchError(f"timed out after {timeout}s waiting for {what}")


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith("SITSMESH_") and k != "PROMETHEUS_MULTIPROC_DIR"}


def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        body: bytes = resp.read()
    return body.decode()


# --------------------------------------------------------------------------- processes

@dataclass
class Proc:
    """One child process in its own session, its output in a log file."""

    role: str  # names the process in logs and in the CPU split
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=clean_env)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, cwd=REPO, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        if not self.alive():
            raise BenchError(f"{self.role} exited early:\n{self.output_tail()}")

    def output_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 20.0) -> list[str]:
        """SIGTERM, expect exit 0 and no survivor in its group; kill the group anyway."""
        proc = self.proc
        errors: list[str] = []
        if proc is None:
            return errors
        try:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                errors.append(f"{self.role} did not exit within {timeout}s of SIGTERM")
            else:
                if code != 0:
                    errors.append(f"{self.role} exited {code} after SIGTERM")
            deadline = time.monotonic() + 5
            while _group_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _group_alive(proc.pid):
                errors.append(f"{self.role}: child processes survived the graceful stop")
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        return errors


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _proc_stats() -> list[tuple[int, list[str]]]:
    out: list[tuple[int, list[str]]] = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            out.append((int(stat.parent.name), stat.read_text().rsplit(")", 1)[1].split()))
    return out


def procs_cpu(procs: Sequence[Proc]) -> dict[str, float]:
    """CPU seconds (user+system) of every live process in each Proc's group."""
    groups = {p.proc.pid: p.role for p in procs if p.proc is not None}
    cpu: dict[str, float] = {}
    for pid, fields in _proc_stats():
        role = groups.get(int(fields[2]))
        if role is not None:
            name = role if pid in groups else f"{role} child {pid}"
            cpu[name] = (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return cpu


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg(0) also succeeds for zombies; count only live members.
    return any(int(fields[2]) == pgid and fields[0] != "Z" for _, fields in _proc_stats())


def sitsmesh_proc(role: str, workdir: Path, *extra: str) -> tuple[Proc, str, str]:
    """A 1-worker `sitsmesh serve`; returns it with its data and metrics addresses."""
    data, admin, metrics = (f"127.0.0.1:{free_port()}" for _ in range(3))
    state = workdir / f"state-{role}"
    argv = [SITSMESH, "serve", "--data-addr", data, "--admin-addr", admin,
            "--metrics-addr", metrics, "--state-dir", str(state),
            "--drain-seconds", "0", "--log-level", "warning", *extra]
    return Proc(role, argv, workdir / f"{role}.log"), data, metrics


def metric_samples(metrics_addr: str) -> dict[str, float]:
    """Every sample on a Prometheus /metrics page, keyed `name{label="v",...}` (sorted)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(http_get(f"http://{metrics_addr}/metrics")):
        for s in family.samples:
            out[sample_key(s.name, **s.labels)] = float(s.value)
    return out


def sample_key(name: str, **labels: str) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def sitsmesh_expectations(domain: str, key: str, requests: int) -> dict[str, float]:
    """Counter deltas of a sitsmesh whose every ShouldRateLimit in a round was within limit."""
    stats_key = f"{domain}.{key}"
    return {
        sample_key("sitsmesh_grpc_server_handled_total", server="data",
                   grpc_service="envoy.service.ratelimit.v3.RateLimitService",
                   grpc_method="ShouldRateLimit", grpc_code="OK"): requests,
        sample_key("sitsmesh_ratelimit_hits_total", key=stats_key,
                   outcome="total_hits"): requests,
        sample_key("sitsmesh_ratelimit_hits_total", key=stats_key,
                   outcome="within_limit"): requests,
        sample_key("sitsmesh_ratelimit_hits_total", key=stats_key, outcome="over_limit"): 0,
    }


# --------------------------------------------------------------------------- targets

@dataclass
class Target:
    name: str
    url: str  # what h2load loads
    procs: list[Proc]  # started in this order, stopped in reverse; their CPU is the target's
    setup: Callable[[], None]  # wait until ready, then check correctness; raises BenchError
    h2load_args: list[str]  # besides -n -c -m -t and the URL
    # DATA bytes each response must carry (min, max); set by setup when it depends on it.
    response_bytes: tuple[int, int] = (0, 0)
    # Server-side counters read before and after each round ...
    counters: Callable[[], dict[str, float]] = dict
    # ... and the exact growth each must show for a round of n requests.
    expected: Callable[[int], dict[str, float]] = lambda n: {}
    goal: float | None = None  # wanted ratio vs the baseline, reported only
    notes: Callable[[], list[str]] = list  # facts observed during the run, printed at the end
    rates: list[float] = field(default_factory=list)
    p50_ms: list[float] = field(default_factory=list)
    p99_ms: list[float] = field(default_factory=list)
    server_us_per_req: list[float] = field(default_factory=list)
    server_cores: list[float] = field(default_factory=list)
    client_cores: list[float] = field(default_factory=list)
    cpu_by_process: dict[str, float] = field(default_factory=dict)  # summed over rounds
    errors: list[str] = field(default_factory=list)

    def alive(self) -> bool:
        return all(p.alive() for p in self.procs)

    def check_counters(self, before: dict[str, float], after: dict[str, float],
                       requests: int) -> None:
        # sitsmesh moves per-rule sums into Prometheus once a second: re-read for a while.
        deadline = time.monotonic() + COUNTER_SETTLE_S
        while True:
            wrong = []
            for key, want in self.expected(requests).items():
                got = after.get(key, 0.0) - before.get(key, 0.0)
                if got != want:
                    wrong.append(f"{key}: grew by {got:g}, expected {want:g}")
            if not wrong:
                return
            if time.monotonic() > deadline:
                raise BenchError("server counters disagree with the load:\n  "
                                 + "\n  ".join(wrong))
            time.sleep(0.2)
            after = self.counters()


@dataclass(frozen=True)
class LoadResult:
    req_per_s: float
    p50_ms: float
    p99_ms: float
    wall_s: float
    client_cpu_s: float  # h2load's user+system CPU
    server_cpu_s: dict[str, float]  # per process of the target


_FINISHED = re.compile(r"finished in [\d.]+\w+, ([\d.]+) req/s")
_REQUESTS = re.compile(r"requests: (\d+) total, \d+ started, (\d+) done, (\d+) succeeded, "
                       r"(\d+) failed, (\d+) errored, (\d+) timeout")
_STATUS = re.compile(r"status codes: (\d+) 2xx")
_DATA = re.compile(r"traffic: .*?\((\d+)\) data")


def percentile(sorted_values: Sequence[int], pct: float) -> int:
    """Nearest-rank percentile of an ascending sequence."""
    return sorted_values[max(0, math.ceil(pct / 100 * len(sorted_values)) - 1)]


def run_h2load(h2load: str, target: Target, args: argparse.Namespace, requests: int,
               workdir: Path) -> LoadResult:
    log_file = workdir / "h2load.log"
    log_file.unlink(missing_ok=True)  # h2load appends; a stale log would skew the count
    argv = [h2load, "-n", str(requests), "-c", str(args.clients), "-m", str(args.streams),
            "-t", str(args.threads), *target.h2load_args, "--log-file", str(log_file),
            target.url]
    before = settled_counters(target)
    cpu_before = procs_cpu(target.procs)
    child_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout,
                              check=False)
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"h2load timed out after {args.timeout}s") from exc
    wall = time.monotonic() - started
    child_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_after = procs_cpu(target.procs)
    after = target.counters()
    client_cpu = (child_after.ru_utime - child_before.ru_utime
                  + child_after.ru_stime - child_before.ru_stime)
    server_cpu = {k: v - cpu_before.get(k, 0.0) for k, v in cpu_after.items()}
    out = done.stdout
    if done.returncode != 0:
        raise BenchError(f"h2load exited {done.returncode}: {done.stderr.strip()}\n{out}")
    finished, reqs = _FINISHED.search(out), _REQUESTS.search(out)
    status, data = _STATUS.search(out), _DATA.search(out)
    if not (finished and reqs and status and data):
        raise BenchError(f"cannot parse h2load output:\n{out}")
    total, done_n, ok, failed, errored, timed_out = (int(g) for g in reqs.groups())
    ok_2xx, data_bytes = int(status.group(1)), int(data.group(1))
    if not (total == done_n == ok == ok_2xx == requests) or failed or errored or timed_out:
        raise BenchError(f"not all requests succeeded with 2xx:\n{out}")
    low, high = target.response_bytes
    if not requests * low <= data_bytes <= requests * high:
        raise BenchError(f"expected {low}..{high} DATA bytes per response, got "
                         f"{data_bytes} for {requests} requests:\n{out}")
    target.check_counters(before, after, requests)
    # --log-file: one line per request, "<start µs>\t<status>\t<duration µs>".
    durations = sorted(int(line.split("\t")[2])
                       for line in log_file.read_text().splitlines() if line)
    log_file.unlink()
    if len(durations) != requests:
        raise BenchError(f"h2load log has {len(durations)} lines, expected {requests}")
    return LoadResult(float(finished.group(1)), percentile(durations, 50) / 1000,
                      percentile(durations, 99) / 1000, wall, client_cpu, server_cpu)


def render_table(targets: Sequence[Target], rounds: int) -> str:
    base = targets[0]
    base_median = statistics.median(base.rates) if base.rates else None
    with_goal = any(t.goal is not None for t in targets)  # the goal column only when used
    lines = ["| target | median req/s | ratio vs baseline |" + (" goal |" if with_goal else "")
             + " p50 (ms) | p99 (ms) | server CPU (µs/req) | server cores busy "
             "| h2load cores busy | rounds ok | req/s per round |",
             "|---|---:|---:|" + ("---|" if with_goal else "")
             + "---:|---:|---:|---:|---:|---:|---|"]
    for t in targets:
        goal = "-" if t.goal is None else f"≥ {t.goal:.2f}"
        if t.rates:
            median = statistics.median(t.rates)
            ratio = median / base_median if base_median else None
            if t.goal is not None and ratio is not None:
                goal += " met" if ratio >= t.goal else " **not met**"
            cells = [f"{median:,.0f}", "n/a" if ratio is None else f"{ratio:.2f}", goal,
                     f"{statistics.median(t.p50_ms):.2f}", f"{statistics.median(t.p99_ms):.2f}",
                     f"{statistics.median(t.server_us_per_req):.0f}",
                     f"{statistics.median(t.server_cores):.2f}",
                     f"{statistics.median(t.client_cores):.2f}"]
        else:
            cells = ["failed", "n/a", goal, "n/a", "n/a", "n/a", "n/a", "n/a"]
        if not with_goal:
            del cells[2]
        per_round = ", ".join(f"{r:,.0f}" for r in t.rates) or "-"
        lines.append(f"| {t.name} | {' | '.join(cells)} | {len(t.rates)}/{rounds} "
                     f"| {per_round} |")
    return "\n".join(lines)


def render_cpu_split(targets: Sequence[Target]) -> str:
    """Share of each target's CPU per process, over all measured rounds."""
    lines = []
    for t in targets:
        total = sum(t.cpu_by_process.values())
        if total <= 0:
            continue
        parts = ", ".join(f"{name} {secs / total:.0%}"
                          for name, secs in sorted(t.cpu_by_process.items()))
        lines.append(f"- {t.name}: {parts}")
    return "\n".join(lines) or "- (no measured rounds)"


def run_bench(targets: Sequence[Target], args: argparse.Namespace, workdir: Path,
              h2load: str, title: str) -> int:
    """Start, verify, warm up and load every target in interleaved rounds; print the tables."""
    started = time.monotonic()
    try:
        for t in targets:
            for p in t.procs:
                p.start()
        for t in targets:
            try:
                t.setup()
                run_h2load(h2load, t, args, args.warmup, workdir)  # warm-up, not counted
            except BenchError as exc:
                t.errors.append(f"setup: {exc}")
        live = [t for t in targets if not t.errors]
        for rnd in range(args.rounds):
            shift = rnd % len(live) if live else 0
            for t in live[shift:] + live[:shift]:
                if not t.alive():
                    t.errors.append(f"round {rnd + 1}: a process had exited")
                    continue
                try:
                    res = run_h2load(h2load, t, args, args.requests, workdir)
                except BenchError as exc:
                    t.errors.append(f"round {rnd + 1}: {exc}")
                    continue
                server_cpu = sum(res.server_cpu_s.values())
                t.rates.append(res.req_per_s)
                t.p50_ms.append(res.p50_ms)
                t.p99_ms.append(res.p99_ms)
                t.server_us_per_req.append(server_cpu * 1e6 / args.requests)
                t.server_cores.append(server_cpu / res.wall_s)
                t.client_cores.append(res.client_cpu_s / res.wall_s)
                for proc_name, secs in res.server_cpu_s.items():
                    t.cpu_by_process[proc_name] = t.cpu_by_process.get(proc_name, 0) + secs
                print(f"round {rnd + 1}/{args.rounds}  {t.name:<46} "
                      f"{res.req_per_s:>9,.0f} req/s  p50 {res.p50_ms:6.2f} ms  "
                      f"p99 {res.p99_ms:6.2f} ms  server {t.server_cores[-1]:.2f} cores  "
                      f"h2load {t.client_cores[-1]:.2f} cores", file=sys.stderr, flush=True)
    finally:
        for t in targets:
            for p in reversed(t.procs):
                t.errors.extend(p.stop())
    failed = [t for t in targets if t.errors or len(t.rates) != args.rounds]
    print(f"\n{title}: h2load -t{args.threads} -c{args.clients} -m{args.streams}, "
          f"{args.requests} requests/round, {args.rounds} rounds, {os.cpu_count()} CPUs, "
          f"{time.monotonic() - started:.0f} s\n")
    print(render_table(targets, args.rounds))
    print("\nServer CPU by process (all measured rounds):\n")
    print(render_cpu_split(targets))
    notes = [f"- {t.name}: {note}" for t in targets for note in t.notes()]
    if notes:
        print("\nNotes:\n")
        print("\n".join(notes))
    for t in failed:
        print(f"\nFAILED {t.name}:", file=sys.stderr)
        for err in t.errors or ["fewer successful rounds than requested"]:
            print(f"  {err}", file=sys.stderr)
        for p in t.procs:
            tail = p.output_tail()
            if tail:
                print(f"  --- last output of {p.role} ---\n{tail}", file=sys.stderr)
    return 1 if failed else 0


def add_load_args(p: argparse.ArgumentParser, requests: int) -> None:
    p.add_argument("--rounds", type=int, default=3, help="rounds per target (default 3)")
    p.add_argument("--requests", type=int, default=requests,
                   help=f"requests per h2load run (default {requests})")
    p.add_argument("--warmup", type=int, default=1000,
                   help="uncounted warm-up requests per target (default 1000)")
    p.add_argument("--clients", type=int, default=16, help="h2load -c (default 16)")
    p.add_argument("--streams", type=int, default=10, help="h2load -m (default 10)")
    p.add_argument("--threads", type=int, default=1, help="h2load -t (default 1)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds allowed per h2load run (default 30)")
    p.add_argument("--ready-timeout", type=float, default=30.0,
                   help="seconds allowed for a target to become ready (default 30)")


def check_load_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.rounds < 1 or args.requests < 1 or args.warmup < 1:
        p.error("--rounds, --requests and --warmup must be >= 1")
    if args.threads > args.clients:
        p.error("--threads must not exceed --clients")


def find_h2load() -> str | None:
    h2load = shutil.which("h2load")
    if h2load is None:
        print("h2load not found: apt-get install -y nghttp2-client", file=sys.stderr)
    return h2load


# --------------------------------------------------------------------------- gRPC targets

def rls_request(domain: str, value: str) -> Any:
    from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
    from envoy.service.ratelimit.v3 import rls_pb2

    entry = ratelimit_pb2.RateLimitDescriptor.Entry(key="user", value=value)
    return rls_pb2.RateLimitRequest(
        domain=domain, descriptors=[ratelimit_pb2.RateLimitDescriptor(entries=[entry])])


def grpc_frame(message: Any) -> bytes:
    body: bytes = message.SerializeToString()
    return b"\x00" + len(body).to_bytes(4, "big") + body


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
        raise BenchError(f"{what}: expected {names(code)} with one status, got "
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
            raise BenchError(f"domain {DOMAIN}: the reply does not carry the configured "
                             f"limit {HUGE_LIMIT}/s (no rule matched?): {reply}")
        # Counting happens: the tiny domain allows one hit, so the second is over the limit.
        value = f"check-{time.time_ns()}"
        _check_reply(should_rate_limit(addr, TINY_DOMAIN, value), ok,
                     f"domain {TINY_DOMAIN}, 1st call")
        _check_reply(should_rate_limit(addr, TINY_DOMAIN, value), over,
                     f"domain {TINY_DOMAIN}, 2nd call")
    except grpc.RpcError as exc:
        raise BenchError(f"ShouldRateLimit failed: {exc}") from exc
    return len(grpc_frame(reply))


def write_configs(workdir: Path) -> list[str]:
    bench = workdir / "bench.yaml"
    bench.write_text(f"domain: {DOMAIN}\ndescriptors:\n  - key: user\n    rate_limit:\n"
                     f"      unit: second\n      requests_per_unit: {HUGE_LIMIT}\n")
    tiny = workdir / "bench-tiny.yaml"
    tiny.write_text(f"domain: {TINY_DOMAIN}\ndescriptors:\n  - key: user\n    rate_limit:\n"
                    "      unit: day\n      requests_per_unit: 1\n")
    return ["--ratelimit-config", str(bench), "--ratelimit-config", str(tiny)]


def grpc_args(body: Path) -> list[str]:
    return ["-d", str(body), "-H", "content-type: application/grpc", "-H", "te: trailers"]


def noop_target(workdir: Path, args: argparse.Namespace, body: Path) -> Target:
    addr = f"127.0.0.1:{free_port()}"
    proc = Proc("no-op server", [sys.executable, str(Path(__file__).resolve()),
                                 "--serve-noop", addr], workdir / "noop.log")

    def setup() -> None:
        from envoy.service.ratelimit.v3 import rls_pb2

        def ready() -> bool:
            proc.check_alive()
            return _answers(addr)

        wait_until(ready, args.ready_timeout, f"{NOOP} on {addr}")
        try:
            reply = should_rate_limit(addr, DOMAIN, "bench")
        except grpc.RpcError as exc:
            raise BenchError(f"ShouldRateLimit failed: {exc}") from exc
        _check_reply(reply, rls_pb2.RateLimitResponse.OK, NOOP)
        size = len(grpc_frame(reply))
        target.response_bytes = (size, size)

    target = Target(NOOP, f"http://{addr}{METHOD}", [proc], setup, grpc_args(body))
    return target


def sitsmesh_target(name: str, workdir: Path, args: argparse.Namespace, body: Path,
                    configs: list[str], redis: bool) -> Target:
    procs: list[Proc] = []
    extra = list(configs)
    redis_port = 0
    if redis:
        redis_port = free_port()
        procs.append(Proc("redis-server", [
            args.redis_server, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(workdir), "--daemonize", "no", "--logfile", ""],
            workdir / "redis.log"))
        extra += ["--ratelimit-store", "redis", "--redis-url",
                  f"redis://127.0.0.1:{redis_port}/0", "--on-store-error", "deny",
                  "--redis-timeout-ms", str(args.redis_timeout_ms)]
    else:
        extra += ["--ratelimit-store", "memory"]
    sitsmesh, data, metrics = sitsmesh_proc("sitsmesh-redis" if redis else "sitsmesh-memory",
                                            workdir, *extra)
    procs.append(sitsmesh)

    most_clients = [0]

    def counters() -> dict[str, float]:
        try:
            out = metric_samples(metrics)
            if redis:
                out.update(redis_calls(redis_port))
                most_clients[0] = max(most_clients[0], int(out["redis connected clients"]))
        except OSError as exc:
            raise BenchError(f"cannot read counters: {exc}") from exc
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

        wait_until(ready, args.ready_timeout, f"{name} on {data}")
        size = verify_sitsmesh_rls(data)
        target.response_bytes = (size - SIZE_SLACK, size + SIZE_SLACK)
        if redis and not redis_calls(redis_port)["redis evalsha calls"]:
            raise BenchError("no EVALSHA reached redis-server: the store is not Redis")

    target = Target(name, f"http://{data}{METHOD}", procs, setup, grpc_args(body),
                    counters=counters, expected=expected, goal=GOALS[name], notes=notes)
    return target


def redis_calls(port: int) -> dict[str, float]:
    """Script calls redis-server has executed (INFO commandstats), and its open connections."""
    import redis as redis_py

    client = redis_py.Redis(host="127.0.0.1", port=port, socket_timeout=5)
    try:
        info: dict[str, Any] = client.info("commandstats")
        clients: dict[str, Any] = client.info("clients")
    except redis_py.RedisError as exc:
        raise BenchError(f"cannot read redis-server INFO: {exc}") from exc
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
    if server.add_insecure_port(addr) == 0:
        raise SystemExit(f"cannot bind {addr}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)


def bench(args: argparse.Namespace) -> int:
    h2load = find_h2load()
    if h2load is None:
        return 2
    with tempfile.TemporaryDirectory(prefix="sitsmesh-rl-bench-") as tmp:
        workdir = Path(tmp)
        body = workdir / "should-rate-limit.grpc"
        body.write_bytes(grpc_frame(rls_request(DOMAIN, "bench")))
        configs = write_configs(workdir)
        targets = [noop_target(workdir, args, body),
                   sitsmesh_target(MEMORY, workdir, args, body, configs, redis=False)]
        if args.redis_server:
            targets.append(sitsmesh_target(REDIS, workdir, args, body, configs, redis=True))
        code = run_bench(targets, args, workdir, h2load, "ShouldRateLimit, direct gRPC")
        if not args.redis_server:
            print("\nredis-server not found: the Redis target was not run "
                  "(apt-get install -y redis-server)", file=sys.stderr)
            code = 1
        return code


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_load_args(p, requests=10000)
    p.add_argument("--redis-server", default=shutil.which("redis-server"),
                   help="redis-server binary (default: from PATH)")
    p.add_argument("--redis-timeout-ms", type=int, default=50,
                   help="sitsmesh --redis-timeout-ms for the Redis target (default 50, "
                        "sitsmesh's default)")
    p.add_argument("--serve-noop", metavar="ADDR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    check_load_args(p, args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_noop:
        asyncio.run(serve_noop(args.serve_noop))
        return 0
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
