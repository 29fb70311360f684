"""Three `sitsmesh serve` replicas behind one real Envoy (issue 15): a replica killed with
SIGKILL under load costs at most the requests in flight at that instant, and a rolling
restart of all three costs none.

As the issue sets it up: the replicas share admin state through one real PostgreSQL and
rate-limit counts, hops and the controller's lease through one real redis-server. Envoy
has all three as endpoints of sitsmesh_data, for ext_authz, ratelimit and access logs,
with the fragments' active gRPC health checks, outlier detection and retries.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sitsmesh.dev import harness
from sitsmesh.dev.redis import RedisServer, redis_server
from tests.pgcluster import pg_cluster, pg_url  # noqa: F401 - fixtures

Start = Callable[..., harness.Sitsmesh]
INFER = "/v2/models/llama-3/infer"
CLUSTER = "sitsmesh_data"
CONCURRENCY = 4
# A limit the load never reaches: every request is counted in Redis, none refused.
RATELIMIT_CONFIG = """
domain: sitsmesh-local
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1000000}
"""


@dataclass
class Outcome:
    started: float
    ended: float
    status: int  # 0: no HTTP answer at all


@dataclass
class Load:
    """CONCURRENCY threads sending authorized requests through Envoy until stopped, each
    bounded by a request count and a deadline."""

    envoy: harness.Envoy
    key: str
    max_requests: int = 20_000
    max_seconds: float = 60.0
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _one(self) -> Outcome:
        req = urllib.request.Request(self.envoy.url(INFER), data=b"{}", method="POST",
                                     headers={"x-api-key": self.key, "x-user": "load",
                                              "content-type": "application/json"})
        started = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                resp.read()
                status = resp.status
        except urllib.error.HTTPError as err:
            status = err.code
        except OSError:
            status = 0
        return Outcome(started, time.monotonic(), status)

    def _run(self) -> None:
        deadline = time.monotonic() + self.max_seconds
        while not self._stop.is_set() and time.monotonic() < deadline:
            outcome = self._one()
            with self._lock:
                if len(self.outcomes) >= self.max_requests:
                    return
                self.outcomes.append(outcome)

    def __enter__(self) -> Load:
        self._threads = [threading.Thread(target=self._run, daemon=True)
                         for _ in range(CONCURRENCY)]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)

    def count(self) -> int:
        with self._lock:
            return len(self.outcomes)

    def wait_for(self, more: int, timeout: float = 20) -> None:
        target = self.count() + more
        harness.wait_until(lambda: self.count() >= target, timeout, f"{more} more requests")

    def failures(self) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if o.status != 200]


def _host_flags(envoy: harness.Envoy) -> dict[str, str]:
    """health_flags of each sitsmesh_data endpoint, by address."""
    flags = {}
    for line in envoy.admin_get("/clusters").splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == CLUSTER and parts[2] == "health_flags":
            flags[parts[1]] = parts[3]
    return flags


def _upstream_errors(envoy: harness.Envoy) -> dict[str, int]:
    """sitsmesh_data's non-zero error counters: what went wrong when something did."""
    names = ("upstream_rq_per_try_timeout", "upstream_rq_timeout", "upstream_cx_connect_fail",
             "upstream_rq_retry_limit_exceeded", "upstream_rq_rx_reset",
             "upstream_rq_pending_failure_eject", "upstream_cx_destroy_remote_with_active_rq")
    counts = {n: _stat(envoy, f"cluster.{CLUSTER}.{n}") for n in names}
    return {n: c for n, c in counts.items() if c}


def _stat(envoy: harness.Envoy, name: str) -> int:
    for line in envoy.admin_get(f"/stats?filter=^{name}$").splitlines():
        key, _, value = line.partition(": ")
        if key == name:
            return int(value)
    return 0


@dataclass
class Replicas:
    nodes: list[harness.Sitsmesh]
    envoy: harness.Envoy
    key: str
    restart: Callable[[harness.Sitsmesh], harness.Sitsmesh]

    def all_healthy(self) -> bool:
        flags = _host_flags(self.envoy)
        return len(flags) == len(self.nodes) and set(flags.values()) == {"healthy"}


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as server:
        yield server


@pytest.fixture
def replicas(tmp_path: Path, start_sitsmesh: Start, upstream: int,
             redis: RedisServer, pg_url: str) -> Iterator[Replicas]:  # noqa: F811
    config = tmp_path / "ratelimit.yaml"
    config.write_text(RATELIMIT_CONFIG)
    # One state dir too: it holds the admin token the CLI calls of every replica use.
    state = tmp_path / "shared-state"
    args = ("--state-url", pg_url, "--ratelimit-config", str(config),
            "--ratelimit-store", "redis", "--redis-url", redis.url,
            "--shared-runtime", "redis", "--store-replicas", "3",
            "--reload-interval-seconds", "0.2")

    def start(name: str, addrs: tuple[str, str, str] | None = None) -> harness.Sitsmesh:
        return start_sitsmesh(*args, name=name, state_dir=state, addrs=addrs, drain=1.0)

    first = start("replica0")
    created = first.cli("tenants", "create", "acme", "--models", "llama-*")
    assert created.returncode == 0, created.stderr
    made = first.cli("apikeys", "create", "--tenant", "acme", "--output", "json")
    assert made.returncode == 0, made.stderr
    key: str = json.loads(made.stdout)["key"]
    nodes = [first, start("replica1"), start("replica2")]
    envoy = harness.start_envoy(tmp_path, first.data_addr, upstream,
                                fragments=["ext_authz", "ratelimit", "access_log"],
                                replicas=[n.data_addr for n in nodes])
    generation = iter(range(3, 100))

    def restart(node: harness.Sitsmesh) -> harness.Sitsmesh:
        return start(f"replica{next(generation)}",
                     (node.data_addr, node.admin_addr, node.metrics_addr))

    stack = Replicas(nodes, envoy, key, restart)
    try:
        harness.wait_until(stack.all_healthy, 15, "Envoy to see three healthy replicas")
        yield stack
    finally:
        envoy.kill()


def test_replica_killed_under_load_fails_only_requests_in_flight_on_it(
        replicas: Replicas) -> None:
    victim = replicas.nodes[1]
    with Load(replicas.envoy, replicas.key) as load:
        load.wait_for(150)
        assert load.failures() == [], "failures before anything was killed"
        killed_at = time.monotonic()
        victim.proc.kill()  # SIGKILL: no drain, connections reset
        harness.wait_until(lambda: _host_flags(replicas.envoy)[victim.data_addr] != "healthy",
                           10, "Envoy to take the killed replica out")
        ejected_after = time.monotonic() - killed_at
        load.wait_for(300)
    failures = load.failures()
    flags = _host_flags(replicas.envoy)[victim.data_addr]
    ejections = _stat(replicas.envoy,
                      f"cluster.{CLUSTER}.outlier_detection.ejections_enforced_total")
    print(f"\nkill -9: {len(load.outcomes)} requests, {len(failures)} failed, "
          f"replica out after {ejected_after * 1000:.0f} ms ({flags}), "
          f"retries {_stat(replicas.envoy, f'cluster.{CLUSTER}.upstream_rq_retry')}, "
          f"outlier ejections {ejections}, errors {_upstream_errors(replicas.envoy)}")
    # Only requests already in flight at the kill may fail, and there are at most
    # CONCURRENCY of those.
    assert all(f.started <= killed_at for f in failures), failures
    assert len(failures) <= CONCURRENCY, failures
    assert "failed_active_hc" in flags or "failed_outlier_check" in flags
    assert len(load.outcomes) >= 450
    # The two survivors served everything after the kill.
    assert sum(o.started > killed_at + ejected_after for o in load.outcomes) >= 300


def _exit_code(node: harness.Sitsmesh, timeout: float) -> int:
    try:
        return node.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{node.data_addr} still running {timeout} s after SIGTERM; its log:\n"
                    f"{node.output()[-6000:]}")


def test_rolling_restart_of_every_replica_fails_no_request(replicas: Replicas) -> None:
    timings = []
    with Load(replicas.envoy, replicas.key) as load:
        load.wait_for(100)
        for i, old in enumerate(list(replicas.nodes)):
            began = time.monotonic()
            old.proc.send_signal(signal.SIGTERM)
            assert _exit_code(old, 20) == 0, old.output()
            new = replicas.restart(old)  # same port: Envoy's static endpoint stays valid
            replicas.nodes[i] = new
            harness.wait_until(replicas.all_healthy, 15,
                               f"Envoy to see {new.data_addr} healthy again")
            timings.append(time.monotonic() - began)
            load.wait_for(50)
    failures = load.failures()
    errors = _stat(replicas.envoy, "cluster.upstream.ratelimit.error")
    print(f"\nrolling restart: {len(load.outcomes)} requests, {len(failures)} failed, "
          f"ratelimit errors {errors}, per replica "
          f"{', '.join(f'{t:.1f}s' for t in timings)}, "
          f"retries {_stat(replicas.envoy, f'cluster.{CLUSTER}.upstream_rq_retry')}, "
          f"errors {_upstream_errors(replicas.envoy)}")
    assert failures == []
    assert errors == 0, "a ShouldRateLimit failed (the filter fails open, so look here)"
    assert len(load.outcomes) >= 250
