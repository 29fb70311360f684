"""Two `sitsmesh serve` processes share limits through a real redis-server, and what
happens to answers and health while that Redis is down and after it returns."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from grpc import aio
from grpc_health.v1 import health_pb2
from redis.asyncio import Redis

from sitsmesh.app.components import STORE_HEALTH
from sitsmesh.dev import harness
from sitsmesh.dev.redis import RedisServer, redis_server
from sitsmesh.dev.rediscluster import RedisClusterNodes
from tests.redisfixtures import (  # noqa: F401 - fixtures
    cluster_fixture,
    redis_cluster_fixture,
    shared_redis_fixture,
)

Start = Callable[..., harness.Sitsmesh]
OK, OVER = rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.OVER_LIMIT
LIMIT = 40
CONFIG = f"""
domain: shared
descriptors:
  - key: user
    rate_limit: {{unit: hour, requests_per_unit: {LIMIT}}}
"""


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as server:
        yield server


def _request(user: str) -> rls_pb2.RateLimitRequest:
    return rls_pb2.RateLimitRequest(domain="shared", descriptors=[ratelimit_pb2.RateLimitDescriptor(
        entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key="user", value=user)])])


async def _admitted(addrs: list[str], user: str, total: int, concurrency: int = 8) -> int:
    """Send `total` requests spread over the servers, concurrently; count the OK answers."""
    admitted = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for n in range(total):
        queue.put_nowait(n)
    channels = [aio.insecure_channel(a) for a in addrs]
    stubs = [rls_pb2_grpc.RateLimitServiceStub(c) for c in channels]

    async def worker() -> None:
        nonlocal admitted
        while not queue.empty():
            n = queue.get_nowait()
            reply = await stubs[n % len(stubs)].ShouldRateLimit(_request(user), timeout=5)
            admitted += reply.overall_code == OK

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        for channel in channels:
            await channel.close()
    return admitted


def _start_pair(start: Start, tmp_path: Path, redis: RedisServer | RedisClusterNodes,
                policy: str = "allow") -> list[harness.Sitsmesh]:
    config = tmp_path / "shared.yaml"
    config.write_text(CONFIG)
    return [start("--ratelimit-config", str(config), "--ratelimit-store", "redis",
                  "--redis-url", redis.url, "--on-store-error", policy,
                  "--store-replicas", "2",
                  # Generous for a loaded 2-core CI box: a spurious timeout would apply
                  # the failure policy and make the exact counts below flaky.
                  "--redis-timeout-ms", "300", name=f"replica{i}") for i in range(2)]


async def test_two_replicas_never_admit_more_than_the_shared_limit(
    start_sitsmesh: Start, tmp_path: Path, shared_redis: RedisServer | RedisClusterNodes
) -> None:
    """On one redis-server and on a Redis Cluster (--redis-url redis+cluster://)."""
    nodes = _start_pair(start_sitsmesh, tmp_path, shared_redis)
    admitted = await _admitted([n.data_addr for n in nodes], "alice", LIMIT * 3)
    assert admitted == LIMIT
    # Each replica alone would have admitted LIMIT; together they admitted LIMIT in total.
    assert await _admitted([nodes[1].data_addr], "alice", 5) == 0


@pytest.mark.parametrize(("policy", "expected_while_down"), [
    ("allow", 20),          # every request admitted
    ("deny", 0),            # every request refused
    ("local", LIMIT // 2),  # each replica counts alone, limit divided by 2 replicas
])
async def test_redis_down_then_back_under_each_policy(
    start_sitsmesh: Start, tmp_path: Path, redis: RedisServer, policy: str,
    expected_while_down: int,
) -> None:
    node = _start_pair(start_sitsmesh, tmp_path, redis, policy)[0]
    assert await _admitted([node.data_addr], "before", 3) == 3

    redis.kill()
    started = time.monotonic()
    sent = 20 if policy != "local" else LIMIT
    admitted = await _admitted([node.data_addr], "down", sent, concurrency=4)
    elapsed = time.monotonic() - started
    assert admitted == expected_while_down
    assert elapsed < 5, f"{sent} calls took {elapsed:.1f}s: the store timeout must bound them"
    harness.wait_until(lambda: harness.health_status(node.data_addr, STORE_HEALTH)
                       == health_pb2.HealthCheckResponse.NOT_SERVING, 5, "store NOT_SERVING")
    assert harness.health_status(node.data_addr) == health_pb2.HealthCheckResponse.SERVING

    redis.start()

    async def counted_in_redis() -> bool:
        await _admitted([node.data_addr], "probe", 1)
        status = harness.health_status(node.data_addr, STORE_HEALTH)
        return bool(status == health_pb2.HealthCheckResponse.SERVING)

    deadline = time.monotonic() + 15
    while not await counted_in_redis():
        assert time.monotonic() < deadline, "store never recovered"
        await asyncio.sleep(0.2)
    # Back on the shared store: a fresh user gets exactly the configured limit.
    assert await _admitted([node.data_addr], "after", LIMIT + 5) == LIMIT
    assert harness.metric_value(node.metrics(), "sitsmesh_ratelimit_store_up") == 1


def test_redis_down_at_start_shows_in_health_before_any_traffic(
    start_sitsmesh: Start, tmp_path: Path
) -> None:
    config = tmp_path / "shared.yaml"
    config.write_text(CONFIG)
    dead = f"redis://127.0.0.1:{harness.free_port()}/0"
    node = start_sitsmesh("--ratelimit-config", str(config), "--ratelimit-store", "redis",
                          "--redis-url", dead, "--on-store-error", "deny")
    assert harness.health_status(node.data_addr, STORE_HEALTH) == \
        health_pb2.HealthCheckResponse.NOT_SERVING
    assert harness.health_status(node.data_addr) == health_pb2.HealthCheckResponse.SERVING
    text = node.metrics()
    assert harness.metric_value(text, "sitsmesh_ratelimit_store_up") == 0
    assert harness.metric_value(text, "sitsmesh_ratelimit_store_errors_total") >= 1
    assert dead not in node.output(), "the Redis URL may carry a password: never logged"


async def test_the_reference_deployments_environment_is_enough(
    start_sitsmesh: Start, tmp_path: Path, redis: RedisServer
) -> None:
    """envoyproxy/ratelimit's variables alone: its runtime directory layout, its
    host:port REDIS_URL, and its response-header switch and names."""
    config_dir = tmp_path / "runtime" / "ratelimit" / "config"
    config_dir.mkdir(parents=True)
    (config_dir / "shared.yaml").write_text(CONFIG)
    node = start_sitsmesh(env={
        "RUNTIME_ROOT": str(tmp_path / "runtime"), "RUNTIME_SUBDIRECTORY": "ratelimit",
        "REDIS_URL": f"127.0.0.1:{redis.port}", "REDIS_TIMEOUT": "2s",
        "LIMIT_RESPONSE_HEADERS_ENABLED": "true", "LIMIT_REMAINING_HEADER": "X-Left"})
    async with aio.insecure_channel(node.data_addr) as channel:
        reply = await rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit(
            _request("env"), timeout=5)
    assert reply.overall_code == OK and reply.statuses[0].limit_remaining == LIMIT - 1
    assert {h.key: h.value for h in reply.response_headers_to_add}.get("X-Left") == str(
        LIMIT - 1)
    # Counted in the shared Redis, not in the process.
    client = Redis(host="127.0.0.1", port=redis.port, decode_responses=True)
    try:
        assert [int(await client.get(k) or 0)
                async for k in client.scan_iter("sitsmesh:rl:*")] == [1]
    finally:
        await client.aclose()


def test_a_reference_setting_sitsmesh_cannot_honour_stops_the_start(tmp_path: Path) -> None:
    result = harness.run_cli("serve", "--state-dir", str(tmp_path / "s"),
                             env={"CONFIG_TYPE": "GRPC_XDS_SOTW"})
    assert result.returncode == 2
    assert "CONFIG_TYPE='GRPC_XDS_SOTW' (envoyproxy/ratelimit's setting) is not supported" \
        in result.stderr
