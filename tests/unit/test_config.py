from __future__ import annotations

from pathlib import Path

import pytest

from sitsmesh.config import Address, describe, load_settings, parse_address
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


# --- transport security (issue 13) --------------------------------------------------

def test_transport_security_settings_from_file_env_and_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data_callers:\n  accesslog: [spiffe://a/envoy]\n"
                   "  authz: [spiffe://a/envoy, spiffe://a/gw]\n"
                   "admin_clients: [spiffe://a/sre]\n")
    s = load_settings({"config": str(cfg), "data_addr": "unix:/run/sitsmesh/data.sock"},
                      env={"SITSMESH_ADMIN_INSECURE": "true"})
    assert s.data_callers == {"accesslog": ("spiffe://a/envoy",),
                              "authz": ("spiffe://a/envoy", "spiffe://a/gw")}
    assert s.admin_clients == ("spiffe://a/sre",)
    assert s.admin_insecure is True
    assert s.data_addr.is_unix and str(s.data_addr) == "unix:/run/sitsmesh/data.sock"
    flagged = load_settings({"data_callers": "ratelimit=spiffe://a/x|spiffe://a/y"}, env={})
    assert flagged.data_callers == {"ratelimit": ("spiffe://a/x", "spiffe://a/y")}


@pytest.mark.parametrize(("flags", "message"), [
    ({"data_callers": "billing=spiffe://a"},
     "--data-callers: unknown service 'billing' (allowed: authz, ratelimit, accesslog, "
     "metrics, quota, tokens)"),
    ({"data_callers": "authz"}, "--data-callers: expected SERVICE=ID|ID, got 'authz'"),
    ({"data_callers": "authz=|"}, "--data-callers: authz: expected at least one client "
     "identity"),
    ({"admin_clients": " , "}, "--admin-clients: expected at least one client identity"),
    ({"data_addr": "unix:relative.sock"},
     "--data-addr: expected unix:/ABSOLUTE/PATH, got 'unix:relative.sock'"),
    ({"admin_insecure": "maybe"}, "--admin-insecure: expected true or false, got 'maybe'"),
])
def test_bad_transport_values_name_their_source(flags: dict[str, str | None],
                                                message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(flags, env={})
    assert err.value.message == message


@pytest.mark.parametrize(("flags", "message"), [
    ({"data_tls_cert_file": "/c.pem"},
     "data_tls_cert_file and data_tls_key_file: set both or neither"),
    ({"admin_tls_client_ca_file": "/ca.pem"},
     "admin_tls_client_ca_file: client certificates need TLS; set admin_tls_cert_file and "
     "admin_tls_key_file too"),
    ({"data_callers": "authz=spiffe://a", "data_tls_cert_file": "/c", "data_tls_key_file": "/k"},
     "data_callers: an allowlist needs mTLS on the data plane; set data_tls_client_ca_file "
     "(with data_tls_cert_file and data_tls_key_file)"),
    ({"admin_clients": "spiffe://a"},
     "admin_clients: an allowlist needs mTLS on the admin API; set admin_tls_client_ca_file "
     "(with admin_tls_cert_file and admin_tls_key_file)"),
    ({"data_addr": "unix:/tmp/s.sock", "workers": "2"},
     "data_addr unix:/tmp/s.sock: a Unix socket cannot be shared by several workers; use "
     "HOST:PORT or --workers 1"),
    ({"admin_addr": "0.0.0.0:50052"},
     "admin_addr 0.0.0.0:50052: not a loopback address and the admin API has no TLS, so its "
     "bearer token would cross the network in clear; set --admin-tls-cert-file and "
     "--admin-tls-key-file, bind 127.0.0.1, or pass --admin-insecure true to accept that"),
])
def test_serve_refuses_contradicting_transport_settings(flags: dict[str, str | None],
                                                        message: str) -> None:
    from sitsmesh.app.tls import check_transport

    with pytest.raises(ConfigError) as err:
        check_transport(load_settings(flags, env={}))
    assert err.value.message == message


@pytest.mark.parametrize("addr", ["127.0.0.1:1", "[::1]:1", "localhost:1", "127.8.0.1:1"])
def test_loopback_admin_needs_no_tls(addr: str) -> None:
    from sitsmesh.app.tls import check_transport

    check_transport(load_settings({"admin_addr": addr}, env={}))
    check_transport(load_settings({"admin_addr": "0.0.0.0:1", "admin_insecure": "yes"},
                                  env={}))


def test_redis_password_file(tmp_path: Path) -> None:
    from sitsmesh.app.tls import redis_url

    secret = tmp_path / "pw"
    secret.write_text("p@ss:/word\n")
    s = load_settings({"redis_url": "redis://10.0.0.1:6379/2",
                       "redis_password_file": str(secret)}, env={})
    assert redis_url(s) == "redis://:p%40ss%3A%2Fword@10.0.0.1:6379/2"
    assert "p@ss" not in str(describe(s))  # the file's content never reaches the logs
    secret.write_text("\n")
    with pytest.raises(ConfigError, match=f"redis_password_file {secret}: file is empty"):
        redis_url(s)
    both = load_settings({"redis_url": "redis://:x@h:1/0", "redis_password_file": str(secret)},
                         env={})
    secret.write_text("y")
    with pytest.raises(ConfigError, match="already carries credentials"):
        redis_url(both)
