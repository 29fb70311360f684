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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SITSMESH = str(BIN / "sitsmesh")
METHOD = "/grpc.health.v1.Health/Check"
# gRPC frame: 1 byte "not compressed", 4 bytes big-endian length 0 = empty HealthCheckRequest.
REQUEST_FRAME = b"\x00\x00\x00\x00\x00"
# Framed HealthCheckResponse{status: SERVING}: 5-byte header + b"\x08\x01".
RESPONSE_DATA_BYTES = 7
BASELINE = "baseline (bare grpc.aio health)"


class BenchError(Exception):
    """A target could not be started, verified, loaded or stopped cleanly."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


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


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise BenchError(f"timed out after {timeout}s waiting for {what}")


@dataclass
class Target:
    name: str
    argv: list[str]
    addr: str
    listeners: int  # LISTEN sockets expected on the data port once fully up
    log_path: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    rates: list[float] = field(default_factory=list)
    p50_ms: list[float] = field(default_factory=list)
    server_us_per_req: list[float] = field(default_factory=list)
    server_cores: list[float] = field(default_factory=list)
    client_cores: list[float] = field(default_factory=list)
    cpu_by_process: dict[str, float] = field(default_factory=dict)  # summed over rounds
    errors: list[str] = field(default_factory=list)

    @property
    def port(self) -> int:
        return int(self.addr.rpartition(":")[2])

    def output_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def start(self) -> None:
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, cwd=REPO, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float) -> None:
        def ready() -> bool:
            if not self.alive():
                raise BenchError(f"{self.name} exited early:\n{self.output_tail()}")
            return (health_status(self.addr) == health_pb2.HealthCheckResponse.SERVING
                    and listening_sockets(self.port) >= self.listeners)

        wait_until(ready, timeout, f"{self.name} SERVING on {self.addr} "
                                   f"with {self.listeners} listener(s)")

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, expect exit 0 and no surviving process in its group; kill the group anyway."""
        proc = self.proc
        if proc is None:
            return
        try:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.errors.append(f"did not exit within {timeout}s of SIGTERM")
            else:
                if code != 0:
                    self.errors.append(f"exited {code} after SIGTERM")
            deadline = time.monotonic() + 5
            while _group_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _group_alive(proc.pid):
                self.errors.append("child processes survived the parent's graceful stop")
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def group_cpu(pgid: int) -> dict[str, float]:
    """CPU seconds (user+system) of each live process in a process group, keyed by role+pid."""
    cpu: dict[str, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:
                continue
            pid = int(stat.parent.name)
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
            if pid == pgid:
                role = "main"
            elif b"spawn_main" in cmdline:
                role = "worker"
            elif b"resource_tracker" in cmdline:
                role = "resource_tracker"
            else:
                role = "child"
            cpu[f"{role} {pid}"] = (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return cpu


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg(0) also succeeds for zombies; count only live members.
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith("SITSMESH_") and k != "PROMETHEUS_MULTIPROC_DIR"}


def sitsmesh_target(name: str, workdir: Path, workers: int) -> Target:
    data, admin, metrics = (f"127.0.0.1:{free_port()}" for _ in range(3))
    state = workdir / f"state-{workers}w"
    argv = [SITSMESH, "serve", "--data-addr", data, "--admin-addr", admin,
            "--metrics-addr", metrics, "--state-dir", str(state),
            "--drain-seconds", "0", "--log-level", "warning"]
    if workers > 1:
        argv += ["--workers", str(workers)]
    return Target(name, argv, data, workers, workdir / f"sitsmesh-{workers}w.log", clean_env())


def baseline_target(workdir: Path) -> Target:
    addr = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, str(Path(__file__).resolve()), "--serve-baseline", addr]
    return Target(BASELINE, argv, addr, 1, workdir / "baseline.log", clean_env())


async def serve_baseline(addr: str) -> None:
    """The baseline: a grpc.aio server with only the standard health service."""
    from grpc_health.v1.health import aio as health_aio

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
    if server.add_insecure_port(addr) == 0:
        raise SystemExit(f"cannot bind {addr}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)


@dataclass(frozen=True)
class LoadResult:
    req_per_s: float
    p50_ms: float
    wall_s: float
    client_cpu_s: float  # h2load's user+system CPU
    server_cpu_s: dict[str, float]  # per process of the target


_FINISHED = re.compile(r"finished in [\d.]+\w+, ([\d.]+) req/s")
_REQUESTS = re.compile(r"requests: (\d+) total, \d+ started, (\d+) done, (\d+) succeeded, "
                       r"(\d+) failed, (\d+) errored, (\d+) timeout")
_STATUS = re.compile(r"status codes: (\d+) 2xx")
_DATA = re.compile(r"traffic: .*?\((\d+)\) data")


def run_h2load(h2load: str, target: Target, args: argparse.Namespace, body: Path,
               requests: int, log_file: Path) -> LoadResult:
    argv = [h2load, "-n", str(requests), "-c", str(args.clients), "-m", str(args.streams),
            "-t", str(args.threads), "-d", str(body),
            "-H", "content-type: application/grpc", "-H", "te: trailers",
            "--log-file", str(log_file), f"http://{target.addr}{METHOD}"]
    pgid = target.proc.pid if target.proc else 0
    cpu_before = group_cpu(pgid)
    child_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout,
                              check=False)
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"h2load timed out after {args.timeout}s") from exc
    wall = time.monotonic() - started
    child_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_after = group_cpu(pgid)
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
    if data_bytes != requests * RESPONSE_DATA_BYTES:
        raise BenchError(f"expected {requests * RESPONSE_DATA_BYTES} DATA bytes "
                         f"(one SERVING reply per request), got {data_bytes}:\n{out}")
    # --log-file: one line per request, "<start µs>\t<status>\t<duration µs>".
    durations = [int(line.split("\t")[2]) for line in log_file.read_text().splitlines() if line]
    log_file.unlink()
    if len(durations) != requests:
        raise BenchError(f"h2load log has {len(durations)} lines, expected {requests}")
    return LoadResult(float(finished.group(1)), statistics.median(durations) / 1000, wall,
                      client_cpu, server_cpu)


def render_table(targets: Sequence[Target], rounds: int) -> str:
    base = targets[0]
    base_median = statistics.median(base.rates) if base.rates else None
    lines = ["| target | median req/s | ratio vs baseline | p50 latency (ms) "
             "| server CPU (µs/req) | server cores busy | h2load cores busy "
             "| rounds ok | req/s per round |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for t in targets:
        if t.rates:
            median = statistics.median(t.rates)
            ratio = f"{median / base_median:.2f}" if base_median else "n/a"
            cells = [f"{median:,.0f}", ratio, f"{statistics.median(t.p50_ms):.2f}",
                     f"{statistics.median(t.server_us_per_req):.0f}",
                     f"{statistics.median(t.server_cores):.2f}",
                     f"{statistics.median(t.client_cores):.2f}"]
        else:
            cells = ["failed", "n/a", "n/a", "n/a", "n/a", "n/a"]
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


def bench(args: argparse.Namespace) -> int:
    if args.threads > args.clients:
        print("--threads must not exceed --clients", file=sys.stderr)
        return 2
    h2load = shutil.which("h2load")
    if h2load is None:
        print("h2load not found: apt-get install -y nghttp2-client", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="sitsmesh-bench-") as tmp:
        workdir = Path(tmp)
        body = workdir / "health-check.grpc"
        body.write_bytes(REQUEST_FRAME)
        targets = [baseline_target(workdir),
                   sitsmesh_target("sitsmesh serve (1 worker)", workdir, 1),
                   sitsmesh_target("sitsmesh serve --workers 2", workdir, 2)]
        try:
            for t in targets:
                t.start()
            for t in targets:
                try:
                    t.wait_ready(args.ready_timeout)
                    # Correctness once per target with a real gRPC client.
                    if health_status(t.addr, timeout=5) != health_pb2.HealthCheckResponse.SERVING:
                        raise BenchError("gRPC client did not get SERVING")
                    # Warm-up, not counted.
                    run_h2load(h2load, t, args, body, args.warmup, workdir / "h2load.log")
                except BenchError as exc:
                    t.errors.append(f"setup: {exc}")
            live = [t for t in targets if not t.errors]
            dead: list[Target] = []
            for rnd in range(args.rounds):
                shift = rnd % len(live) if live else 0
                for t in live[shift:] + live[:shift]:
                    if not t.alive():
                        if t not in dead:
                            dead.append(t)
                            t.errors.append(f"round {rnd + 1}: process had exited")
                        continue
                    try:
                        res = run_h2load(h2load, t, args, body, args.requests,
                                         workdir / "h2load.log")
                    except BenchError as exc:
                        t.errors.append(f"round {rnd + 1}: {exc}")
                        continue
                    server_cpu = sum(res.server_cpu_s.values())
                    t.rates.append(res.req_per_s)
                    t.p50_ms.append(res.p50_ms)
                    t.server_us_per_req.append(server_cpu * 1e6 / args.requests)
                    t.server_cores.append(server_cpu / res.wall_s)
                    t.client_cores.append(res.client_cpu_s / res.wall_s)
                    for proc_name, secs in res.server_cpu_s.items():
                        t.cpu_by_process[proc_name] = t.cpu_by_process.get(proc_name, 0) + secs
                    print(f"round {rnd + 1}/{args.rounds}  {t.name:<34} "
                          f"{res.req_per_s:>10,.0f} req/s  p50 {res.p50_ms:6.2f} ms  "
                          f"server {t.server_cores[-1]:.2f} cores  "
                          f"h2load {t.client_cores[-1]:.2f} cores",
                          file=sys.stderr, flush=True)
        finally:
            for t in targets:
                t.stop()
        failed = [t for t in targets if t.errors or len(t.rates) != args.rounds]
        print(f"\nh2load -t{args.threads} -c{args.clients} -m{args.streams}, "
              f"{args.requests} requests/round, {args.rounds} rounds, "
              f"{os.cpu_count()} CPUs\n")
        print(render_table(targets, args.rounds))
        print("\nServer CPU by process (all measured rounds):\n")
        print(render_cpu_split(targets))
        for t in failed:
            print(f"\nFAILED {t.name}:", file=sys.stderr)
            for err in t.errors or ["fewer successful rounds than requested"]:
                print(f"  {err}", file=sys.stderr)
            tail = t.output_tail()
            if tail:
                print(f"  --- last output of {t.name} ---\n{tail}", file=sys.stderr)
        return 1 if failed else 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=5, help="rounds per target (default 5)")
    p.add_argument("--requests", type=int, default=30000,
                   help="requests per h2load run (default 30000)")
    p.add_argument("--warmup", type=int, default=3000,
                   help="uncounted warm-up requests per target (default 3000)")
    p.add_argument("--clients", type=int, default=16, help="h2load -c (default 16)")
    p.add_argument("--streams", type=int, default=10, help="h2load -m (default 10)")
    p.add_argument("--threads", type=int, default=1, help="h2load -t (default 1)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds allowed per h2load run (default 120)")
    p.add_argument("--ready-timeout", type=float, default=60.0,
                   help="seconds allowed for a target to become SERVING (default 60)")
    p.add_argument("--serve-baseline", metavar="ADDR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.requests < 1 or args.warmup < 1:
        p.error("--rounds, --requests and --warmup must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_baseline:
        asyncio.run(serve_baseline(args.serve_baseline))
        return 0
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
