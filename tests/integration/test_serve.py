"""`sitsmesh serve` as a subprocess: admin API, auth, CLI, metrics, reflection, settings."""

from __future__ import annotations

import json
import stat
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from sitsmesh.admin.enums import word
from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.dev import harness

Start = Callable[..., harness.Sitsmesh]


def _get_status(node: harness.Sitsmesh,
                metadata: tuple[tuple[str, str], ...] | None) -> admin_pb2.GetStatusResponse:
    with grpc.insecure_channel(node.admin_addr) as channel:
        reply: admin_pb2.GetStatusResponse = admin_pb2_grpc.AdminServiceStub(channel).GetStatus(
            admin_pb2.GetStatusRequest(), metadata=metadata, timeout=5)
        return reply


def test_get_status_reports_version_uptime_services_and_config(
    sitsmesh: harness.Sitsmesh,
) -> None:
    reply = _get_status(sitsmesh, sitsmesh.admin_metadata())
    assert reply.version
    assert reply.uptime_seconds > 0
    assert reply.started_at.seconds > 0
    assert len(reply.config_version) == 12
    assert reply.data_addr == sitsmesh.data_addr
    assert reply.admin_addr == sitsmesh.admin_addr
    assert reply.metrics_addr == sitsmesh.metrics_addr
    states = {(word(admin_pb2.Listener, s.server), s.name): s.state for s in reply.services}
    serving = admin_pb2.SERVING_STATE_SERVING
    assert states == {("data", ""): serving,
                      ("data", "envoy.service.ratelimit.v3.RateLimitService"): serving,
                      ("data", "envoy.service.auth.v3.Authorization"): serving,
                      ("data", "envoy.service.accesslog.v3.AccessLogService"): serving,
                      ("data", "envoy.service.metrics.v3.MetricsService"): serving,
                      ("data", "envoy.service.rate_limit_quota.v3.RateLimitQuotaService"): serving,
                      ("data", "envoy.service.ext_proc.v3.ExternalProcessor"): serving,
                      ("admin", "sitsmesh.admin.v1.AdminService"): serving}
    assert not reply.workers


@pytest.mark.parametrize("metadata", [
    None,
    (("authorization", "Bearer not-the-token"),),
    (("authorization", "Basic dXNlcjpwYXNz"),),
])
def test_admin_rejects_missing_or_wrong_token_and_never_logs_it(
    sitsmesh: harness.Sitsmesh, metadata: tuple[tuple[str, str], ...] | None
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _get_status(sitsmesh, metadata)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    harness.wait_until(lambda: "admin call rejected" in sitsmesh.output(), 5, "rejection log")
    assert "not-the-token" not in sitsmesh.output()
    assert sitsmesh.token not in sitsmesh.output()
    assert harness.metric_value(sitsmesh.metrics(), "sitsmesh_admin_auth_failures_total") == 1


def test_token_file_is_created_once_with_mode_0600(sitsmesh: harness.Sitsmesh) -> None:
    path = sitsmesh.state_dir / "admin-token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(sitsmesh.token) >= 32


def test_token_from_environment_replaces_the_file(start_sitsmesh: Start) -> None:
    node = start_sitsmesh(env={"SITSMESH_ADMIN_TOKEN": "s3cret-token-from-env"})
    assert not (node.state_dir / "admin-token").exists()
    reply = _get_status(node, (("authorization", "Bearer s3cret-token-from-env"),))
    assert reply.version


def test_status_cli_table_json_and_failures(sitsmesh: harness.Sitsmesh) -> None:
    table = sitsmesh.cli("status")
    assert table.returncode == 0, table.stderr
    assert "SERVING" in table.stdout
    assert "sitsmesh.admin.v1.AdminService" in table.stdout

    as_json = sitsmesh.cli("status", "--output", "json")
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert {s["state"] for s in doc["services"]} == {"SERVING"}
    assert doc["data_addr"] == sitsmesh.data_addr

    via_env = harness.run_cli("status", "--admin", sitsmesh.admin_addr,
                              env={"SITSMESH_ADMIN_TOKEN": sitsmesh.token})
    assert via_env.returncode == 0, via_env.stderr

    wrong = sitsmesh.cli("status", "--token", "wrong")
    assert wrong.returncode == 1
    assert "UNAUTHENTICATED" in wrong.stderr

    unreachable = harness.run_cli("status", "--admin", f"127.0.0.1:{harness.free_port()}",
                                  "--token", "x", "--timeout", "1")
    assert unreachable.returncode == 1
    assert "UNAVAILABLE" in unreachable.stderr


def test_metrics_expose_process_and_per_rpc_series(sitsmesh: harness.Sitsmesh) -> None:
    check = {"grpc_service": "grpc.health.v1.Health", "grpc_method": "Check",
             "grpc_type": "unary"}
    status = {"grpc_service": "sitsmesh.admin.v1.AdminService", "grpc_method": "GetStatus",
              "grpc_type": "unary"}
    before = sitsmesh.metrics()
    for _ in range(3):
        assert harness.health_status(sitsmesh.data_addr) == health_pb2.HealthCheckResponse.SERVING
    _get_status(sitsmesh, sitsmesh.admin_metadata())
    with pytest.raises(grpc.RpcError):
        _get_status(sitsmesh, None)
    after = sitsmesh.metrics()

    def delta(name: str, **labels: str) -> float:
        return (harness.metric_value(after, name, **labels)
                - harness.metric_value(before, name, **labels))

    assert harness.metric_value(after, "process_resident_memory_bytes") > 0
    assert delta("grpc_server_handled_total", grpc_code="OK", **check) == 3
    assert delta("grpc_server_handling_seconds_count", **check) == 3
    assert delta("grpc_server_handled_total", grpc_code="OK", **status) == 1
    assert delta("sitsmesh_admin_auth_failures_total") == 1


def _reflected_services(addr: str) -> set[str]:
    with grpc.insecure_channel(addr) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        return {s.name for r in replies for s in r.list_services_response.service}


def test_reflection_lists_services_on_both_servers(sitsmesh: harness.Sitsmesh) -> None:
    assert "grpc.health.v1.Health" in _reflected_services(sitsmesh.data_addr)
    assert "sitsmesh.admin.v1.AdminService" in _reflected_services(sitsmesh.admin_addr)


def test_flag_beats_env_beats_file(start_sitsmesh: Start, tmp_path: Path) -> None:
    config = tmp_path / "sitsmesh.yaml"
    config.write_text("log_level: debug\ndrain_seconds: 7\ngrace_seconds: 3\n")
    # start_sitsmesh passes --grace-seconds 5 as a flag; the env says 9, the file 3.
    node = start_sitsmesh("--config", str(config),
                          env={"SITSMESH_GRACE_SECONDS": "9", "SITSMESH_LOG_LEVEL": "warning"})
    log = node.output()
    assert "serving" not in log, "warning level set by env should beat debug from the file"
    reply = _get_status(node, node.admin_metadata())
    assert reply.config_version
    # Debug from the file lost to env's warning, so the info-level 'serving' line is absent;
    # check the effective values through a second instance that logs at info.
    node2 = start_sitsmesh("--config", str(config), "--log-level", "info",
                           env={"SITSMESH_GRACE_SECONDS": "9"})
    serving = next(json.loads(line) for line in node2.output().splitlines()
                   if '"event": "serving"' in line)
    assert serving["settings"]["log_level"] == "info"      # flag beats file
    assert serving["settings"]["grace_seconds"] == "5.0"   # flag beats env
    assert serving["settings"]["drain_seconds"] == "0.5"   # flag beats file
    assert serving["settings"]["config_file"] == str(config)
