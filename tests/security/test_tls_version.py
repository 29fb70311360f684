"""`tls_min_version` (issue 26, item 7): with 1.3, a real `sitsmesh serve` refuses TLS 1.2
handshakes on both ports (every worker), still serves TLS 1.3, and the CLI refuses a
server that offers only TLS 1.2. The handshakes are made with Python's ssl module, one
version offered at a time, so what is refused is the version, nothing else."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from sitsmesh import tlsversion
from sitsmesh.dev import harness
from sitsmesh.errors import ConfigError
from tests.security import tlsnode
from tests.security.pki import Ca, Pair

pytestmark = pytest.mark.integration

TLS12, TLS13 = ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3


@pytest.fixture
def nodes() -> Iterator[list[harness.Sitsmesh]]:
    started: list[harness.Sitsmesh] = []
    yield started
    for node in started:
        node.kill()


def handshake(addr: str, ca: Path, version: ssl.TLSVersion) -> str | None:
    """The version agreed when the client offers only `version`; None when refused."""
    host, _, port = addr.rpartition(":")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(ca)
    context.minimum_version = context.maximum_version = version
    context.set_alpn_protocols(["h2"])  # gRPC servers insist on it
    try:
        with socket.create_connection((host, int(port)), timeout=5) as raw, \
                context.wrap_socket(raw, server_hostname=host) as tls:
            return tls.version()
    except (ssl.SSLError, ConnectionError):
        return None


def _tls_flags(pair: Pair) -> list[str]:
    return [f"--{side}-tls-{what}-file={path}" for side in ("data", "admin")
            for what, path in (("cert", pair.cert), ("key", pair.key))]


def test_tls_13_refuses_tls_12_on_both_ports_of_every_worker(
        tmp_path: Path, ca: Ca, server_pair: Pair, nodes: list[harness.Sitsmesh]) -> None:
    node = tlsnode.start(tmp_path, *_tls_flags(server_pair), "--tls-min-version", "1.3",
                         "--workers", "2", data=(ca.cert, None), admin=(ca.cert, None))
    nodes.append(node)
    for addr in (node.admin_addr, *[node.data_addr] * 8):  # SO_REUSEPORT spreads these
        assert handshake(addr, ca.cert, TLS12) is None, addr
        assert handshake(addr, ca.cert, TLS13) == "TLSv1.3", addr
    # gRPC over TLS 1.3 is served as before (tlsnode.start waited for TLS health), and
    # the CLI holding itself to 1.3 reaches it.
    probe = harness.run_cli("health", "--addr", node.data_addr, "--ca", str(ca.cert),
                            "--tls-min-version", "1.3")
    assert (probe.returncode, probe.stdout.strip()) == (0, "SERVING"), probe.stderr
    status = harness.run_cli("status", "--admin", node.admin_addr, "--state-dir",
                             str(node.state_dir), "--ca", str(ca.cert),
                             "--tls-min-version", "1.3", "--output", "json")
    assert status.returncode == 0, status.stderr


def test_by_default_tls_12_is_accepted(tmp_path: Path, ca: Ca, server_pair: Pair,
                                       nodes: list[harness.Sitsmesh]) -> None:
    """The probe above can succeed: without the setting the same handshake goes through."""
    node = tlsnode.start(tmp_path, *_tls_flags(server_pair), data=(ca.cert, None),
                         admin=(ca.cert, None))
    nodes.append(node)
    for addr in (node.data_addr, node.admin_addr):
        assert handshake(addr, ca.cert, TLS12) == "TLSv1.2"
        assert handshake(addr, ca.cert, TLS13) == "TLSv1.3"


def test_the_setting_from_the_environment_applies(tmp_path: Path, ca: Ca, server_pair: Pair,
                                                  nodes: list[harness.Sitsmesh]) -> None:
    node = tlsnode.start(tmp_path, *_tls_flags(server_pair), data=(ca.cert, None),
                         admin=(ca.cert, None), env={"SITSMESH_TLS_MIN_VERSION": "1.3"})
    nodes.append(node)
    assert handshake(node.data_addr, ca.cert, TLS12) is None


@contextlib.contextmanager
def tls12_only_server(pair: Pair) -> Iterator[tuple[int, list[str]]]:
    """A TLS server that speaks at most TLS 1.2 and records each handshake's outcome."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pair.cert, pair.key)
    context.maximum_version = TLS12
    context.set_alpn_protocols(["h2"])
    outcomes: list[str] = []
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                raw, _ = listener.accept()
            except TimeoutError:
                continue
            raw.settimeout(5)
            try:
                with context.wrap_socket(raw, server_side=True) as tls:
                    outcomes.append(str(tls.version()))
            except (ssl.SSLError, OSError):
                outcomes.append("refused")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], outcomes
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def test_the_cli_at_13_refuses_a_server_that_offers_only_tls_12(ca: Ca,
                                                                server_pair: Pair) -> None:
    with tls12_only_server(server_pair) as (port, outcomes):
        addr = f"127.0.0.1:{port}"
        held = harness.run_cli("health", "--addr", addr, "--ca", str(ca.cert), "--timeout",
                               "2", "--tls-min-version", "1.3")
        assert held.returncode == 1
        assert outcomes and set(outcomes) == {"refused"}, outcomes
        outcomes.clear()
        # Without it the same client agrees on TLS 1.2 (and then finds no gRPC there).
        plain = harness.run_cli("health", "--addr", addr, "--ca", str(ca.cert), "--timeout",
                                "2")
        assert plain.returncode == 1
        assert "TLSv1.2" in outcomes, outcomes


def test_serve_refuses_a_cipher_list_it_would_have_to_override(tmp_path: Path, ca: Ca,
                                                               server_pair: Pair) -> None:
    suites = {"GRPC_SSL_CIPHER_SUITES": "ECDHE-RSA-AES128-GCM-SHA256"}
    node = harness.start_sitsmesh(tmp_path, *_tls_flags(server_pair), "--tls-min-version",
                                  "1.3", env=suites, wait=False)
    try:
        assert node.proc.wait(30) != 0
        assert ("tls_min_version 1.3: GRPC_SSL_CIPHER_SUITES is set "
                "('ECDHE-RSA-AES128-GCM-SHA256'), and TLS 1.3 is enforced through that "
                "variable; unset it") in node.output()
    finally:
        node.kill()


def test_a_bad_version_is_refused() -> None:
    from sitsmesh.config import load_settings

    with pytest.raises(ConfigError, match=r"--tls-min-version: must be one of 1.2, 1.3; "
                                          r"got '1.1'"):
        load_settings({"tls_min_version": "1.1"}, env={})
    done = harness.run_cli("health", "--tls-min-version", "1.1")
    assert done.returncode == 2 and "invalid choice: '1.1'" in done.stderr


def test_too_late_is_an_error_not_a_silent_tls_12(monkeypatch: pytest.MonkeyPatch) -> None:
    # This test process has loaded grpc already: setting the variable now would change
    # nothing, so require() says so instead of pretending.
    monkeypatch.delenv(tlsversion.CIPHER_SUITES_ENV, raising=False)
    with pytest.raises(ConfigError, match="gRPC was loaded before the setting was read"):
        tlsversion.require("1.3", "tls_min_version")
    tlsversion.require("1.2", "tls_min_version")  # nothing to do
    monkeypatch.setenv(tlsversion.CIPHER_SUITES_ENV, tlsversion.TLS12_NOTHING)
    tlsversion.require("1.3", "tls_min_version")  # already in force from the start
