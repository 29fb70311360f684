"""With --workers, a config applied through the supervisor's admin API reaches every worker."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.dev import harness

CONFIG = """
domain: w
descriptors:
  - key: k
    rate_limit: {unit: hour, requests_per_unit: 1000}
"""


def _limit_seen(addr: str) -> int:
    # A fresh channel each time: SO_REUSEPORT spreads new connections over the workers.
    with grpc.insecure_channel(addr) as channel:
        reply = rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit(
            rls_pb2.RateLimitRequest(domain="w", descriptors=[ratelimit_pb2.RateLimitDescriptor(
                entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key="k", value="v")])]),
            timeout=5)
    limit: int = reply.statuses[0].current_limit.requests_per_unit
    return limit


def test_applied_config_reaches_all_workers(
    start_sitsmesh: Callable[..., harness.Sitsmesh],
) -> None:
    node = start_sitsmesh("--workers", "2", "--reload-interval-seconds", "0.2")
    with grpc.insecure_channel(node.admin_addr) as channel:
        admin_pb2_grpc.AdminServiceStub(channel).ApplyRateLimitConfig(
            admin_pb2.ApplyRateLimitConfigRequest(
                files=[admin_pb2.RateLimitConfigFile(name="w.yaml", yaml=CONFIG)]),
            metadata=node.admin_metadata(), timeout=5)
    harness.wait_until(lambda: all(_limit_seen(node.data_addr) == 1000 for _ in range(20)),
                       10, "every worker to load the applied config")
    assert node.stop() == 0
