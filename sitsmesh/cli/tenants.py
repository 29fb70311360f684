"""`sitsmesh tenants ...` and `sitsmesh apikeys ...`: who may call which models (admin API)."""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from collections.abc import Sequence
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.cli.common import (
    Subcommands,
    UsageError,
    add_common_admin,
    all_pages,
    call_admin,
    examples,
    message_dict,
    render,
    table,
)


def add_commands(sub: Subcommands) -> None:
    tenants = sub.add_parser("tenants", help="manage tenants (admin API)", **examples(
        "sitsmesh tenants create acme --models 'llama-*,bert' --priority 2 --label team=ml",
        "sitsmesh tenants list -o yaml",
        "sitsmesh tenants usage acme -o json")).add_subparsers(
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
    p = tenants.add_parser("usage", help="what each limit of the tenant's TokenBudget has "
                           "used and has left in its current window")
    p.add_argument("name")
    add_common_admin(p)
    p.set_defaults(func=cmd_tenants)

    keys = sub.add_parser("apikeys", help="manage API keys (admin API)", **examples(
        "sitsmesh apikeys create --tenant acme --name ci --expires 30d",
        "sitsmesh apikeys list --tenant acme",
        "sitsmesh apikeys revoke 8a4c6f1fa1d1")).add_subparsers(
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


def parse_labels(pairs: Sequence[str] | None) -> dict[str, str]:
    labels = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--label wants KEY=VALUE, got {pair!r}")
        labels[key] = value
    return labels


TENANT_COLUMNS = ("NAME", "MODELS", "PRIORITY", "MAX_PRIORITY", "MAX_CONCURRENCY", "LABELS")


def tenant_table(tenants: Sequence[Any]) -> str:
    rows = [TENANT_COLUMNS]
    rows += [(t.name, ",".join(t.models), str(t.priority), str(t.max_priority),
              str(t.max_concurrency), ",".join(f"{k}={v}" for k, v in sorted(t.labels.items())))
             for t in tenants]
    return table(rows)


def _show_tenant(args: argparse.Namespace, tenant: Any) -> None:
    render(args, message_dict(tenant), lambda: tenant_table([tenant]))


def cmd_tenants(args: argparse.Namespace) -> int:
    action = args.tenants_command
    if action in ("create", "update"):
        tenant = admin_pb2.Tenant(name=args.name)
        if action == "update":
            tenant = call_admin(args, "GetTenant",
                                admin_pb2.GetTenantRequest(name=args.name)).tenant
        if args.models is not None:
            del tenant.models[:]
            tenant.models.extend(m for m in args.models.split(",") if m)
        for field in ("priority", "max_priority", "max_concurrency"):
            if getattr(args, field) is not None:
                setattr(tenant, field, getattr(args, field))
        if args.label:
            tenant.labels.update(parse_labels(args.label))
        if action == "create":
            reply = call_admin(args, "CreateTenant", admin_pb2.CreateTenantRequest(tenant=tenant))
        else:
            reply = call_admin(args, "UpdateTenant", admin_pb2.UpdateTenantRequest(tenant=tenant))
        _show_tenant(args, reply.tenant)
    elif action == "get":
        _show_tenant(args, call_admin(args, "GetTenant",
                                      admin_pb2.GetTenantRequest(name=args.name)).tenant)
    elif action == "usage":
        reply = call_admin(args, "GetTokenUsage",
                           admin_pb2.GetTokenUsageRequest(tenant=args.name))
        render(args, usage_doc(reply), lambda: usage_table(reply))
    elif action == "list":
        reply = all_pages(lambda r: call_admin(args, "ListTenants", r),
                          admin_pb2.ListTenantsRequest(), "tenants")
        render(args, message_dict(reply), lambda: tenant_table(reply.tenants))
    else:
        call_admin(args, "DeleteTenant", admin_pb2.DeleteTenantRequest(name=args.name))
        render(args, {"deleted": {"tenant": args.name}}, f"deleted tenant {args.name}")
    return 0


def usage_doc(reply: Any) -> dict[str, Any]:
    # By hand: MessageToDict spells uint64 as strings, and drops zero counts.
    return {"tenant": reply.tenant, "truncated": reply.truncated, "usage": [
        {"limit_index": u.limit_index, "per": u.per, "each": u.each, "tokens": u.tokens,
         "models": list(u.models), "subject": u.subject, "used": u.used,
         "remaining": u.remaining, "reset_s": u.reset_s} for u in reply.usage]}


def usage_table(reply: Any) -> str:
    rows = [("LIMIT", "PER", "EACH", "SUBJECT", "TOKENS", "USED", "REMAINING", "RESET_S",
             "MODELS")]
    rows += [(str(u.limit_index), u.per, u.each, u.subject, str(u.tokens), str(u.used),
              str(u.remaining), f"{u.reset_s:.1f}", ",".join(u.models)) for u in reply.usage]
    more = (f"\n(the first {len(reply.usage)} counters; the tenant has more)"
            if reply.truncated else "")
    return table(rows) + more


def parse_expiry(text: str) -> float:
    """'30d', '12h', '90m' from now, or an ISO 8601 time."""
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    if text[:-1].isdigit() and text[-1:] in units:
        return time.time() + int(text[:-1]) * units[text[-1]]
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(f"--expires wants 30d, 12h, 90m or an ISO 8601 time, got {text!r}"
                         ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def cmd_apikeys(args: argparse.Namespace) -> int:
    action = args.apikeys_command
    if action == "create":
        request = admin_pb2.CreateApiKeyRequest(tenant=args.tenant, name=args.name or "")
        if args.expires:
            stamp = Timestamp()
            stamp.FromNanoseconds(int(parse_expiry(args.expires) * 1e9))
            request.expires_at.CopyFrom(stamp)
        reply = call_admin(args, "CreateApiKey", request)
        # The secret alone on stdout (for $(...)); what it is goes to stderr.
        render(args, {"key": reply.secret, "id": reply.key.id}, reply.secret)
        if args.output == "table":
            print(f"(key id {reply.key.id} for tenant {reply.key.tenant}; the key is shown "
                  "only now)", file=sys.stderr)
    elif action == "list":
        reply = all_pages(lambda r: call_admin(args, "ListApiKeys", r),
                          admin_pb2.ListApiKeysRequest(tenant=args.tenant or ""), "keys")
        render(args, message_dict(reply), lambda: apikey_table(reply.keys))
    else:
        key = call_admin(args, "RevokeApiKey", admin_pb2.RevokeApiKeyRequest(id=args.id)).key
        render(args, message_dict(key), f"revoked key {key.id} of tenant {key.tenant}")
    return 0


def apikey_table(keys: Sequence[Any]) -> str:
    rows = [("ID", "TENANT", "STATE", "EXPIRES", "NAME")]
    rows += [(k.id, k.tenant, "revoked" if k.revoked else "active",
              k.expires_at.ToJsonString() if k.HasField("expires_at") else "never", k.name)
             for k in keys]
    return table(rows)
