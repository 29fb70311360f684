"""`sitsmesh ratelimit ...`: check rate-limit configs offline; apply, get, delete them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.cli.common import (
    EXIT_FAILED,
    Subcommands,
    UsageError,
    add_common_admin,
    call_admin,
    die,
    examples,
    message_dict,
    read_text,
    render,
)


def add_commands(sub: Subcommands) -> None:
    rl = sub.add_parser("ratelimit", help="rate-limit configs", **examples(
        "sitsmesh ratelimit check config/ratelimit/",
        "sitsmesh ratelimit apply --dry-run config/ratelimit/models.yaml",
        "sitsmesh ratelimit get -o yaml")).add_subparsers(
        dest="ratelimit_command", required=True)
    check = rl.add_parser("check", help="validate config files offline; exit 1 if any is bad")
    check.add_argument("paths", nargs="+", metavar="PATH")
    check.add_argument("--merge-domain-config", action="store_true",
                       help="files naming one domain add their top-level descriptors "
                            "together (as serve's ratelimit_merge_domain_config)")
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
        rlconfig.build(good, merge=args.merge_domain_config)
    except ConfigError as exc:
        print(exc.message)
        failed = True
    return EXIT_FAILED if failed else 0


def cmd_ratelimit_apply(args: argparse.Namespace) -> int:
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
    render(args, message_dict(reply, all_fields=True),
           f"{verb}: {', '.join(reply.domains)}; config version {reply.config_version}")
    return 0


def cmd_ratelimit_get(args: argparse.Namespace) -> int:
    reply = call_admin(args, "GetRateLimitConfig", admin_pb2.GetRateLimitConfigRequest())
    render(args, message_dict(reply), lambda: "\n".join(
        [f"# config version {reply.config_version}"]
        + [f"---\n# domain {d.domain} from {d.source}\n{d.yaml.rstrip()}"
           for d in reply.domains]))
    return 0


def cmd_ratelimit_delete(args: argparse.Namespace) -> int:
    call_admin(args, "DeleteRateLimitConfig",
               admin_pb2.DeleteRateLimitConfigRequest(domain=args.domain))
    render(args, {"deleted": {"domain": args.domain}}, f"deleted domain {args.domain}")
    return 0
