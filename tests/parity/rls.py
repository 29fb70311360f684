"""What the parity modules share: one `sitsmesh serve` per module and flag set (memory or
a real redis-server), ShouldRateLimit calls, and the per-rule hit counters."""

from __future__ import annotations

import contextlib
import itertools
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

import grpc
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from envoy.type.v3 import ratelimit_unit_pb2

from sitsmesh.dev import harness
from sitsmesh.dev.redis import RedisServer

FIXTURES = Path(__file__).parent / "fixtures"
GOOD = FIXTURES / "good"
BAD = FIXTURES / "bad"
MERGE = FIXTURES / "merge"

Response = rls_pb2.RateLimitResponse
OK, OVER = Response.OK, Response.OVER_LIMIT
UNIT = Response.RateLimit
UNLIMITED_REMAINING = 2**32 - 1
UNIT_SECONDS = {UNIT.SECOND: 1, UNIT.MINUTE: 60, UNIT.HOUR: 3600, UNIT.DAY: 86400,
                UNIT.WEEK: 604800, UNIT.MONTH: 2592000, UNIT.YEAR: 31536000}
HITS = "sitsmesh_ratelimit_hits_total"
OUTCOMES = ("total_hits", "over_limit", "near_limit", "within_limit", "shadow_mode")

# Values unique to this run and call: counters of one serve never collide between tests.
_RUN = uuid.uuid4().hex[:6]
_seq = itertools.count()


def fresh(prefix: str = "v") -> str:
    return f"{prefix}{_RUN}x{next(_seq)}"


def desc(*pairs: tuple[str, str], addend: int | None = None,
         override: tuple[int, int] | None = None) -> ratelimit_pb2.RateLimitDescriptor:
    """A descriptor of (key, value) entries; `addend` sets its hits_addend wrapper,
    `override` its request-level limit (requests_per_unit, RateLimitUnit)."""
    d = ratelimit_pb2.RateLimitDescriptor(
        entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in pairs])
    if addend is not None:
        d.hits_addend.value = addend
    if override is not None:
        d.limit.requests_per_unit, d.limit.unit = override
    return d



DAY = ratelimit_unit_pb2.RateLimitUnit.DAY


def ask(node: harness.Sitsmesh, domain: str, *descs: ratelimit_pb2.RateLimitDescriptor,
        hits_addend: int = 0) -> rls_pb2.RateLimitResponse:
    with grpc.insecure_channel(node.data_addr) as channel:
        reply: rls_pb2.RateLimitResponse = rls_pb2_grpc.RateLimitServiceStub(
            channel).ShouldRateLimit(rls_pb2.RateLimitRequest(
                domain=domain, descriptors=list(descs), hits_addend=hits_addend), timeout=5)
        return reply


def refused(node: harness.Sitsmesh, domain: str,
            *descs: ratelimit_pb2.RateLimitDescriptor) -> grpc.RpcError:
    """The gRPC error a ShouldRateLimit gets (fails the test when it gets an answer)."""
    try:
        reply = ask(node, domain, *descs)
    except grpc.RpcError as exc:
        return exc
    raise AssertionError(f"expected a gRPC error, got an answer: {reply}")


def limit_of(reply: rls_pb2.RateLimitResponse, i: int = 0) -> int | None:
    """requests_per_unit of status i's current_limit; None when it has no limit."""
    status = reply.statuses[i]
    return status.current_limit.requests_per_unit if status.HasField("current_limit") else None


def hits(node: harness.Sitsmesh, key: str, text: str | None = None) -> dict[str, float]:
    """The rule's hit counters by outcome, from one scrape."""
    text = node.metrics() if text is None else text
    return {o: harness.metric_value(text, HITS, key=key, outcome=o) for o in OUTCOMES}


def stats_keys(text: str, prefix: str) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.labels["key"] for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == HITS and s.labels.get("key", "").startswith(prefix)}


def wait_for_keys(node: harness.Sitsmesh, keys: Iterable[str], total: dict[str, float],
                  timeout: float = 4) -> str:
    """Metrics are flushed once a second: wait until every key shows its expected
    total_hits (or the timeout), and return that scrape."""
    wanted = dict.fromkeys(keys, 1.0) | total
    text = ""

    def done() -> bool:
        nonlocal text
        text = node.metrics()
        return all(harness.metric_value(text, HITS, key=k, outcome="total_hits") >= v
                   for k, v in wanted.items())

    # On a timeout the caller's assertions name what is missing.
    with contextlib.suppress(TimeoutError):
        harness.wait_until(done, timeout, "rate-limit hit counters")
    return text


class Fleet:
    """The serves of one test module: one per (store, flags), started on first use and
    killed at the end. Each Redis-backed serve counts in its own Redis database, so two
    serves of a module never share a counter."""

    def __init__(self, tmp: Path) -> None:
        self._tmp = tmp
        self._redis: RedisServer | None = None
        self._nodes: dict[tuple[str, ...], harness.Sitsmesh] = {}

    def redis_args(self) -> list[str]:
        if self._redis is None:
            self._redis = RedisServer(self._tmp / "redis")
            self._redis.start()
        db = sum(1 for key in self._nodes if key[0] == "redis") + 1
        return ["--ratelimit-store", "redis", "--redis-url",
                f"redis://127.0.0.1:{self._redis.port}/{db}", "--redis-timeout-ms", "500"]

    def get(self, store: str, *flags: str, config: Path = GOOD) -> harness.Sitsmesh:
        key = (store, str(config), *flags)
        node = self._nodes.get(key)
        if node is None:
            extra = self.redis_args() if store == "redis" else []
            node = harness.start_sitsmesh(
                self._tmp, "--ratelimit-config", str(config), *extra, *flags,
                name=f"serve{len(self._nodes)}")
            self._nodes[key] = node
        return node

    def close(self) -> None:
        for node in self._nodes.values():
            node.kill()
        if self._redis is not None and self._redis.running:
            self._redis.stop()


FLUSH_S = 1.2  # sitsmesh moves request-path counts into its metrics once a second


def settled(node: harness.Sitsmesh, metric: str) -> float:
    """A counter's value once everything sent before this call has been flushed."""
    time.sleep(FLUSH_S)
    return harness.metric_value(node.metrics(), metric)
