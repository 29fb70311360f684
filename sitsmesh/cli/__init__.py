"""The `sitsmesh` command: `serve` runs the control plane; the rest speak to a running one."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sitsmesh import __version__
from sitsmesh.cli.common import (
    EXIT_FAILED,
    RpcFailed,
    UsageError,
    add_common_admin,
    call_admin,
    die,
    message_dict,
    print_json,
    read_text,
    settings_from,
)
from sitsmesh.config import PARSERS, flag_name
from sitsmesh.errors import SitsmeshError

_FLAG_HELP = {
    "data_addr": "data-plane gRPC address (Envoy-facing services, health, reflection)",
    "admin_addr": "admin gRPC address",
    "metrics_addr": "Prometheus /metrics HTTP address",
    "state_dir": "directory for the state database and the admin token",
    "log_level": "debug, info, warning or error",
    "log_format": "auto (JSON unless stderr is a terminal), json or console",
    "workers": "data-plane processes sharing data_addr through SO_REUSEPORT",
    "drain_seconds": "seconds to keep answering after health goes NOT_SERVING",
    "grace_seconds": "seconds in-flight RPCs get once the listeners close",
    "admin_token_file": "admin token file (default: STATE_DIR/admin-token)",
    "ratelimit_config": "rate-limit config file or directory (repeatable)",
    "ratelimit_store": "counter store: memory (per process) or redis (shared)",
    "redis_url": "redis://HOST:PORT/DB for --ratelimit-store redis",
    "redis_timeout_ms": "bound on each Redis round trip (default 50)",
    "on_store_error": "when Redis fails: allow, deny, or local (per-replica counting)",
    "store_replicas": "replica count that divides limits under on_store_error=local",
    "ratelimit_shadow_mode": "true: log and count over-limit decisions, never enforce",
    "ratelimit_max_descriptors": "most descriptors one ShouldRateLimit may carry",
    "reload_interval_seconds": "how often config files and applied configs are checked",
    "authz_api_key_headers": "headers that may carry an API key (comma-separated)",
    "authz_peer_tenants": "SPIFFE principal=tenant pairs for mTLS callers (comma-separated)",
    "authz_jwt_header": "header with Istio's verified JWT payload (trusted from mesh peers)",
    "authz_jwt_tenant_claim": "JWT claim that names the tenant",
    "authz_priority_header": "header a caller uses to ask for a priority",
    "admission_hold_seconds": "how long a request counts against a concurrency cap at most",
    "chain_ttl_seconds": "how long a latency chain waits for its missing hops",
    "pressure_scrape_seconds": "how often Triton's /metrics is scraped (default 0.25)",
    "pressure_stale_seconds": "a stage signal older than this counts as saturated (default 1)",
    "triton": "Triton endpoints as a JSON list of {name, url, metrics_url, preflight_url}",
    "triton_url": "gRPC HOST:PORT of the one Triton server (endpoint 'default')",
    "triton_metrics_url": "its http://HOST:PORT/metrics",
    "triton_preflight_url": "gRPC HOST:PORT of a sandbox Triton that vets candidates first",
}


def cmd_serve(args: argparse.Namespace) -> int:
    from sitsmesh import logs, preflight
    from sitsmesh.ratelimit import config as rlconfig

    settings = settings_from(args, list(PARSERS))
    preflight.check_all(settings)
    rlconfig.load(settings.ratelimit_config)  # a bad file stops the start, before any port
    logs.configure(settings.log_level, settings.log_format)
    if settings.workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Must be set before prometheus_client is imported (server imports it).
        mp_dir = settings.state_dir / "prometheus-multiproc"
        shutil.rmtree(mp_dir, ignore_errors=True)
        mp_dir.mkdir(mode=0o700)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(mp_dir)
    from sitsmesh import server

    return asyncio.run(server.run(settings))


def cmd_status(args: argparse.Namespace) -> int:
    from sitsmesh.admin.v1 import admin_pb2

    reply = call_admin(args, "GetStatus", admin_pb2.GetStatusRequest())
    if args.output == "json":
        print(json.dumps(message_dict(reply, all_fields=True), indent=2, sort_keys=True))
        return 0
    names = {v: k for k, v in admin_pb2.ServingState.items()}
    print(f"sitsmesh {reply.version}   uptime {reply.uptime_seconds:.1f}s   "
          f"config {reply.config_version}   state revision {reply.state_revision}")
    print(f"data {reply.data_addr}   admin {reply.admin_addr}   metrics {reply.metrics_addr}")
    print()
    rows = [("SERVICE", "SERVER", "STATE")]
    rows += [(s.name or "(server)", s.server, names[s.state]) for s in reply.services]
    width = max(len(r[0]) for r in rows)
    for name, server_name, state in rows:
        print(f"{name:<{width}}  {server_name:<6}  {state}")
    if reply.workers:
        print()
        print("WORKER  PID      ALIVE  RESTARTS")
        for w in reply.workers:
            print(f"{w.index:<6}  {w.pid:<7}  {'yes' if w.alive else 'no':<5}  {w.restarts}")
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(args.addr) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as exc:
            return die(f"health check on {args.addr}: {exc.code().name}: {exc.details()}",
                       EXIT_FAILED)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else EXIT_FAILED


def cmd_ratelimit_check(args: argparse.Namespace) -> int:
    """Validate files offline: each alone, then all together (domains, replaces)."""
    from sitsmesh.errors import ConfigError
    from sitsmesh.ratelimit import config as rlconfig

    failed = False
    good: list[tuple[str, str]] = []
    paths = rlconfig.expand(Path(p) for p in args.paths)
    if not paths:
        print("sitsmesh: error: no config files found", file=sys.stderr)
        return EXIT_FAILED
    for path in paths:
        try:
            (item,) = rlconfig.read_files([path])
            domain, _ = rlconfig.parse_domain(*item)
        except ConfigError as exc:
            print(exc.message)
            failed = True
            continue
        good.append(item)
        print(f"{path}: ok (domain '{domain}')")
    try:
        rlconfig.build(good)
    except ConfigError as exc:
        print(exc.message)
        failed = True
    return EXIT_FAILED if failed else 0


def cmd_ratelimit_apply(args: argparse.Namespace) -> int:
    from sitsmesh.admin.v1 import admin_pb2

    files = []
    for name in args.files:
        path = Path(name)
        try:
            files.append(admin_pb2.RateLimitConfigFile(name=path.name, yaml=read_text(path)))
        except UsageError as exc:  # an unreadable file fails `apply` (1), not usage (2)
            return die(str(exc), EXIT_FAILED)
    reply = call_admin(args, "ApplyRateLimitConfig", admin_pb2.ApplyRateLimitConfigRequest(
        files=files, dry_run=args.dry_run))
    verb = "applied" if reply.applied else "valid (dry run, nothing changed)"
    print(f"{verb}: {', '.join(reply.domains)}; config version {reply.config_version}")
    return 0


def cmd_ratelimit_get(args: argparse.Namespace) -> int:
    from sitsmesh.admin.v1 import admin_pb2

    reply = call_admin(args, "GetRateLimitConfig", admin_pb2.GetRateLimitConfigRequest())
    if args.output == "json":
        print_json(reply)
        return 0
    print(f"# config version {reply.config_version}")
    for domain in reply.domains:
        print(f"---\n# domain {domain.domain} from {domain.source}\n{domain.yaml.rstrip()}")
    return 0


def cmd_ratelimit_delete(args: argparse.Namespace) -> int:
    from sitsmesh.admin.v1 import admin_pb2

    call_admin(args, "DeleteRateLimitConfig",
               admin_pb2.DeleteRateLimitConfigRequest(domain=args.domain))
    print(f"deleted domain {args.domain}")
    return 0


def _labels(pairs: Sequence[str] | None) -> dict[str, str]:
    labels = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--label wants KEY=VALUE, got {pair!r}")
        labels[key] = value
    return labels


def _show_tenant(args: argparse.Namespace, tenant: Any) -> None:
    if args.output == "json":
        print_json(tenant)
        return
    labels = ",".join(f"{k}={v}" for k, v in sorted(tenant.labels.items()))
    print(f"{tenant.name}  models={','.join(tenant.models)}  priority={tenant.priority}  "
          f"max_priority={tenant.max_priority}  max_concurrency={tenant.max_concurrency}"
          + (f"  labels={labels}" if labels else ""))


def cmd_tenants(args: argparse.Namespace) -> int:
    from sitsmesh.admin.v1 import admin_pb2

    action = args.tenants_command
    if action in ("create", "update"):
        tenant = admin_pb2.Tenant(name=args.name)
        if action == "update":
            tenant = call_admin(args, "GetTenant", admin_pb2.GetTenantRequest(name=args.name))
        if args.models is not None:
            del tenant.models[:]
            tenant.models.extend(m for m in args.models.split(",") if m)
        for field in ("priority", "max_priority", "max_concurrency"):
            if getattr(args, field) is not None:
                setattr(tenant, field, getattr(args, field))
        if args.label:
            tenant.labels.update(_labels(args.label))
        rpc = "CreateTenant" if action == "create" else "UpdateTenant"
        _show_tenant(args, call_admin(args, rpc, tenant))
    elif action == "get":
        _show_tenant(args, call_admin(args, "GetTenant",
                                      admin_pb2.GetTenantRequest(name=args.name)))
    elif action == "list":
        reply = call_admin(args, "ListTenants", admin_pb2.ListTenantsRequest())
        if args.output == "json":
            print_json(reply)
        for tenant in reply.tenants if args.output != "json" else []:
            _show_tenant(args, tenant)
    else:
        call_admin(args, "DeleteTenant", admin_pb2.DeleteTenantRequest(name=args.name))
        print(f"deleted tenant {args.name}")
    return 0


def _expiry(text: str) -> float:
    """'30d', '12h', '90m' from now, or an ISO 8601 time."""
    import datetime as dt
    import time as _time

    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    if text[:-1].isdigit() and text[-1:] in units:
        return _time.time() + int(text[:-1]) * units[text[-1]]
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(f"--expires wants 30d, 12h, 90m or an ISO 8601 time, got {text!r}"
                         ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def cmd_apikeys(args: argparse.Namespace) -> int:
    from google.protobuf.timestamp_pb2 import Timestamp

    from sitsmesh.admin.v1 import admin_pb2

    action = args.apikeys_command
    if action == "create":
        request = admin_pb2.CreateApiKeyRequest(tenant=args.tenant, name=args.name or "")
        if args.expires:
            stamp = Timestamp()
            stamp.FromNanoseconds(int(_expiry(args.expires) * 1e9))
            request.expires_at.CopyFrom(stamp)
        reply = call_admin(args, "CreateApiKey", request)
        if args.output == "json":
            print(json.dumps({"key": reply.secret, "id": reply.key.id}))
        else:
            print(reply.secret)
            print(f"(key id {reply.key.id} for tenant {reply.key.tenant}; the key is shown "
                  "only now)", file=sys.stderr)
    elif action == "list":
        reply = call_admin(args, "ListApiKeys", admin_pb2.ListApiKeysRequest(
            tenant=args.tenant or ""))
        if args.output == "json":
            print_json(reply)
            return 0
        print("ID            TENANT          STATE    EXPIRES               NAME")
        for key in reply.keys:
            expires = key.expires_at.ToJsonString() if key.HasField("expires_at") else "never"
            state = "revoked" if key.revoked else "active"
            print(f"{key.id:<12}  {key.tenant:<14}  {state:<7}  {expires:<20}  {key.name}")
    else:
        key = call_admin(args, "RevokeApiKey", admin_pb2.RevokeApiKeyRequest(id=args.id))
        print(f"revoked key {key.id} of tenant {key.tenant}")
    return 0


def cmd_pipelines(args: argparse.Namespace) -> int:
    from sitsmesh.admin.v1 import admin_pb2

    action = args.pipelines_command
    if action == "apply":
        path = Path(args.file)
        try:
            text = read_text(path)
        except UsageError as exc:  # an unreadable file fails `apply` (1), not usage (2)
            return die(str(exc), EXIT_FAILED)
        reply = call_admin(args, "ApplyPipeline",
                           admin_pb2.ApplyPipelineRequest(yaml=text, source=str(path)))
        print(f"applied pipeline {reply.name}")
    elif action == "get":
        reply = call_admin(args, "GetPipeline", admin_pb2.GetPipelineRequest(name=args.name))
        if args.output == "json":
            print_json(reply)
        else:
            print(reply.yaml, end="")
    elif action == "list":
        reply = call_admin(args, "ListPipelines", admin_pb2.ListPipelinesRequest())
        if args.output == "json":
            print_json(reply)
        else:
            for pipeline in reply.pipelines:
                print(pipeline.name)
    else:
        call_admin(args, "DeletePipeline", admin_pb2.DeletePipelineRequest(name=args.name))
        print(f"deleted pipeline {args.name}")
    return 0


def cmd_chain_show(args: argparse.Namespace) -> int:
    from sitsmesh.admin.v1 import admin_pb2

    reply = call_admin(args, "GetLatencyChain", admin_pb2.GetLatencyChainRequest(
        pipeline=args.pipeline, window=args.window))
    stages = []
    for s in reply.stages:
        stage: dict[str, Any] = {"name": s.name, "p50_ms": s.p50_ms, "p90_ms": s.p90_ms,
                                 "p99_ms": s.p99_ms, "attributed_ms": s.attributed_ms,
                                 "share_of_e2e_p99": s.share_of_e2e_p99}
        if s.HasField("ttfb_p99_ms"):
            stage["ttfb_p99_ms"] = s.ttfb_p99_ms
        if s.HasField("total_p99_ms"):
            stage["total_p99_ms"] = s.total_p99_ms
        if s.HasField("queue_p99_ms"):
            stage["queue_p99_ms"] = s.queue_p99_ms
        stages.append(stage)
    doc = {"pipeline": reply.pipeline, "window": reply.window, "chains": reply.chains,
           "incomplete": reply.incomplete, "failed": reply.failed,
           "e2e_p50_ms": reply.e2e_p50_ms,
           "e2e_p99_ms": reply.e2e_p99_ms, "bottleneck": reply.bottleneck, "stages": stages}
    if args.output == "json":
        print(json.dumps(doc, indent=2))
        return 0
    print(f"pipeline {reply.pipeline}, last {reply.window}: {reply.chains} chains "
          f"({reply.incomplete} incomplete); end to end p50 {reply.e2e_p50_ms:.1f} ms, "
          f"p99 {reply.e2e_p99_ms:.1f} ms; bottleneck: {reply.bottleneck or '-'}")
    print("STAGE             P50 ms   P90 ms   P99 ms  TTFB99 ms  SLOWEST-1% ms  SHARE")
    for s in stages:
        ttfb = f"{s['ttfb_p99_ms']:.1f}" if "ttfb_p99_ms" in s else "-"
        print(f"{s['name']:<16} {s['p50_ms']:>7.1f}  {s['p90_ms']:>7.1f}  {s['p99_ms']:>7.1f}  "
              f"{ttfb:>9}  {s['attributed_ms']:>13.1f}  {s['share_of_e2e_p99']:>5.0%}")
    return 0


def cmd_dev(args: argparse.Namespace) -> int:
    from sitsmesh import devstack

    serve_args = [a for a in args.serve_args if a != "--"]
    try:
        http, grpc_port, metrics = (int(p) for p in args.triton_ports.split(","))
    except ValueError:
        raise UsageError(f"--triton-ports: expected HTTP,GRPC,METRICS port numbers, got "
                         f"{args.triton_ports!r}") from None
    ports = devstack.DevPorts(args.listen_port, args.envoy_admin_port, args.upstream_port,
                              args.data_addr, http, grpc_port, metrics)
    return devstack.main(Path(args.run_dir), Path(args.filters_dir), ports, serve_args)


def _add_ratelimit_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    rl = sub.add_parser("ratelimit", help="rate-limit configs").add_subparsers(
        dest="ratelimit_command", required=True)
    check = rl.add_parser("check", help="validate config files offline; exit 1 if any is bad")
    check.add_argument("paths", nargs="+", metavar="PATH")
    check.set_defaults(func=cmd_ratelimit_check)
    apply = rl.add_parser("apply", help="validate and apply config files (admin API)")
    apply.add_argument("files", nargs="+", metavar="FILE")
    apply.add_argument("--dry-run", action="store_true", help="validate only")
    add_common_admin(apply)
    apply.set_defaults(func=cmd_ratelimit_apply)
    get = rl.add_parser("get", help="print the live rate-limit config (admin API)")
    add_common_admin(get)
    get.set_defaults(func=cmd_ratelimit_get)
    delete = rl.add_parser("delete", help="remove a domain applied through the admin API")
    delete.add_argument("domain")
    add_common_admin(delete)
    delete.set_defaults(func=cmd_ratelimit_delete)


def _add_tenant_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    tenants = sub.add_parser("tenants", help="manage tenants (admin API)").add_subparsers(
        dest="tenants_command", required=True)
    for action in ("create", "update"):
        p = tenants.add_parser(action, help=f"{action} a tenant")
        p.add_argument("name")
        p.add_argument("--models", required=action == "create", metavar="GLOB[,GLOB...]",
                       help="model name globs the tenant may call")
        p.add_argument("--priority", type=int, help="default priority (0-9)")
        p.add_argument("--max-priority", dest="max_priority", type=int,
                       help="highest priority a caller may ask for")
        p.add_argument("--max-concurrency", dest="max_concurrency", type=int,
                       help="requests in flight at once (0: no cap)")
        p.add_argument("--label", action="append", metavar="KEY=VALUE")
        add_common_admin(p)
        p.set_defaults(func=cmd_tenants)
    for action in ("get", "delete"):
        p = tenants.add_parser(action, help=f"{action} a tenant")
        p.add_argument("name")
        add_common_admin(p)
        p.set_defaults(func=cmd_tenants)
    p = tenants.add_parser("list", help="list tenants")
    add_common_admin(p)
    p.set_defaults(func=cmd_tenants)


def _add_apikey_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = sub.add_parser("apikeys", help="manage API keys (admin API)").add_subparsers(
        dest="apikeys_command", required=True)
    p = keys.add_parser("create", help="create a key; it is printed once")
    p.add_argument("--tenant", required=True)
    p.add_argument("--name", help="a label for the key")
    p.add_argument("--expires", help="30d, 12h, 90m, or an ISO 8601 time")
    add_common_admin(p)
    p.set_defaults(func=cmd_apikeys)
    p = keys.add_parser("list", help="list keys (never their secrets)")
    p.add_argument("--tenant", help="only this tenant's keys")
    add_common_admin(p)
    p.set_defaults(func=cmd_apikeys)
    p = keys.add_parser("revoke", help="revoke a key by id")
    p.add_argument("id")
    add_common_admin(p)
    p.set_defaults(func=cmd_apikeys)


def _add_chain_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    pipelines = sub.add_parser("pipelines", help="manage pipelines (admin API)").add_subparsers(
        dest="pipelines_command", required=True)
    p = pipelines.add_parser("apply", help="store a pipeline from a YAML file")
    p.add_argument("file", metavar="FILE.yaml")
    add_common_admin(p)
    p.set_defaults(func=cmd_pipelines)
    for action in ("get", "delete"):
        p = pipelines.add_parser(action, help=f"{action} a pipeline")
        p.add_argument("name")
        add_common_admin(p)
        p.set_defaults(func=cmd_pipelines)
    p = pipelines.add_parser("list", help="list pipelines")
    add_common_admin(p)
    p.set_defaults(func=cmd_pipelines)

    chain = sub.add_parser("chain", help="latency chains (admin API)").add_subparsers(
        dest="chain_command", required=True)
    p = chain.add_parser("show", help="per-stage latency and the bottleneck of a pipeline")
    p.add_argument("pipeline")
    p.add_argument("--window", choices=("1m", "5m"), default="1m")
    add_common_admin(p)
    p.set_defaults(func=cmd_chain_show)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sitsmesh", description=__doc__)
    parser.add_argument("--version", action="version", version=f"sitsmesh {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the control plane")
    serve.add_argument("--config", help="YAML config file (or SITSMESH_CONFIG)")
    for key in PARSERS:
        if key == "ratelimit_config":
            serve.add_argument(flag_name(key), dest=key, action="append", help=_FLAG_HELP[key])
        else:
            serve.add_argument(flag_name(key), dest=key, help=_FLAG_HELP[key])
    serve.set_defaults(func=cmd_serve)

    status = sub.add_parser("status", help="show a running sitsmesh's status (admin API)")
    add_common_admin(status)
    status.set_defaults(func=cmd_status)

    health = sub.add_parser("health", help="gRPC health check; exit 0 only when SERVING")
    health.add_argument("--addr", default="127.0.0.1:50051", help="data-plane HOST:PORT")
    health.add_argument("--service", default="", help="service name ('' = whole server)")
    health.add_argument("--timeout", type=float, default=3.0)
    health.set_defaults(func=cmd_health)

    _add_ratelimit_commands(sub)
    _add_tenant_commands(sub)
    _add_apikey_commands(sub)
    _add_chain_commands(sub)

    dev = sub.add_parser("dev", help="run sitsmesh with a local Envoy and demo upstream")
    dev.add_argument("--run-dir", default=".run", help="state and logs (default .run)")
    dev.add_argument("--filters-dir", default="filters", help="Envoy configs (default filters)")
    dev.add_argument("--listen-port", type=int, default=10000, help="Envoy listener port")
    dev.add_argument("--envoy-admin-port", type=int, default=9901, help="Envoy admin port")
    dev.add_argument("--upstream-port", type=int, default=18080, help="demo upstream port")
    dev.add_argument("--data-addr", default="127.0.0.1:50051", help="sitsmesh data plane")
    dev.add_argument("--triton-ports", default="18000,18001,18002", metavar="HTTP,GRPC,METRICS",
                     help="the demo Triton's ports")
    dev.add_argument("serve_args", nargs=argparse.REMAINDER,
                     help="after --: more `sitsmesh serve` flags")
    dev.set_defaults(func=cmd_dev)

    from sitsmesh.cli import models, pressure

    models.add_commands(sub)
    pressure.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except SitsmeshError as exc:
        return die(exc.message)
    except RpcFailed as exc:
        return die(str(exc), EXIT_FAILED)
    except UsageError as exc:
        return die(str(exc))
    except KeyboardInterrupt:
        return 130
    return code
