"""`sitsmesh models ...` and `sitsmesh swaps ...`: Triton models and hot swaps (admin API)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from sitsmesh.admin.enums import label, word
from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.cli import batching
from sitsmesh.cli.common import (
    EXIT_FAILED,
    RpcFailed,
    Subcommands,
    UsageError,
    add_common_admin,
    admin_call,
    all_pages,
    call_admin,
    examples,
    message_dict,
    render,
    table,
)

SWAP_TIMEOUT_S = 1800.0  # a whole swap: loads, drain and all
BAR_WIDTH = 30


def add_commands(sub: Subcommands) -> None:
    models = sub.add_parser("models", help="Triton models and hot swaps (admin API)",
                            **examples("sitsmesh models list --endpoint gpu-a",
                                       "sitsmesh models swap resnet --to 7 --warmup-count 2",
                                       "sitsmesh models profile resnet --plot curve.png",
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
    batching.add_model_commands(models, swap_flags)

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


def swap_flags(p: argparse.ArgumentParser) -> None:
    """The flags of a swap's options, for `models swap` and `models tune`."""
    p.add_argument("--warmup-count", type=int, default=0, help="warmup runs per instance")
    p.add_argument("--warmup-data", choices=("zero", "random"), default="")
    p.add_argument("--sample", metavar="FILE.json",
                   help='probe values: {"INPUT0": [1, 2, 3, 4]} (flattened)')
    p.add_argument("--probes", type=int, default=0, help="verify probes (default 20)")
    p.add_argument("--max-latency-ratio", type=float, default=0.0)
    p.add_argument("--drain-timeout", type=float, default=0.0, help="seconds (default 30)")
    p.add_argument("--load-timeout", type=float, default=0.0, help="seconds (default 300)")


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


def _options(args: argparse.Namespace) -> Any:
    options = admin_pb2.SwapOptions(
        warmup_count=max(0, args.warmup_count),
        warmup_data=label(admin_pb2.WarmupData, args.warmup_data),
        verify_probes=max(0, args.probes), max_latency_ratio=args.max_latency_ratio,
        drain_timeout_s=args.drain_timeout, load_timeout_s=args.load_timeout)
    if args.sample:
        try:
            sample = json.loads(Path(args.sample).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise UsageError(f"{args.sample}: cannot read sample: {exc}") from None
        if not isinstance(sample, dict) or not all(
                isinstance(v, list) and all(isinstance(x, int | float) for x in v)
                for v in sample.values()):
            raise UsageError(f"{args.sample}: expected {{input name: [numbers]}}")
        for name, values in sample.items():
            options.sample[name].values.extend(float(x) for x in values)
    return options


def cmd_models_swap(args: argparse.Namespace) -> int:
    request = admin_pb2.SwapModelRequest(model=args.model, target_version=args.target,
                                         endpoint=args.endpoint, options=_options(args))
    progress = _Progress(sys.stderr, live=sys.stderr.isatty())
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
    render(args, message_dict(final), lambda: _summary(final))
    return 0 if final.state == admin_pb2.SWAP_STATE_SUCCEEDED else EXIT_FAILED


class _Progress:
    """A bar redrawn in place on a terminal; one line per event otherwise."""

    def __init__(self, out: TextIO, *, live: bool) -> None:
        self._out = out
        self._live = live

    def show(self, event: Any) -> None:
        filled = round(event.progress * BAR_WIDTH)
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        phase = word(admin_pb2.SwapPhase, event.phase)
        state = word(admin_pb2.StepState, event.state)
        text = f"[{bar}] {event.progress:4.0%} {phase:<9} {state:<8} {event.message}"
        if self._live:
            self._out.write("\r\x1b[2K" + text[:160])
        else:
            self._out.write(text + "\n")
        self._out.flush()

    def close(self) -> None:
        if self._live:
            self._out.write("\n")
            self._out.flush()


def _seconds(step: Any) -> str:
    if not step.HasField("ended_at"):
        return "-"
    started = step.started_at.ToNanoseconds()
    return f"{(step.ended_at.ToNanoseconds() - started) / 1e9:.2f}"


def _summary(record: Any) -> str:
    source = f"v{record.from_version}" if record.HasField("from_version") else "?"
    lines = [f"swap {record.id}: {record.model} {source} -> v{record.to_version} on "
             f"{record.endpoint}: {word(admin_pb2.SwapState, record.state).upper()}"]
    if record.error:
        lines.append(f"error: {record.error}")
    rows = [("PHASE", "RESULT", "SECONDS", "MESSAGE")]
    rows += [(word(admin_pb2.SwapPhase, s.phase), word(admin_pb2.StepState, s.state),
              _seconds(s), s.message) for s in record.steps]
    return "\n".join([*lines, table(rows)])


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
    render(args, message_dict(record), lambda: _summary(record))
    return 0
