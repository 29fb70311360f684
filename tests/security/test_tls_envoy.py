"""Envoy -> sitsmesh over mTLS with filters/tls/sitsmesh_mtls.yaml, through real Envoys:
the allowlisted Envoy is answered; an Envoy with another identity, from the same CA, is
refused and counted (its rate-limit filter fails open, as configured)."""

from __future__ import annotations

import json
import string
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from sitsmesh.dev import envoyconf, harness
from tests.security import tlsnode
from tests.security.pki import Ca, Pair

pytestmark = pytest.mark.integration

TLS = harness.REPO / "filters" / "tls"
BOOTSTRAP = harness.REPO / "filters" / "local" / "bootstrap.yaml"
RATELIMIT_CONFIG = harness.REPO / "filters" / "local" / "ratelimit"
SITSMESH_ID = "spiffe://cluster.local/ns/sitsmesh/sa/sitsmesh"
ENVOY_ID = "spiffe://cluster.local/ns/istio-system/sa/istio-ingressgateway"


def secret_dir(path: Path, ca: Ca, pair: Pair) -> Path:
    """`path` laid out like a mounted Kubernetes Secret, holding `pair` and `ca`: each file
    a link into ..data, itself a link to a versioned directory. Called again, it rotates
    the content the way the kubelet does: a new version, then one atomic rename."""
    path.mkdir(parents=True, exist_ok=True)
    version = path / f"..{time.monotonic_ns()}"
    version.mkdir()
    for name, source in (("tls.crt", pair.cert), ("tls.key", pair.key), ("ca.crt", ca.cert)):
        (version / name).write_bytes(source.read_bytes())
        if not (path / name).is_symlink():
            (path / name).symlink_to(f"..data/{name}")
    (path / "..data_tmp").symlink_to(version.name)
    (path / "..data_tmp").replace(path / "..data")
    return path


def mtls_bootstrap(work: Path, ca: Ca, envoy: Pair, sitsmesh_addr: str, upstream: int,
                   listen: int, admin: int,
                   fragments: tuple[str, ...] = ("ratelimit", "access_log")) -> dict[str, Any]:
    """The local bootstrap with filters/tls/sitsmesh_mtls.yaml on its sitsmesh cluster,
    Envoy's certificate in `work`/secret and the SDS files in `work`/sds."""
    values = harness.envoy_values(sitsmesh_addr, upstream, listen, admin)
    config = envoyconf.render(BOOTSTRAP, values, list(fragments))
    secret = secret_dir(work / "secret", ca, envoy)
    sds = work / "sds"
    sds.mkdir(parents=True, exist_ok=True)
    for name in ("sds_client.yaml", "sds_ca.yaml"):
        (sds / name).write_text(string.Template((TLS / name).read_text()).substitute(
            cert_dir=secret))
    socket = yaml.safe_load(string.Template((TLS / "sitsmesh_mtls.yaml").read_text())
                            .substitute(sds_dir=sds, sitsmesh_id=SITSMESH_ID))
    [cluster] = [c for c in config["static_resources"]["clusters"]
                 if c["name"] == "sitsmesh_data"]
    cluster.update(socket)
    config.setdefault("node", {"id": "gateway", "cluster": "gateway"})  # SDS needs both
    return config


@pytest.fixture
def procs() -> Iterator[list[harness.Proc]]:
    started: list[harness.Proc] = []
    yield started
    for proc in started:
        proc.kill()


def test_the_mtls_fragment_validates_with_the_real_envoy(tmp_path: Path, ca: Ca) -> None:
    envoy = ca.issue("envoy", f"URI:{ENVOY_ID}")
    config = mtls_bootstrap(tmp_path, ca, envoy, "127.0.0.1:50051", 18080, 10000, 9901)
    out = envoyconf.write(config, tmp_path / "envoy.yaml")
    result = subprocess.run([harness.ENVOY, "--mode", "validate", "-c", str(out),
                             "--disable-hot-restart"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr[-3000:]


def _launch(tmp: Path, name: str, ca: Ca, pair: Pair, node: harness.Sitsmesh,
            upstream: int, fragments: tuple[str, ...] = ("ratelimit", "access_log")
            ) -> harness.Envoy:
    listen, admin = harness.free_port(), harness.free_port()
    work = tmp / name
    work.mkdir()
    config = envoyconf.write(mtls_bootstrap(work, ca, pair, node.data_addr, upstream, listen,
                                            admin, fragments), work / "envoy.yaml")
    return harness.launch_envoy(config, listen, admin, work / "envoy.log")


def _get(envoy: harness.Envoy) -> dict[str, str]:
    req = urllib.request.Request(envoy.url("/v2/models/demo/infer"),
                                 headers={"x-user": "alice"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200
        return {k.lower(): v for k, v in resp.headers.items()}


def test_envoy_reaches_sitsmesh_over_mtls_and_only_the_allowlisted_one_is_answered(
        tmp_path: Path, ca: Ca, procs: list[harness.Proc]) -> None:
    server = ca.issue("sitsmesh", "IP:127.0.0.1", f"URI:{SITSMESH_ID}")
    envoy_pair = ca.issue("gateway", f"URI:{ENVOY_ID}")
    intruder_pair = ca.issue("intruder", "URI:spiffe://cluster.local/ns/apps/sa/intruder")
    node = tlsnode.start(
        tmp_path, "--ratelimit-config", str(RATELIMIT_CONFIG),
        "--data-tls-cert-file", str(server.cert), "--data-tls-key-file", str(server.key),
        "--data-tls-client-ca-file", str(ca.cert),
        "--data-callers", f"ratelimit={ENVOY_ID},accesslog={ENVOY_ID},metrics={ENVOY_ID}",
        data=(ca.cert, envoy_pair))
    procs.append(node)
    everything = ("ratelimit", "access_log", "metrics_service")
    with harness.echo_upstream() as upstream:
        gateway = _launch(tmp_path, "gateway", ca, envoy_pair, node, upstream, everything)
        procs.append(gateway)
        # Envoy's gRPC health check crosses the mTLS connection too.
        harness.wait_until(lambda: gateway.cluster_health("sitsmesh_data") == ["healthy"],
                           15, "Envoy to see sitsmesh healthy over mTLS")
        assert _get(gateway)["x-ratelimit-limit"].startswith("5, 5;w=60")
        # Spending alice's limit directly (the probe's second finding) is refused...
        request = rls_pb2.RateLimitRequest(domain="sitsmesh-local", hits_addend=1)
        request.descriptors.add().entries.add(key="user", value="alice")
        with tlsnode.channel(node.data_addr, ca.cert, intruder_pair) as ch:
            for _ in range(6):
                with pytest.raises(grpc.RpcError) as spent:
                    rls_pb2_grpc.RateLimitServiceStub(ch).ShouldRateLimit(request, timeout=5)
                assert spent.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # ...so her second request of the minute still has 3 left after it.
        assert _get(gateway)["x-ratelimit-remaining"] == "3"

        intruder = _launch(tmp_path, "intruder", ca, intruder_pair, node, upstream, everything)
        procs.append(intruder)
        harness.wait_until(lambda: intruder.cluster_health("sitsmesh_data") == ["healthy"],
                           15, "the intruder's Envoy to connect")
        assert "x-ratelimit-limit" not in _get(intruder)  # refused; the filter fails open
        # Its stats sink and access logs are refused as well, the gateway's are taken.
        harness.wait_until(lambda: all(
            harness.metric_value(node.metrics(), "sitsmesh_data_calls_refused_total",
                                 service=service) >= 1
            for service in ("ratelimit", "metrics", "accesslog")), 10,
            "the intruder's stats and access logs to be refused")
    handled = harness.metric_value(
        node.metrics(), "grpc_server_handled_total",
        grpc_service="envoy.service.ratelimit.v3.RateLimitService", grpc_code="OK")
    assert handled >= 2  # the gateway's own calls


def _infer(envoy: harness.Envoy, key: str) -> tuple[int, str]:
    """(status, the x-request-id the upstream saw, which is what an attacker learns)."""
    req = urllib.request.Request(envoy.url("/v2/models/llama-3/infer"), data=b"{}",
                                 headers={"x-api-key": key}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())["headers"]["x-request-id"]
    except urllib.error.HTTPError as err:
        return err.code, ""


def _release(addr: str, ca: Ca, pair: Pair, request_id: str) -> grpc.StatusCode:
    """One access-log entry saying `request_id` ended: what frees its admission hold."""
    message = als_pb2.StreamAccessLogsMessage()
    message.identifier.log_name = "forged"
    entry = message.http_logs.log_entry.add()
    entry.request.request_id = request_id
    entry.common_properties.start_time.seconds = int(time.time())
    entry.common_properties.duration.nanos = 1_000_000
    entry.response.response_code.value = 200
    with tlsnode.channel(addr, ca.cert, pair) as ch:
        try:
            als_pb2_grpc.AccessLogServiceStub(ch).StreamAccessLogs(iter([message]), timeout=5)
        except grpc.RpcError as exc:
            code: grpc.StatusCode = exc.code()
            return code
    return grpc.StatusCode.OK


def test_a_forged_access_log_from_an_unlisted_caller_frees_no_concurrency_hold(
        tmp_path: Path, ca: Ca, procs: list[harness.Proc]) -> None:
    """The probe's attack: end another tenant's admission hold with a forged entry."""
    server = ca.issue("sitsmesh", "IP:127.0.0.1", f"URI:{SITSMESH_ID}")
    envoy_pair = ca.issue("gateway", f"URI:{ENVOY_ID}")
    intruder = ca.issue("intruder", "URI:spiffe://cluster.local/ns/apps/sa/intruder")
    node = tlsnode.start(
        tmp_path, "--admission-hold-seconds", "60", "--reload-interval-seconds", "0.2",
        "--data-tls-cert-file", str(server.cert), "--data-tls-key-file", str(server.key),
        "--data-tls-client-ca-file", str(ca.cert),
        "--data-callers", f"authz={ENVOY_ID},accesslog={ENVOY_ID}",
        data=(ca.cert, envoy_pair))
    procs.append(node)
    assert node.cli("tenants", "create", "acme", "--models", "llama-*",
                    "--max-concurrency", "1").returncode == 0
    made = node.cli("apikeys", "create", "--tenant", "acme", "--output", "json")
    key = json.loads(made.stdout)["key"]
    with harness.echo_upstream() as upstream:
        gateway = _launch(tmp_path, "gateway", ca, envoy_pair, node, upstream, ("ext_authz",))
        procs.append(gateway)
        admitted: list[str] = []

        def admit() -> bool:
            status, request_id = _infer(gateway, key)
            admitted.extend([request_id] if status == 200 else [])
            return status == 200

        harness.wait_until(admit, 10, "the key to apply")
        [held] = admitted
        assert _infer(gateway, key)[0] == 429  # the cap of 1 is held for 60 s

        assert _release(node.data_addr, ca, intruder, held) == grpc.StatusCode.PERMISSION_DENIED
        time.sleep(0.3)
        assert _infer(gateway, key)[0] == 429, "a forged entry freed the hold"

        # The same entry from the allowlisted identity does free it: the refusal above is
        # what protected the hold, not a malformed entry.
        assert _release(node.data_addr, ca, envoy_pair, held) == grpc.StatusCode.OK
        harness.wait_until(lambda: _infer(gateway, key)[0] == 200, 5, "the hold to be freed")


def test_envoy_presents_its_rotated_certificate_without_a_restart(
        tmp_path: Path, ca: Ca, procs: list[harness.Proc]) -> None:
    """Envoy's client certificate rotates like a mounted Secret; its next connection to
    sitsmesh (here after sitsmesh restarts on the same port) carries the new identity."""
    server = ca.issue("sitsmesh", "IP:127.0.0.1", f"URI:{SITSMESH_ID}")
    old, new = (ca.issue(n, f"URI:{ENVOY_ID}-{n}") for n in ("old", "new"))
    addr = f"127.0.0.1:{harness.free_port()}"
    flags = ["--ratelimit-config", str(RATELIMIT_CONFIG),
             "--data-tls-cert-file", str(server.cert), "--data-tls-key-file", str(server.key),
             "--data-tls-client-ca-file", str(ca.cert),
             "--data-callers", f"ratelimit={ENVOY_ID}-new"]  # only the rotated identity
    first = tlsnode.start(tmp_path, *flags, data=(ca.cert, new), name="first", data_addr=addr)
    procs.append(first)
    with harness.echo_upstream() as upstream:
        gateway = _launch(tmp_path, "gateway", ca, old, first, upstream)
        procs.append(gateway)
        harness.wait_until(lambda: gateway.cluster_health("sitsmesh_data") == ["healthy"],
                           15, "Envoy to reach sitsmesh")
        assert "x-ratelimit-limit" not in _get(gateway)  # the old identity is refused

        secret_dir(tmp_path / "gateway" / "secret", ca, new)
        time.sleep(1)  # Envoy's directory watch reads the new pair
        assert first.stop() == 0
        second = tlsnode.start(tmp_path, *flags, data=(ca.cert, new), name="second",
                               data_addr=addr)
        procs.append(second)
        harness.wait_until(lambda: "x-ratelimit-limit" in _get(gateway), 15,
                           "Envoy to present the rotated certificate")
        assert gateway.proc.poll() is None


def test_envoy_reaches_a_sitsmesh_that_requires_tls_13(
        tmp_path: Path, ca: Ca, procs: list[harness.Proc]) -> None:
    """Envoy's upstream TLS stops at 1.2 unless told otherwise; the fragment allows 1.3,
    so `--tls-min-version 1.3` on sitsmesh keeps the mTLS path working (issue 26)."""
    server = ca.issue("sitsmesh", "IP:127.0.0.1", f"URI:{SITSMESH_ID}")
    envoy_pair = ca.issue("gateway", f"URI:{ENVOY_ID}")
    node = tlsnode.start(
        tmp_path, "--ratelimit-config", str(RATELIMIT_CONFIG), "--tls-min-version", "1.3",
        "--data-tls-cert-file", str(server.cert), "--data-tls-key-file", str(server.key),
        "--data-tls-client-ca-file", str(ca.cert), "--data-callers", f"ratelimit={ENVOY_ID}",
        data=(ca.cert, envoy_pair))
    procs.append(node)
    with harness.echo_upstream() as upstream:
        gateway = _launch(tmp_path, "gateway", ca, envoy_pair, node, upstream, ("ratelimit",))
        procs.append(gateway)
        harness.wait_until(lambda: gateway.cluster_health("sitsmesh_data") == ["healthy"],
                           15, "Envoy to see sitsmesh healthy over TLS 1.3")
        assert _get(gateway)["x-ratelimit-limit"].startswith("5, 5;w=60")
