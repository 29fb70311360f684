"""/metrics of a real `sitsmesh serve` behind real Envoy (ext_authz and ratelimit) counts
each decision: ext_authz by decision, reason and tenant, rate limits under sitsmesh's and
envoyproxy/ratelimit's names (both by default), RPCs under the standard grpc_server_*
names, and serving state."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from sitsmesh.dev import harness

CONFIG = harness.REPO / "filters" / "local" / "ratelimit"
AUTHZ = "envoy.service.auth.v3.Authorization"




def test_decisions_rate_limits_and_rpcs_are_counted(
        tmp_path: Path, start_sitsmesh: Callable[..., harness.Sitsmesh], upstream: int) -> None:
    node = start_sitsmesh("--ratelimit-config", str(CONFIG))
    envoy = harness.start_envoy(tmp_path, node.data_addr, upstream,
                                fragments=["ext_authz", "ratelimit"])
    try:
        assert node.cli("tenants", "create", "acme", "--models", "bert").returncode == 0
        key = json.loads(node.cli("apikeys", "create", "--tenant", "acme", "--output",
                                  "json").stdout)["key"]
        harness.wait_until(lambda: envoy.post_status("/v2/models/bert/infer",
                                                     {"x-api-key": key}) == 200, 10, "the key")
        assert envoy.post_status("/v2/models/bert/infer", {}) == 401
        assert envoy.post_status("/v2/models/gpt/infer", {"x-api-key": key}) == 403
        codes = [envoy.post_status("/v2/models/bert/infer", {"x-api-key": key, "x-user": "carol"})
                 for _ in range(6)]
        assert codes == [200] * 5 + [429]

        def value(name: str, **labels: str) -> float:
            return harness.metric_value(node.metrics(), name, **labels)

        # Counts reach /metrics once a second: wait for the last Check's.
        harness.wait_until(lambda: value("sitsmesh_authz_decisions_total", decision="allow",
                                         reason="ok", tenant="acme") >= 7,
                           5, "decisions to be flushed")
        text = node.metrics()
        assert harness.metric_value(text, "sitsmesh_authz_decisions_total", decision="deny",
                                    reason="unauthenticated", tenant="none") == 1
        assert harness.metric_value(text, "sitsmesh_authz_decisions_total", decision="deny",
                                    reason="model_not_allowed", tenant="acme") == 1
        assert harness.metric_value(text, "sitsmesh_authz_check_seconds_count",
                                    decision="deny") == 2
        assert harness.metric_value(text, "grpc_server_handled_total", grpc_service=AUTHZ,
                                    grpc_method="Check", grpc_code="OK",
                                    grpc_type="unary") >= 9
        assert harness.metric_value(text, "grpc_server_handling_seconds_count",
                                    grpc_service=AUTHZ, grpc_method="Check",
                                    grpc_type="unary") >= 9
        # Rate limits under both name sets, by default.
        harness.wait_until(lambda: value("ratelimit_service_rate_limit_over_limit",
                                         domain="sitsmesh-local", key1="user") == 1,
                           5, "rate-limit counters to be flushed")
        text = node.metrics()
        assert harness.metric_value(text, "ratelimit_service_rate_limit_total_hits",
                                    domain="sitsmesh-local", key1="user") == 6
        assert harness.metric_value(text, "sitsmesh_ratelimit_hits_total",
                                    key="sitsmesh-local.user", outcome="over_limit") == 1
        assert harness.metric_value(text, "sitsmesh_serving", server="data", service="") == 1
        assert harness.metric_value(text, "sitsmesh_serving", server="data",
                                    service=AUTHZ) == 1
        assert harness.metric_value(text, "sitsmesh_serving", server="admin",
                                    service="sitsmesh.admin.v1.AdminService") == 1
    finally:
        envoy.kill()
