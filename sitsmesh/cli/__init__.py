"""The `sitsmesh` command: `serve` runs the control plane; the rest speak to a running one."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from sitsmesh import __version__
from sitsmesh.cli import (
    completion,
    credentials,
    declarative,
    dev,
    models,
    pipelines,
    pressure,
    ratelimit,
    serve,
    status,
    tenants,
)
from sitsmesh.cli.common import EXIT_FAILED, RpcFailed, UsageError, apply_tls_floor, die
from sitsmesh.errors import SitsmeshError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sitsmesh", description=__doc__)
    parser.add_argument("--version", action="version", version=f"sitsmesh {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    # In the order `sitsmesh --help` lists them.
    serve.add_commands(sub)
    status.add_commands(sub)
    ratelimit.add_commands(sub)
    tenants.add_commands(sub)
    pipelines.add_commands(sub)
    dev.add_commands(sub)
    models.add_commands(sub)
    pressure.add_commands(sub)
    declarative.add_commands(sub)
    credentials.add_commands(sub)
    completion.add_commands(sub, parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        apply_tls_floor(args)
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
