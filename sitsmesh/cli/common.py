"""What the CLI's command modules share: admin calls and flags, output, errors, exit codes."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import yaml
from google.protobuf.json_format import MessageToDict

from sitsmesh.config import Settings, load_settings

EXIT_FAILED = 1
EXIT_USAGE = 2

# What `add_subparsers()` returns; each command module's add_commands(sub) takes it.
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class UsageError(Exception):
    """Bad input on the command line or in a file it names: main() exits EXIT_USAGE."""


class RpcFailed(Exception):
    """The admin API refused or could not be reached: main() exits EXIT_FAILED."""


def die(message: str, code: int = EXIT_USAGE) -> int:
    print(f"sitsmesh: error: {message}", file=sys.stderr)
    return code


def settings_from(args: argparse.Namespace, keys: Sequence[str]) -> Settings:
    flags: dict[str, str | None] = {"config": args.config}
    for key in keys:
        value = getattr(args, key, None)
        flags[key] = os.pathsep.join(value) if isinstance(value, list) else value
    return load_settings(flags)


OUTPUTS = ("table", "json", "yaml")


def add_common_admin(p: argparse.ArgumentParser,
                     outputs: Sequence[str] = OUTPUTS) -> None:
    p.add_argument("--config", help="YAML config file (or SITSMESH_CONFIG)")
    p.add_argument("--admin", dest="admin_addr", metavar="HOST:PORT",
                   help="admin address (or SITSMESH_ADMIN_ADDR; default 127.0.0.1:50052)")
    p.add_argument("--token", help="admin token (prefer SITSMESH_ADMIN_TOKEN or --token-file: "
                   "argv is visible to every user of the machine)")
    p.add_argument("--token-file", "--admin-token-file", dest="admin_token_file",
                   help="file holding the admin token (or SITSMESH_ADMIN_TOKEN_FILE; "
                   "default STATE_DIR/admin-token)")
    p.add_argument("--state-dir", dest="state_dir", help="where to find admin-token")
    add_tls_flags(p, "admin API")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    add_output(p, outputs)


def add_output(p: argparse.ArgumentParser, outputs: Sequence[str] = OUTPUTS) -> None:
    p.add_argument("--output", "-o", choices=tuple(outputs), default="table",
                   help=f"{', '.join(outputs)} (default table); json and yaml print the "
                   "same document")


# flag, environment variable, help: what the CLI needs to speak TLS / mTLS to `serve`.
_TLS_FLAGS = (
    ("--ca", "SITSMESH_ADMIN_CA", "CA bundle that signed the server's certificate"),
    ("--cert", "SITSMESH_ADMIN_CERT", "client certificate, when the server wants mTLS"),
    ("--key", "SITSMESH_ADMIN_KEY", "private key of --cert"),
    ("--server-name", "SITSMESH_ADMIN_SERVER_NAME",
     "name to verify in the server's certificate, when it differs from --admin's host"),
)


def add_tls_flags(p: argparse.ArgumentParser, what: str) -> None:
    tls = p.add_argument_group(f"TLS to the {what} (any of these turns TLS on)")
    for flag, env, meaning in _TLS_FLAGS:
        tls.add_argument(flag, metavar="PEM" if flag != "--server-name" else "NAME",
                         help=f"{meaning} (or {env})")


def _tls_option(args: argparse.Namespace, flag: str, env: str) -> str:
    value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
    return str(value or os.environ.get(env, ""))


def admin_channel(args: argparse.Namespace, target: str) -> Any:
    """A channel to `target` (the admin API, or the data plane for `health`): TLS when
    --ca/--cert/--key (or their variables) say so."""
    import grpc

    ca, cert, key, name = (_tls_option(args, flag, env) for flag, env, _ in _TLS_FLAGS)
    if not (ca or cert or key):
        return grpc.insecure_channel(target)
    if bool(cert) != bool(key):
        raise UsageError("--cert and --key go together (or SITSMESH_ADMIN_CERT and "
                         "SITSMESH_ADMIN_KEY)")
    read = {path: read_text(path, what).encode() for path, what in
            ((ca, "CA bundle"), (cert, "client certificate"), (key, "client key")) if path}
    credentials = grpc.ssl_channel_credentials(
        root_certificates=read.get(ca), private_key=read.get(key),
        certificate_chain=read.get(cert))
    options = [("grpc.ssl_target_name_override", name)] if name else []
    return grpc.secure_channel(target, credentials, options=options)


def _admin_token(args: argparse.Namespace, settings: Settings) -> str:
    from sitsmesh.app.admintoken import TOKEN_ENV, read_token

    if args.token:
        return str(args.token)
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    return read_token(settings.token_path)


@contextlib.contextmanager
def admin_call(args: argparse.Namespace, method: str,
               extra_metadata: Sequence[tuple[str, str]] = ()) -> Iterator[Any]:
    """The bound admin method, ready to call (unary or streaming) with the token and
    `args.timeout`; an RPC error anywhere in the block becomes one RpcFailed line."""
    # grpc stays lazy: the offline commands (ratelimit check, simulate) never load it.
    import grpc

    from sitsmesh.admin.v1 import admin_pb2_grpc

    settings = settings_from(args, ["admin_addr", "state_dir", "admin_token_file"])
    metadata = (("authorization", f"Bearer {_admin_token(args, settings)}"),
                *extra_metadata)
    with admin_channel(args, str(settings.admin_addr)) as channel:
        bound = getattr(admin_pb2_grpc.AdminStub(channel), method)
        try:
            yield lambda request: bound(request, timeout=args.timeout, metadata=metadata)
        except grpc.RpcError as exc:
            code = exc.code().name if exc.code() else "UNKNOWN"
            raise RpcFailed(f"{method} on {settings.admin_addr}: {code}: {exc.details()}"
                            ) from None


def call_admin(args: argparse.Namespace, method: str, request: Any,
               extra_metadata: Sequence[tuple[str, str]] = ()) -> Any:
    with admin_call(args, method, extra_metadata) as call:
        return call(request)


def read_text(path: str | Path, what: str = "") -> str:
    """A file named on the command line; UsageError '<path>: cannot read <what>: <reason>'."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        reading = f"cannot read {what}" if what else "cannot read"
        raise UsageError(f"{path}: {reading}: {exc.strerror or exc}") from None


def table(rows: Sequence[tuple[str, ...]]) -> str:
    """Rows as left-aligned columns, two spaces apart, each as wide as its widest cell: the
    one table layout of the CLI (no fixed widths: a long name widens its column)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


def message_dict(message: Any, *, all_fields: bool = False) -> dict[str, Any]:
    """A protobuf message as JSON-ready data, keyed by the proto field names."""
    doc: dict[str, Any] = MessageToDict(message, preserving_proto_field_name=True,
                                        always_print_fields_with_no_presence=all_fields)
    return doc


def print_json(message: Any) -> None:
    print(json.dumps(message_dict(message), indent=2))


def dump(doc: Any, output: str, *, sort_keys: bool = False) -> str:
    """`doc` as --output json or yaml prints it: one document, two spellings."""
    if output == "yaml":
        # Through JSON first, so yaml holds exactly what json would (int keys become
        # strings, tuples lists) and `yq` and `jq` read the same document.
        text: str = yaml.safe_dump(json.loads(json.dumps(doc)), sort_keys=sort_keys,
                                   allow_unicode=True, default_flow_style=False)
        return text.rstrip("\n")
    return json.dumps(doc, indent=2, sort_keys=sort_keys)


def render(args: argparse.Namespace, doc: Any, text: Callable[[], str | None] | str | None,
           *, sort_keys: bool = False) -> None:
    """What a command prints: `doc` as json/yaml, else `text` (a callable is called only
    for the table, so a command builds its rows only when they are shown)."""
    output = getattr(args, "output", "table")
    if output in ("json", "yaml"):
        print(dump(doc, output, sort_keys=sort_keys))
        return
    shown = text() if callable(text) else text
    if shown is not None:
        print(shown)
