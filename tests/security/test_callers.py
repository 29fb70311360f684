"""Who may call what (issue 13, parts 2 and 8), through a real `sitsmesh serve`.

The probe: anyone who reached the data port could end tenants' concurrency holds and
drive a pipeline's admitted fraction to zero with forged access-log entries, and count
ShouldRateLimit hits against other users. Now each data-plane service answers only the
mTLS identities on its allowlist. Also: the admin auth-failure log names the peer, short
tokens are warned about, and secrets can come from files."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf import duration_pb2

from sitsmesh.admin.enums import word
from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.dev import harness
from tests.security import pki, tlsnode
from tests.security.pki import Ca

pytestmark = pytest.mark.integration

ENVOY_ID = "spiffe://cluster.local/ns/istio-system/sa/gateway"


@pytest.fixture
def nodes() -> Iterator[list[harness.Sitsmesh]]:
    started: list[harness.Sitsmesh] = []
    yield started
    for node in started:
        node.kill()


def _forged_entries(count: int) -> Iterator[als_pb2.StreamAccessLogsMessage]:
    message = als_pb2.StreamAccessLogsMessage()
    message.identifier.log_name = "forged"
    for i in range(count):
        entry = message.http_logs.log_entry.add()
        entry.request.request_id = f"victim-{i}"
        entry.common_properties.start_time.seconds = 1_700_000_000
        entry.common_properties.duration.nanos = 1_000_000
        entry.common_properties.upstream_cluster = "triton"
        entry.response.response_code.value = 503
    yield message


def _should_rate_limit(ch: grpc.Channel) -> rls_pb2.RateLimitResponse:
    request = rls_pb2.RateLimitRequest(domain="any", hits_addend=1)
    request.descriptors.add().entries.add(key="user", value="victim")
    reply: rls_pb2.RateLimitResponse = rls_pb2_grpc.RateLimitServiceStub(ch).ShouldRateLimit(
        request, timeout=5)
    return reply


def _quota_report(channel: grpc.Channel) -> Any:
    """One RLQS usage report (1000 requests a second on one bucket); the first reply."""
    usage = rlqs_pb2.RateLimitQuotaUsageReports.BucketQuotaUsage(
        bucket_id=rlqs_pb2.BucketId(bucket={"tenant": "acme"}), num_requests_allowed=5000,
        time_elapsed=duration_pb2.Duration(seconds=5))
    report = rlqs_pb2.RateLimitQuotaUsageReports(domain="edge", bucket_quota_usages=[usage])
    stream = rlqs_pb2_grpc.RateLimitQuotaServiceStub(channel).StreamRateLimitQuotas(
        iter([report]), timeout=5)
    return next(stream)


def test_data_plane_services_answer_only_their_allowlisted_callers(
        tmp_path: Path, ca: Ca, nodes: list[harness.Sitsmesh]) -> None:
    server = ca.issue("server", "IP:127.0.0.1")
    envoy = ca.issue("envoy", f"URI:{ENVOY_ID}")
    intruder = ca.issue("intruder", "URI:spiffe://cluster.local/ns/apps/sa/intruder")
    node = tlsnode.start(
        tmp_path, "--data-tls-cert-file", str(server.cert), "--data-tls-key-file",
        str(server.key), "--data-tls-client-ca-file", str(ca.cert), "--data-callers",
        f"accesslog={ENVOY_ID},ratelimit={ENVOY_ID},authz={ENVOY_ID},metrics={ENVOY_ID},"
        f"quota={ENVOY_ID}", data=(ca.cert, envoy))
    nodes.append(node)

    with tlsnode.channel(node.data_addr, ca.cert, intruder) as ch:
        with pytest.raises(grpc.RpcError) as forged:
            als_pb2_grpc.AccessLogServiceStub(ch).StreamAccessLogs(_forged_entries(1800),
                                                                  timeout=5)
        assert forged.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "spiffe://cluster.local/ns/apps/sa/intruder" in str(forged.value.details())
        with pytest.raises(grpc.RpcError) as counted:
            _should_rate_limit(ch)
        assert counted.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # An RLQS stream claiming a huge demand would take most of every shared rate.
        with pytest.raises(grpc.RpcError) as greedy:
            _quota_report(ch)
        assert greedy.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # Health stays open to probes whatever the allowlists say.
        assert tlsnode.health(node.data_addr, ca.cert, intruder) == tlsnode.SERVING

    # A certificate naming the Envoy only in its CN, with no SAN, is not that identity.
    cn_only = ca.issue(ENVOY_ID)
    assert f"CN = {ENVOY_ID}" in pki.subject(cn_only.cert)
    with tlsnode.channel(node.data_addr, ca.cert, cn_only) as ch, \
            pytest.raises(grpc.RpcError) as by_cn:
        _should_rate_limit(ch)
    assert by_cn.value.code() == grpc.StatusCode.PERMISSION_DENIED

    with tlsnode.channel(node.data_addr, ca.cert, envoy) as ch:
        assert _should_rate_limit(ch).overall_code == rls_pb2.RateLimitResponse.OK
        als_pb2_grpc.AccessLogServiceStub(ch).StreamAccessLogs(_forged_entries(3), timeout=5)
        assert len(_quota_report(ch).bucket_action) == 1

    metrics = node.metrics()
    assert harness.metric_value(metrics, "sitsmesh_data_calls_refused_total",
                                service="accesslog") == 1
    assert harness.metric_value(metrics, "sitsmesh_data_calls_refused_total",
                                service="ratelimit") == 2  # the intruder's, the CN-only one
    assert "data-plane call refused" in node.output()


def test_the_rlqs_process_takes_the_data_ports_tls_and_allowlist(
        tmp_path: Path, ca: Ca, nodes: list[harness.Sitsmesh]) -> None:
    """rlqs_addr is a port of its own: the same certificates, client CA and `quota`
    callers as the data port, not a side door around them."""
    server = ca.issue("server", "IP:127.0.0.1")
    envoy = ca.issue("envoy", f"URI:{ENVOY_ID}")
    intruder = ca.issue("intruder", "URI:spiffe://cluster.local/ns/apps/sa/intruder")
    rlqs_addr = f"127.0.0.1:{harness.free_port()}"
    node = tlsnode.start(
        tmp_path, "--data-tls-cert-file", str(server.cert), "--data-tls-key-file",
        str(server.key), "--data-tls-client-ca-file", str(ca.cert), "--data-callers",
        f"quota={ENVOY_ID}", "--rlqs-addr", rlqs_addr, data=(ca.cert, envoy))
    nodes.append(node)
    harness.wait_until(lambda: tlsnode.health(rlqs_addr, ca.cert, envoy) == tlsnode.SERVING,
                       20, "the RLQS process over mTLS")

    with tlsnode.channel(rlqs_addr) as plain, pytest.raises(grpc.RpcError) as cleartext:
        _quota_report(plain)
    assert cleartext.value.code() == grpc.StatusCode.UNAVAILABLE
    with tlsnode.channel(rlqs_addr, ca.cert) as anonymous, \
            pytest.raises(grpc.RpcError) as no_cert:
        _quota_report(anonymous)
    assert no_cert.value.code() == grpc.StatusCode.UNAVAILABLE
    with tlsnode.channel(rlqs_addr, ca.cert, intruder) as ch, \
            pytest.raises(grpc.RpcError) as greedy:
        _quota_report(ch)
    assert greedy.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with tlsnode.channel(rlqs_addr, ca.cert, envoy) as ch:
        assert len(_quota_report(ch).bucket_action) == 1
    # Counted where the data process's /metrics sees it (the multiprocess files).
    harness.wait_until(lambda: harness.metric_value(
        node.metrics(), "sitsmesh_data_calls_refused_total", service="quota") == 1, 5,
        "the RLQS process's refusal on /metrics")


def test_an_allowlist_without_mtls_refuses_to_start(tmp_path: Path, ca: Ca) -> None:
    server = ca.issue("server", "IP:127.0.0.1")
    for extra in ([], ["--data-tls-cert-file", str(server.cert), "--data-tls-key-file",
                       str(server.key)]):
        done = harness.run_cli("serve", "--state-dir", str(tmp_path / "s"), "--data-callers",
                               f"accesslog={ENVOY_ID}", *extra)
        assert done.returncode == 2
        assert done.stderr.strip() == (
            "sitsmesh: error: data_callers: an allowlist needs mTLS on the data plane; set "
            "data_tls_client_ca_file (with data_tls_cert_file and data_tls_key_file)")


def test_admin_auth_failures_name_the_peer_and_weak_secrets_are_warned(
        tmp_path: Path, nodes: list[harness.Sitsmesh]) -> None:
    # The memory store never dials this URL; its password is only warned about.
    node = harness.start_sitsmesh(tmp_path, env={"SITSMESH_ADMIN_TOKEN": "short-token",
                                                 "SITSMESH_REDIS_URL": "redis://:pw@h:1/0"})
    nodes.append(node)
    assert "admin token is short" in node.output()
    assert "redis_url carries a password" in node.output()
    wrong = harness.run_cli("status", "--admin", node.admin_addr,
                            env={"SITSMESH_ADMIN_TOKEN": "not-the-token"})
    assert wrong.returncode == 1 and "UNAUTHENTICATED" in wrong.stderr
    [line] = [ln for ln in node.output().splitlines() if "admin call rejected" in ln]
    assert '"peer": "ipv4:127.0.0.1:' in line and "wrong bearer token" in line
    assert "GetStatus" in line


def test_token_file_keeps_the_token_out_of_argv(tmp_path: Path,
                                                nodes: list[harness.Sitsmesh]) -> None:
    node = harness.start_sitsmesh(tmp_path)
    nodes.append(node)
    copy = tmp_path / "token"
    copy.write_text(node.token + "\n")
    done = harness.run_cli("status", "--admin", node.admin_addr, "--token-file", str(copy))
    assert done.returncode == 0, done.stderr
    assert "admin token is short" not in node.output()  # the generated one is 43 bytes


def _redis_with_password(tmp: Path, password: str) -> harness.Proc:
    from sitsmesh.dev.redis import redis_server_binary

    port = harness.free_port()
    conf = tmp / "redis.conf"  # the password stays out of this process's argv too
    conf.write_text(f'port {port}\nbind 127.0.0.1\nsave ""\nappendonly no\n'
                    f'requirepass "{password}"\n')
    proc = harness.spawn([redis_server_binary(), str(conf)], tmp / "redis.log")
    proc.port = port  # type: ignore[attr-defined]

    def up() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"-NOAUTH")
        except OSError:
            return False

    harness.wait_until(up, 10, "redis-server with a password")
    return proc


def test_redis_password_comes_from_a_file(tmp_path: Path,
                                          nodes: list[harness.Sitsmesh]) -> None:
    password = "s3cret/with:odd@chars"
    redis = _redis_with_password(tmp_path, password)
    try:
        secret = tmp_path / "redis-password"
        secret.write_text(password + "\n")
        node = harness.start_sitsmesh(
            tmp_path, "--ratelimit-store", "redis", "--redis-url",
            f"redis://127.0.0.1:{redis.port}/0",  # type: ignore[attr-defined]
            "--redis-password-file", str(secret))
        nodes.append(node)
        harness.wait_until(lambda: harness.health_status(
            node.data_addr, "sitsmesh.ratelimit.store") == tlsnode.SERVING, 10,
            "the Redis store to be healthy")
        assert password not in " ".join(map(str, node.proc.args))  # type: ignore[arg-type]
        assert password not in node.output()
    finally:
        redis.kill()


def test_workers_serve_mtls_and_count_refusals_where_the_supervisor_sees_them(
        tmp_path: Path, ca: Ca, nodes: list[harness.Sitsmesh]) -> None:
    server = ca.issue("server", "IP:127.0.0.1")
    envoy = ca.issue("envoy", f"URI:{ENVOY_ID}")
    intruder = ca.issue("intruder", "URI:spiffe://cluster.local/ns/apps/sa/intruder")
    node = tlsnode.start(
        tmp_path, "--workers", "2", "--data-tls-cert-file", str(server.cert),
        "--data-tls-key-file", str(server.key), "--data-tls-client-ca-file", str(ca.cert),
        "--data-callers", f"ratelimit={ENVOY_ID}", data=(ca.cert, envoy))
    nodes.append(node)
    for _ in range(4):  # new connections: SO_REUSEPORT spreads them over the workers
        with tlsnode.channel(node.data_addr, ca.cert, intruder) as ch:
            with pytest.raises(grpc.RpcError) as refused:
                _should_rate_limit(ch)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with tlsnode.channel(node.data_addr, ca.cert, envoy) as ch:
            assert _should_rate_limit(ch).overall_code == rls_pb2.RateLimitResponse.OK
    assert harness.metric_value(node.metrics(), "sitsmesh_data_calls_refused_total",
                                service="ratelimit") == 4


PIPELINE = """name: plain
models: ["svc"]
stages:
  - name: svc
    match: {upstream_cluster: upstream}
    sla_p99_ms: 250
"""


def _failures(count: int) -> Iterator[als_pb2.StreamAccessLogsMessage]:
    """`count` entries of 503s on the stage's cluster over the last second."""
    now = time.time()
    message = als_pb2.StreamAccessLogsMessage()
    message.identifier.log_name = "forged"
    for i in range(count):
        entry = message.http_logs.log_entry.add()
        entry.request.request_id = f"forged-{i}"
        started = now - 1.0 + i / count
        entry.common_properties.start_time.FromNanoseconds(int(started * 1e9))
        entry.common_properties.duration.nanos = 5_000_000
        entry.common_properties.upstream_cluster = "upstream"
        entry.response.response_code.value = 503
    yield message


def _levels(node: harness.Sitsmesh, seconds: float) -> set[str]:
    seen = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen.add(word(admin_pb2.PressureLevel, node.pressure("plain").level))
        time.sleep(0.2)
    return seen


def test_forged_failures_from_an_unlisted_caller_do_not_mark_a_stage_overloaded(
        tmp_path: Path, ca: Ca, nodes: list[harness.Sitsmesh]) -> None:
    server = ca.issue("server", "IP:127.0.0.1")
    envoy = ca.issue("envoy", f"URI:{ENVOY_ID}")
    intruder = ca.issue("intruder", "URI:spiffe://cluster.local/ns/apps/sa/intruder")
    node = tlsnode.start(
        tmp_path, "--data-tls-cert-file", str(server.cert), "--data-tls-key-file",
        str(server.key), "--data-tls-client-ca-file", str(ca.cert),
        "--data-callers", f"accesslog={ENVOY_ID}", data=(ca.cert, envoy))
    nodes.append(node)
    (tmp_path / "plain.yaml").write_text(PIPELINE)
    assert node.cli("pipelines", "apply", str(tmp_path / "plain.yaml")).returncode == 0

    with tlsnode.channel(node.data_addr, ca.cert, intruder) as ch, \
            pytest.raises(grpc.RpcError) as refused:
        als_pb2_grpc.AccessLogServiceStub(ch).StreamAccessLogs(_failures(1800), timeout=10)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert _levels(node, 1.5) == {"ok"}

    # The same entries from the allowlisted Envoy are believed: the attack was real.
    with tlsnode.channel(node.data_addr, ca.cert, envoy) as ch:
        als_pb2_grpc.AccessLogServiceStub(ch).StreamAccessLogs(_failures(1800), timeout=10)
    harness.wait_until(lambda: node.pressure("plain").level
                       == admin_pb2.PRESSURE_LEVEL_OVERLOADED, 5,
                       "the believed failures to mark the stage overloaded")
