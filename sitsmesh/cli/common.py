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

from sitsmesh.config import TLS_VERSIONS, Settings, load_settings

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
DEFAULT_TIMEOUT_S = 5.0


def env_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup, *flags: str,
                 env: str, help: str, **kwargs: Any) -> argparse.Action:
    """A flag whose default is the variable `env` when it is set: the CLI's one way to honour
    SITSMESH_* (a flag given on the command line still wins). An empty variable counts as
    unset, as in config.load_settings. argparse runs `type` on a string default but checks
    no `choices` there, so a bad value in the variable is refused here, naming it."""
    raw = os.environ.get(env, "")
    if raw:
        convert = kwargs.get("type") or str
        choices = kwargs.get("choices")

        def parse(text: str) -> Any:
            try:
                value = convert(text)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"invalid value {text!r} (on the command line or in {env})") from None
            if choices is not None and value not in choices:
                raise argparse.ArgumentTypeError(
                    f"invalid choice {text!r} (on the command line or in {env}; choose from "
                    f"{', '.join(map(str, choices))})")
            return value

        kwargs["type"] = parse
        kwargs["default"] = raw
    return p.add_argument(*flags, help=f"{help} (or {env})", **kwargs)


def add_common_admin(p: argparse.ArgumentParser, outputs: Sequence[str] = OUTPUTS,
                     timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """The flags every admin command takes. A command whose call lasts (a swap, a watch)
    passes its own `timeout`; SITSMESH_TIMEOUT, sized for one-shot calls, leaves it alone."""
    from sitsmesh.app.admintoken import TOKEN_ENV

    env_argument(p, "--config", env="SITSMESH_CONFIG", help="YAML config file")
    env_argument(p, "--admin", dest="admin_addr", metavar="HOST:PORT",
                 env="SITSMESH_ADMIN_ADDR", help="admin address (default 127.0.0.1:50052)")
    env_argument(p, "--token", env=TOKEN_ENV,
                 help="admin token (prefer the variable or --token-file: argv is visible to "
                 "every user of the machine)")
    env_argument(p, "--token-file", "--admin-token-file", dest="admin_token_file",
                 env="SITSMESH_ADMIN_TOKEN_FILE",
                 help="file holding the admin token (default STATE_DIR/admin-token)")
    env_argument(p, "--state-dir", dest="state_dir", env="SITSMESH_STATE_DIR",
                 help="where to find admin-token")
    add_tls_flags(p, "admin API")
    if timeout == DEFAULT_TIMEOUT_S:
        env_argument(p, "--timeout", type=float, default=timeout, env="SITSMESH_TIMEOUT",
                     help=f"seconds (default {timeout:g})")
    else:
        p.add_argument("--timeout", type=float, default=timeout,
                       help=f"seconds (default {timeout:g}; SITSMESH_TIMEOUT does not apply)")
    add_output(p, outputs)


def examples(*lines: str) -> dict[str, Any]:
    """add_parser(**examples(...)): an epilog of real invocations under --help, kept as
    written (tests/unit/test_cli_help.py parses every one)."""
    return {"formatter_class": argparse.RawDescriptionHelpFormatter,
            "epilog": "examples:\n" + "\n".join(f"  {line}" for line in lines)}


def add_output(p: argparse.ArgumentParser, outputs: Sequence[str] = OUTPUTS) -> None:
    env_argument(p, "--output", "-o", choices=tuple(outputs), default="table",
                 env="SITSMESH_OUTPUT", help=f"{', '.join(outputs)} (default table); json "
                 "and yaml print the same document")


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
        env_argument(tls, flag, metavar="PEM" if flag != "--server-name" else "NAME",
                     env=env, help=meaning)
    # The variable `serve` reads too: a pod that requires TLS 1.3 requires it of both.
    env_argument(tls, "--tls-min-version", choices=TLS_VERSIONS, default="1.2",
                 env="SITSMESH_TLS_MIN_VERSION",
                 help="oldest TLS version to accept from the server: 1.2 (default) or 1.3 "
                 "(applies once TLS is on)")


def apply_tls_floor(args: argparse.Namespace) -> None:
    """--tls-min-version, set before the command imports grpc (tlsversion says why).
    `serve` reads its own `tls_min_version` setting (flag, variable or file) instead."""
    from sitsmesh import tlsversion

    version = getattr(args, "tls_min_version", None)
    if version and getattr(args, "command", "") != "serve":
        tlsversion.require(version, "--tls-min-version")


def _tls_option(args: argparse.Namespace, flag: str) -> str:
    return str(getattr(args, flag.lstrip("-").replace("-", "_"), None) or "")


def admin_channel(args: argparse.Namespace, target: str) -> Any:
    """A channel to `target` (the admin API, or the data plane for `health`): TLS when
    --ca/--cert/--key (or their variables) say so."""
    import grpc

    ca, cert, key, name = (_tls_option(args, flag) for flag, _, _ in _TLS_FLAGS)
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
    from sitsmesh.app.admintoken import read_token

    if args.token:  # the flag, or SITSMESH_ADMIN_TOKEN through its default
        return str(args.token)
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
        bound = getattr(admin_pb2_grpc.AdminServiceStub(channel), method)
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


def all_pages(call: Callable[[Any], Any], request: Any, field: str, limit: int = 0) -> Any:
    """Every page of a list RPC joined into one reply (the first `limit` items when > 0):
    the CLI lists everything, whatever the server's page size."""
    if limit > 0:
        request.page_size = min(limit, MAX_PAGE)
    whole = call(request)
    reply, seen = whole, set()
    while reply.next_page_token and not 0 < limit <= len(getattr(whole, field)):
        if reply.next_page_token in seen:  # a server that would loop forever
            raise RpcFailed(f"the server repeated page token {reply.next_page_token!r}")
        seen.add(reply.next_page_token)
        request.page_token = reply.next_page_token
        reply = call(request)
        getattr(whole, field).extend(getattr(reply, field))
    if limit > 0:
        del getattr(whole, field)[limit:]
    whole.next_page_token = ""
    return whole


MAX_PAGE = 1000  # the server's bound on page_size


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
    from sitsmesh.admin.enums import words_in

    doc: dict[str, Any] = MessageToDict(message, preserving_proto_field_name=True,
                                        always_print_fields_with_no_presence=all_fields)
    # Enums print as the words they were before they were enums; serving states as gRPC
    # health spells its own.
    return words_in(message, doc, upper=UPPER_ENUMS)


UPPER_ENUMS = frozenset({"sitsmesh.admin.v1.ServingState"})


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
