"""Overload shed across two replicas behind two real Envoys, one stage service: one
controller decides on the traffic of both, and when it dies the other replica takes over
within a second and shedding goes on.

The stage is sitsmesh.dev.stagesvc: one worker, 20 ms a request, so 50 requests/s. Each
Envoy sends its Checks, access logs and stats to its own sitsmesh replica; the replicas
share them through a real redis-server (shared_runtime=redis).
"""

from __future__ import annotations

import json
import queue
import random
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

from sitsmesh.dev import harness
from sitsmesh.dev.redis import RedisServer, redis_server
from sitsmesh.dev.stagesvc import StageService
from tests import sharedstack
from tests.sharedstack import replicas

pytestmark = pytest.mark.integration

HIGH, LOW = 9, 0
PIPELINE = """name: plain
models: ["svc"]
stages:
  - name: svc
    match: {upstream_cluster: upstream}
    sla_p99_ms: 250
"""
THRESHOLDS = "stages:\n  svc: {parallelism: 1}\n"


@dataclass(frozen=True, slots=True)
class Result:
    sent: float
    priority: int
    status: int


@dataclass
class Fleet:
    stage: StageService
    nodes: list[harness.Sitsmesh]
    envoys: list[harness.Envoy]
    key: str


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as server:
        yield server


@pytest.fixture
def fleet(tmp_path: Path, redis: RedisServer) -> Iterator[Fleet]:
    stage = StageService(name="svc", parallelism=1, service_ms=20).start()
    nodes: list[harness.Sitsmesh] = []
    envoys: list[harness.Envoy] = []
    state = tmp_path / "state"
    try:
        nodes += replicas(partial(harness.start_sitsmesh, tmp_path), state,
                                      redis.url)
        a = nodes[0]
        (tmp_path / "plain.yaml").write_text(PIPELINE)
        (tmp_path / "thresholds.yaml").write_text(THRESHOLDS)
        for args in (("pipelines", "apply", str(tmp_path / "plain.yaml")),
                     ("thresholds", "set", "plain", str(tmp_path / "thresholds.yaml")),
                     ("tenants", "create", "acme", "--models", "*", "--priority", "0",
                      "--max-priority", "9")):
            done = a.cli(*args)
            assert done.returncode == 0, done.stderr
        key = json.loads(a.cli("apikeys", "create", "--tenant", "acme", "--output",
                               "json").stdout)["key"]
        for n, node in enumerate(nodes):
            workdir = tmp_path / f"envoy-{n}"
            workdir.mkdir()
            envoys.append(harness.start_envoy(
                workdir, node.data_addr, stage.port,
                fragments=["ext_authz", "access_log", "metrics_service"],
                access_log_flush="1s"))
        harness.wait_until(lambda: all(_knows(n) for n in nodes), 5, "the pipeline on both")
        yield Fleet(stage, nodes, envoys, key)
    finally:
        for proc in [*envoys, *nodes]:
            proc.kill()
        stage.stop()


def _knows(node: harness.Sitsmesh) -> bool:
    try:
        node.pressure("plain")
    except Exception:
        return False
    return True


def _drive(fleet: Fleet, envoys: list[harness.Envoy], rate: float, seconds: float,
           seed: int, high_share: float = 0.3, workers: int = 48) -> list[Result]:
    """Open loop, Poisson arrivals, spread evenly over `envoys`. Bounded: rate x seconds
    requests, each with a 10 s timeout."""
    rng = random.Random(seed)
    due: queue.Queue[tuple[float, int, str] | None] = queue.Queue()
    start = time.monotonic() + 0.2
    at, n = 0.0, 0
    while at < seconds:
        url = envoys[n % len(envoys)].url("/v2/models/svc/infer")
        due.put((start + at, HIGH if rng.random() < high_share else LOW, url))
        at += rng.expovariate(rate)
        n += 1
    results: list[Result] = []
    lock = threading.Lock()

    def work() -> None:
        while (item := due.get()) is not None:
            when, priority, url = item
            time.sleep(max(0.0, when - time.monotonic()))
            request = urllib.request.Request(url, data=b"{}", method="POST", headers={
                "x-api-key": fleet.key, "x-priority": str(priority)})
            try:
                with urllib.request.urlopen(request, timeout=10) as reply:
                    reply.read()
                    status = reply.status
            except urllib.error.HTTPError as exc:
                exc.read()
                status = exc.code
            except OSError:
                status = 0
            with lock:
                results.append(Result(when - start, priority, status))

    threads = [threading.Thread(target=work, daemon=True) for _ in range(workers)]
    for _ in threads:
        due.put(None)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 30)
    return sorted(results, key=lambda r: r.sent)


def test_two_replicas_shed_as_one_and_shedding_survives_the_leaders_death(
        fleet: Fleet) -> None:
    # 80 requests/s over both Envoys against a stage that serves 50: each replica alone
    # sees 40 (under capacity, nothing to shed), but the one controller sees all of it.
    both = _drive(fleet, fleet.envoys, rate=80, seconds=6, seed=7)
    steady = [r for r in both if r.sent >= 2.0]
    high = [r for r in steady if r.priority == HIGH]
    low = [r for r in steady if r.priority == LOW]
    assert high and low
    assert all(r.status == 200 for r in high), {r.status for r in high}
    assert sum(r.status == 429 for r in low) > 0.2 * len(low)
    for node in fleet.nodes:  # either replica reports the same decision
        assert node.pressure("plain").fraction < 0.9

    leader = sharedstack.leader(fleet.nodes)
    survivor = next(n for n in fleet.nodes if n is not leader)
    survivor_envoy = fleet.envoys[fleet.nodes.index(survivor)]
    assert leader.stop(signal.SIGKILL) != 0
    killed = time.monotonic()
    harness.wait_until(lambda: '"leading"' in survivor.output(), 3, "the survivor leads")
    assert time.monotonic() - killed < 1.0
    # The whole load now through the survivor: shedding goes on, high priority served.
    after = _drive(fleet, [survivor_envoy], rate=80, seconds=5, seed=8)
    steady_after = [r for r in after if r.sent >= 1.0]
    high_after = [r for r in steady_after if r.priority == HIGH]
    low_after = [r for r in steady_after if r.priority == LOW]
    assert all(r.status == 200 for r in high_after), {r.status for r in high_after}
    assert sum(r.status == 429 for r in low_after) > 0.2 * len(low_after)
