"""envoyproxy/ratelimit's environment variables, read as sitsmesh settings.

A team moving from the reference keeps its Deployment's environment: each variable
that has a sitsmesh equivalent becomes that setting (below SITSMESH_* and flags,
which win), and each one sitsmesh cannot honour stops the start with the reason,
rather than being silently ignored. Variables that change nothing a caller sees
(pool sizes, pipelining, statsd) are not read. README "Migrating from
envoyproxy/ratelimit" lists every variable.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from urllib.parse import quote

from sitsmesh.errors import ConfigError

# (reference variable, sitsmesh setting, how its value is written as the setting's).
Translate = Callable[[str], str]


def _go_bool(raw: str) -> str:
    """Go's strconv.ParseBool spellings; anything else is left to the setting's parser."""
    text = raw.strip()
    if text in ("1", "t", "T", "TRUE", "true", "True"):
        return "true"
    if text in ("0", "f", "F", "FALSE", "false", "False"):
        return "false"
    return raw


def _same(raw: str) -> str:
    return raw


def _go_duration_ms(raw: str) -> str:
    """A Go duration ("500ms", "2s", "1m") as whole milliseconds."""
    text = raw.strip()
    for suffix, scale in (("ms", 1.0), ("us", 0.001), ("s", 1000.0), ("m", 60_000.0)):
        if text.endswith(suffix):
            try:
                return str(max(1, round(float(text[: -len(suffix)]) * scale)))
            except ValueError:
                break
    raise ValueError(f"expected a Go duration such as 50ms or 2s, got {raw!r}")


def _listen_addr(raw: str) -> str:
    """":9090" (every interface, in Go) as 0.0.0.0:9090."""
    text = raw.strip()
    return "0.0.0.0" + text if text.startswith(":") else text


SIMPLE: dict[str, tuple[str, Translate]] = {
    "SHADOW_MODE": ("ratelimit_shadow_mode", _go_bool),
    "QUOTA_MODE": ("ratelimit_quota_mode", _go_bool),
    "MERGE_DOMAIN_CONFIG": ("ratelimit_merge_domain_config", _go_bool),
    "LIMIT_RESPONSE_HEADERS_ENABLED": ("ratelimit_response_headers", _go_bool),
    "LIMIT_LIMIT_HEADER": ("ratelimit_limit_header", _same),
    "LIMIT_REMAINING_HEADER": ("ratelimit_remaining_header", _same),
    "LIMIT_RESET_HEADER": ("ratelimit_reset_header", _same),
    "RESPONSE_DYNAMIC_METADATA": ("ratelimit_response_dynamic_metadata", _go_bool),
    "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT": ("ratelimit_stop_increment_when_over", _go_bool),
    "NEAR_LIMIT_RATIO": ("ratelimit_near_limit_ratio", _same),
    "EXPIRATION_JITTER_MAX_SECONDS": ("ratelimit_expiration_jitter_seconds", _same),
    "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED": ("ratelimit_healthy_requires_config", _go_bool),
    "REDIS_TIMEOUT": ("redis_timeout_ms", _go_duration_ms),
    "GRPC_SERVER_TLS_CERT": ("data_tls_cert_file", _same),
    "GRPC_SERVER_TLS_KEY": ("data_tls_key_file", _same),
    "GRPC_CLIENT_TLS_CACERT": ("data_tls_client_ca_file", _same),
    "PROMETHEUS_ADDR": ("metrics_addr", _listen_addr),
}

# Set to anything but these values, the reference does something sitsmesh does not.
UNSUPPORTED: dict[str, tuple[tuple[str, ...], str]] = {
    "CONFIG_TYPE": (("", "FILE"), "only file (and admin API) configs are supported, not xDS"),
    "BACKEND_TYPE": (("", "redis"), "the shared store is Redis (or memory, per process)"),
    "REDIS_TYPE": (("", "single", "SINGLE"),
                   "only a single Redis URL is supported (no sentinel or cluster list)"),
    "REDIS_PERSECOND": (("", "false", "False", "FALSE", "0", "f", "F"),
                        "per-second limits count in the same Redis as the others"),
}


def read(env: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Setting -> (value as sitsmesh parses it, where it came from) for every reference
    variable set in `env`. Raises ConfigError for one sitsmesh cannot honour."""
    for name, (accepted, why) in UNSUPPORTED.items():
        if name in env and env[name].strip() not in accepted:
            raise ConfigError(f"environment {name}={env[name]!r} (envoyproxy/ratelimit's "
                              f"setting) is not supported: {why}")
    out: dict[str, tuple[str, str]] = {}

    def put(setting: str, name: str, translate: Translate) -> None:
        try:
            value = translate(env[name])
        except ValueError as exc:
            raise ConfigError(f"{_source(name)}: {exc}") from None
        out[setting] = (value, _source(name))

    for name, (setting, translate) in SIMPLE.items():
        if name in env:
            put(setting, name, translate)
    if "GRPC_SERVER_USE_TLS" in env and _go_bool(env["GRPC_SERVER_USE_TLS"]) == "true" and (
            "data_tls_cert_file" not in out or "data_tls_key_file" not in out):
        raise ConfigError(f"{_source('GRPC_SERVER_USE_TLS')}: needs GRPC_SERVER_TLS_CERT and "
                          "GRPC_SERVER_TLS_KEY")
    if "GRPC_HOST" in env or "GRPC_PORT" in env:
        host = env.get("GRPC_HOST", "0.0.0.0")
        out["data_addr"] = (f"{host}:{env.get('GRPC_PORT', '8081')}",
                            _source("GRPC_HOST/GRPC_PORT"))
    if "USE_PROMETHEUS" in env and _go_bool(env["USE_PROMETHEUS"]) == "true":
        # Dashboards built on the reference read its names; sitsmesh's stay alongside.
        out["ratelimit_metric_names"] = ("both", _source("USE_PROMETHEUS"))
    _redis(env, out)
    _runtime(env, out)
    return out


def _redis(env: Mapping[str, str], out: dict[str, tuple[str, str]]) -> None:
    """REDIS_URL is HOST:PORT in the reference; with REDIS_TLS and REDIS_AUTH ("password"
    or "user:password") it becomes one redis URL, and the store becomes Redis."""
    if "REDIS_URL" not in env:
        return
    address = env["REDIS_URL"].strip()
    if address.startswith("unix:") or "://" in address:
        url = address if "://" in address else "unix://" + address.removeprefix("unix:")
    else:
        scheme = "rediss" if _go_bool(env.get("REDIS_TLS", "false")) == "true" else "redis"
        auth = env.get("REDIS_AUTH", "")
        if auth:
            user, sep, password = auth.partition(":")
            credentials = (f"{quote(user, safe='')}:{quote(password, safe='')}" if sep
                           else f":{quote(auth, safe='')}")
            url = f"{scheme}://{credentials}@{address}/0"
        else:
            url = f"{scheme}://{address}/0"
    out["redis_url"] = (url, _source("REDIS_URL"))
    out["ratelimit_store"] = ("redis", _source("REDIS_URL"))


def _runtime(env: Mapping[str, str], out: dict[str, tuple[str, str]]) -> None:
    """RUNTIME_ROOT/RUNTIME_SUBDIRECTORY[/RUNTIME_APPDIRECTORY]: the directory of config
    files. With RUNTIME_WATCH_ROOT (the default) the reference loads only the app
    directory's files."""
    if "RUNTIME_ROOT" not in env and "RUNTIME_SUBDIRECTORY" not in env:
        return
    parts = [env.get("RUNTIME_ROOT", "/srv/runtime_data/current"),
             env.get("RUNTIME_SUBDIRECTORY", "")]
    if _go_bool(env.get("RUNTIME_WATCH_ROOT", "true")) == "true":
        parts.append(env.get("RUNTIME_APPDIRECTORY", "config"))
    path = "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts) if p)
    out["ratelimit_config"] = (path, _source("RUNTIME_ROOT"))


def _source(name: str) -> str:
    return f"environment {name} (envoyproxy/ratelimit's name)"
