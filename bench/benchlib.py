"""The shared benchmark harness: processes, h2load rounds, CPU accounting and the tables.

A benchmark script builds a list of `Target`s (the first is the baseline), each
made of `Proc`s, a setup that waits for readiness and checks correctness, and
optionally server-side counters that every round must move exactly; then
`run_bench` starts them, warms them up, loads them with h2load in interleaved
rounds, stops them and prints the markdown tables. Scripts in this directory
import it as `import benchlib as bl` (the directory of the running script is
on sys.path).
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
STOP_LOG_LINES = 120  # of a replica that did not stop cleanly: its stacks, when it dumped them

COUNTER_SETTLE_S = 3.0  # longer than sitsmesh's 1 s metrics flush
FLUSH_WAIT_S = 1.2  # sitsmesh flushes per-rule sums into Prometheus every second


class BenchError(Exception):
    """A target could not be started, verified, loaded or stopped cleanly."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_until(predicate: Callable[[], bool], timeout: float, what: str,
               interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise BenchError(f"timed out after {timeout}s waiting for {what}")


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith("SITSMESH_") and k != "PROMETHEUS_MULTIPROC_DIR"}


def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        body: bytes = resp.read()
    return body.decode()


def envoy_ready(admin_port: int, *, sitsmesh: bool) -> bool:
    """Envoy's admin says LIVE and, when it fronts sitsmesh, every sitsmesh_data host is
    healthy (ext_authz and ratelimit calls fail until the health check passes)."""
    try:
        if http_get(f"http://127.0.0.1:{admin_port}/ready", timeout=1).strip() != "LIVE":
            return False
        if not sitsmesh:
            return True
        clusters = http_get(f"http://127.0.0.1:{admin_port}/clusters", timeout=1)
    except OSError:
        return False
    return "sitsmesh_data::" in clusters and all(
        line.endswith("::health_flags::healthy") for line in clusters.splitlines()
        if line.startswith("sitsmesh_data::") and "::health_flags::" in line)


# --------------------------------------------------------------------------- processes

def by_role(role: str, leader: int, pid: int) -> str:
    """CPU-split name of a process: its Proc's role, or a child of that role."""
    return role if pid == leader else f"{role} child {pid}"


@dataclass
class Proc:
    """One child process in its own session, its output in a log file."""

    role: str  # names the process in logs and in the CPU split
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=clean_env)
    # Names each process of the group in the CPU split: (role, leader pid, pid) -> name.
    cpu_name: Callable[[str, int, int], str] = by_role
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
                    # The log goes with the bench's directory: a stuck stop's stacks
                    # (sitsmesh/app/stopbound.py) are only seen here.
                    errors.append(f"{self.role} exited {code} after SIGTERM:\n"
                                  f"{self.output_tail(STOP_LOG_LINES)}")
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
    groups = {p.proc.pid: p for p in procs if p.proc is not None}
    cpu: dict[str, float] = {}
    for pid, fields in _proc_stats():
        p = groups.get(int(fields[2]))
        if p is not None and p.proc is not None:
            with contextlib.suppress(OSError):  # cpu_name may read /proc of a process now gone
                name = p.cpu_name(p.role, p.proc.pid, pid)
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
    """A `sitsmesh serve` (extra args appended); returns it with its data and metrics addresses."""
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


# --------------------------------------------------------------------------- gRPC

def grpc_frame(message: Any) -> bytes:
    """A message as one gRPC frame: 1 byte "not compressed", 4 bytes big-endian length."""
    body: bytes = message.SerializeToString()
    return b"\x00" + len(body).to_bytes(4, "big") + body


def grpc_args(body: Path) -> list[str]:
    """h2load arguments for a gRPC unary call with the framed request in `body`."""
    return ["-d", str(body), "-H", "content-type: application/grpc", "-H", "te: trailers"]


async def serve_grpc(server: grpc.aio.Server, addr: str) -> None:
    """Bind a grpc.aio server with its services added to addr; serve until SIGTERM/SIGINT."""
    if server.add_insecure_port(addr) == 0:
        raise SystemExit(f"cannot bind {addr}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)


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
    # More servers loaded at once with `url` (replicas): the requests and clients are
    # split evenly, one h2load each, started together; rates are the sum.
    extra_urls: list[str] = field(default_factory=list)
    # Several h2loads on each URL at once, each adding one of these argument sets to
    # h2load_args (h2load sends one -d body, so one set per request body); requests and
    # clients are split evenly as for extra_urls. Empty: one h2load per URL.
    arg_sets: list[list[str]] = field(default_factory=list)
    notes: Callable[[], list[str]] = list  # facts observed during the run, printed at the end
    # Wait before reading a round's baseline counters; 0 when every counter is immediate.
    flush_wait_s: float = FLUSH_WAIT_S
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

    def settled_counters(self) -> dict[str, float]:
        """Counters once earlier traffic has been flushed, so a baseline includes all of it."""
        if self.expected(1):
            time.sleep(self.flush_wait_s)
        return self.counters()

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


# --------------------------------------------------------------------------- h2load

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


def _checked_rate(code: int, out: str, err: str, target: Target, requests: int) -> float:
    """One h2load's req/s, after checking every request got its 2xx and its bytes."""
    if code != 0:
        raise BenchError(f"h2load exited {code}: {err.strip()}\n{out}")
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
    return float(finished.group(1))


def split_requests(requests: int, parts: int) -> list[int]:
    """How run_h2load shares a round among its h2loads (in URL, then argument-set order):
    evenly, the remainder to the first."""
    share, extra = divmod(requests, parts)
    return [share + (extra if n == 0 else 0) for n in range(parts)]


def run_h2load(h2load: str, target: Target, args: argparse.Namespace, requests: int,
               workdir: Path, extra_args: Sequence[str] = ()) -> LoadResult:
    """One checked h2load run; `extra_args` (e.g. `--rps=N`) go before the target's own."""
    loads = [(url, arg_set) for url in [target.url, *target.extra_urls]
             for arg_set in target.arg_sets or [[]]]
    clients = max(1, args.clients // len(loads))
    runs = []
    for n, ((url, arg_set), count) in enumerate(
            zip(loads, split_requests(requests, len(loads)), strict=True)):
        log_file = workdir / f"h2load-{n}.log"
        log_file.unlink(missing_ok=True)  # h2load appends; a stale log would skew the count
        argv = [h2load, "-n", str(count), "-c", str(clients), "-m", str(args.streams),
                "-t", str(args.threads), *extra_args, *target.h2load_args, *arg_set,
                "--log-file", str(log_file), url]
        runs.append((argv, log_file, count))
    before = target.settled_counters()
    cpu_before = procs_cpu(target.procs)
    child_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv, _, _ in runs]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, args.timeout
                                                        - (time.monotonic() - started))))
    except subprocess.TimeoutExpired as exc:
        for proc in procs:
            proc.kill()
            proc.wait()
        raise BenchError(f"h2load timed out after {args.timeout}s") from exc
    wall = time.monotonic() - started
    child_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_after = procs_cpu(target.procs)
    after = target.counters()
    client_cpu = (child_after.ru_utime - child_before.ru_utime
                  + child_after.ru_stime - child_before.ru_stime)
    server_cpu = {k: v - cpu_before.get(k, 0.0) for k, v in cpu_after.items()}
    rate = 0.0
    durations: list[int] = []
    for proc, (out, err), (_, log_file, count) in zip(procs, outputs, runs, strict=True):
        rate += _checked_rate(proc.returncode, out, err, target, count)
        # --log-file: one line per request, "<start µs>\t<status>\t<duration µs>".
        lines = [int(line.split("\t")[2]) for line in log_file.read_text().splitlines() if line]
        log_file.unlink()
        if len(lines) != count:
            raise BenchError(f"h2load log has {len(lines)} lines, expected {count}")
        durations += lines
    target.check_counters(before, after, requests)
    durations.sort()
    # Several started together: the slowest one bounds the combined rate.
    finished_rate = rate if len(runs) == 1 else requests / wall
    return LoadResult(finished_rate, percentile(durations, 50) / 1000,
                      percentile(durations, 99) / 1000, wall, client_cpu, server_cpu)


# --------------------------------------------------------------------------- report

def render_table(targets: Sequence[Target], rounds: int, p99: bool = True) -> str:
    base = targets[0]
    base_median = statistics.median(base.rates) if base.rates else None
    with_goal = any(t.goal is not None for t in targets)  # the goal column only when used
    latency = " p50 (ms) | p99 (ms) |" if p99 else " p50 latency (ms) |"
    lines = ["| target | median req/s | ratio vs baseline |" + (" goal |" if with_goal else "")
             + latency + " server CPU (µs/req) | server cores busy "
             "| h2load cores busy | rounds ok | req/s per round |",
             "|---|---:|---:|" + ("---|" if with_goal else "") + ("---:|---:|" if p99 else "---:|")
             + "---:|---:|---:|---:|---|"]
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
        if not p99:
            del cells[4]
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
              h2load: str, title: str | None = None, p99: bool = True) -> int:
    """Start, verify, warm up and load every target in interleaved rounds; print the tables.

    A title heads the summary line, which then also gives the run's wall time;
    p99=False leaves the p99 latency out of the progress lines and the table.
    """
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
                tail = f"p99 {res.p99_ms:6.2f} ms  " if p99 else ""
                print(f"round {rnd + 1}/{args.rounds}  {t.name:<46} "
                      f"{res.req_per_s:>9,.0f} req/s  p50 {res.p50_ms:6.2f} ms  "
                      f"{tail}server {t.server_cores[-1]:.2f} cores  "
                      f"h2load {t.client_cores[-1]:.2f} cores", file=sys.stderr, flush=True)
    finally:
        for t in targets:
            for p in reversed(t.procs):
                t.errors.extend(p.stop())
    failed = [t for t in targets if t.errors or len(t.rates) != args.rounds]
    summary = (f"h2load -t{args.threads} -c{args.clients} -m{args.streams}, "
               f"{args.requests} requests/round, {args.rounds} rounds, {os.cpu_count()} CPUs")
    if title is not None:
        summary = f"{title}: {summary}, {time.monotonic() - started:.0f} s"
    print(f"\n{summary}\n")
    print(render_table(targets, args.rounds, p99))
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


# --------------------------------------------------------------------------- command line

def load_parser(doc: str | None, *, requests: int, rounds: int = 3, warmup: int = 1000,
                timeout: float = 30.0, ready_timeout: float = 30.0,
                ready: str = "ready") -> argparse.ArgumentParser:
    """A parser described by the script's docstring, with the load flags every benchmark takes.

    `ready` says what --ready-timeout waits for.
    """
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0] if doc else None)
    p.add_argument("--rounds", type=int, default=rounds,
                   help=f"rounds per target (default {rounds})")
    p.add_argument("--requests", type=int, default=requests,
                   help=f"requests per h2load run (default {requests})")
    p.add_argument("--warmup", type=int, default=warmup,
                   help=f"uncounted warm-up requests per target (default {warmup})")
    p.add_argument("--clients", type=int, default=16, help="h2load -c (default 16)")
    p.add_argument("--streams", type=int, default=10, help="h2load -m (default 10)")
    p.add_argument("--threads", type=int, default=1, help="h2load -t (default 1)")
    p.add_argument("--timeout", type=float, default=timeout,
                   help=f"seconds allowed per h2load run (default {timeout:g})")
    p.add_argument("--ready-timeout", type=float, default=ready_timeout,
                   help=f"seconds allowed for a target to become {ready} "
                        f"(default {ready_timeout:g})")
    return p


def parse_load_args(p: argparse.ArgumentParser,
                    argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse, and reject load flags h2load cannot honour."""
    args = p.parse_args(argv)
    if args.rounds < 1 or args.requests < 1 or args.warmup < 1:
        p.error("--rounds, --requests and --warmup must be >= 1")
    if args.threads > args.clients:
        p.error("--threads must not exceed --clients")
    return args


def find_h2load() -> str | None:
    h2load = shutil.which("h2load")
    if h2load is None:
        print("h2load not found: apt-get install -y nghttp2-client", file=sys.stderr)
    return h2load
