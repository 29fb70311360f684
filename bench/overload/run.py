"""Overload on a real Triton: no control vs Envoy adaptive_concurrency vs seed vs sitsmesh.

Everything is started (and stopped) by this script on free 127.0.0.1 ports,
in a temporary directory, with the stack of tests/integration/test_pressure_e2e.py:

- one `tritonserver` from the nvidia-pytriton wheel (sitsmesh/dev/triton.py),
  explicit model control, serving the lazy python-backend demo model
  (sitsmesh.dev.demo_model) with a fixed `--service-ms` (20 ms, first
  request included) and ONE CPU instance, so its capacity is about
  1 / service time;
- one `sitsmesh serve --triton-url ... --triton-metrics-url ...`, the pipeline
  `demo` (one stage `model`, SLA p99 `--sla-ms`, Triton model `lazy`) applied
  with `sitsmesh pipelines apply`, thresholds set with `sitsmesh thresholds
  set demo` (queue_capacity 32, parallelism 1, shed_priorities 0-4), a tenant
  (default priority 0, max 9) and an API key;
- per variant, a fresh real Envoy in front of Triton's HTTP port, rendered
  from filters/local/bootstrap.yaml with the ext_authz and access_log
  fragments (filters/fragments/), i.e. every variant authenticates through
  sitsmesh and logs to it; only the admission decision differs:

  | variant | Envoy filters | sitsmesh thresholds policy |
  |---|---|---|
  | no control | ext_authz, access_log, router | off (never sheds) |
  | adaptive_concurrency | ext_authz, adaptive_concurrency, access_log, router | off |
  | seed | ext_authz, access_log, router | seed (priority-blind queue-depth cap) |
  | sitsmesh | ext_authz, access_log, router | sitsmesh |

  envoyconf.render only reads fragments from filters/fragments/, so the
  adaptive_concurrency filter (ADAPTIVE_FILTER below: the gradient
  controller with the settings of Envoy's documentation example, p90 samples,
  0.1 s updates, minRTT from 50 requests every 60 s with 10 % jitter, default
  buffer 25 % and min concurrency 3; 503 when over the limit) is inserted
  into the rendered config just before the router.

First the capacity is measured: `--capacity-workers` closed-loop callers
through an Envoy of the "no control" kind for `--capacity-s` seconds (after
1 s of warm-up); completions per second = capacity. Then every variant, in
order, gets the same open-loop load, scaled by that capacity:

  | phase | seconds | offered load |
  |---|---:|---|
  | calm | 0-3 | 0.5x |
  | ramp | 3-8 | 0.5x -> 3x, linear |
  | peak | 8-10 | 3x |
  | 2x | 10-16 | 2x |
  | recovery | 16-24 | 0.5x (the load drops) |

Arrivals are evenly spaced at the current rate (deterministic, no Poisson
bursts); `--high-share` of them (30 %, spread evenly by a golden-ratio
sequence) send `x-priority: 9`, the others priority 0. The client is one
asyncio loop, one task and one TCP connection (`connection: close`) per
request, started at its due time whatever is outstanding (truly open loop;
the lag behind the due time is reported). A caller gives up after
`--timeout-s` (2 s): that request counts as failed. Before each variant the
script waits until Triton's nv_inference_pending_request_count is 0 (the
backlog a variant left behind drains first).

Per variant, with requests bucketed by the second they were SENT in:
offered, goodput (200 within the SLA), admitted p99 (latency of the
requests answered 200, whatever it was), shed (429 from sitsmesh, 503
"reached concurrency limit" from adaptive_concurrency), timeouts. Summary:
goodput in the 2x phase (requests/s and % of capacity) and in the 3x peak,
admitted p99 in the 2x phase and overall, success within the SLA per
priority (2x phase and overall), and the time to recover: from the drop to
0.5x, the first moment T (0.1 s grid) from which every 1 s window has
goodput >= 95 % of offered. While each variant runs, sitsmesh's decisions
(WatchPressure, every tick) and the adaptive_concurrency stats are recorded
and summarised per second.

`--rounds N` repeats the whole sequence N times on the same stack (capacity
measured once) and adds a min / median / max table and how many rounds met
each target; the PNG shows `--plot-round`. The header names the git commit
(and says if sitsmesh/ or filters/ had local changes, or HEAD moved during
the run). Notes flag a sitsmesh capacity estimate (mu) above 2x the measured
capacity, and where the concurrency cap peaked.

The sitsmesh targets of the issue are checked and printed (reported, not
enforced): in the 2x phase goodput >= adaptive_concurrency's and >= 90 % of
capacity, admitted p99 <= SLA; high-priority success >= 99.9 % over the
whole run (high-priority demand alone is at most 0.3 x 3 = 0.9x capacity, so
it always fits); recovery <= 2 s. A PNG with goodput/s and admitted p99 over
time (one line per variant, offered load dashed) goes to `--png`.

    .venv/bin/python bench/overload/run.py [--rounds 1] [--plot-round 1]
        [--png bench/overload/overload.png] [--variants none,adaptive,seed,sitsmesh]
        [--service-ms 20] [--sla-ms 250] [--timeout-s 2] [--high-share 0.3]
        [--capacity RPS] [--json FILE] [--replot FILE]

One round takes about 2 minutes (the no-control backlog takes ~8 s to drain).

Exit status 1 if anything fails to start, the sanity request of a variant
is not answered 200, or Triton does not drain between variants.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import tritonclient.grpc as triton_grpc

from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.dev import demo_model, envoyconf, harness
from sitsmesh.dev.triton import TritonServer

REPO = Path(__file__).resolve().parents[2]

MODEL = "lazy"
PIPELINE_NAME = "demo"
HIGH, LOW = 9, 0
BODY = json.dumps({"inputs": [{"name": "INPUT0", "shape": [4], "datatype": "FP32",
                               "data": [1, 2, 3, 4]}]}).encode()
PIPELINE = """name: demo
models: ["{model}"]
stages:
  - name: model
    match: {{upstream_cluster: upstream}}
    sla_p99_ms: {sla:g}
    triton_model: {model}
"""
THRESHOLDS = """policy: "{policy}"  # quoted: a YAML 1.1 reader takes a bare off for false
shed_priorities: [0, 1, 2, 3, 4]
stages:
  model: {{queue_capacity: 32, parallelism: 1}}
"""
# Envoy's adaptive concurrency filter with the settings of its documentation's example.
ADAPTIVE_FILTER: dict[str, Any] = {
    "name": "envoy.filters.http.adaptive_concurrency",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.adaptive_concurrency.v3"
                 ".AdaptiveConcurrency",
        "gradient_controller_config": {
            "sample_aggregate_percentile": {"value": 90},
            "concurrency_limit_params": {"concurrency_update_interval": "0.1s"},
            "min_rtt_calc_params": {"jitter": {"value": 10}, "interval": "60s",
                                    "request_count": 50},
        },
        "enabled": {"default_value": True, "runtime_key": "adaptive_concurrency.enabled"},
    },
}
AC_LIMIT_BODY = "reached concurrency limit"

NONE, ADAPTIVE, SEED, SITSMESH = "none", "adaptive", "seed", "sitsmesh"


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    policy: str      # sitsmesh thresholds policy
    adaptive: bool   # Envoy with the adaptive_concurrency filter


VARIANTS = {v.key: v for v in (
    Variant(NONE, "no control", "off", False),
    Variant(ADAPTIVE, "adaptive_concurrency", "off", True),
    Variant(SEED, "seed", "seed", False),
    Variant(SITSMESH, "sitsmesh", "sitsmesh", False),
)}
COLORS = {NONE: "tab:gray", ADAPTIVE: "tab:orange", SEED: "tab:purple", SITSMESH: "tab:blue"}


@dataclass(frozen=True)
class Segment:
    name: str
    seconds: float
    start_x: float  # offered load, in multiples of capacity, at the start ...
    end_x: float    # ... and at the end (linear in between)


PROFILE = (Segment("calm", 3, 0.5, 0.5), Segment("ramp", 5, 0.5, 3.0),
           Segment("peak", 2, 3.0, 3.0), Segment("2x", 6, 2.0, 2.0),
           Segment("recovery", 8, 0.5, 0.5))
RECOVERY_SHARE = 0.95  # goodput / offered that counts as recovered
WINDOW_S, GRID_S = 1.0, 0.1
HIGH_TARGET = 0.999
GOODPUT_TARGET = 0.9


class BenchError(Exception):
    """Something could not be started, or a variant could not be run."""


def phase(name: str) -> tuple[float, float]:
    t = 0.0
    for seg in PROFILE:
        if seg.name == name:
            return t, t + seg.seconds
        t += seg.seconds
    raise KeyError(name)


def total_s() -> float:
    return sum(seg.seconds for seg in PROFILE)


def multiplier(t: float) -> float:
    start = 0.0
    for seg in PROFILE:
        if t < start + seg.seconds:
            return seg.start_x + (seg.end_x - seg.start_x) * (t - start) / seg.seconds
        start += seg.seconds
    return PROFILE[-1].end_x


def schedule(capacity: float, high_share: float) -> list[tuple[float, int]]:
    """(due second, priority) of every request: evenly spaced at the current rate."""
    out: list[tuple[float, int]] = []
    t, i, end = 0.0, 0, total_s()
    golden = (math.sqrt(5) - 1) / 2
    while t < end:
        out.append((t, HIGH if (i * golden) % 1.0 < high_share else LOW))
        t += 1.0 / (multiplier(t) * capacity)
        i += 1
    return out


# --------------------------------------------------------------------------- the client

@dataclass(frozen=True, slots=True)
class Result:
    sent: float       # due time, seconds from the variant's start
    lag: float        # how late the client actually started it
    priority: int
    status: int       # HTTP status; 0 = the caller gave up (timeout), -1 = connection error
    seconds: float
    code: str         # sitsmesh's JSON code, the start of another body, or "timeout"


def request_head(port: int, key: str, priority: int) -> bytes:
    head = (f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
            f"x-api-key: {key}\r\nx-priority: {priority}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(BODY)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + BODY


def parse_reply(raw: bytes) -> tuple[int, str]:
    head, _, body = raw.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return -1, "unparsable reply"
    if status == 200:
        return status, ""
    text = body.decode(errors="replace").strip()
    if text.startswith("{"):
        with contextlib.suppress(ValueError, AttributeError):
            return status, str(json.loads(text).get("code", ""))
    return status, text[:40]


async def call(port: int, payload: bytes, timeout: float) -> tuple[int, str, float]:
    began = time.monotonic()
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(payload)
            await writer.drain()
            raw = await reader.read()  # connection: close, so until EOF
        status, code = parse_reply(raw)
    except TimeoutError:
        status, code = 0, "timeout"
    except OSError as exc:
        status, code = -1, type(exc).__name__
    finally:
        if writer is not None:
            writer.transport.abort()
    return status, code, time.monotonic() - began


async def open_loop(port: int, key: str, plan: Sequence[tuple[float, int]],
                    timeout: float, t0_box: list[float]) -> list[Result]:
    payloads = {p: request_head(port, key, p) for p in (HIGH, LOW)}
    t0 = time.monotonic() + 0.2
    t0_box.append(t0)

    async def one(due: float, priority: int) -> Result:
        lag = time.monotonic() - (t0 + due)
        status, code, seconds = await call(port, payloads[priority], timeout)
        return Result(due, lag, priority, status, seconds, code)

    tasks = []
    for due, priority in plan:
        delay = t0 + due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(due, priority)))
    return list(await asyncio.gather(*tasks))


async def closed_loop(port: int, key: str, workers: int, warm_s: float, seconds: float,
                      timeout: float) -> tuple[int, list[float], int]:
    """Completions inside [warm, warm + seconds], their latencies, and failures."""
    payload = request_head(port, key, LOW)
    start = time.monotonic()
    begin, end = start + warm_s, start + warm_s + seconds
    done: list[float] = []
    failed = 0

    async def worker() -> None:
        nonlocal failed
        while time.monotonic() < end:
            status, _, latency = await call(port, payload, timeout)
            now = time.monotonic()
            if status != 200:
                failed += 1
            elif begin <= now <= end:
                done.append(latency)

    await asyncio.gather(*(worker() for _ in range(workers)))
    return len(done), done, failed


# --------------------------------------------------------------------------- side recorders

class Recorder:
    """sitsmesh's decisions (WatchPressure, every tick) and, for adaptive_concurrency,
    Envoy's gradient-controller gauges, with monotonic receive times."""

    def __init__(self, node: harness.Sitsmesh, envoy: harness.Envoy | None) -> None:
        self.node, self.envoy = node, envoy
        self.pressure: list[tuple[float, dict[str, Any]]] = []
        self.envoy_stats: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._channel = grpc.insecure_channel(node.admin_addr)
        self._call: Any = None
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> Recorder:
        stub = admin_pb2_grpc.AdminStub(self._channel)
        self._call = stub.WatchPressure(
            admin_pb2.WatchPressureRequest(pipeline=PIPELINE_NAME),
            metadata=self.node.admin_metadata(), timeout=600)
        self._threads = [threading.Thread(target=self._watch, daemon=True)]
        if self.envoy is not None:
            self._threads.append(threading.Thread(target=self._poll_envoy, daemon=True))
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        for thread in self._threads:
            thread.join(5)
        self._channel.close()

    def _watch(self) -> None:
        with contextlib.suppress(grpc.RpcError):
            for snapshot in self._call:
                now = time.monotonic()
                for p in snapshot.pipelines:
                    if p.pipeline != PIPELINE_NAME:
                        continue
                    stage = p.stages[0] if p.stages else None
                    self.pressure.append((now, {
                        "policy": p.policy, "fraction": p.fraction, "cutoff": p.cutoff,
                        "concurrency": p.concurrency, "level": p.level,
                        "lam": p.arrival_rate, "in_flight": p.in_flight,
                        "shed_total": p.shed_total,
                        "mu": stage.capacity if stage else 0.0,
                        "queue": stage.queue if stage else 0.0,
                        "rt99_ms": stage.rt99_ms if stage else 0.0,
                        "stage_level": stage.level if stage else ""}))

    def _poll_envoy(self) -> None:
        assert self.envoy is not None
        while not self._stop.wait(0.2):
            try:
                text = self.envoy.admin_get("/stats?filter=gradient_controller")
            except OSError:
                continue
            values: dict[str, float] = {}
            for line in text.splitlines():
                name, _, value = line.partition(": ")
                with contextlib.suppress(ValueError):
                    values[name.rsplit(".", 1)[-1]] = float(value)
            self.envoy_stats.append((time.monotonic(), values))


# --------------------------------------------------------------------------- the stack

def start_envoy(tmp: Path, name: str, sitsmesh_addr: str, upstream_port: int,
                adaptive: bool) -> harness.Envoy:
    listen, admin = harness.free_port(), harness.free_port()
    config = envoyconf.render(REPO / "filters" / "local" / "bootstrap.yaml",
                              harness.envoy_values(sitsmesh_addr, upstream_port, listen, admin),
                              ["ext_authz", "access_log"])
    if adaptive:
        filters = envoyconf.http_connection_manager(config)["http_filters"]
        filters.insert(len(filters) - 1, ADAPTIVE_FILTER)  # just before the router
    path = envoyconf.write(config, tmp / f"envoy-{name}.yaml")
    try:
        envoy = harness.launch_envoy(path, listen, admin, tmp / f"envoy-{name}.log")
    except RuntimeError as exc:  # Envoy exited: a setup failure of this variant
        raise BenchError(f"envoy ({name}): {str(exc)[-2000:]}") from None
    try:
        # ext_authz needs the sitsmesh_data cluster healthy before the first request.
        harness.wait_until(lambda: envoy.cluster_health("sitsmesh_data") == ["healthy"], 10,
                           f"envoy ({name}) sees sitsmesh healthy")
    except BaseException:
        envoy.kill()
        raise
    return envoy


def pressure_once(node: harness.Sitsmesh) -> admin_pb2.PipelinePressure:
    with grpc.insecure_channel(node.admin_addr) as channel:
        stream = admin_pb2_grpc.AdminStub(channel).WatchPressure(
            admin_pb2.WatchPressureRequest(pipeline=PIPELINE_NAME, count=1),
            metadata=node.admin_metadata(), timeout=5)
        [snapshot] = list(stream)
    [pipeline] = snapshot.pipelines
    return pipeline


def set_policy(node: harness.Sitsmesh, tmp: Path, policy: str) -> None:
    path = tmp / f"thresholds-{policy}.yaml"
    path.write_text(THRESHOLDS.format(policy=policy))
    done = node.cli("thresholds", "set", PIPELINE_NAME, str(path))
    if done.returncode != 0:
        raise BenchError(f"sitsmesh thresholds set ({policy}) failed: {done.stderr}")
    try:
        harness.wait_until(lambda: pressure_once(node).policy == policy, 10,
                           f"sitsmesh to apply policy {policy}", interval=0.1)
    except TimeoutError as exc:
        raise BenchError(str(exc)) from exc


def triton_pending(triton: TritonServer) -> float:
    return harness.metric_value(triton.metrics(), "nv_inference_pending_request_count",
                                model=MODEL)


def wait_drained(triton: TritonServer, timeout: float = 180.0) -> float:
    """Seconds until Triton's queue for the model is empty (and stays so for 0.5 s)."""
    began = time.monotonic()
    try:
        harness.wait_until(lambda: triton_pending(triton) == 0, timeout,
                           "Triton's pending requests to drain", interval=0.2)
        time.sleep(0.5)
        harness.wait_until(lambda: triton_pending(triton) == 0, timeout,
                           "Triton's pending requests to drain", interval=0.2)
    except TimeoutError as exc:
        raise BenchError(str(exc)) from exc
    return time.monotonic() - began


@dataclass
class Stack:
    tmp: Path
    triton: TritonServer
    node: harness.Sitsmesh
    key: str
    version: str


def start_stack(tmp: Path, args: argparse.Namespace, procs: list[Any]) -> Stack:
    """The stack; every process started goes into `procs` at once, for the caller's finally."""
    repo = tmp / "models"
    demo_model.write_lazy_model(repo, MODEL, [1], context_ms=args.service_ms,
                                service_ms=args.service_ms)
    triton = TritonServer(tmp / "triton", repo)
    procs.append(triton)
    triton.start(timeout=60)
    client = triton_grpc.InferenceServerClient(triton.grpc_url)
    try:
        client.load_model(MODEL)
        version = str(client.get_server_metadata().version)
    finally:
        client.close()
    node = harness.start_sitsmesh(tmp, "--triton-url", triton.grpc_url,
                                  "--triton-metrics-url", triton.metrics_url)
    procs.append(node)
    (tmp / "demo.yaml").write_text(PIPELINE.format(model=MODEL, sla=args.sla_ms))
    (tmp / "thresholds.yaml").write_text(THRESHOLDS.format(policy="off"))
    for cli_args in (("pipelines", "apply", str(tmp / "demo.yaml")),
                     ("thresholds", "set", PIPELINE_NAME, str(tmp / "thresholds.yaml")),
                     ("tenants", "create", "acme", "--models", "*", "--priority", "0",
                      "--max-priority", "9")):
        done = node.cli(*cli_args)
        if done.returncode != 0:
            raise BenchError(f"sitsmesh {' '.join(cli_args[:2])} failed: {done.stderr}")
    made = node.cli("apikeys", "create", "--tenant", "acme", "--output", "json")
    if made.returncode != 0:
        raise BenchError(f"sitsmesh apikeys create failed: {made.stderr}")
    key = str(json.loads(made.stdout)["key"])
    return Stack(tmp, triton, node, key, version)


# --------------------------------------------------------------------------- one variant

@dataclass
class VariantRun:
    variant: Variant
    results: list[Result]
    t0: float
    drained_s: float
    pressure: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    envoy_stats: list[tuple[float, dict[str, float]]] = field(default_factory=list)


def sanity(envoy: harness.Envoy, key: str, timeout: float) -> None:
    status, code, _ = asyncio.run(call(envoy.listen_port, request_head(envoy.listen_port, key,
                                                                       LOW), timeout))
    if status != 200:
        raise BenchError(f"sanity request through Envoy got {status} {code!r}")


def measure_capacity(stack: Stack, args: argparse.Namespace) -> tuple[float, float]:
    """Closed loop through a no-control Envoy: (completions/s, median latency ms)."""
    set_policy(stack.node, stack.tmp, "off")
    envoy = start_envoy(stack.tmp, "capacity", stack.node.data_addr, stack.triton.http_port,
                        adaptive=False)
    try:
        sanity(envoy, stack.key, args.timeout_s)
        n, latencies, failed = asyncio.run(closed_loop(
            envoy.listen_port, stack.key, args.capacity_workers, 1.0, args.capacity_s,
            args.timeout_s))
    finally:
        envoy.kill()
    if failed or not n:
        raise BenchError(f"capacity run: {failed} requests failed, {n} completed")
    return n / args.capacity_s, sorted(latencies)[len(latencies) // 2] * 1000


def run_variant(stack: Stack, variant: Variant, plan: Sequence[tuple[float, int]],
                args: argparse.Namespace) -> VariantRun:
    set_policy(stack.node, stack.tmp, variant.policy)
    drained = wait_drained(stack.triton)
    envoy = start_envoy(stack.tmp, variant.key, stack.node.data_addr, stack.triton.http_port,
                        variant.adaptive)
    try:
        sanity(envoy, stack.key, args.timeout_s)
        time.sleep(0.5)
        t0_box: list[float] = []
        with Recorder(stack.node, envoy if variant.adaptive else None) as recorder:
            results = asyncio.run(open_loop(envoy.listen_port, stack.key, plan,
                                            args.timeout_s, t0_box))
        if envoy.proc.poll() is not None:
            raise BenchError(f"envoy ({variant.key}) died during the run")
    finally:
        envoy.kill()
    return VariantRun(variant, sorted(results, key=lambda r: r.sent), t0_box[0], drained,
                      recorder.pressure, recorder.envoy_stats)


# --------------------------------------------------------------------------- analysis

def nearest_rank(values: Sequence[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]


def good(r: Result, sla_ms: float) -> bool:
    return r.status == 200 and r.seconds * 1000 <= sla_ms


def shed(r: Result) -> bool:
    return r.status == 429 or (r.status == 503 and r.code.startswith(AC_LIMIT_BODY))


def within(results: Sequence[Result], lo: float, hi: float) -> list[Result]:
    return [r for r in results if lo <= r.sent < hi]


def p99_ms(results: Sequence[Result]) -> float | None:
    ok = [r.seconds * 1000 for r in results if r.status == 200]
    return nearest_rank(ok, 99) if ok else None


def success(results: Sequence[Result], priority: int, sla_ms: float) -> float | None:
    mine = [r for r in results if r.priority == priority]
    return sum(good(r, sla_ms) for r in mine) / len(mine) if mine else None


def recovery_s(results: Sequence[Result], sla_ms: float) -> float | None:
    """From the drop to 0.5x: the first T on a GRID_S grid from which every WINDOW_S
    window (starting on the grid) has goodput >= RECOVERY_SHARE of offered. None if the
    last window still misses it."""
    lo, hi = phase("recovery")
    steps = round((hi - lo - WINDOW_S) / GRID_S)
    last_bad = -1
    for k in range(steps + 1):
        start = lo + k * GRID_S
        window = within(results, start, start + WINDOW_S)
        if window and sum(good(r, sla_ms) for r in window) < RECOVERY_SHARE * len(window):
            last_bad = k
    if last_bad == steps:
        return None
    return (last_bad + 1) * GRID_S


@dataclass
class Summary:
    key: str
    label: str
    requests: int
    goodput_2x: float
    goodput_2x_pct: float
    goodput_peak: float
    p99_2x_ms: float | None
    p99_all_ms: float | None
    high_2x: float | None
    low_2x: float | None
    high_all: float | None
    low_all: float | None
    shed: int
    timeouts: int
    other_errors: int
    recovery_s: float | None
    lag_p99_ms: float
    lag_max_ms: float
    drained_before_s: float
    codes: dict[str, int]


def summarise(run: VariantRun, capacity: float, sla_ms: float) -> Summary:
    rs = run.results
    lo2, hi2 = phase("2x")
    lop, hip = phase("peak")
    hold, peak = within(rs, lo2, hi2), within(rs, lop, hip)
    goodput_2x = sum(good(r, sla_ms) for r in hold) / (hi2 - lo2)
    codes: dict[str, int] = {}
    for r in rs:
        label = f"{r.status} {r.code}".strip()
        codes[label] = codes.get(label, 0) + 1
    lags = [r.lag * 1000 for r in rs]
    return Summary(
        key=run.variant.key, label=run.variant.label, requests=len(rs),
        goodput_2x=goodput_2x, goodput_2x_pct=100 * goodput_2x / capacity,
        goodput_peak=sum(good(r, sla_ms) for r in peak) / (hip - lop),
        p99_2x_ms=p99_ms(hold), p99_all_ms=p99_ms(rs),
        high_2x=success(hold, HIGH, sla_ms), low_2x=success(hold, LOW, sla_ms),
        high_all=success(rs, HIGH, sla_ms), low_all=success(rs, LOW, sla_ms),
        shed=sum(shed(r) for r in rs), timeouts=sum(r.status == 0 for r in rs),
        other_errors=sum(r.status not in (0, 200) and not shed(r) for r in rs),
        recovery_s=recovery_s(rs, sla_ms), lag_p99_ms=nearest_rank(lags, 99),
        lag_max_ms=max(lags), drained_before_s=run.drained_s,
        codes=dict(sorted(codes.items(), key=lambda kv: -kv[1])))


@dataclass
class Second:
    offered: int
    goodput: int
    p99_ms: float | None
    shed: int
    timeouts: int


def per_second(run: VariantRun, sla_ms: float) -> list[Second]:
    out = []
    for s in range(math.ceil(total_s())):
        rs = within(run.results, s, s + 1)
        out.append(Second(len(rs), sum(good(r, sla_ms) for r in rs), p99_ms(rs),
                          sum(shed(r) for r in rs), sum(r.status == 0 for r in rs)))
    return out


# --------------------------------------------------------------------------- report

def fmt_pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f} %"


def fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def summary_table(summaries: Sequence[Summary]) -> str:
    lines = ["| variant | requests | goodput 2x (rps) | goodput 2x (% cap) "
             "| goodput 3x peak (rps) | admitted p99 2x (ms) | admitted p99 all (ms) "
             "| high prio ok 2x | low prio ok 2x | high prio ok all | low prio ok all "
             "| shed | timed out | other errors | recovery (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summaries:
        rec = "not within 8 s" if s.recovery_s is None else f"{s.recovery_s:.1f}"
        lines.append(
            f"| {s.label} | {s.requests} | {s.goodput_2x:.1f} | {s.goodput_2x_pct:.0f} % "
            f"| {s.goodput_peak:.1f} | {fmt_ms(s.p99_2x_ms)} | {fmt_ms(s.p99_all_ms)} "
            f"| {fmt_pct(s.high_2x, 2)} | {fmt_pct(s.low_2x)} | {fmt_pct(s.high_all, 2)} "
            f"| {fmt_pct(s.low_all)} | {s.shed} | {s.timeouts} | {s.other_errors} | {rec} |")
    return "\n".join(lines)


def seconds_table(runs: Sequence[VariantRun], sla_ms: float) -> str:
    per = {run.variant.key: per_second(run, sla_ms) for run in runs}
    head = ("| t (s) | load | offered | "
            + " | ".join(f"{r.variant.label}: good / p99 ms / shed" for r in runs) + " |")
    lines = [head, "|---:|---:|---:|" + "---:|" * len(runs)]
    first = per[runs[0].variant.key]
    for s in range(len(first)):
        cells = []
        for run in runs:
            sec = per[run.variant.key][s]
            extra = f" ({sec.timeouts} t/o)" if sec.timeouts else ""
            cells.append(f"{sec.goodput} / {fmt_ms(sec.p99_ms)} / {sec.shed}{extra}")
        lines.append(f"| {s}-{s + 1} | {multiplier(s + 0.5):.2f}x | {first[s].offered} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def controller_table(run: VariantRun, sla_ms: float) -> str:
    """sitsmesh's decisions per second of the run, beside what the client saw."""
    secs = per_second(run, sla_ms)
    lines = ["| t (s) | offered | goodput | shed | fraction (min) | cutoff (max) "
             "| concurrency (min-max) | in flight (max) | lambda (max) | mu (mean) "
             "| Triton queue (max) | rt99 ms (max) | level (worst) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    order = {"ok": 0, "high": 1, "overloaded": 2, "stale": 3}
    for s, sec in enumerate(secs):
        ticks = [d for t, d in run.pressure if s <= t - run.t0 < s + 1]
        if not ticks:
            lines.append(f"| {s}-{s + 1} | {sec.offered} | {sec.goodput} | {sec.shed} "
                         "| - | - | - | - | - | - | - | - | - |")
            continue
        conc = [d["concurrency"] for d in ticks]
        lines.append(
            f"| {s}-{s + 1} | {sec.offered} | {sec.goodput} | {sec.shed} "
            f"| {min(d['fraction'] for d in ticks):.2f} "
            f"| {max(d['cutoff'] for d in ticks):.2f} | {min(conc)}-{max(conc)} "
            f"| {max(d['in_flight'] for d in ticks)} | {max(d['lam'] for d in ticks):.0f} "
            f"| {sum(d['mu'] for d in ticks) / len(ticks):.1f} "
            f"| {max(d['queue'] for d in ticks):.0f} "
            f"| {max(d['rt99_ms'] for d in ticks):.0f} "
            f"| {max((d['level'] for d in ticks), key=lambda x: order.get(x, 9))} |")
    return "\n".join(lines)


def adaptive_table(run: VariantRun) -> str:
    lines = ["| t (s) | concurrency_limit (min-max) | min_rtt_msecs | sample_rtt_msecs (max) "
             "| rq_blocked (in the second) |", "|---:|---:|---:|---:|---:|"]
    prev_blocked = 0.0
    for s in range(math.ceil(total_s())):
        rows = [v for t, v in run.envoy_stats if s <= t - run.t0 < s + 1]
        if not rows:
            continue
        limits = [v.get("concurrency_limit", 0) for v in rows]
        blocked = max(v.get("rq_blocked", 0) for v in rows)
        lines.append(f"| {s}-{s + 1} | {min(limits):.0f}-{max(limits):.0f} "
                     f"| {rows[-1].get('min_rtt_msecs', 0):.0f} "
                     f"| {max(v.get('sample_rtt_msecs', 0) for v in rows):.0f} "
                     f"| {blocked - prev_blocked:.0f} |")
        prev_blocked = blocked
    return "\n".join(lines)


def target_checks(summaries: Sequence[Summary], sla_ms: float
                  ) -> list[tuple[str, bool, str]]:
    """(target, met, the numbers) for sitsmesh in one round."""
    by = {s.key: s for s in summaries}
    sm, ac = by.get(SITSMESH), by.get(ADAPTIVE)
    if sm is None:
        return []
    out = []
    if ac is not None:
        out.append(("goodput at 2x >= adaptive_concurrency's", sm.goodput_2x >= ac.goodput_2x,
                    f"{sm.goodput_2x:.1f} vs {ac.goodput_2x:.1f} rps"))
    out.append((f"goodput at 2x >= {GOODPUT_TARGET:.0%} of capacity",
                sm.goodput_2x_pct >= 100 * GOODPUT_TARGET, f"{sm.goodput_2x_pct:.1f} %"))
    out.append((f"admitted p99 at 2x <= SLA {sla_ms:g} ms",
                sm.p99_2x_ms is not None and sm.p99_2x_ms <= sla_ms,
                f"{fmt_ms(sm.p99_2x_ms)} ms; whole run {fmt_ms(sm.p99_all_ms)} ms"))
    out.append((f"high-priority success >= {HIGH_TARGET:.1%} (whole run; high-priority demand "
                "<= 0.9x capacity throughout)",
                sm.high_all is not None and sm.high_all >= HIGH_TARGET, fmt_pct(sm.high_all, 2)))
    out.append(("recovery to full goodput <= 2 s after the drop",
                sm.recovery_s is not None and sm.recovery_s <= 2.0,
                "never" if sm.recovery_s is None else f"{sm.recovery_s:.1f} s"))
    return out


def targets(summaries: Sequence[Summary], sla_ms: float) -> list[str]:
    checks = target_checks(summaries, sla_ms)
    if not checks:
        return ["- sitsmesh was not run: no targets checked"]
    return [f"- {name}: {'met' if ok else '**not met**'} ({detail})"
            for name, ok, detail in checks]


def spread_table(rounds: Sequence[Sequence[Summary]]) -> str:
    """Per variant, min / median / max over the rounds."""
    def mmm(values: Sequence[float | None], fmt: Callable[[float], str]) -> str:
        known = sorted(v for v in values if v is not None)
        if not known:
            return "-"
        mid = known[len(known) // 2] if len(known) % 2 else (
            (known[len(known) // 2 - 1] + known[len(known) // 2]) / 2)
        missing = len(values) - len(known)
        extra = f" ({missing}x none)" if missing else ""
        return f"{fmt(known[0])} / {fmt(mid)} / {fmt(known[-1])}{extra}"

    lines = [f"| variant (min / median / max of {len(rounds)} rounds) | goodput 2x (rps) "
             "| goodput 2x (% cap) | admitted p99 2x (ms) | high prio ok all | low prio ok all "
             "| recovery (s) |", "|---|---:|---:|---:|---:|---:|---:|"]
    keys = [s.key for s in rounds[0]]
    for key in keys:
        rs = [next(s for s in r if s.key == key) for r in rounds]
        lines.append(
            f"| {rs[0].label} | {mmm([s.goodput_2x for s in rs], lambda v: f'{v:.1f}')} "
            f"| {mmm([s.goodput_2x_pct for s in rs], lambda v: f'{v:.0f}')} "
            f"| {mmm([s.p99_2x_ms for s in rs], lambda v: f'{v:.0f}')} "
            f"| {mmm([s.high_all for s in rs], lambda v: f'{100 * v:.2f} %')} "
            f"| {mmm([s.low_all for s in rs], lambda v: f'{100 * v:.1f} %')} "
            f"| {mmm([s.recovery_s for s in rs], lambda v: f'{v:.1f}')} |")
    return "\n".join(lines)


def controller_notes(run: VariantRun, capacity: float) -> list[str]:
    """What looks wrong in sitsmesh's own estimates during the run."""
    if not run.pressure:
        return []
    ticks = [(t - run.t0, d) for t, d in run.pressure if 0 <= t - run.t0 <= total_s()]
    t_mu, top = max(ticks, key=lambda x: x[1]["mu"])
    t_cap, cap = max(ticks, key=lambda x: x[1]["concurrency"])
    low = [d["mu"] for t, d in ticks if phase("2x")[0] <= t < phase("2x")[1] and d["mu"]]
    out = [f"stage capacity estimate (mu) peaked at {top['mu']:.0f} rps at t={t_mu:.1f} s "
           f"(measured capacity {capacity:.0f} rps; in the 2x phase it ranged "
           + (f"{min(low):.0f}-{max(low):.0f}" if low else "-")
           + f" rps); concurrency cap peaked at {cap['concurrency']} at t={t_cap:.1f} s"]
    wild = [(t, d) for t, d in ticks if d["mu"] > 2 * capacity]
    if wild:
        out.append(f"mu above 2x the measured capacity in {len(wild)} ticks, "
                   f"t={wild[0][0]:.1f}-{wild[-1][0]:.1f} s; the cap was "
                   f"{min(d['concurrency'] for _, d in wild)}-"
                   f"{max(d['concurrency'] for _, d in wild)} then")
    return out


def plot(rounds: Sequence[dict[str, list[Second]]], plotted: int, capacity: float,
         sla_ms: float, out: Path) -> None:
    """Goodput and admitted p99 per second: every variant of round `plotted` (0-based), and
    sitsmesh in the other rounds as thin dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    xs = [s + 0.5 for s in range(math.ceil(total_s()))]
    offered = [multiplier(x) * capacity for x in xs]
    top.plot(xs, offered, "k--", lw=1.2, label="offered")
    top.axhline(capacity, color="k", lw=0.6, alpha=0.4)
    lines = [(key, secs, f"{VARIANTS[key].label}" + (f" (round {plotted + 1})"
                                                     if len(rounds) > 1 else ""), 1.8, "-")
             for key, secs in rounds[plotted].items()]
    others = [(i, r) for i, r in enumerate(rounds) if i != plotted and SITSMESH in r]
    styles = ("--", ":", "-.")
    lines += [(SITSMESH, r[SITSMESH], f"sitsmesh (round {i + 1})", 1.0,
               styles[n % len(styles)]) for n, (i, r) in enumerate(others)]
    for key, secs, label, width, style in lines:
        color = COLORS[key]
        marker = "." if style == "-" else ""
        top.plot(xs, [s.goodput for s in secs], color=color, lw=width, ls=style,
                 marker=marker, label=label)
        bottom.plot([x for x, s in zip(xs, secs, strict=True) if s.p99_ms is not None],
                    [s.p99_ms for s in secs if s.p99_ms is not None], color=color, lw=width,
                    ls=style, marker=marker, label=label)
    bottom.axhline(sla_ms, color="r", ls="--", lw=1, label=f"SLA {sla_ms:g} ms")
    t = 0.0
    for seg in PROFILE:
        top.text(t + seg.seconds / 2, 3.1 * capacity, seg.name, ha="center", fontsize=8,
                 color="0.35")
        t += seg.seconds
        if seg is not PROFILE[-1]:
            for ax in (top, bottom):
                ax.axvline(t, color="k", lw=0.5, alpha=0.25)
    top.set_ylabel("requests/s")
    top.set_title(f"goodput (200 within {sla_ms:g} ms) per second sent; capacity "
                  f"{capacity:.0f} rps")
    bottom.set_ylabel("ms (log)")
    bottom.set_yscale("log")
    bottom.set_title("admitted p99 (requests answered 200) per second sent")
    bottom.set_xlabel("seconds since the variant started (by send time)")
    top.set_ylim(0, 3.3 * capacity)
    handles, labels = top.get_legend_handles_labels()
    sla_handles, sla_labels = bottom.get_legend_handles_labels()
    fig.legend(handles + sla_handles[-1:], labels + sla_labels[-1:], loc="upper center",
               ncol=4, fontsize=8, frameon=False)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(out, dpi=90)
    plt.close(fig)


def replot(path: Path, args: argparse.Namespace) -> int:
    """Draw the PNG again from a --json file of an earlier run."""
    doc = json.loads(path.read_text())
    rounds = [{key: [Second(**x) for x in secs] for key, secs in r["seconds"].items()}
              for r in doc["rounds"]]
    plotted = min(args.plot_round, len(rounds)) - 1
    plot(rounds, plotted, float(doc["capacity"]), args.sla_ms, args.png)
    print(f"plot of {path} (round {plotted + 1}, commit {doc.get('commit', '?')}): {args.png}")
    return 0


# --------------------------------------------------------------------------- main

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, run in this order (default {','.join(VARIANTS)})")
    p.add_argument("--service-ms", type=float, default=20.0,
                   help="the model's fixed service time (default 20)")
    p.add_argument("--sla-ms", type=float, default=250.0, help="stage SLA p99 (default 250)")
    p.add_argument("--timeout-s", type=float, default=2.0,
                   help="callers give up after this (default 2)")
    p.add_argument("--high-share", type=float, default=0.3,
                   help="share of requests at priority 9 (default 0.3)")
    p.add_argument("--capacity", type=float, default=0.0,
                   help="capacity in requests/s; 0 = measure it (default)")
    p.add_argument("--capacity-s", type=float, default=4.0,
                   help="closed-loop measurement length (default 4)")
    p.add_argument("--capacity-workers", type=int, default=4,
                   help="closed-loop callers (default 4)")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every variant this many times, for the spread (default 1)")
    p.add_argument("--plot-round", type=int, default=1,
                   help="the round the PNG shows (default 1)")
    p.add_argument("--png", type=Path, default=Path(__file__).resolve().parent / "overload.png",
                   help="where to write the plot (default bench/overload/overload.png)")
    p.add_argument("--json", type=Path, default=None,
                   help="also write the summaries and per-second numbers as JSON here")
    p.add_argument("--replot", type=Path, default=None,
                   help="only draw the PNG again from a --json file of an earlier run")
    args = p.parse_args(argv)
    keys = [k.strip() for k in args.variants.split(",") if k.strip()]
    unknown = [k for k in keys if k not in VARIANTS]
    if unknown or not keys:
        p.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    args.variant_list = [VARIANTS[k] for k in keys]
    if args.rounds < 1 or args.plot_round < 1:
        p.error("--rounds and --plot-round must be >= 1")
    if not 0 <= args.high_share <= 1:
        p.error("--high-share must be within 0..1")
    return args


def tails(procs: Sequence[Any]) -> list[str]:
    out = []
    for proc in procs:
        with contextlib.suppress(OSError):
            text = "\n".join(proc.output().splitlines()[-15:])
            if text:
                out.append(f"--- last output of {type(proc).__name__} ---\n{text}")
    return out


def git_head() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=REPO, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "sitsmesh", "filters"],
                               capture_output=True, text=True, cwd=REPO, check=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" (sitsmesh/ or filters/ modified)" if dirty else "")


def run(args: argparse.Namespace, tmp: Path, report: Callable[[str], None]
        ) -> tuple[float, str, list[list[VariantRun]]]:
    procs: list[Any] = []
    try:
        stack = start_stack(tmp, args, procs)
        if args.capacity > 0:
            capacity = args.capacity
            report(f"capacity given: {capacity:.1f} rps")
        else:
            capacity, median = measure_capacity(stack, args)
            report(f"capacity measured: {capacity:.1f} rps closed loop "
                   f"({args.capacity_workers} callers, median latency {median:.0f} ms; "
                   f"1 / service time = {1000 / args.service_ms:.0f} rps)")
        plan = schedule(capacity, args.high_share)
        rounds: list[list[VariantRun]] = []
        for rnd in range(1, args.rounds + 1):
            runs = []
            for variant in args.variant_list:
                began = time.monotonic()
                one = run_variant(stack, variant, plan, args)
                runs.append(one)
                s = summarise(one, capacity, args.sla_ms)
                rec = "never" if s.recovery_s is None else f"{s.recovery_s:.1f} s"
                report(f"round {rnd}/{args.rounds} {variant.label:<21} goodput 2x "
                       f"{s.goodput_2x:5.1f} rps ({s.goodput_2x_pct:3.0f} %)  p99 2x "
                       f"{fmt_ms(s.p99_2x_ms):>5} ms  high {fmt_pct(s.high_all, 2)}  "
                       f"low {fmt_pct(s.low_all)}  recovery {rec}  (drained "
                       f"{one.drained_s:.1f} s before; {time.monotonic() - began:.0f} s)")
            rounds.append(runs)
        return capacity, stack.version, rounds
    except (BenchError, RuntimeError, TimeoutError, OSError, ValueError, grpc.RpcError,
            subprocess.SubprocessError) as exc:
        raise BenchError("\n".join([str(exc), *tails(procs)])) from exc
    finally:
        for proc in reversed(procs):
            with contextlib.suppress(Exception):
                proc.kill()


def print_round(rnd: int, runs: Sequence[VariantRun], capacity: float,
                args: argparse.Namespace) -> list[Summary]:
    summaries = [summarise(r, capacity, args.sla_ms) for r in runs]
    print(f"\n### Round {rnd}\n")
    print(summary_table(summaries))
    print()
    print("\n".join(targets(summaries, args.sla_ms)))
    print(f"\nRound {rnd}, per second sent (goodput / admitted p99 / shed):\n")
    print(seconds_table(runs, args.sla_ms))
    for r in runs:
        if r.variant.policy == "sitsmesh":
            print(f"\nRound {rnd}, sitsmesh controller per second:\n")
            print(controller_table(r, args.sla_ms))
        if r.variant.adaptive:
            print(f"\nRound {rnd}, adaptive_concurrency gradient controller per second:\n")
            print(adaptive_table(r))
    print(f"\nRound {rnd} notes:\n")
    for s in summaries:
        codes = ", ".join(f"{k}: {v}" for k, v in s.codes.items())
        print(f"- {s.label}: statuses {codes}; client start lag p99 {s.lag_p99_ms:.1f} ms, "
              f"max {s.lag_max_ms:.1f} ms; Triton drained {s.drained_before_s:.1f} s "
              "before it")
    for r in runs:
        if r.variant.policy == "sitsmesh":
            for note in controller_notes(r, capacity):
                print(f"- sitsmesh controller: {note}")
    return summaries


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot is not None:
        return replot(args.replot, args)
    started = time.monotonic()
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    head_before = git_head()

    def report(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-overload-") as tmp_name:
        try:
            capacity, version, rounds = run(args, Path(tmp_name), report)
        except BenchError as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            return 1
    head_after = git_head()
    plotted = min(args.plot_round, len(rounds)) - 1
    plot([{r.variant.key: per_second(r, args.sla_ms) for r in runs} for runs in rounds],
         plotted, capacity, args.sla_ms, args.png)

    profile = ", ".join(f"{seg.name} {seg.seconds:g} s "
                        + (f"{seg.start_x:g}x" if seg.start_x == seg.end_x
                           else f"{seg.start_x:g}x->{seg.end_x:g}x") for seg in PROFILE)
    commit = head_before if head_before == head_after else (
        f"{head_before} at the start, {head_after} at the end (sitsmesh serve ran the code "
        "of the start)")
    print(f"\nOverload, {stamp}, commit {commit}: tritonserver {version}, demo model "
          f"{args.service_ms:g} ms fixed, 1 instance; capacity {capacity:.1f} rps; SLA "
          f"{args.sla_ms:g} ms; client timeout {args.timeout_s:g} s; {args.high_share:.0%} "
          f"priority 9; profile: {profile}; {len(rounds)} round(s); {os.cpu_count()} CPUs; "
          f"{time.monotonic() - started:.0f} s")
    all_summaries = [print_round(i + 1, runs, capacity, args) for i, runs in enumerate(rounds)]
    if len(rounds) > 1:
        print(f"\n### Over {len(rounds)} rounds\n")
        print(spread_table(all_summaries))
        checks = [target_checks(s, args.sla_ms) for s in all_summaries]
        if checks and checks[0]:
            print()
            for i, (name, _, _) in enumerate(checks[0]):
                met = sum(c[i][1] for c in checks)
                details = "; ".join(c[i][2] for c in checks)
                print(f"- {name}: met in {met}/{len(checks)} rounds ({details})")
    print(f"\n- plot: {args.png} (round {plotted + 1})")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "at": stamp, "commit": commit, "capacity": capacity,
            "rounds": [{
                "summaries": [asdict(s) for s in summaries],
                "seconds": {r.variant.key: [asdict(x) for x in per_second(r, args.sla_ms)]
                            for r in runs},
                "ticks": {r.variant.key: [{"t": round(t - r.t0, 3), **d}
                                          for t, d in r.pressure] for r in runs}}
                for summaries, runs in zip(all_summaries, rounds, strict=True)]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
