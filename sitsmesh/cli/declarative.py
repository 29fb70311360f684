"""`sitsmesh apply`, `diff`, `get` (declarative config on the admin API) and `schemas write`
(the JSON Schemas and CRDs generated from the same models)."""

from __future__ import annotations

import argparse
import getpass
import json
import socket
import sys
from pathlib import Path
from typing import Any

from sitsmesh.cli.common import (
    RpcFailed,
    Subcommands,
    UsageError,
    add_common_admin,
    add_output,
    admin_channel,
    die,
    dump,
    examples,
    message_dict,
    read_text,
    render,
    settings_from,
    table,
)

EXIT_DIFFERENT = 1  # kubectl diff's: 0 same, 1 different, above 1 an error
EXIT_DIFF_ERROR = 2
_SUFFIXES = (".yaml", ".yml", ".json")
_ACTIONS = {1: "created", 2: "configured", 3: "unchanged", 4: "pruned"}


def add_commands(sub: Subcommands) -> None:
    p = sub.add_parser("apply", help="apply declarative config files in one transaction",
                       **examples(
                           "sitsmesh apply -f config/ --dry-run",
                           "sitsmesh apply -f tenants.yaml -f pipelines.yaml",
                           "sitsmesh apply -f team-a/ --prune -l sitsmesh.io/managed-by=team-a"))
    _file_flags(p)
    p.add_argument("--dry-run", dest="dry_run", action="store_true",
                   help="validate and show the outcome; write nothing")
    add_common_admin(p)
    p.set_defaults(func=cmd_apply)

    p = sub.add_parser("diff", help="unified diff of the live config against files "
                       "(exit 1 when they differ)", **examples(
                           "sitsmesh diff -f config/",
                           "sitsmesh diff -f team-a/ --prune -l sitsmesh.io/managed-by=team-a"))
    _file_flags(p)
    add_common_admin(p)
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("get", help="the stored config as documents `apply -f` accepts",
                       **examples("sitsmesh get tenants -o yaml",
                                  "sitsmesh get pipeline checkout -o json",
                                  "sitsmesh get all -o yaml > live.yaml"))
    p.add_argument("kind", help="Tenant, ApiKeyPolicy, TokenBudget, Pipeline, Thresholds, "
                   "RateLimitConfig (any case, singular or plural), or all")
    p.add_argument("name", nargs="?", default="")
    add_common_admin(p)
    p.set_defaults(func=cmd_get)

    p = sub.add_parser("schemas", help="write the JSON Schemas and CRDs of the config kinds",
                       **examples("sitsmesh schemas write .",
                                  "sitsmesh schemas write /tmp/sitsmesh-schemas -o json"))
    p.add_argument("action", choices=("write",))
    p.add_argument("dir", nargs="?", default=".",
                   help="root to write schemas/ and deploy/crds/ under (default .)")
    add_output(p)
    p.set_defaults(func=cmd_schemas)


def _file_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--filename", dest="files", action="append", required=True,
                   metavar="FILE|DIR", help="a YAML or JSON file, a directory of them "
                   "(*.yaml, *.yml, *.json), or - for stdin; repeatable")
    p.add_argument("--prune", action="store_true",
                   help="delete labelled objects of the applied kinds the files no longer "
                   "name (needs -l)")
    p.add_argument("-l", "--selector", default="", metavar="KEY=VALUE",
                   help="the label --prune is scoped to")


def read_files(paths: list[str]) -> list[tuple[str, str]]:
    """(name, text) of every file the -f flags name, a directory's in name order."""
    found = []
    for raw in paths:
        if raw == "-":
            found.append(("<stdin>", sys.stdin.read()))
            continue
        path = Path(raw)
        files = (sorted(p for p in path.iterdir() if p.suffix in _SUFFIXES and p.is_file())
                 if path.is_dir() else [path])
        if path.is_dir() and not files:
            raise UsageError(f"{raw}: no *.yaml, *.yml or *.json files in the directory")
        found += [(str(file), read_text(file, "config file")) for file in files]
    return found


def _request(args: argparse.Namespace, dry_run: bool) -> Any:
    from sitsmesh.admin.v1 import config_pb2

    if args.prune and not args.selector:
        raise UsageError("--prune needs -l KEY=VALUE: only labelled objects are pruned")
    if args.selector and not args.prune:
        raise UsageError("-l is only used with --prune")
    files = [config_pb2.ApplyFile(name=name, documents=text)
             for name, text in read_files(args.files)]
    return config_pb2.ApplyRequest(files=files, dry_run=dry_run, prune=args.prune,
                                   prune_selector=args.selector)


def _actor() -> tuple[str, str]:
    """Who runs the CLI, for the audit of threshold changes (a claim beside the identity
    the server can prove), as `thresholds set` sends it."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return ("x-sitsmesh-actor", f"{user}@{socket.gethostname()}")


def call_config(args: argparse.Namespace, method: str, request: Any) -> Any:
    """One ConfigService call with the admin flags' address, TLS and token."""
    import grpc

    from sitsmesh.admin.v1 import config_pb2_grpc
    from sitsmesh.app.admintoken import read_token

    settings = settings_from(args, ["admin_addr", "state_dir", "admin_token_file"])
    token = str(args.token) if args.token else read_token(settings.token_path)
    with admin_channel(args, str(settings.admin_addr)) as channel:
        bound = getattr(config_pb2_grpc.ConfigServiceStub(channel), method)
        try:
            return bound(request, timeout=args.timeout,
                         metadata=(("authorization", f"Bearer {token}"), _actor()))
        except grpc.RpcError as exc:
            code = exc.code().name if exc.code() else "UNKNOWN"
            raise RpcFailed(f"{method} on {settings.admin_addr}: {code}: {exc.details()}"
                            ) from None


def cmd_apply(args: argparse.Namespace) -> int:
    reply = call_config(args, "Apply", _request(args, args.dry_run))
    suffix = " (dry run)" if args.dry_run else ""

    def text() -> str:
        return "\n".join(f"{r.kind.lower()}/{r.name} {_ACTIONS.get(r.action, '?')}{suffix}"
                         for r in reply.results)

    render(args, {**message_dict(reply, all_fields=True), "dry_run": args.dry_run}, text)
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    try:
        reply = call_config(args, "Apply", _request(args, dry_run=True))
    except (RpcFailed, UsageError) as exc:
        return die(str(exc), EXIT_DIFF_ERROR)
    diff = "".join(r.diff for r in reply.results)
    if args.output in ("json", "yaml"):  # each object's outcome with its own diff
        print(dump(message_dict(reply, all_fields=True)["results"], args.output))
    elif diff:
        sys.stdout.write(diff)
    return EXIT_DIFFERENT if diff else 0


def kind_of(text: str) -> str:
    from sitsmesh.declarative.models import KINDS

    wanted = text.lower()
    if wanted == "all":
        return ""
    for kind, model in KINDS.items():
        if wanted in (kind.lower(), model.PLURAL):
            return kind
    raise UsageError(f"unknown kind {text!r}: use {', '.join(KINDS)} or all")


def cmd_get(args: argparse.Namespace) -> int:
    from sitsmesh.admin.v1 import config_pb2

    kind = kind_of(args.kind)
    if args.name and not kind:
        raise UsageError("a name needs its kind")
    reply = call_config(args, "Get", config_pb2.GetRequest(kind=kind, name=args.name))
    docs = [json.loads(d.json) for d in reply.documents]
    if args.output == "yaml":
        # One YAML document each, as files hold them: `apply -f` reads it back.
        print("\n---\n".join(dump(d, "yaml") for d in docs))
        return 0
    if args.output == "json":  # one object, or a list of them (apply takes both)
        print(dump(docs[0] if args.name and docs else docs, "json"))
        return 0
    rows = [("KIND", "NAME", "LABELS")] + [
        (d["kind"], d["metadata"]["name"],
         ",".join(f"{k}={v}" for k, v in sorted(d["metadata"].get("labels", {}).items())))
        for d in docs]
    print(table(rows) if docs else "no objects")
    return 0


def cmd_schemas(args: argparse.Namespace) -> int:
    from sitsmesh.declarative import schemas

    written = [str(path) for path in schemas.write(Path(args.dir))]
    render(args, {"written": written}, "\n".join(written))
    return 0
