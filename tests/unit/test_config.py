from __future__ import annotations

from pathlib import Path

import pytest

from sitsmesh.config import Address, load_settings, parse_address
from sitsmesh.errors import ConfigError


@pytest.mark.parametrize(("text", "expected"), [
    ("127.0.0.1:50051", Address("127.0.0.1", 50051)),
    ("0.0.0.0:0", Address("0.0.0.0", 0)),
    ("[::1]:9000", Address("::1", 9000)),
    ("localhost:80", Address("localhost", 80)),
])
def test_parse_address(text: str, expected: Address) -> None:
    assert parse_address(text) == expected
    assert str(parse_address(text)) == text


@pytest.mark.parametrize(("text", "message"), [
    ("50051", "expected HOST:PORT, got '50051'"),
    (":50051", "expected HOST:PORT, got ':50051'"),
    ("host:", "port must be a number from 0 to 65535, got ''"),
    ("host:65536", "port must be a number from 0 to 65535, got '65536'"),
    ("host:-1", "port must be a number from 0 to 65535, got '-1'"),
    ("::1:80", "IPv6 hosts need brackets"),
    ("[::1]80", "expected [IPV6]:PORT"),
])
def test_parse_address_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_address(text)


def test_defaults(tmp_path: Path) -> None:
    s = load_settings({}, env={})
    assert s.data_addr == Address("127.0.0.1", 50051)
    assert s.admin_addr == Address("127.0.0.1", 50052)
    assert s.metrics_addr == Address("127.0.0.1", 9464)
    assert s.workers == 1
    assert s.token_path == s.state_dir / "admin-token"


def test_precedence_flag_env_file_default(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("workers: 3\ndrain_seconds: 7\ngrace_seconds: 8\nlog_level: debug\n")
    env = {"SITSMESH_CONFIG": str(cfg), "SITSMESH_DRAIN_SECONDS": "2",
           "SITSMESH_GRACE_SECONDS": "4"}
    s = load_settings({"grace_seconds": "1"}, env=env)
    assert s.grace_seconds == 1        # flag beats env and file
    assert s.drain_seconds == 2        # env beats file
    assert s.workers == 3              # file beats default
    assert s.log_level == "debug"
    assert s.metrics_addr.port == 9464  # default
    assert s.config_file == cfg


def test_config_flag_beats_config_env(tmp_path: Path) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("workers: 2\n")
    b.write_text("workers: 5\n")
    assert load_settings({"config": str(b)}, env={"SITSMESH_CONFIG": str(a)}).workers == 5


def test_unknown_key_names_file_key_and_suggestion(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("log_levle: info\n")
    with pytest.raises(ConfigError) as err:
        load_settings({"config": str(cfg)}, env={})
    assert err.value.message == f"{cfg}: unknown key 'log_levle' (did you mean 'log_level'?)"


@pytest.mark.parametrize(("flags", "env", "message"), [
    ({"workers": "0"}, {}, "--workers: must be between 1 and 64, got 0"),
    ({}, {"SITSMESH_WORKERS": "two"},
     "environment SITSMESH_WORKERS: expected an integer, got 'two'"),
    ({"drain_seconds": "-1"}, {}, "--drain-seconds: must be between 0 and 3600 seconds, got -1"),
    ({"log_format": "xml"}, {}, "--log-format: must be one of auto, json, console; got 'xml'"),
    ({"workers": "2", "data_addr": "127.0.0.1:0"}, {},
     "data_addr: port 0 cannot be shared by several workers; pick a port"),
])
def test_bad_values_name_their_source(flags: dict[str, str | None], env: dict[str, str],
                                      message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(flags, env=env)
    assert err.value.message == message


def test_file_types_are_checked(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("workers: true\n")
    with pytest.raises(ConfigError, match="key 'workers': expected an integer, got True"):
        load_settings({"config": str(cfg)}, env={})


def test_empty_file_is_all_defaults(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("# nothing\n")
    assert load_settings({"config": str(cfg)}, env={}).workers == 1


def test_config_version_tracks_effective_settings() -> None:
    a = load_settings({}, env={})
    b = load_settings({}, env={})
    c = load_settings({"workers": "2"}, env={})
    assert a.config_version == b.config_version
    assert a.config_version != c.config_version


def test_triton_endpoints_from_file_and_from_flags(tmp_path: Path) -> None:
    from sitsmesh.config import TritonEndpoint

    path = tmp_path / "c.yaml"
    path.write_text("triton:\n"
                    "  - name: gpu-a\n    url: 10.0.0.5:8001\n"
                    "    metrics_url: http://10.0.0.5:8002/metrics\n"
                    "    preflight_url: grpc://127.0.0.1:9001\n"
                    "  - name: gpu-b\n    url: 10.0.0.6:8001\n")
    settings = load_settings({"config": str(path)}, env={})
    assert settings.triton_endpoints == (
        TritonEndpoint("gpu-a", "10.0.0.5:8001", "http://10.0.0.5:8002/metrics",
                       "127.0.0.1:9001"),
        TritonEndpoint("gpu-b", "10.0.0.6:8001"))
    # The simple case: flags describe one endpoint, and win over the file's list.
    flagged = load_settings({"config": str(path), "triton_url": "127.0.0.1:8001",
                             "triton_preflight_url": "127.0.0.1:9001"}, env={})
    assert flagged.triton_endpoints == (
        TritonEndpoint("default", "127.0.0.1:8001", "", "127.0.0.1:9001"),)
    assert load_settings({}, env={}).triton_endpoints == ()


@pytest.mark.parametrize(("body", "message"), [
    ("triton: {url: x}", "key 'triton': expected a list of endpoints, got dict"),
    ("triton:\n  - url: 127.0.0.1:1", "key 'triton': endpoint 1: 'name' is required"),
    ("triton:\n  - {name: a, url: 127.0.0.1:1, urls: x}",
     "key 'triton': endpoint 1: unknown key 'urls' (allowed: name, url, metrics_url, "
     "preflight_url)"),
    ("triton:\n  - {name: a, url: nowhere}",
     "key 'triton': endpoint 1: 'url': expected HOST:PORT, got 'nowhere'"),
    ("triton:\n  - {name: a, url: 127.0.0.1:1, metrics_url: 127.0.0.1:2}",
     "endpoint 1: 'metrics_url': expected an http:// URL, got '127.0.0.1:2'"),
    ("triton:\n  - {name: a, url: 127.0.0.1:1}\n  - {name: a, url: 127.0.0.1:2}",
     "key 'triton': endpoint 2: name 'a' is used twice"),
])
def test_bad_triton_sections_name_file_key_and_endpoint(tmp_path: Path, body: str,
                                                         message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(body + "\n")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_settings({"config": str(path)}, env={})
