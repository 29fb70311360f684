"""`sitsmesh models ...` and `sitsmesh swaps ...`: Triton models and hot swaps (admin API)."""

from __future__ import annotations

import argparse
import sys

from sitsmesh.admin.enums import word
from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.cli.batching import add_model_commands
from sitsmesh.cli.common import (
    EXIT_FAILED,
    RpcFailed,
    Subcommands,
    add_common_admin,
    admin_call,
    all_pages,
    call_admin,
    examples,
    message_dict,
    render,
    table,
)
from sitsmesh.cli.swapview import (
    SWAP_TIMEOUT_S,
    Progress,
    swap_flags,
    swap_options,
    swap_summary,
)


def add_commands(sub: Subcommands) -> None:
    models = sub.add_parser("models", help="Triton models and hot swaps (admin API)",
                            **examples("sitsmesh models list --endpoint gpu-a",
                                       "sitsmesh models swap resnet --to 7 --warmup-count 2",
                                       "sitsmesh models tune resnet --dry-run")
                            ).add_subparsers(dest="models_command", required=True)
    p = models.add_parser("list", help="every endpoint's models and version states")
    p.add_argument("--endpoint", default="", help="only this Triton endpoint")
    add_common_admin(p)
    p.set_defaults(func=cmd_models_list)

    p = models.add_parser("swap", help="hot-swap a model to another version; exit 1 unless "
                          "it succeeds")
    p.add_argument("model")
    p.add_argument("--to", dest="target", type=int, required=True, metavar="VERSION")
    p.add_argument("--endpoint", default="", help="Triton endpoint (needed when several)")
    swap_flags(p)
    add_common_admin(p, timeout=SWAP_TIMEOUT_S)
    p.set_defaults(func=cmd_models_swap)
    add_model_commands(models, swap_flags)

    swaps = sub.add_parser("swaps", help="the history of model swaps (admin API)",
                           **examples("sitsmesh swaps list --model resnet --limit 5",
                                      "sitsmesh swaps get 3f2a9c -o yaml")
                           ).add_subparsers(dest="swaps_command", required=True)
    p = swaps.add_parser("list", help="recent swaps, newest first")
    p.add_argument("--model", default="")
    p.add_argument("--limit", type=int, default=20, help="at most this many (0: all)")
    add_common_admin(p)
    p.set_defaults(func=cmd_swaps_list)
    p = swaps.add_parser("get", help="one swap, step by step")
    p.add_argument("id")
    add_common_admin(p)
    p.set_defaults(func=cmd_swaps_get)


def cmd_models_list(args: argparse.Namespace) -> int:
    reply = call_admin(args, "ListModels", admin_pb2.ListModelsRequest(endpoint=args.endpoint))
    rows = [("ENDPOINT", "MODEL", "VERSION", "STATE", "REASON")]
    rows += [(v.endpoint, v.model, str(v.version or "-"), v.state, v.reason)
             for v in reply.versions]
    render(args, message_dict(reply), lambda: table(rows))
    if args.output == "table":
        for error in reply.errors:
            print(f"endpoint {error.endpoint}: {error.error}", file=sys.stderr)
    return EXIT_FAILED if reply.errors else 0


def cmd_models_swap(args: argparse.Namespace) -> int:
    request = admin_pb2.SwapModelRequest(model=args.model, target_version=args.target,
                                         endpoint=args.endpoint, options=swap_options(args))
    progress = Progress(sys.stderr, live=sys.stderr.isatty())
    final = None
    try:
        with admin_call(args, "SwapModel") as call:
            for event in call(request):
                progress.show(event)
                if event.HasField("swap"):
                    final = event.swap
    finally:
        progress.close()
    if final is None:
        raise RpcFailed("SwapModel ended without the swap's record")
    render(args, message_dict(final), lambda: swap_summary(final))
    return 0 if final.state == admin_pb2.SWAP_STATE_SUCCEEDED else EXIT_FAILED


def cmd_swaps_list(args: argparse.Namespace) -> int:
    reply = all_pages(lambda r: call_admin(args, "ListSwaps", r),
                      admin_pb2.ListSwapsRequest(model=args.model), "swaps",
                      limit=max(0, args.limit))
    rows = [("ID", "MODEL", "FROM", "TO", "STATE", "PHASE", "ERROR")]
    rows += [(r.id, r.model, str(r.from_version) if r.HasField("from_version") else "-",
              str(r.to_version), word(admin_pb2.SwapState, r.state),
              word(admin_pb2.SwapPhase, r.phase), r.error) for r in reply.swaps]
    render(args, message_dict(reply), lambda: table(rows))
    return 0


def cmd_swaps_get(args: argparse.Namespace) -> int:
    record = call_admin(args, "GetSwap", admin_pb2.GetSwapRequest(id=args.id)).swap
    render(args, message_dict(record), lambda: swap_summary(record))
    return 0
