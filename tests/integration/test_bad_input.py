"""Bad input to `sitsmesh serve`: one clear error line, exit 2, no port opened."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from sitsmesh.dev import harness


def _serve(tmp_path: Path, *args: str, state: Path | None = None,
           ) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    ports = [harness.free_port() for _ in range(3)]
    base = ["serve", "--state-dir", str(state or tmp_path / "state")]
    defaults = {"--data-addr": ports[0], "--admin-addr": ports[1], "--metrics-addr": ports[2]}
    for flag, port in defaults.items():
        if flag not in args:
            base += [flag, f"127.0.0.1:{port}"]
    return harness.run_cli(*base, *args, timeout=20), ports


def _assert_rejected(result: subprocess.CompletedProcess[str], ports: list[int],
                     *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("sitsmesh: error: ")
    for fragment in fragments:
        assert fragment in lines[0]
    for port in ports:  # nothing was left listening, and nothing was bound
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_unknown_key_names_file_and_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("data_adr: 127.0.0.1:1\n")
    result, ports = _serve(tmp_path, "--config", str(config))
    _assert_rejected(result, ports, str(config), "unknown key 'data_adr'",
                     "did you mean 'data_addr'")
    assert not (tmp_path / "state").exists(), "a rejected start must change nothing"


@pytest.mark.parametrize(("text", "fragment"), [
    ("workers: [1\n", "invalid YAML at line"),
    ("- a\n- b\n", "top level must be a mapping"),
    ("workers: zero\n", "key 'workers': expected an integer"),
    ("log_level: loud\n", "key 'log_level': must be one of"),
])
def test_invalid_config_file(tmp_path: Path, text: str, fragment: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    result, ports = _serve(tmp_path, "--config", str(config))
    _assert_rejected(result, ports, str(config), fragment)


def test_missing_config_file(tmp_path: Path) -> None:
    result, ports = _serve(tmp_path, "--config", str(tmp_path / "nope.yaml"))
    _assert_rejected(result, ports, "nope.yaml", "cannot read config file")


@pytest.mark.parametrize(("addr", "fragment"), [
    ("localhost", "expected HOST:PORT"),
    ("127.0.0.1:99999", "port must be a number from 0 to 65535"),
    ("::1:80", "IPv6 hosts need brackets"),
])
def test_malformed_address(tmp_path: Path, addr: str, fragment: str) -> None:
    result, ports = _serve(tmp_path, "--admin-addr", addr)
    _assert_rejected(result, ports, "--admin-addr", fragment)


def test_malformed_address_from_environment(tmp_path: Path) -> None:
    ports = [harness.free_port()]
    result = harness.run_cli("serve", "--state-dir", str(tmp_path / "s"),
                             env={"SITSMESH_DATA_ADDR": "nohost"})
    _assert_rejected(result, ports, "environment SITSMESH_DATA_ADDR", "expected HOST:PORT")


def test_address_taken(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        result, ports = _serve(tmp_path, "--admin-addr", f"127.0.0.1:{taken}")
        _assert_rejected(result, [ports[0], ports[2]], f"admin_addr 127.0.0.1:{taken}",
                         "cannot bind", "in use")


def test_address_taken_by_another_sitsmesh(tmp_path: Path, sitsmesh: harness.Sitsmesh) -> None:
    # gRPC sets SO_REUSEPORT by default; a second instance must not silently share the port.
    result, ports = _serve(tmp_path, "--data-addr", sitsmesh.data_addr)
    _assert_rejected(result, [ports[1], ports[2]], "data_addr", "in use")
    assert harness.health_status(sitsmesh.data_addr) == 1


def test_same_address_twice(tmp_path: Path) -> None:
    port = harness.free_port()
    result, ports = _serve(tmp_path, "--data-addr", f"127.0.0.1:{port}",
                           "--metrics-addr", f"127.0.0.1:{port}")
    _assert_rejected(result, [ports[1]], "same address as data_addr")


def test_state_dir_not_writable(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result, ports = _serve(tmp_path, state=blocker / "state")
    _assert_rejected(result, ports, "state dir", "not writable")
