"""`sitsmesh models profile|curve|tune|autotune|batching-history`: dynamic batching."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sitsmesh.admin.enums import word
from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.cli.common import (
    EXIT_FAILED,
    RpcFailed,
    UsageError,
    add_common_admin,
    admin_call,
    all_pages,
    call_admin,
    message_dict,
    render,
    table,
)
from sitsmesh.cli.swapview import SWAP_TIMEOUT_S, Progress, swap_options, swap_summary

PROFILE_TIMEOUT_S = 1800.0


def add_model_commands(models: Any, swap_options: Any) -> None:
    """Under `sitsmesh models`; `swap_options(p)` adds the swap's own flags."""
    p = models.add_parser("profile", help="measure throughput and p50/p99 per batch size "
                          "(on the preflight sandbox unless --production)")
    p.add_argument("model")
    p.add_argument("--endpoint", default="", help="Triton endpoint (needed when several)")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32", help="comma-separated sizes")
    p.add_argument("--concurrency", type=int, default=0,
                   help="callers at once (default: one per model instance)")
    p.add_argument("--requests", type=int, default=0, help="per batch size (default 40)")
    p.add_argument("--seconds", type=float, default=0.0,
                   help="at most, per batch size (default 10)")
    p.add_argument("--production", action="store_true",
                   help="profile the serving model (sends real load; needs --yes-production)")
    p.add_argument("--yes-production", action="store_true",
                   help="consent to a production profile at --max-rate")
    p.add_argument("--max-rate", type=float, default=0.0,
                   help="production: items/s the profile may send (default 20)")
    p.add_argument("--plot", metavar="FILE.png", help="write the curve as a PNG plot")
    add_common_admin(p, timeout=PROFILE_TIMEOUT_S)
    p.set_defaults(func=cmd_profile)

    p = models.add_parser("curve", help="the stored batching curve of a model")
    p.add_argument("model")
    p.add_argument("--plot", metavar="FILE.png", help="write the curve as a PNG plot")
    add_common_admin(p)
    p.set_defaults(func=cmd_curve)

    p = models.add_parser("tune", help="recommend batching from the curve, the live rate "
                          "and the SLA; apply it through a warm config swap")
    p.add_argument("model")
    p.add_argument("--endpoint", default="", help="Triton endpoint (needed when several)")
    p.add_argument("--dry-run", action="store_true",
                   help="show current vs proposed and the predicted p99; change nothing")
    p.add_argument("--pipeline", default="", help="the pipeline whose stage serves the model")
    p.add_argument("--rate", type=float, default=0.0,
                   help="items/s to tune for instead of the live arrival rate")
    p.add_argument("--sla-ms", type=float, default=0.0,
                   help="p99 SLA instead of the stage's sla_p99_ms")
    p.add_argument("--preferred", default="",
                   help="apply these preferred batch sizes (comma-separated) instead")
    p.add_argument("--delay-us", type=int, default=-1,
                   help="with --preferred: max_queue_delay_microseconds")
    p.add_argument("--no-batching", action="store_true",
                   help="apply: remove dynamic batching")
    p.add_argument("--watch", type=float, default=-1.0,
                   help="seconds the live p99 is watched after the reload (default 3)")
    swap_options(p)
    add_common_admin(p, timeout=SWAP_TIMEOUT_S)
    p.set_defaults(func=cmd_tune)

    p = models.add_parser("autotune", help="automatic re-tuning of a pipeline's Triton "
                          "stages: on, off or show")
    p.add_argument("pipeline")
    p.add_argument("state", nargs="?", choices=("on", "off"))
    p.add_argument("--hold", type=float, default=0.0, help="seconds (default 30)")
    p.add_argument("--cooldown", type=float, default=0.0, help="seconds (default 300)")
    add_common_admin(p)
    p.set_defaults(func=cmd_autotune)

    p = models.add_parser("batching-history", help="every batching change, newest first")
    p.add_argument("--model", default="")
    p.add_argument("--limit", type=int, default=20, help="at most this many (0: all)")
    add_common_admin(p)
    p.set_defaults(func=cmd_history)


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"{text!r}: use whole numbers separated by commas") from None
    if not sizes or min(sizes) < 1:
        raise UsageError(f"{text!r}: give batch sizes of at least 1")
    return sizes


def cmd_profile(args: argparse.Namespace) -> int:
    target = (admin_pb2.PROFILE_TARGET_PRODUCTION if args.production
              else admin_pb2.PROFILE_TARGET_PREFLIGHT)
    request = admin_pb2.ProfileModelRequest(
        model=args.model, endpoint=args.endpoint, batch_sizes=_sizes(args.batch_sizes),
        concurrency=max(0, args.concurrency), requests=max(0, args.requests),
        seconds=max(0.0, args.seconds), target=target,
        allow_production=args.yes_production, max_rate=max(0.0, args.max_rate))
    curve = None
    with admin_call(args, "ProfileModel") as call:
        for reply in call(request):
            if reply.HasField("point"):
                point = reply.point
                print(f"batch {point.batch_size:>4}: {point.throughput:9.1f} items/s, "
                      f"p50 {point.p50_ms:7.1f} ms, p99 {point.p99_ms:7.1f} ms",
                      file=sys.stderr)
            if reply.HasField("curve"):
                curve = reply.curve
    if curve is None:
        raise RpcFailed("ProfileModel ended without the curve")
    return _show_curve(args, curve)


def cmd_curve(args: argparse.Namespace) -> int:
    curve = call_admin(args, "GetModelProfile",
                       admin_pb2.GetModelProfileRequest(model=args.model)).curve
    return _show_curve(args, curve)


def _show_curve(args: argparse.Namespace, curve: Any) -> int:
    if args.plot:
        plot(curve, Path(args.plot))
    render(args, message_dict(curve), lambda: curve_table(curve))
    return 0


def curve_table(curve: Any) -> str:
    front = set(curve.pareto)
    rows = [("BATCH", "ITEMS/S", "P50_MS", "P99_MS", "REQUESTS", "")]
    rows += [(str(p.batch_size), f"{p.throughput:.1f}", f"{p.p50_ms:.1f}", f"{p.p99_ms:.1f}",
              str(p.requests),
              " ".join(m for m, on in (("knee", p.batch_size == curve.knee),
                                       ("pareto", p.batch_size in front)) if on))
             for p in curve.points]
    where = word(admin_pb2.ProfileTarget, curve.target) or "?"
    head = (f"{curve.model} on {curve.endpoint} ({where}): {curve.instances} instance(s), "
            f"max_batch_size {curve.max_batch_size}, concurrency {curve.concurrency}; "
            f"knee B* = {curve.knee}")
    return head + "\n" + table(rows)


def plot(curve: Any, path: Path) -> None:
    """Throughput and p99 over batch size, the knee marked: a PNG."""
    try:
        import matplotlib  # only --plot needs it

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'sitsmesh[plot]'") from None
    sizes = [p.batch_size for p in curve.points]
    figure, left = plt.subplots(figsize=(7, 4), dpi=100)
    left.plot(sizes, [p.throughput for p in curve.points], "o-", color="tab:blue",
              label="throughput")
    left.set_xscale("log", base=2)
    left.set_xticks(sizes, [str(s) for s in sizes])
    left.set_xlabel("batch size")
    left.set_ylabel("items/s", color="tab:blue")
    right = left.twinx()
    right.plot(sizes, [p.p99_ms for p in curve.points], "s--", color="tab:red", label="p99")
    right.set_ylabel("p99 ms", color="tab:red")
    left.axvline(curve.knee, color="gray", linestyle=":")
    left.annotate(f"knee B*={curve.knee}", (curve.knee, max(p.throughput
                                                            for p in curve.points) * 0.5),
                  textcoords="offset points", xytext=(5, 0))
    left.set_title(f"{curve.model}: throughput and p99 by batch size")
    figure.tight_layout()
    try:
        figure.savefig(path, format="png")
    except OSError as exc:
        raise UsageError(f"{path}: cannot write the plot: {exc}") from None
    finally:
        plt.close(figure)


def _given(args: argparse.Namespace) -> Any:
    if args.no_batching and args.preferred:
        raise UsageError("--no-batching and --preferred exclude each other")
    if args.no_batching:
        return admin_pb2.DynamicBatching(enabled=False)
    if args.preferred:
        if args.delay_us < 0:
            raise UsageError("--preferred needs --delay-us")
        return admin_pb2.DynamicBatching(enabled=True, preferred_batch_size=_sizes(
            args.preferred), max_queue_delay_microseconds=args.delay_us)
    if args.delay_us >= 0:
        raise UsageError("--delay-us goes with --preferred")
    return None


def cmd_tune(args: argparse.Namespace) -> int:
    request = admin_pb2.TuneModelRequest(
        model=args.model, endpoint=args.endpoint, dry_run=args.dry_run,
        rate=max(0.0, args.rate), sla_ms=max(0.0, args.sla_ms), pipeline=args.pipeline,
        options=swap_options(args))
    given = _given(args)
    if given is not None:
        request.batching.CopyFrom(given)
    if args.watch >= 0:
        request.watch_s = args.watch
    found = final = None
    progress = Progress(sys.stderr, live=sys.stderr.isatty())
    try:
        with admin_call(args, "TuneModel") as call:
            for reply in call(request):
                if reply.HasField("recommendation"):
                    found = reply.recommendation
                    if args.output == "table":
                        print(recommendation_text(found))
                if reply.HasField("progress"):
                    progress.show(reply.progress)
                    if reply.progress.HasField("swap"):
                        final = reply.progress.swap
    finally:
        progress.close()
    if found is None:
        raise RpcFailed("TuneModel ended without a recommendation")
    doc: dict[str, Any] = {"recommendation": message_dict(found)}
    if final is not None:
        doc["swap"] = message_dict(final)
    render(args, doc, lambda: swap_summary(final) if final is not None else None)
    if final is not None and final.state != admin_pb2.SWAP_STATE_SUCCEEDED:
        return EXIT_FAILED
    return 0


def _batching_text(message: Any) -> str:
    if not message.enabled:
        return "no dynamic batching"
    sizes = ",".join(map(str, message.preferred_batch_size)) or "any"
    return f"preferred [{sizes}], delay {message.max_queue_delay_microseconds / 1000:g} ms"


def _p99(prediction: Any) -> str:
    return f"{prediction.p99_ms:.1f}" if prediction.stable else "unbounded"


def recommendation_text(found: Any) -> str:
    source = word(admin_pb2.RateSource, found.rate_source)
    where = f" ({found.pipeline}/{found.stage})" if found.stage else ""
    lines = [f"{found.model}{where}: {found.rate:.1f} items/s ({source}), SLA p99 "
             f"{found.sla_ms:g} ms, knee B* = {found.knee}"]
    rows: list[tuple[str, ...]] = [("", "BATCHING", "P99_MS", "P50_MS", "ITEMS/S",
                                    "MEAN_BATCH", "HEADROOM")]
    for name, p in (("current", found.current), ("proposed", found.proposed)):
        rows.append((name, _batching_text(p.batching), _p99(p),
                     f"{p.p50_ms:.1f}" if p.stable else "-", f"{p.throughput:.1f}",
                     f"{p.mean_batch:.1f}", f"{p.headroom:g}x"))
    lines.append(table(rows))
    lines.append(f"why: {found.reason}")
    if found.changes:
        lines.append(f"new capacity: {found.capacity:.0f} items/s")
    return "\n".join(lines)


def cmd_autotune(args: argparse.Namespace) -> int:
    if args.state is None:
        if args.hold or args.cooldown:
            raise UsageError("--hold and --cooldown go with on or off")
        reply = call_admin(args, "GetAutoTuning",
                           admin_pb2.GetAutoTuningRequest(pipeline=args.pipeline))
    else:
        reply = call_admin(args, "SetAutoTuning", admin_pb2.SetAutoTuningRequest(
            auto_tuning=admin_pb2.AutoTuning(pipeline=args.pipeline,
                                             enabled=args.state == "on",
                                             hold_s=max(0.0, args.hold),
                                             cooldown_s=max(0.0, args.cooldown))))
    auto = reply.auto_tuning
    render(args, message_dict(auto, all_fields=True), lambda: (
        f"{auto.pipeline}: automatic batching {'on' if auto.enabled else 'off'} (hold "
        f"{auto.hold_s:g} s, cool-down {auto.cooldown_s:g} s)"))
    return 0


def cmd_history(args: argparse.Namespace) -> int:
    reply = all_pages(lambda r: call_admin(args, "ListBatchingChanges", r),
                      admin_pb2.ListBatchingChangesRequest(model=args.model), "changes",
                      limit=max(0, args.limit))
    rows: list[tuple[str, ...]] = [("AT", "MODEL", "ACTOR", "FROM", "TO", "OUTCOME",
                                    "REASON")]
    rows += [(c.at.ToDatetime().isoformat(timespec="seconds"), c.model or "-", c.actor,
              _batching_text(c.previous) if c.HasField("previous") else "-",
              _batching_text(c.batching) if c.HasField("batching") else "-",
              word(admin_pb2.SwapState, c.outcome) or "-", c.reason)
             for c in reply.changes]
    render(args, message_dict(reply), lambda: table(rows))
    return 0


__all__: Sequence[str] = ("add_model_commands", "plot")
