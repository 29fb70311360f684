"""Backpressure on a plain HTTP stage (no Triton metrics) behind real Envoy with Envoy's
default 1 s access-log flush, as Istio ships it: only the pipeline, its SLA and the
stage's parallelism are set. Envoy pushes its per-cluster stats to sitsmesh too.

The stage is sitsmesh.dev.stagesvc: one worker, 20 ms a request, so 50 requests/s.

Both ways of shedding run the same test: `calls` (ext_authz's Check answers 429) and
`rlqs` (Envoy's rate_limit_quota filter answers 429 on the quotas sitsmesh pushes it;
Check, still there for identity, only counts). `rlqs-process` is `rlqs` served by
sitsmesh's RLQS process (rlqs_addr): the controller's decisions cross to it.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sitsmesh.admin.enums import word
from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.dev import harness
from sitsmesh.dev.stagesvc import StageService

pytestmark = pytest.mark.integration

SLA_MS = 250.0
HIGH, LOW = 9, 0
PIPELINE = f"""name: plain
models: ["svc"]
stages:
  - name: svc
    match: {{upstream_cluster: upstream}}
    sla_p99_ms: {SLA_MS:g}
"""
THRESHOLDS = "stages:\n  svc: {parallelism: 1}\n"


@dataclass(frozen=True, slots=True)
class Result:
    sent: float
    priority: int
    status: int
    seconds: float


@dataclass
class Stack:
    stage: StageService
    node: harness.Sitsmesh
    envoy: harness.Envoy
    key: str
    admission: str


@pytest.fixture(params=["calls", "rlqs", "rlqs-process"])
def stack(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Stack]:
    with _stack(tmp_path, str(request.param)) as made:
        yield made


@contextlib.contextmanager
def _stack(tmp_path: Path, param: str, distribution: str = "fixed") -> Iterator[Stack]:
    admission, _, process = param.partition("-")
    stage = StageService(name="svc", parallelism=1, service_ms=20,
                         distribution=distribution, seed=29).start()
    node = envoy = None
    limits = ["rate_limit_quota"] if admission == "rlqs" else []
    rlqs_addr = f"127.0.0.1:{harness.free_port()}" if process else ""
    try:
        node = harness.start_sitsmesh(tmp_path, "--admission", admission,
                                      *(("--rlqs-addr", rlqs_addr) if process else ()))
        (tmp_path / "plain.yaml").write_text(PIPELINE)
        (tmp_path / "thresholds.yaml").write_text(THRESHOLDS)
        for args in (("pipelines", "apply", str(tmp_path / "plain.yaml")),
                     ("thresholds", "set", "plain", str(tmp_path / "thresholds.yaml")),
                     ("tenants", "create", "acme", "--models", "*", "--priority", "0",
                      "--max-priority", "9")):
            done = node.cli(*args)
            assert done.returncode == 0, done.stderr
        made = node.cli("apikeys", "create", "--tenant", "acme", "--output", "json")
        key = json.loads(made.stdout)["key"]
        envoy = harness.start_envoy(tmp_path, node.data_addr, stage.port,
                                    fragments=["ext_authz", *limits, "access_log",
                                               "metrics_service"],
                                    access_log_flush="1s", rlqs_addr=rlqs_addr)
        yield Stack(stage, node, envoy, key, admission)
    finally:
        for proc in (envoy, node):
            if proc is not None:
                proc.kill()
        stage.stop()


def _drive(stack: Stack, rate: float, seconds: float, high_share: float = 0.3,
           workers: int = 48) -> list[Result]:
    """Open loop, Poisson arrivals (seeded): each request is sent at its time, whatever
    came back before. Bounded: rate x seconds requests, each with a 10 s timeout."""
    import random

    rng = random.Random(7)
    url = stack.envoy.url("/v2/models/svc/infer")
    due: queue.Queue[tuple[float, int] | None] = queue.Queue()
    start = time.monotonic() + 0.2
    at = 0.0
    while at < seconds:
        due.put((start + at, HIGH if rng.random() < high_share else LOW))
        at += rng.expovariate(rate)
    results: list[Result] = []
    lock = threading.Lock()

    def work() -> None:
        while (item := due.get()) is not None:
            when, priority = item
            time.sleep(max(0.0, when - time.monotonic()))
            request = urllib.request.Request(url, data=b"{}", method="POST", headers={
                "x-api-key": stack.key, "x-priority": str(priority)})
            began = time.monotonic()
            try:
                with urllib.request.urlopen(request, timeout=10) as reply:
                    reply.read()
                    status = reply.status
            except urllib.error.HTTPError as exc:
                exc.read()
                status = exc.code
            with lock:
                results.append(Result(when - start, priority, status, time.monotonic() - began))

    threads = [threading.Thread(target=work, daemon=True) for _ in range(workers)]
    for _ in threads:
        due.put(None)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 30)
    return sorted(results, key=lambda r: r.sent)



def test_half_load_sheds_nothing_twice_sheds_low_priority_and_it_recovers(
        stack: Stack) -> None:
    calm = _drive(stack, rate=25, seconds=8)
    shed = [r for r in calm if r.status == 429]
    assert len(shed) <= 0.005 * len(calm), f"{len(shed)} of {len(calm)} shed at 0.5x"
    assert {r.status for r in calm} <= {200, 429}
    stage = stack.node.pressure("plain").stages[0]
    assert 35 <= stage.capacity <= 70, stage.capacity  # from the stage's own work: ~50/s
    # ... with how far to trust it: the unqueued service times behind it, and their
    # spread (the stage's are fixed, 20 ms; Envoy's timing adds a little).
    assert stage.capacity_samples >= 10, stage
    assert 0 <= stage.service_cs2 < 0.5, stage

    results = _drive(stack, rate=100, seconds=8)
    steady = [r for r in results if r.sent >= 2.0]
    high = [r for r in steady if r.priority == HIGH]
    low = [r for r in steady if r.priority == LOW]
    assert high and low
    assert all(r.status == 200 for r in high), {r.status for r in high}
    high_ms = sorted(r.seconds * 1000 for r in high)
    assert high_ms[int(0.99 * (len(high_ms) - 1))] <= SLA_MS, high_ms[-10:]
    assert sum(r.status == 429 for r in low) > 0.2 * len(low)
    served = sum(r.status == 200 for r in steady) / 6.0
    assert served >= 0.8 * 50, served  # the stage kept busy
    if stack.admission == "rlqs":
        # Every 429 came from Envoy, on its quotas: sitsmesh's Check refused nothing.
        assert "sitsmesh_shed_total{" not in stack.node.metrics()

    # Envoy's stats reached sitsmesh: the stage's queue as Envoy saw it.
    metrics = stack.node.metrics()
    assert harness.metric_value(metrics, "sitsmesh_envoy_stats_flushes_total") > 0
    # Each signal says how old it is: the access log a flush (1 s) behind and not stale
    # for it, Envoy's stats (flushed every 0.25 s here) fresher.
    ages = {word(admin_pb2.SignalSource, a.source): a
            for a in stack.node.pressure("plain").stages[0].signals}
    assert set(ages) == {"access_log", "envoy_stats"}, ages
    assert 0 <= ages["access_log"].age_s <= 2.5 and not ages["access_log"].stale
    assert 0 <= ages["envoy_stats"].age_s <= 1.0 and not ages["envoy_stats"].stale
    assert 'source="access_log"' in metrics  # exported (the value is 0.0 when absent)
    assert harness.metric_value(metrics, "sitsmesh_stage_signal_age_seconds",
                                pipeline="plain", stage="svc", source="access_log") > 0

    dropped = time.monotonic()
    while True:
        pressure = stack.node.pressure("plain")
        if pressure.fraction == 1.0 and pressure.level == admin_pb2.PRESSURE_LEVEL_OK:
            break
        assert time.monotonic() - dropped < 3.0, f"no recovery within 3 s: {pressure}"
        time.sleep(0.05)
    after = _drive(stack, rate=25, seconds=2, high_share=0.0)
    assert sum(r.status == 200 for r in after) >= 0.995 * len(after)


def test_a_noisy_stage_gets_a_cap_sized_to_the_tail_of_its_service_times(
        tmp_path: Path) -> None:
    """Issue 29 through real Envoy: exponential service times (20 ms mean). sitsmesh
    learns their spread, and under overload caps low priority at the queue that drains
    within the SLA at their tail (about 2 in flight), not at the mean-sized queue a
    fixed stage gets (6): high priority, never shed, finds little ahead of it."""
    with _stack(tmp_path, "calls", "exp") as stack:
        _drive(stack, rate=25, seconds=5)
        # The spread is learned from unqueued calls, which half load has plenty of (a
        # fixed stage reads under 0.5 here, in the test above). Under overload few calls
        # find the stage idle: a window of 10 exponential samples reads under 0.5 one
        # time in four, so the overloaded snapshots are not where to check it.
        calm = stack.node.pressure("plain").stages[0]
        assert calm.capacity_samples >= 10 and calm.service_cs2 >= 0.5, calm
        seen: list[admin_pb2.PipelinePressure] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                seen.append(stack.node.pressure("plain"))
                done.wait(0.2)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            results = _drive(stack, rate=100, seconds=7)
        finally:
            done.set()
            watcher.join(10)
    overloaded = [p for p in seen if p.level == admin_pb2.PRESSURE_LEVEL_OVERLOADED]
    assert len(overloaded) >= 5, [word(admin_pb2.PressureLevel, p.level) for p in seen]
    caps = sorted(p.concurrency for p in overloaded)
    assert 1 <= caps[len(caps) // 2] <= 3, caps
    steady = [r for r in results if r.sent >= 2.0]
    assert all(r.status == 200 for r in steady if r.priority == HIGH)
    low = [r for r in steady if r.priority == LOW]
    assert sum(r.status == 429 for r in low) > 0.3 * len(low)
    assert sum(r.status == 200 for r in steady) / 5.0 >= 0.6 * 50  # still busy
