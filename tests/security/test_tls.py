"""Transport security of `sitsmesh serve` (issue 13, part 1): TLS and mTLS on the data
and admin servers, certificate rotation without a restart, a Unix-socket data plane, the
refusal to put the admin token on a network in clear, and the CLI speaking TLS."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.dev import harness
from tests.security import tlsnode
from tests.security.pki import Ca, Pair, install, make_ca

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sre(ca: Ca) -> Pair:
    return ca.issue("sre", "URI:spiffe://test/sre")


@pytest.fixture
def nodes() -> Iterator[list[harness.Sitsmesh]]:
    started: list[harness.Sitsmesh] = []
    yield started
    for node in started:
        node.kill()


def _data_tls(pair: Pair, ca: Ca | None = None) -> list[str]:
    flags = ["--data-tls-cert-file", str(pair.cert), "--data-tls-key-file", str(pair.key)]
    return flags + (["--data-tls-client-ca-file", str(ca.cert)] if ca else [])


def _admin_tls(pair: Pair, ca: Ca | None = None) -> list[str]:
    flags = ["--admin-tls-cert-file", str(pair.cert), "--admin-tls-key-file", str(pair.key)]
    return flags + (["--admin-tls-client-ca-file", str(ca.cert)] if ca else [])


def test_data_plane_tls_refuses_plaintext(tmp_path: Path, ca: Ca, server_pair: Pair,
                                          nodes: list[harness.Sitsmesh]) -> None:
    node = tlsnode.start(tmp_path, *_data_tls(server_pair), data=(ca.cert, None))
    nodes.append(node)
    assert tlsnode.health(node.data_addr, ca.cert) == tlsnode.SERVING
    assert tlsnode.health(node.data_addr) is None  # a plaintext client gets nothing


def test_data_plane_mtls_needs_a_client_certificate_from_the_ca(
        tmp_path: Path, ca: Ca, server_pair: Pair, sre: Pair,
        nodes: list[harness.Sitsmesh]) -> None:
    other = make_ca(tmp_path / "other", "other")
    stranger = other.issue("stranger", "URI:spiffe://test/sre")
    node = tlsnode.start(tmp_path, *_data_tls(server_pair, ca), data=(ca.cert, sre))
    nodes.append(node)
    assert tlsnode.health(node.data_addr, ca.cert, sre) == tlsnode.SERVING
    assert tlsnode.health(node.data_addr, ca.cert) is None
    assert tlsnode.health(node.data_addr, ca.cert, stranger) is None
    # `sitsmesh health` (the image's HEALTHCHECK, exec probes) speaks mTLS too.
    probe = harness.run_cli("health", "--addr", node.data_addr, "--ca", str(ca.cert),
                            "--cert", str(sre.cert), "--key", str(sre.key))
    assert (probe.returncode, probe.stdout.strip()) == (0, "SERVING"), probe.stderr
    assert harness.run_cli("health", "--addr", node.data_addr, "--ca",
                           str(ca.cert)).returncode == 1


def test_rotated_certificate_files_are_served_without_a_restart(
        tmp_path: Path, ca: Ca, nodes: list[harness.Sitsmesh]) -> None:
    live = tmp_path / "live"
    live.mkdir()
    cert, key = live / "tls.crt", live / "tls.key"
    install(ca.issue("before", "IP:127.0.0.1"), cert, key)
    node = tlsnode.start(tmp_path, "--data-tls-cert-file", str(cert), "--data-tls-key-file",
                         str(key), data=(ca.cert, None))
    nodes.append(node)
    rotated = make_ca(tmp_path / "rotated", "rotated")
    assert tlsnode.health(node.data_addr, rotated.cert) is None

    install(rotated.issue("after", "IP:127.0.0.1"), cert, key)
    # New connections get the new certificate within about a second (the stat throttle).
    harness.wait_until(lambda: tlsnode.health(node.data_addr, rotated.cert)
                       == tlsnode.SERVING, 15, "the rotated certificate")
    assert tlsnode.health(node.data_addr, ca.cert) is None
    assert node.proc.poll() is None
    assert "TLS certificate reloaded" in node.output()

    # A broken rotation (a key that does not match) keeps the last good pair serving.
    mismatched = Pair(ca.issue("x", "IP:127.0.0.1").cert, rotated.issue("y", "IP:1.2.3.4").key)
    install(mismatched, cert, key)
    time.sleep(1.5)
    assert tlsnode.health(node.data_addr, rotated.cert) == tlsnode.SERVING
    assert "TLS files changed but do not load" in node.output()


def test_unix_socket_data_plane(tmp_path: Path, nodes: list[harness.Sitsmesh]) -> None:
    sock = tmp_path / "sitsmesh.sock"
    node = harness.start_sitsmesh(tmp_path, "--data-addr", f"unix:{sock}", wait=False)
    nodes.append(node)
    node.data_addr = f"unix:{sock}"
    harness.wait_until(lambda: tlsnode.health(node.data_addr) == tlsnode.SERVING, 30,
                       "sitsmesh on a unix socket")
    status = node.cli("status", "--output", "json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["data_addr"] == f"unix:{sock}"


def test_serve_refuses_a_network_admin_address_without_tls(
        tmp_path: Path, server_pair: Pair, ca: Ca, nodes: list[harness.Sitsmesh]) -> None:
    port = harness.free_port()
    refused = harness.run_cli("serve", "--admin-addr", f"0.0.0.0:{port}", "--data-addr",
                              f"127.0.0.1:{harness.free_port()}", "--metrics-addr",
                              f"127.0.0.1:{harness.free_port()}", "--state-dir",
                              str(tmp_path / "s"))
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip() == (
        f"sitsmesh: error: admin_addr 0.0.0.0:{port}: not a loopback address and the admin "
        "API has no TLS, so its bearer token would cross the network in clear; set "
        "--admin-tls-cert-file and --admin-tls-key-file, bind 127.0.0.1, or pass "
        "--admin-insecure true to accept that")
    assert not (tmp_path / "s").exists()  # refused before anything was written

    # The same address with TLS serves; the token never crosses in clear.
    node = harness.start_sitsmesh(tmp_path, *_admin_tls(server_pair), "--admin-addr",
                                  f"0.0.0.0:{port}", wait=False)
    nodes.append(node)
    node.admin_addr = f"127.0.0.1:{port}"
    harness.wait_until(lambda: tlsnode.health(node.admin_addr, ca.cert) == tlsnode.SERVING,
                       30, "admin over TLS")
    assert tlsnode.health(node.admin_addr) is None


def test_cli_speaks_tls_and_mtls_to_the_admin_api(
        tmp_path: Path, ca: Ca, server_pair: Pair, sre: Pair,
        nodes: list[harness.Sitsmesh]) -> None:
    node = tlsnode.start(tmp_path, *_admin_tls(server_pair, ca), admin=(ca.cert, sre))
    nodes.append(node)
    flags = ["--ca", str(ca.cert), "--cert", str(sre.cert), "--key", str(sre.key)]
    done = node.cli("status", *flags)
    assert done.returncode == 0, done.stderr
    by_env = node.cli("status", env={"SITSMESH_ADMIN_CA": str(ca.cert),
                                     "SITSMESH_ADMIN_CERT": str(sre.cert),
                                     "SITSMESH_ADMIN_KEY": str(sre.key)})
    assert by_env.returncode == 0, by_env.stderr
    without_cert = node.cli("status", "--ca", str(ca.cert))
    assert without_cert.returncode == 1
    assert "UNAVAILABLE" in without_cert.stderr
    plaintext = node.cli("status")
    assert plaintext.returncode == 1


def test_admin_allowlist_and_audit_actor_come_from_the_client_certificate(
        tmp_path: Path, ca: Ca, server_pair: Pair, sre: Pair,
        nodes: list[harness.Sitsmesh]) -> None:
    intern = ca.issue("intern", "URI:spiffe://test/intern")
    node = tlsnode.start(tmp_path, *_admin_tls(server_pair, ca), "--admin-clients",
                         "spiffe://test/sre", admin=(ca.cert, sre))
    nodes.append(node)
    (tmp_path / "p.yaml").write_text(
        "name: demo\nmodels: [m]\nstages:\n  - name: model\n"
        "    match: {upstream_cluster: triton}\n    sla_p99_ms: 250\n")
    flags = ["--ca", str(ca.cert), "--cert", str(sre.cert), "--key", str(sre.key)]
    assert node.cli("pipelines", "apply", str(tmp_path / "p.yaml"), *flags).returncode == 0

    metadata = (*node.admin_metadata(), ("x-sitsmesh-actor", "root@somewhere"))
    request = admin_pb2.SetThresholdsRequest(pipeline="demo", yaml="policy: seed\n")
    with tlsnode.channel(node.admin_addr, ca.cert, intern) as ch, \
            pytest.raises(grpc.RpcError) as refused:
        admin_pb2_grpc.AdminServiceStub(ch).SetThresholds(request, metadata=metadata, timeout=5)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with tlsnode.channel(node.admin_addr, ca.cert, sre) as ch:
        admin_pb2_grpc.AdminServiceStub(ch).SetThresholds(request, metadata=metadata, timeout=5)
        changes = admin_pb2_grpc.AdminServiceStub(ch).ListThresholdChanges(
            admin_pb2.ListThresholdChangesRequest(pipeline="demo"), metadata=metadata,
            timeout=5).changes
    # The token is the built-in admin credential; the certificate says where it came from.
    assert [c.actor for c in changes] == [
        "admin via spiffe://test/sre (on behalf of root@somewhere)"]


def test_bad_tls_files_stop_serve_before_anything_changes(tmp_path: Path, ca: Ca,
                                                          server_pair: Pair) -> None:
    other = ca.issue("other", "IP:127.0.0.1")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    missing = tmp_path / "missing.pem"
    cases = [
        (["--data-tls-cert-file", str(missing), "--data-tls-key-file", str(server_pair.key)],
         f"data_tls_cert_file {missing}: cannot read: No such file or directory"),
        (["--data-tls-cert-file", str(server_pair.cert), "--data-tls-key-file", str(other.key)],
         f"data_tls_cert_file {server_pair.cert} and data_tls_key_file {other.key}: the key "
         "does not match the certificate"),
        (["--data-tls-cert-file", str(junk), "--data-tls-key-file", str(server_pair.key)],
         f"data_tls_cert_file {junk} and data_tls_key_file {server_pair.key}: not a PEM "
         "certificate chain and private key"),
        ([*_admin_tls(server_pair), "--admin-tls-client-ca-file", str(server_pair.key)],
         f"admin_tls_client_ca_file {server_pair.key}: not a PEM CA bundle"),
        (["--data-tls-key-file", str(server_pair.key)],
         "data_tls_cert_file and data_tls_key_file: set both or neither"),
    ]
    state = tmp_path / "state"
    for flags, message in cases:
        done = harness.run_cli("serve", "--state-dir", str(state), *flags)
        assert (done.returncode, done.stderr.strip()) == (2, f"sitsmesh: error: {message}")
    assert not state.exists()
