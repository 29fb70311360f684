"""`sitsmesh admin-credentials`: make a token, hash one for the credentials file, check
a file. All local: none of these talks to a server."""

from __future__ import annotations

import argparse
import sys

from sitsmesh.cli.common import Subcommands, add_output, examples, render, table


def add_commands(sub: Subcommands) -> None:
    group = sub.add_parser(
        "admin-credentials", help="named admin credentials: generate, hash, check",
        **examples("sitsmesh admin-credentials generate",
                   "sitsmesh admin-credentials hash < token.txt",
                   "sitsmesh admin-credentials check credentials.yaml"))
    cmds = group.add_subparsers(dest="action", required=True)
    p = cmds.add_parser("generate", help="print a new random token and its token_hash line")
    add_output(p)
    p.set_defaults(func=cmd_generate)
    p = cmds.add_parser("hash", help="read a token on stdin, print its token_hash line")
    add_output(p)
    p.set_defaults(func=cmd_hash)
    p = cmds.add_parser("check", help="validate a credentials file as `serve` would")
    p.add_argument("file", metavar="FILE")
    add_output(p)
    p.set_defaults(func=cmd_check)


def cmd_generate(args: argparse.Namespace) -> int:
    from sitsmesh.access.credentials import hash_token, new_token

    token = new_token()
    # The token goes to whoever uses it, the hash into the file: two lines, told apart.
    doc = {"token": token, "token_hash": hash_token(token)}
    render(args, doc, "\n".join(f"{k}: {v}" for k, v in doc.items()))
    return 0


def cmd_hash(args: argparse.Namespace) -> int:
    from sitsmesh.access.credentials import hash_token

    token_hash = hash_token(sys.stdin.read())
    render(args, {"token_hash": token_hash}, f"token_hash: {token_hash}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sitsmesh.access.credentials import load

    credentials = list(load(Path(args.file)).by_name.values())
    doc = [{"name": c.name, "role": c.role, "proof": c.identity or "token",
            "scopes": {k: sorted(v) for k, v in c.scopes.items()}} for c in credentials]
    render(args, doc, lambda: table([("NAME", "ROLE", "PROOF", "SCOPES"), *(
        (c.name, c.role, c.identity or "token",
         " ".join(f"{k}={','.join(sorted(v))}" for k, v in c.scopes.items()))
        for c in credentials)]))
    return 0
