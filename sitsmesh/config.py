"""Settings: defaults < YAML file < envoyproxy/ratelimit's variable names < SITSMESH_*
environment < flags, into one frozen snapshot.

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

from sitsmesh import netsettings, ratelimitenv, tritonsettings
from sitsmesh import settingvalues as values
from sitsmesh.authz import gie, methods, streamcheck
from sitsmesh.authz.extract import open_path
from sitsmesh.errors import ConfigError
from sitsmesh.limits import LIMIT_PARSERS
from sitsmesh.netsettings import callers, data_address, identities, optional_address

# Defined in netsettings with the other address values; callers import them from here.
Address = netsettings.Address
parse_address = netsettings.parse_address
TritonEndpoint = tritonsettings.TritonEndpoint
ENV_PREFIX = "SITSMESH_"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "console")
TLS_VERSIONS = ("1.2", "1.3")


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
    ratelimit_merge_domain_config: bool = False
    ratelimit_response_headers: bool = False
    ratelimit_response_dynamic_metadata: bool = False
    ratelimit_max_descriptors: int = 64
    # --- envoyproxy/ratelimit parity: README "Migrating from envoyproxy/ratelimit" ---
    ratelimit_quota_mode: bool = False
    ratelimit_stop_increment_when_over: bool = False
    ratelimit_near_limit_ratio: float = 0.8
    ratelimit_count_rejected_hits: bool = True
    ratelimit_require_config: bool = False
    ratelimit_healthy_requires_config: bool = False
    ratelimit_limit_header: str = "RateLimit-Limit"
    ratelimit_remaining_header: str = "RateLimit-Remaining"
    ratelimit_reset_header: str = "RateLimit-Reset"
    # Both by default: dashboards built on envoyproxy/ratelimit keep working after a switch.
    ratelimit_metric_names: str = "both"
    ratelimit_expiration_jitter_seconds: int = 0
    # --- shared runtime state: README "Replicas" ---
    shared_runtime: str = "off"
    # --- RLQS (rate_limit_quota): README "Quotas in Envoy (RLQS)" ---
    rlqs_assignment_ttl_s: int = 20
    # None: RLQS on data_addr, computed in the data process; set: a process of its own.
    rlqs_addr: Address | None = None
    admission: str = "calls"
    reload_interval_seconds: float = 1.0
    authz_api_key_headers: tuple[str, ...] = ("x-api-key", "authorization")
    authz_peer_tenants: Mapping[str, str] = field(default_factory=dict)
    authz_jwt_header: str = ""
    authz_jwt_tenant_claim: str = "tenant"
    authz_priority_header: str = "x-priority"
    admission_hold_seconds: float = 60.0
    # A token-budget reservation whose stream's end never came is released (charged at
    # its estimate) after this (sitsmesh/budgets/gate.py).
    token_budget_hold_seconds: float = 600.0
    # reserve: Check reserves the estimate (the default); charge_after: Check only looks
    # whether the budget is spent, as gateways that charge after the response do (its
    # overshoot is measured against reserve in bench/token_budgets.py).
    budget_charging: str = "reserve"
    # A tenant with no TokenBudget: its LLM calls unlimited in tokens (false), or
    # refused with 403 token_budget_missing (true).
    budget_required: bool = False
    # Model glob -> a Hugging Face tokenizer.json: the prompt of a request for a matching
    # model is counted in its own tokens at Check (else estimated from the body's size).
    budget_tokenizers: Mapping[str, str] = field(default_factory=dict)
    # --- authz request-path policy: README "Request-path policy" ---
    authz_jwt_trusted_principals: tuple[str, ...] = ()
    authz_trust_pipeline_hint: bool = False
    authz_open_paths: tuple[str, ...] = ()
    authz_jwt_metadata_key: str = ""
    # Route family -> HTTP methods it accepts (authz/methods.py); the rest get a 405.
    authz_methods: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: dict(methods.DEFAULTS))
    # Per-message checks of gRPC streams: README "Per-message checks of gRPC streams".
    # Streaming method path -> the field number of its messages' model name.
    stream_check_methods: Mapping[str, int] = field(
        default_factory=lambda: dict(streamcheck.DEFAULT_METHODS))
    stream_check_deadline_seconds: float = 1.0
    stream_check_fail_mode: str = "closed"  # a message incomplete past the deadline
    chain_ttl_seconds: float = 30.0
    pressure_scrape_seconds: float = 0.25
    pressure_stale_seconds: float = 1.0
    triton: tuple[TritonEndpoint, ...] = ()
    triton_url: str = ""
    triton_metrics_url: str = ""
    triton_preflight_url: str = ""
    # Limits: untrusted bytes and memory bounds; ranges in sitsmesh/limits.py.
    max_message_bytes: int = 4 << 20
    max_check_message_bytes: int = 1 << 20
    max_ratelimit_message_bytes: int = 1 << 20
    max_concurrent_rpcs: int = 1000
    max_streams_per_connection: int = 16
    check_max_headers: int = 128
    check_max_header_bytes: int = 64 << 10
    ratelimit_max_entries: int = 16
    ratelimit_max_key_length: int = 256
    ratelimit_max_value_length: int = 1024
    ratelimit_max_hits_addend: int = 1_000_000
    ratelimit_cache_bytes: int = 16 << 20
    ratelimit_store_bytes: int = 64 << 20
    request_id_max_length: int = 128
    chain_max_bytes: int = 32 << 20
    inflight_budget_bytes: int = 0  # 0: 1/8 of the container's memory limit
    large_message_lag_ms: int = 50
    # transport security: TLS / mTLS, who may call, secrets in files
    data_tls_cert_file: Path | None = None
    data_tls_key_file: Path | None = None
    data_tls_client_ca_file: Path | None = None
    data_callers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    admin_tls_cert_file: Path | None = None
    admin_tls_key_file: Path | None = None
    admin_tls_client_ca_file: Path | None = None
    admin_clients: tuple[str, ...] = ()
    admin_insecure: bool = False
    # Oldest TLS version both TLS ports accept (and every gRPC client of the process).
    tls_min_version: str = "1.2"
    redis_password_file: Path | None = None
    # --- state backend: README "State backends" ---
    # sqlite:///ABS/PATH or postgresql://...; empty: SQLite at STATE_DIR/state.db.
    state_url: str = ""
    # --- observability: README "Operations" ---
    decision_log: str = "off"
    decision_log_sample: float = 1.0
    decision_log_max_per_s: int = 100
    decision_log_headers: tuple[str, ...] = ()
    decision_log_mask: tuple[str, ...] = ()
    metrics_max_tenants: int = 100
    # --- tracing (OpenTelemetry): README "Tracing" ---
    # http://HOST:PORT (plaintext) or https://HOST:PORT (TLS) of an OTLP/gRPC receiver;
    # empty: tracing is off and no OpenTelemetry SDK object exists.
    otlp_endpoint: str = ""
    otlp_ca_file: Path | None = None  # CA bundle for an https:// endpoint (default: system)
    trace_sample_ratio: float = 1.0   # of root traces; a traceparent's own flag wins
    # --- Gateway API Inference Extension headers: README "Inference Extension headers" ---
    gie_headers: bool = True
    gie_objective_header: str = gie.OBJECTIVE_HEADER
    gie_fairness_header: str = gie.FAIRNESS_HEADER
    gie_objective_label: str = gie.OBJECTIVE_LABEL
    gie_priority_objectives: Mapping[int, str] = field(default_factory=dict)
    # --- admin access (per-team RBAC): README "Admin credentials and roles" ---
    admin_credentials: Path | None = None  # YAML of named credentials; None: the one token
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


def _address(raw: Any) -> Address:
    if not isinstance(raw, str):
        raise ValueError(f"expected HOST:PORT as a string, got {raw!r}")
    return parse_address(raw)


PARSERS: dict[str, Callable[[Any], Any]] = {
    "data_addr": data_address,
    "admin_addr": _address,
    "metrics_addr": _address,
    "state_dir": values.path,
    "log_level": values.choice(LOG_LEVELS),
    "log_format": values.choice(LOG_FORMATS),
    "workers": values.int_range(1, 64),
    "drain_seconds": values.seconds,
    "grace_seconds": values.seconds,
    "admin_token_file": values.path,
    "ratelimit_config": values.paths,
    "ratelimit_store": values.choice(("memory", "redis")),
    "redis_url": values.redis_url,
    "redis_timeout_ms": values.int_range(1, 10_000),
    "on_store_error": values.choice(("allow", "deny", "local")),
    "store_replicas": values.int_range(1, 10_000),
    "ratelimit_shadow_mode": values.boolean,
    "ratelimit_merge_domain_config": values.boolean,
    "ratelimit_response_headers": values.boolean,
    "ratelimit_response_dynamic_metadata": values.boolean,
    "ratelimit_max_descriptors": values.int_range(1, 100_000),
    "ratelimit_quota_mode": values.boolean,
    "ratelimit_stop_increment_when_over": values.boolean,
    "ratelimit_near_limit_ratio": values.fraction,
    "ratelimit_count_rejected_hits": values.boolean,
    "ratelimit_require_config": values.boolean,
    "ratelimit_healthy_requires_config": values.boolean,
    "ratelimit_limit_header": values.header_name_as_given,
    "ratelimit_remaining_header": values.header_name_as_given,
    "ratelimit_reset_header": values.header_name_as_given,
    "ratelimit_metric_names": values.choice(("sitsmesh", "envoyproxy", "both")),
    "ratelimit_expiration_jitter_seconds": values.int_range(0, 86_400),
    "shared_runtime": values.choice(("off", "redis")),
    "rlqs_assignment_ttl_s": values.int_range(6, 3600),
    "rlqs_addr": optional_address,
    "admission": values.choice(("calls", "rlqs")),
    "reload_interval_seconds": values.seconds,
    "authz_api_key_headers": values.header_names,
    "authz_peer_tenants": values.mapping,
    "authz_jwt_header": values.header_name,
    "authz_jwt_tenant_claim": values.string,
    "authz_priority_header": values.header_name,
    "admission_hold_seconds": values.seconds,
    "token_budget_hold_seconds": values.seconds,
    "budget_charging": values.choice(("reserve", "charge_after")),
    "budget_required": values.boolean,
    "budget_tokenizers": values.mapping,
    "stream_check_methods": streamcheck.parse_methods,
    "stream_check_deadline_seconds": streamcheck.parse_deadline,
    "stream_check_fail_mode": values.choice(("closed", "open")),
    "chain_ttl_seconds": values.seconds,
    "pressure_scrape_seconds": values.seconds,
    "pressure_stale_seconds": values.seconds,
    "triton": tritonsettings.endpoints,
    "triton_url": values.grpc_target,
    "triton_metrics_url": values.http_url,
    "triton_preflight_url": values.grpc_target,
    **LIMIT_PARSERS,
    # transport security
    "data_tls_cert_file": values.path,
    "data_tls_key_file": values.path,
    "data_tls_client_ca_file": values.path,
    "data_callers": callers,
    "admin_tls_cert_file": values.path,
    "admin_tls_key_file": values.path,
    "admin_tls_client_ca_file": values.path,
    "admin_clients": identities,
    "admin_insecure": values.boolean,
    "tls_min_version": values.choice(TLS_VERSIONS),
    "redis_password_file": values.path,
    # authz request-path policy: README "Request-path policy"
    "authz_jwt_trusted_principals": values.strings,
    "authz_trust_pipeline_hint": values.boolean,
    "authz_open_paths": lambda raw: tuple(map(open_path, values.strings(raw))),
    "authz_jwt_metadata_key": values.string,
    "authz_methods": methods.parse,
    # state backend: README "State backends"
    "state_url": values.state_url,
    # observability: README "Operations"
    "decision_log": values.choice(("off", "denials", "all")),
    "decision_log_sample": values.fraction,
    "decision_log_max_per_s": values.int_range(1, 100_000),
    "decision_log_headers": lambda raw: values.header_names(raw) if raw else (),
    "decision_log_mask": values.strings,
    "metrics_max_tenants": values.int_range(1, 10_000),
    # tracing (OpenTelemetry): README "Tracing"
    "otlp_endpoint": values.otlp_endpoint,
    "otlp_ca_file": values.path,
    "trace_sample_ratio": values.fraction,
    # Gateway API Inference Extension headers: README "Inference Extension headers"
    "gie_headers": values.boolean,
    "gie_objective_header": gie.header,
    "gie_fairness_header": gie.header,
    "gie_objective_label": values.string,
    "gie_priority_objectives": gie.priority_objectives,
    # admin access (per-team RBAC): README "Admin credentials and roles"
    "admin_credentials": values.path,
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

    # envoyproxy/ratelimit's variable names, below SITSMESH_* (see ratelimitenv).
    reference = ratelimitenv.read(env)
    config_raw = flags.get("config") or env.get(env_name("config"))
    config_file = Path(config_raw).expanduser() if config_raw else None
    file_values = _read_file(config_file) if config_file else {}

    values: dict[str, Any] = {}
    for key, parse in PARSERS.items():
        if key in flags:
            raw, source = flags[key], flag_name(key)
        elif env_name(key) in env:
            raw, source = env[env_name(key)], f"environment {env_name(key)}"
        elif key in reference:
            raw, source = reference[key]
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
    if settings.rlqs_addr in (settings.data_addr, settings.admin_addr, settings.metrics_addr):
        raise ConfigError(f"rlqs_addr: {settings.rlqs_addr} is another server's; give RLQS its own")
    if settings.gie_objective_header == settings.gie_fairness_header:
        raise ConfigError("gie_objective_header and gie_fairness_header name the same "
                          f"header {settings.gie_fairness_header}; give each its own")
    return settings


def describe(settings: Settings) -> dict[str, str]:
    """Settings as plain strings, for logs and status output (holds no secrets)."""
    hidden = {"redis_url"}  # may carry a password
    out = {f.name: str(getattr(settings, f.name)) for f in fields(settings)
           if f.name not in hidden}
    out["state_url"] = values.redact_url(settings.state_url)  # may carry a password
    return out
