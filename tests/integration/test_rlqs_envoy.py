"""RLQS with real Envoys (issue 16): Envoy's rate_limit_quota filter enforces quotas
sitsmesh assigns, with no call to sitsmesh per request.

Requests carry x-sits-tenant/-priority/-model themselves (in a mesh ext_authz sets
them): the filter is the only one in front of the router, so every call sitsmesh
gets is a usage report on the RLQS stream.
"""

from __future__ import annotations

import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sitsmesh.dev import harness
from sitsmesh.dev.redis import redis_server

Start = Callable[..., harness.Sitsmesh]
PER_MINUTE = 600  # 10/s in all
CONFIG = f"""
domain: sitsmesh-local
descriptors:
  - key: tenant
    value: acme
    rate_limit: {{unit: minute, requests_per_unit: {PER_MINUTE}}}
  - key: tenant
    value: free
    rate_limit: {{unit: minute, requests_per_unit: 0}}
"""


@dataclass
class Pacer:
    """One thread sending `rate` requests/s as tenant `tenant` through one Envoy, each
    answer stamped with its time; bounded by `seconds`."""

    envoy: harness.Envoy
    tenant: str
    rate: float
    seconds: float
    answers: list[tuple[float, int]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def _send(self) -> int:
        request = urllib.request.Request(
            self.envoy.url("/v2/models/llama/infer"), data=b"{}", method="POST",
            headers={"x-sits-tenant": self.tenant, "x-sits-priority": "0",
                     "x-sits-model": "llama"})
        try:
            with urllib.request.urlopen(request, timeout=5) as reply:
                reply.read()
                status: int = reply.status
                return status
        except urllib.error.HTTPError as err:
            err.read()
            return err.code

    def _run(self) -> None:
        # Poisson arrivals (seeded): requests in lockstep with Envoy's refill would
        # measure the phase between the two, not the quota.
        draw = random.Random(len(self.tenant) * 1000 + int(self.rate))
        began = time.monotonic()
        due = began
        while not self._stop.is_set() and time.monotonic() - began < self.seconds:
            due += draw.expovariate(self.rate)
            if due > time.monotonic():
                time.sleep(due - time.monotonic())
            self.answers.append((time.monotonic(), self._send()))

    def __enter__(self) -> Pacer:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def admitted(self, start: float, end: float) -> int:
        return sum(1 for at, status in self.answers if start <= at < end and status == 200)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "ratelimit.yaml"
    path.write_text(CONFIG)
    return path


def _envoys(tmp_path: Path, node: harness.Sitsmesh, upstream: int, n: int
            ) -> list[harness.Envoy]:
    envoys = []
    for i in range(n):
        (tmp_path / f"envoy{i}").mkdir()
        envoys.append(harness.start_envoy(tmp_path / f"envoy{i}", node.data_addr, upstream,
                                          fragments=["rate_limit_quota"]))
    return envoys


def test_sitsmesh_down_keeps_assignments_for_their_ttl_then_fails_open_and_resumes(
        tmp_path: Path, start_sitsmesh: Start, upstream: int, config: Path,
        kill_envoys: list[harness.Envoy]) -> None:
    args = ("--ratelimit-config", str(config), "--rlqs-assignment-ttl-s", "6")
    node = start_sitsmesh(*args, name="rlqs")
    [envoy] = _envoys(tmp_path, node, upstream, 1)
    kill_envoys.append(envoy)

    def status() -> int:
        return Pacer(envoy, "free", 1.0, 0)._send()

    status()  # the bucket's first request goes through and is reported at once
    harness.wait_until(lambda: status() == 429, 5, "DENY_ALL for the free tenant")
    node.proc.kill()
    killed = time.monotonic()
    assert status() == 429, "an assignment outlives its server until its TTL"
    harness.wait_until(lambda: status() == 200, 15, "fail open once the TTL ran out")
    opened = time.monotonic() - killed
    back = start_sitsmesh(*args, name="rlqs-again",
                          addrs=(node.data_addr, node.admin_addr, node.metrics_addr))
    assert back.proc.poll() is None
    restarted = time.monotonic()
    # Envoy reopens its stream at its next 5 s report and sitsmesh answers at once.
    harness.wait_until(lambda: status() == 429, 12, "DENY_ALL again after the restart")
    print(f"\nfailed open {opened:.1f} s after the kill (TTL 6 s); denying again "
          f"{time.monotonic() - restarted:.1f} s after the restart")
    assert opened >= 4.0


def test_two_envoys_on_two_replicas_hold_one_global_limit_and_the_busy_one_gets_most(
        tmp_path: Path, start_sitsmesh: Start, upstream: int, config: Path,
        kill_envoys: list[harness.Envoy]) -> None:
    """Each Envoy's RLQS stream reaches one replica; through Redis every replica splits
    the rate over the whole fleet's Envoys, by demand: two replicas do not admit twice
    the limit, and the Envoy with 90 % of the demand gets about 90 % of it."""
    with redis_server(tmp_path / "redis") as redis:
        args = ("--ratelimit-config", str(config), "--ratelimit-store", "redis",
                "--redis-url", redis.url)
        nodes = [start_sitsmesh(*args, name=f"replica{i}") for i in range(2)]
        envoys = []
        for i, node in enumerate(nodes):  # Envoy i talks to replica i only
            (tmp_path / f"envoy{i}").mkdir()
            envoys.append(harness.start_envoy(tmp_path / f"envoy{i}", node.data_addr,
                                              upstream, fragments=["rate_limit_quota"]))
        kill_envoys += envoys
        busy, quiet = envoys
        warmup, measured = 11.0, 20.0  # two reports, then two 10 s windows
        with Pacer(busy, "acme", 27.0, warmup + measured) as a, \
                Pacer(quiet, "acme", 3.0, warmup + measured) as b:
            time.sleep(warmup + measured + 0.5)
    start = min(a.answers[0][0], b.answers[0][0]) + warmup
    windows = [(start + 10 * i, start + 10 * (i + 1)) for i in range(2)]
    per_window = [a.admitted(*w) + b.admitted(*w) for w in windows]
    busy_share = sum(a.admitted(*w) for w in windows) / max(1, sum(per_window))
    print(f"\nadmitted per 10 s window {per_window} (limit {PER_MINUTE // 6}), "
          f"busy Envoy's share {busy_share:.2f}, sent {len(a.answers)}+{len(b.answers)}")
    expected = PER_MINUTE / 6
    assert abs(sum(per_window) - 2 * expected) <= 0.05 * 2 * expected, per_window
    assert 0.85 <= busy_share <= 0.95, busy_share
