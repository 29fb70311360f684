"""envoyproxy/ratelimit's environment variable names, read as sitsmesh settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from sitsmesh.config import Address, load_settings
from sitsmesh.errors import ConfigError


def test_every_answer_changing_switch_maps_to_its_setting() -> None:
    s = load_settings(env={
        "SHADOW_MODE": "T", "QUOTA_MODE": "1", "MERGE_DOMAIN_CONFIG": "True",
        "LIMIT_RESPONSE_HEADERS_ENABLED": "true", "RESPONSE_DYNAMIC_METADATA": "TRUE",
        "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT": "t", "NEAR_LIMIT_RATIO": "0.5",
        "EXPIRATION_JITTER_MAX_SECONDS": "300", "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED": "1",
        "LIMIT_LIMIT_HEADER": "X-Limit", "LIMIT_REMAINING_HEADER": "X-Left",
        "LIMIT_RESET_HEADER": "X-Reset"})
    assert (s.ratelimit_shadow_mode, s.ratelimit_quota_mode, s.ratelimit_merge_domain_config,
            s.ratelimit_response_headers, s.ratelimit_response_dynamic_metadata,
            s.ratelimit_stop_increment_when_over, s.ratelimit_healthy_requires_config) == (
        True, True, True, True, True, True, True)
    assert s.ratelimit_near_limit_ratio == 0.5
    assert s.ratelimit_expiration_jitter_seconds == 300
    assert (s.ratelimit_limit_header, s.ratelimit_remaining_header,
            s.ratelimit_reset_header) == ("X-Limit", "X-Left", "X-Reset")


def test_sitsmesh_names_and_flags_win_over_the_reference_names() -> None:
    env = {"QUOTA_MODE": "true", "SITSMESH_RATELIMIT_QUOTA_MODE": "false",
           "NEAR_LIMIT_RATIO": "0.5"}
    s = load_settings(flags={"ratelimit_near_limit_ratio": "0.9"}, env=env)
    assert (s.ratelimit_quota_mode, s.ratelimit_near_limit_ratio) == (False, 0.9)


def test_redis_host_port_auth_and_tls_become_one_url() -> None:
    s = load_settings(env={"REDIS_URL": "redis.ns:6379", "REDIS_AUTH": "user:p@ss",
                           "REDIS_TLS": "true", "REDIS_TIMEOUT": "250ms"})
    assert (s.ratelimit_store, s.redis_url) == ("redis", "rediss://user:p%40ss@redis.ns:6379/0")
    assert s.redis_timeout_ms == 250
    assert load_settings(env={"REDIS_URL": "r:1", "REDIS_AUTH": "secret"}).redis_url == \
        "redis://:secret@r:1/0"
    assert load_settings(env={"REDIS_URL": "unix:/run/redis.sock"}).redis_url == \
        "unix:///run/redis.sock"


def test_the_runtime_directory_layout_names_the_config_directory() -> None:
    env = {"RUNTIME_ROOT": "/data", "RUNTIME_SUBDIRECTORY": "ratelimit"}
    assert load_settings(env=env).ratelimit_config == (Path("/data/ratelimit/config"),)
    assert load_settings(env={**env, "RUNTIME_APPDIRECTORY": "rl"}).ratelimit_config == (
        Path("/data/ratelimit/rl"),)
    assert load_settings(env={**env, "RUNTIME_WATCH_ROOT": "false"}).ratelimit_config == (
        Path("/data/ratelimit"),)


def test_ports_tls_and_prometheus() -> None:
    s = load_settings(env={"GRPC_PORT": "9000", "USE_PROMETHEUS": "true",
                           "PROMETHEUS_ADDR": ":9090", "GRPC_SERVER_TLS_CERT": "/t/c.pem",
                           "GRPC_SERVER_TLS_KEY": "/t/k.pem", "GRPC_SERVER_USE_TLS": "true"})
    assert s.data_addr == Address("0.0.0.0", 9000)
    assert s.metrics_addr == Address("0.0.0.0", 9090)
    assert s.ratelimit_metric_names == "both"
    assert (s.data_tls_cert_file, s.data_tls_key_file) == (Path("/t/c.pem"), Path("/t/k.pem"))


@pytest.mark.parametrize(("env", "message"), [
    ({"CONFIG_TYPE": "GRPC_XDS_SOTW"}, "not supported: only file (and admin API) configs"),
    ({"BACKEND_TYPE": "memcache"}, "not supported: the shared store is Redis"),
    ({"REDIS_TYPE": "sentinel"}, "not supported: only a single Redis URL"),
    ({"REDIS_PERSECOND": "true"}, "per-second limits count in the same Redis"),
    ({"NEAR_LIMIT_RATIO": "1.5"},
     "environment NEAR_LIMIT_RATIO (envoyproxy/ratelimit's name): must be between 0 and 1"),
    ({"REDIS_TIMEOUT": "soon"}, "expected a Go duration"),
    ({"QUOTA_MODE": "maybe"}, "environment QUOTA_MODE (envoyproxy/ratelimit's name): "
                              "expected true or false"),
    ({"GRPC_SERVER_USE_TLS": "true"}, "needs GRPC_SERVER_TLS_CERT and GRPC_SERVER_TLS_KEY"),
])
def test_what_sitsmesh_cannot_honour_is_refused_by_name(env: dict[str, str],
                                                        message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(env=env)
    assert message in err.value.message


def test_defaults_of_the_reference_that_match_sitsmesh_are_accepted() -> None:
    s = load_settings(env={"CONFIG_TYPE": "FILE", "BACKEND_TYPE": "redis",
                           "REDIS_TYPE": "SINGLE", "REDIS_PERSECOND": "false"})
    assert s.ratelimit_store == "memory"  # no REDIS_URL: nothing to point at
