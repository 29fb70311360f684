"""Settings: defaults < YAML file < SITSMESH_* environment < flags, into one frozen snapshot.

Every value passes through the same parser whatever its source, so an error
names where the bad value came from (file and key, variable, or flag).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from sitsmesh import netsettings
from sitsmesh.errors import ConfigError
from sitsmesh.netsettings import callers, data_address, identities

# Defined in netsettings with the other address values; callers import them from here.
Address = netsettings.Address
parse_address = netsettings.parse_address
ENV_PREFIX = "SITSMESH_"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "console")


@dataclass(frozen=True, slots=True)
class TritonEndpoint:
    """One production Triton server, and the sandbox that vets candidates for it."""

    name: str
    url: str                  # gRPC HOST:PORT
    metrics_url: str = ""     # http://HOST:PORT/metrics; pressure and drain read it
    preflight_url: str = ""   # gRPC HOST:PORT of a sandbox serving the same repository


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "sitsmesh"


@dataclass(frozen=True, slots=True)
class Settings:
    data_addr: Address = Address("127.0.0.1", 50051)  # noqa: RUF009 - frozen
    admin_addr: Address = Address("127.0.0.1", 50052)  # noqa: RUF009 - frozen
    metrics_addr: Address = Address("127.0.0.1", 9464)  # noqa: RUF009 - frozen
    state_dir: Path = field(default_factory=default_state_dir)
    log_level: str = "info"
    log_format: str = "auto"
    workers: int = 1
    drain_seconds: float = 5.0
    grace_seconds: float = 10.0
    admin_token_file: Path | None = None
    ratelimit_config: tuple[Path, ...] = ()
    ratelimit_store: str = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_timeout_ms: int = 50
    on_store_error: str = "allow"
    store_replicas: int = 1
    ratelimit_shadow_mode: bool = False
    ratelimit_max_descriptors: int = 64
    reload_interval_seconds: float = 1.0
    authz_api_key_headers: tuple[str, ...] = ("x-api-key", "authorization")
    authz_peer_tenants: Mapping[str, str] = field(default_factory=dict)
    authz_jwt_header: str = ""
    authz_jwt_tenant_claim: str = "tenant"
    authz_priority_header: str = "x-priority"
    admission_hold_seconds: float = 60.0
    chain_ttl_seconds: float = 30.0
    pressure_scrape_seconds: float = 0.25
    pressure_stale_seconds: float = 1.0
    triton: tuple[TritonEndpoint, ...] = ()
    triton_url: str = ""
    triton_metrics_url: str = ""
    triton_preflight_url: str = ""
    # transport security (issue 13): TLS / mTLS, who may call, secrets in files
    data_tls_cert_file: Path | None = None
    data_tls_key_file: Path | None = None
    data_tls_client_ca_file: Path | None = None
    data_callers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    admin_tls_cert_file: Path | None = None
    admin_tls_key_file: Path | None = None
    admin_tls_client_ca_file: Path | None = None
    admin_clients: tuple[str, ...] = ()
    admin_insecure: bool = False
    redis_password_file: Path | None = None
    config_file: Path | None = None

    @property
    def triton_endpoints(self) -> tuple[TritonEndpoint, ...]:
        """The `triton` list, or the one endpoint the triton_* flags describe (they win)."""
        if self.triton_url:
            return (TritonEndpoint("default", self.triton_url, self.triton_metrics_url,
                                   self.triton_preflight_url),)
        return self.triton

    @property
    def token_path(self) -> Path:
        return self.admin_token_file or self.state_dir / "admin-token"

    @property
    def config_version(self) -> str:
        """Digest of the effective settings, so operators can tell two configs apart."""
        data = {k: str(v) for k, v in asdict(self).items() if k != "config_file"}
        data["redis_url"] = hashlib.sha256(self.redis_url.encode()).hexdigest()
        blob = json.dumps(data, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def _int_range(low: int, high: int) -> Callable[[Any], int]:
    def parse(raw: Any) -> int:
        if isinstance(raw, bool) or not isinstance(raw, int | str):
            raise ValueError(f"expected an integer, got {raw!r}")
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"expected an integer, got {raw!r}") from None
        if not low <= value <= high:
            raise ValueError(f"must be between {low} and {high}, got {value}")
        return value

    return parse


def _seconds(raw: Any) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        raise ValueError(f"expected a number of seconds, got {raw!r}")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"expected a number of seconds, got {raw!r}") from None
    if not 0 <= value <= 3600:
        raise ValueError(f"must be between 0 and 3600 seconds, got {value:g}")
    return value


def _choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(raw: Any) -> str:
        value = str(raw).lower()
        if value not in options:
            raise ValueError(f"must be one of {', '.join(options)}; got {raw!r}")
        return value

    return parse


def _bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {raw!r}")


def _paths(raw: Any) -> tuple[Path, ...]:
    """A list (YAML) or an os.pathsep-separated string (env, repeated flags)."""
    items = raw if isinstance(raw, list) else str(raw).split(os.pathsep)
    if not all(isinstance(i, str) for i in items):
        raise ValueError(f"expected paths, got {raw!r}")
    return tuple(Path(i).expanduser() for i in items if i)


def _redis_url(raw: Any) -> str:
    if not isinstance(raw, str) or not raw.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"expected a redis://, rediss:// or unix:// URL, got {raw!r}")
    return raw


def _header_names(raw: Any) -> tuple[str, ...]:
    items = raw if isinstance(raw, list) else str(raw).split(",")
    names = tuple(str(i).strip().lower() for i in items if str(i).strip())
    if not names:
        raise ValueError("expected at least one header name")
    return names


def _header_name(raw: Any) -> str:
    if not isinstance(raw, str):
        raise ValueError(f"expected a header name, got {raw!r}")
    return raw.strip().lower()


def _string(raw: Any) -> str:
    if not isinstance(raw, str) or not raw:
        raise ValueError(f"expected a non-empty string, got {raw!r}")
    return raw


def _mapping(raw: Any) -> dict[str, str]:
    """A YAML mapping, or 'key=value,key=value' from the environment or a flag."""
    if isinstance(raw, dict):
        items = list(raw.items())
    else:
        items = []
        for part in str(raw).split(","):
            if part.strip():
                key, sep, value = part.partition("=")
                if not sep:
                    raise ValueError(f"expected key=value, got {part!r}")
                items.append((key.strip(), value.strip()))
    if not all(isinstance(k, str) and isinstance(v, str) and k and v for k, v in items):
        raise ValueError("expected a mapping of non-empty strings")
    return dict(items)


def _address(raw: Any) -> Address:
    if not isinstance(raw, str):
        raise ValueError(f"expected HOST:PORT as a string, got {raw!r}")
    return parse_address(raw)


def _path(raw: Any) -> Path:
    if not isinstance(raw, str) or not raw:
        raise ValueError(f"expected a path, got {raw!r}")
    return Path(raw).expanduser()


def _grpc_target(raw: Any) -> str:
    """HOST:PORT, as tritonclient takes it; a grpc:// prefix is dropped."""
    if not isinstance(raw, str) or not raw:
        raise ValueError(f"expected a gRPC HOST:PORT, got {raw!r}")
    text = raw.removeprefix("grpc://")
    parse_address(text)
    return text


def _http_url(raw: Any) -> str:
    if not isinstance(raw, str) or not raw.startswith(("http://", "https://")):
        raise ValueError(f"expected an http:// URL, got {raw!r}")
    return raw


_ENDPOINT_KEYS = {"name": _string, "url": _grpc_target, "metrics_url": _http_url,
                  "preflight_url": _grpc_target}


def _triton(raw: Any) -> tuple[TritonEndpoint, ...]:
    """A YAML list of endpoints, or the same list as JSON (environment, flag)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            raise ValueError("expected a list of endpoints (JSON from a flag or the "
                             "environment)") from None
    if not isinstance(raw, list):
        raise ValueError(f"expected a list of endpoints, got {type(raw).__name__}")
    endpoints: list[TritonEndpoint] = []
    for i, item in enumerate(raw):
        where = f"endpoint {i + 1}"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected a mapping, got {type(item).__name__}")
        for key in item:
            if key not in _ENDPOINT_KEYS:
                raise ValueError(f"{where}: unknown key '{key}' (allowed: "
                                 f"{', '.join(_ENDPOINT_KEYS)})")
        for key in ("name", "url"):
            if key not in item:
                raise ValueError(f"{where}: '{key}' is required")
        values: dict[str, str] = {}
        for key, parse in _ENDPOINT_KEYS.items():
            if key in item:
                try:
                    values[key] = parse(item[key])
                except ValueError as exc:
                    raise ValueError(f"{where}: '{key}': {exc}") from None
        if any(e.name == values["name"] for e in endpoints):
            raise ValueError(f"{where}: name '{values['name']}' is used twice")
        endpoints.append(TritonEndpoint(**values))
    return tuple(endpoints)


PARSERS: dict[str, Callable[[Any], Any]] = {
    "data_addr": data_address,
    "admin_addr": _address,
    "metrics_addr": _address,
    "state_dir": _path,
    "log_level": _choice(LOG_LEVELS),
    "log_format": _choice(LOG_FORMATS),
    "workers": _int_range(1, 64),
    "drain_seconds": _seconds,
    "grace_seconds": _seconds,
    "admin_token_file": _path,
    "ratelimit_config": _paths,
    "ratelimit_store": _choice(("memory", "redis")),
    "redis_url": _redis_url,
    "redis_timeout_ms": _int_range(1, 10_000),
    "on_store_error": _choice(("allow", "deny", "local")),
    "store_replicas": _int_range(1, 10_000),
    "ratelimit_shadow_mode": _bool,
    "ratelimit_max_descriptors": _int_range(1, 100_000),
    "reload_interval_seconds": _seconds,
    "authz_api_key_headers": _header_names,
    "authz_peer_tenants": _mapping,
    "authz_jwt_header": _header_name,
    "authz_jwt_tenant_claim": _string,
    "authz_priority_header": _header_name,
    "admission_hold_seconds": _seconds,
    "chain_ttl_seconds": _seconds,
    "pressure_scrape_seconds": _seconds,
    "pressure_stale_seconds": _seconds,
    "triton": _triton,
    "triton_url": _grpc_target,
    "triton_metrics_url": _http_url,
    "triton_preflight_url": _grpc_target,
    # transport security (issue 13)
    "data_tls_cert_file": _path,
    "data_tls_key_file": _path,
    "data_tls_client_ca_file": _path,
    "data_callers": callers,
    "admin_tls_cert_file": _path,
    "admin_tls_key_file": _path,
    "admin_tls_client_ca_file": _path,
    "admin_clients": identities,
    "admin_insecure": _bool,
    "redis_password_file": _path,
}
FILE_KEYS = tuple(PARSERS)


def env_name(key: str) -> str:
    return ENV_PREFIX + key.upper()


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "malformed YAML"
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of keys, got {type(data).__name__}")
    for key in data:
        if key not in PARSERS:
            hint = difflib.get_close_matches(str(key), FILE_KEYS, n=1)
            suffix = f" (did you mean '{hint[0]}'?)" if hint else ""
            raise ConfigError(f"{path}: unknown key '{key}'{suffix}")
    return data


def load_settings(
    flags: Mapping[str, str | None] | None = None,
    env: Mapping[str, str] | None = None,
) -> Settings:
    """Build the effective settings. Raises ConfigError naming the offending source."""
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    env = os.environ if env is None else env
    unknown = set(flags) - set(PARSERS) - {"config"}
    if unknown:
        raise ConfigError(f"unknown setting(s): {', '.join(sorted(unknown))}")

    config_raw = flags.get("config") or env.get(env_name("config"))
    config_file = Path(config_raw).expanduser() if config_raw else None
    file_values = _read_file(config_file) if config_file else {}

    values: dict[str, Any] = {}
    for key, parse in PARSERS.items():
        if key in flags:
            raw, source = flags[key], flag_name(key)
        elif env_name(key) in env:
            raw, source = env[env_name(key)], f"environment {env_name(key)}"
        elif key in file_values:
            raw, source = file_values[key], f"{config_file}: key '{key}'"
        else:
            continue
        try:
            values[key] = parse(raw)
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    settings = Settings(config_file=config_file, **values)
    # (A Unix socket, also port 0, gets its own message from `serve`'s checks.)
    if settings.workers > 1 and settings.data_addr.port == 0 and not settings.data_addr.is_unix:
        raise ConfigError("data_addr: port 0 cannot be shared by several workers; pick a port")
    return settings


def describe(settings: Settings) -> dict[str, str]:
    """Settings as plain strings, for logs and status output (holds no secrets)."""
    hidden = {"redis_url"}  # may carry a password
    return {f.name: str(getattr(settings, f.name)) for f in fields(settings)
            if f.name not in hidden}
