"""`sitsmesh serve`: run the control plane, with a flag for every setting."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil

from sitsmesh.cli.common import Subcommands, env_argument, examples, settings_from
from sitsmesh.config import PARSERS, env_name, flag_name

# sitsmesh.app.server (and prometheus_client with it) is imported by cmd_serve only, once
# PROMETHEUS_MULTIPROC_DIR is set: importing it here would be too early.

_FLAG_HELP = {
    "data_addr": "data-plane gRPC address (Envoy-facing services, health, reflection), "
                 "HOST:PORT or unix:/PATH",
    "admin_addr": "admin gRPC address",
    "metrics_addr": "Prometheus /metrics HTTP address",
    "state_dir": "directory for the state database and the admin token",
    "state_url": "state store: sqlite:///ABS/PATH or postgresql://USER@HOST:PORT/DB "
                 "(default: SQLite in --state-dir; password: PGPASSWORD or ~/.pgpass)",
    "log_level": "debug, info, warning or error",
    "log_format": "auto (JSON unless stderr is a terminal), json or console",
    "workers": "data-plane processes sharing data_addr through SO_REUSEPORT",
    "drain_seconds": "seconds to keep answering after health goes NOT_SERVING",
    "grace_seconds": "seconds in-flight RPCs get once the listeners close",
    "admin_token_file": "admin token file (default: STATE_DIR/admin-token); at least 32 "
                        "random bytes",
    "ratelimit_config": "rate-limit config file or directory (repeatable)",
    "ratelimit_store": "counter store: memory (per process) or redis (shared)",
    "redis_url": "redis://HOST:PORT/DB for shared state, or a Redis Cluster as "
                 "redis+cluster://HOST:PORT[,HOST:PORT...] (password: use "
                 "--redis-password-file)",
    "redis_timeout_ms": "bound on each Redis round trip (default 50)",
    "on_store_error": "when Redis fails: allow, deny, or local (per-replica counting)",
    "store_replicas": "replica count that divides limits under on_store_error=local",
    "ratelimit_shadow_mode": "true: log and count over-limit decisions, never enforce",
    "ratelimit_merge_domain_config": "true: files naming one domain add their top-level "
                                     "descriptors together (envoyproxy/ratelimit's "
                                     "MERGE_DOMAIN_CONFIG)",
    "ratelimit_response_headers": "true: answers with a limit carry RateLimit-Limit, "
                                  "-Remaining and -Reset (envoyproxy/ratelimit's "
                                  "LIMIT_RESPONSE_HEADERS_ENABLED)",
    "ratelimit_response_dynamic_metadata": "true: answers carry Envoy dynamic metadata "
                                           "(domain, descriptors, merged config metadata; "
                                           "envoyproxy/ratelimit's RESPONSE_DYNAMIC_METADATA)",
    "ratelimit_max_descriptors": "most descriptors one ShouldRateLimit may carry",
    "ratelimit_quota_mode": "true: every descriptor is in quota mode (QUOTA_MODE)",
    "ratelimit_stop_increment_when_over": "true: a request that goes over counts only on "
                                          "the descriptors that went over "
                                          "(STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT)",
    "ratelimit_near_limit_ratio": "share of a limit past which hits count as near_limit "
                                  "(NEAR_LIMIT_RATIO, default 0.8)",
    "ratelimit_count_rejected_hits": "false: a fixed-window hit that is over the limit is "
                                     "not counted (the default counts it, as the reference)",
    "ratelimit_require_config": "true: refuse to start when the rate-limit config does not "
                                "load (the default serves and answers each call with an error)",
    "ratelimit_healthy_requires_config": "true: health is NOT_SERVING until a config with at "
                                         "least one domain is live "
                                         "(HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED)",
    "ratelimit_limit_header": "name of the limit header (LIMIT_LIMIT_HEADER)",
    "ratelimit_remaining_header": "name of the remaining header (LIMIT_REMAINING_HEADER)",
    "ratelimit_reset_header": "name of the reset header (LIMIT_RESET_HEADER)",
    "decision_log": "decision log of ext_authz and rate-limit decisions: off (default), "
                    "denials, or all",
    "decision_log_sample": "share of decisions the decision log keeps (0-1, default 1)",
    "decision_log_max_per_s": "most decision-log records a second; the rest are counted "
                              "and dropped (default 100)",
    "decision_log_headers": "request headers the decision log shows (comma-separated; "
                            "credentials among them are masked)",
    "decision_log_mask": "more header names and descriptor keys whose values the decision "
                         "log masks (comma-separated)",
    "metrics_max_tenants": "tenants with their own label in sitsmesh_authz_decisions_total; "
                           "the rest count as other (default 100)",
    "ratelimit_metric_names": "rate-limit metric names: sitsmesh, envoyproxy "
                              "(ratelimit_service_rate_limit_*) or both (default)",
    "shared_runtime": "redis: replicas and workers share latency-chain hops and admission-hold "
                      "releases through redis_url (off: each process keeps its own)",
    "admission": "who sheds on backpressure: calls (Check and ShouldRateLimit answer 429) or "
                 "rlqs (Envoy's rate_limit_quota filter, on quotas sitsmesh assigns; Check "
                 "then only counts)",
    "rlqs_addr": "serve RLQS here, from a process of its own, so its work never delays "
                 "Check (empty: on data_addr, in the data process; for more than ~30 Envoys "
                 "use it)",
    "rlqs_assignment_ttl_s": "seconds an RLQS quota assignment lasts in Envoy without a "
                             "renewal (Envoy reports every 5 s; sitsmesh renews on each)",
    "ratelimit_expiration_jitter_seconds": "random extra seconds [0, N) on Redis counter "
                                           "expiry (EXPIRATION_JITTER_MAX_SECONDS)",
    "reload_interval_seconds": "how often config files and applied configs are checked",
    "authz_api_key_headers": "headers that may carry an API key (comma-separated)",
    "authz_peer_tenants": "SPIFFE principal=tenant pairs for mTLS callers (comma-separated)",
    "authz_jwt_header": "header with Istio's verified JWT payload (trusted principals only)",
    "authz_jwt_tenant_claim": "JWT claim that names the tenant",
    "authz_priority_header": "header a caller uses to ask for a priority",
    "admission_hold_seconds": "how long a request counts against a concurrency cap at most",
    "token_budget_hold_seconds": "how long a token-budget reservation waits for its "
                                 "stream's end before it is charged at its estimate",
    "budget_tokenizers": "model glob=path to a Hugging Face tokenizer.json (comma-separated): "
                         "prompts of those models counted in their own tokens",
    "budget_required": "true: LLM calls of a tenant with no TokenBudget are refused (403); "
                       "false: unlimited in tokens",
    "budget_charging": "reserve (the estimate at Check) or charge_after (only what "
                         "streams produced, when they end: overshoots by what is in flight)",
    "authz_jwt_trusted_principals": "mesh principals whose JWT-payload header is read "
                                    "(comma-separated; default none: header ignored)",
    "authz_trust_pipeline_hint": "true: a known x-sits-pipeline-hint picks the pipeline "
                                 "(only where the edge sets or strips it)",
    "authz_open_paths": "non-model paths any identified tenant may call (comma-separated)",
    "authz_methods": "HTTP methods per route family, the rest get 405: e.g. "
                     "inference=POST,metadata=GET|HEAD,health=GET|HEAD,open=GET|HEAD|POST "
                     "(those are the defaults; families not named keep theirs)",
    "authz_jwt_metadata_key": "payload_in_metadata of Envoy's jwt_authn: read its verified "
                              "payload from the Check's metadata_context",
    "stream_check_methods": "gRPC streaming methods checked message by message, with "
                            "the field of their model name: /pkg.Service/Method=FIELD,...",
    "stream_check_deadline_seconds": "how long one message of a checked stream may take "
                                     "to arrive whole",
    "stream_check_fail_mode": "a message past that deadline: closed ends the stream, "
                              "open forwards it unchecked",
    "chain_ttl_seconds": "how long a latency chain waits for its missing hops",
    "pressure_scrape_seconds": "how often Triton's /metrics is scraped (default 0.25)",
    "pressure_stale_seconds": "a stage signal older than this counts as saturated (default 1)",
    "triton": "Triton endpoints as a JSON list of {name, url, metrics_url, preflight_url}",
    "triton_url": "gRPC HOST:PORT of the one Triton server (endpoint 'default')",
    "triton_metrics_url": "its http://HOST:PORT/metrics",
    "triton_preflight_url": "gRPC HOST:PORT of a sandbox Triton that vets candidates first",
    # limits
    "max_message_bytes": "largest gRPC message the data port accepts (access-log, metrics)",
    "max_check_message_bytes": "largest Check (headers + body); bigger ones: a 413 deny, unparsed",
    "max_ratelimit_message_bytes": "largest ShouldRateLimit request (RESOURCE_EXHAUSTED)",
    "max_concurrent_rpcs": "data-port RPCs at once, streams included; more: RESOURCE_EXHAUSTED",
    "max_streams_per_connection": "HTTP/2 streams one data-port connection may have open at once",
    "check_max_headers": "more request headers in a Check get a 431 deny",
    "check_max_header_bytes": "more header bytes (names + values) in a Check get a 431 deny",
    "ratelimit_max_entries": "most entries one rate-limit descriptor may carry",
    "ratelimit_max_key_length": "longest descriptor entry key (characters)",
    "ratelimit_max_value_length": "longest descriptor entry value (characters)",
    "ratelimit_max_hits_addend": "largest hits_addend a ShouldRateLimit may ask for",
    "ratelimit_cache_bytes": "memory bound of the descriptor match cache",
    "ratelimit_store_bytes": "memory bound of the in-process counter store",
    "request_id_max_length": "access-log entries with a longer request id are dropped",
    "chain_max_bytes": "memory bound of open latency chains (oldest evicted first)",
    "inflight_budget_bytes": "request bytes held at once across every RPC and stream, admin "
                             "included; past it: RESOURCE_EXHAUSTED (0: 1/8 of the memory "
                             "limit)",
    "large_message_lag_ms": "while the event loop is this far behind, messages over 64 KiB "
                            "are refused (unary: RESOURCE_EXHAUSTED, Check: 503) or wait "
                            "(streams)",
    # transport security
    "data_tls_cert_file": "PEM certificate chain: the data plane serves TLS (reloaded when "
                          "the file changes)",
    "data_tls_key_file": "PEM private key of --data-tls-cert-file",
    "data_tls_client_ca_file": "PEM CA bundle: the data plane requires client certificates "
                               "it signed (mTLS)",
    "data_callers": "who may call each data-plane service, by client certificate SAN or "
                    "SPIFFE id: authz=ID|ID,ratelimit=ID,accesslog=ID,metrics=ID "
                    "(needs mTLS)",
    "admin_tls_cert_file": "PEM certificate chain: the admin API serves TLS (reloaded)",
    "admin_tls_key_file": "PEM private key of --admin-tls-cert-file",
    "admin_tls_client_ca_file": "PEM CA bundle: admin callers need a client certificate "
                                "it signed, besides the token",
    "admin_clients": "client certificate SANs / SPIFFE ids allowed to call the admin API "
                     "(comma-separated; needs mTLS)",
    "admin_insecure": "true: serve the admin API without TLS on a non-loopback address "
                      "(the token crosses the network in clear)",
    "tls_min_version": "oldest TLS version the data and admin ports accept: 1.2 (default) or "
                       "1.3 (a TLS 1.2 handshake is refused)",
    "redis_password_file": "file holding the Redis password (keeps it out of argv and "
                           "--redis-url)",
    # tracing (OpenTelemetry): README "Tracing"
    "otlp_endpoint": "OTLP/gRPC receiver for traces: http://HOST:PORT (plaintext) or "
                     "https://HOST:PORT (TLS); empty (default): tracing off",
    "otlp_ca_file": "PEM CA bundle that signed an https:// OTLP receiver's certificate "
                    "(default: the system's)",
    "trace_sample_ratio": "share of root traces (no sampled traceparent) recorded, 0..1 "
                          "(default 1); a traceparent's sampled flag always wins",
    # Gateway API Inference Extension headers: README "Inference Extension headers"
    "gie_headers": "false: neither set nor strip the inference extension's objective and "
                   "fairness-id headers (default true: sitsmesh decides both)",
    "gie_objective_header": "header naming the InferenceObjective "
                            "(default x-gateway-inference-objective)",
    "gie_fairness_header": "header carrying the tenant as fairness id "
                           "(default x-gateway-inference-fairness-id)",
    "gie_objective_label": "tenant label naming its InferenceObjective "
                           "(default inference-objective; wins over the priority map)",
    "gie_priority_objectives": "priority=objective pairs (comma-separated): a request gets "
                               "the objective of the highest priority at or below its own",
    # admin access (per-team RBAC): README "Admin credentials and roles"
    "admin_credentials": "YAML file of named admin credentials with roles (viewer, operator, "
                         "admin); reloaded when it changes or on SIGHUP. Unset: the one admin "
                         "token",
}


def add_commands(sub: Subcommands) -> None:
    serve = sub.add_parser("serve", help="run the control plane", **examples(
        "sitsmesh serve --config sitsmesh.yaml",
        "sitsmesh serve --workers 4 --ratelimit-config config/ratelimit/",
        "SITSMESH_LOG_LEVEL=debug sitsmesh serve --data-addr 0.0.0.0:50051"))
    env_argument(serve, "--config", env="SITSMESH_CONFIG", help="YAML config file")
    # Not env_argument: load_settings layers SITSMESH_* over the config file (and over
    # envoyproxy/ratelimit's names) itself, and names the variable in its errors.
    for key in PARSERS:
        action = "append" if key == "ratelimit_config" else "store"
        serve.add_argument(flag_name(key), dest=key, action=action,
                           help=f"{_FLAG_HELP[key]} (or {env_name(key)})")
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from sitsmesh import tlsversion
    from sitsmesh.transport.budget import tune_allocator

    tune_allocator()  # first: before gRPC's threads make their heaps
    settings = settings_from(args, list(PARSERS))
    # Before anything imports grpc: it reads the TLS floor once, at import.
    tlsversion.require(settings.tls_min_version, "tls_min_version")
    from sitsmesh import logs
    from sitsmesh.app import preflight, tls
    from sitsmesh.ratelimit import config as rlconfig

    tls.check_transport(settings)
    if settings.admin_credentials is not None:  # a bad file stops the start here
        from sitsmesh import access
        access.load(settings.admin_credentials)
    for side in ("data", "admin"):
        tls.cert_files(settings, side)  # unreadable or mismatched files stop the start here
    tls.redis_url(settings)
    preflight.check_all(settings)
    if settings.ratelimit_require_config:
        # A bad file stops the start, before any port opens. (By default, as
        # envoyproxy/ratelimit, sitsmesh serves and answers each call with an error.)
        rlconfig.load(settings.ratelimit_config, merge=settings.ratelimit_merge_domain_config)
    logs.configure(settings.log_level, settings.log_format)
    children = settings.workers > 1 or settings.rlqs_addr is not None
    if children and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Must be set before prometheus_client is imported (server imports it).
        mp_dir = settings.state_dir / "prometheus-multiproc"
        shutil.rmtree(mp_dir, ignore_errors=True)
        mp_dir.mkdir(mode=0o700)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(mp_dir)
    from sitsmesh.app import server

    return asyncio.run(server.run(settings))
