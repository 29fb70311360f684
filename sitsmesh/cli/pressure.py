"""`sitsmesh thresholds ...`, `sitsmesh pressure watch` and `sitsmesh simulate`."""

from __future__ import annotations

import argparse
import getpass
import json
import socket
import sys
from pathlib import Path
from typing import Any

import yaml

from sitsmesh.admin.enums import word
from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.cli.common import (
    Subcommands,
    UsageError,
    add_common_admin,
    add_output,
    admin_call,
    all_pages,
    call_admin,
    dump,
    examples,
    message_dict,
    read_text,
    render,
    table,
)

WATCH_TIMEOUT_S = 24 * 3600.0


def add_commands(sub: Subcommands) -> None:
    thresholds = sub.add_parser("thresholds", help="backpressure thresholds (admin API)",
                                **examples("sitsmesh thresholds get demo",
                                           "sitsmesh thresholds set demo t.yaml --dry-run",
                                           "sitsmesh thresholds history demo -o yaml")
                                ).add_subparsers(dest="thresholds_command", required=True)
    p = thresholds.add_parser("get", help="a pipeline's thresholds (defaults until set)")
    p.add_argument("pipeline")
    add_common_admin(p)
    p.set_defaults(func=cmd_thresholds_get)
    p = thresholds.add_parser("set", help="validate, persist and audit a thresholds file")
    p.add_argument("pipeline")
    p.add_argument("file", metavar="FILE.yaml")
    p.add_argument("--dry-run", action="store_true", help="validate only")
    add_common_admin(p)
    p.set_defaults(func=cmd_thresholds_set)
    p = thresholds.add_parser("history", help="who changed which thresholds, newest first")
    p.add_argument("pipeline", nargs="?", default="")
    p.add_argument("--limit", type=int, default=20, help="at most this many (0: all)")
    add_common_admin(p)
    p.set_defaults(func=cmd_thresholds_history)

    pressure = sub.add_parser("pressure", help="live backpressure (admin API)",
                              **examples("sitsmesh pressure watch demo",
                                         "sitsmesh pressure watch --count 1 -o json | jq .")
                              ).add_subparsers(dest="pressure_command", required=True)
    p = pressure.add_parser("watch", help="a live table of the controller's decisions")
    p.add_argument("pipeline", nargs="?", default="")
    p.add_argument("--interval-ms", type=int, default=500)
    p.add_argument("--count", type=int, default=0, help="stop after N snapshots")
    add_common_admin(p, timeout=WATCH_TIMEOUT_S)
    p.set_defaults(func=cmd_pressure_watch)

    p = sub.add_parser("simulate", help="try thresholds offline against a queueing model",
                       **examples("sitsmesh simulate --pipeline demo.yaml --load load.yaml",
                                  "sitsmesh simulate --pipeline demo.yaml --thresholds t.yaml "
                                  "--load load.yaml --compare"))
    p.add_argument("--pipeline", required=True, metavar="FILE.yaml")
    p.add_argument("--thresholds", metavar="FILE.yaml", help="default thresholds if absent")
    p.add_argument("--load", required=True, metavar="PROFILE.yaml")
    p.add_argument("--compare", action="store_true",
                   help="also run the seed and off policies, and print all three")
    add_output(p)
    p.set_defaults(func=cmd_simulate)


def _actor() -> tuple[tuple[str, str], ...]:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return (("x-sitsmesh-actor", f"{user}@{socket.gethostname()}"),)


def cmd_thresholds_get(args: argparse.Namespace) -> int:
    reply = call_admin(args, "GetThresholds",
                       admin_pb2.GetThresholdsRequest(pipeline=args.pipeline)).thresholds
    default = f"# {reply.pipeline}: none set, these are the defaults\n"
    render(args, _thresholds_doc(reply),
           (default if reply.is_default else "") + reply.yaml.rstrip("\n"))
    return 0


def _thresholds_doc(reply: Any) -> dict[str, Any]:
    return {"pipeline": reply.pipeline, "is_default": reply.is_default,
            "thresholds": yaml.safe_load(reply.yaml)}


def cmd_thresholds_set(args: argparse.Namespace) -> int:
    try:
        text = Path(args.file).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"{args.file}: {exc.strerror or exc}") from None
    request = admin_pb2.SetThresholdsRequest(pipeline=args.pipeline, yaml=text,
                                             source=args.file, dry_run=args.dry_run)
    reply = call_admin(args, "SetThresholds", request, _actor()).thresholds
    verb = "valid (dry run, nothing changed)" if args.dry_run else "applied"
    print(f"thresholds for {reply.pipeline} {verb}", file=sys.stderr)
    render(args, {"pipeline": reply.pipeline, "dry_run": args.dry_run,
                  "thresholds": yaml.safe_load(reply.yaml)}, reply.yaml.rstrip("\n"))
    return 0


def cmd_thresholds_history(args: argparse.Namespace) -> int:
    reply = all_pages(lambda r: call_admin(args, "ListThresholdChanges", r),
                      admin_pb2.ListThresholdChangesRequest(pipeline=args.pipeline), "changes",
                      limit=max(0, args.limit))
    doc = [{"pipeline": c.pipeline, "actor": c.actor, "peer": c.peer,
            "at": c.at.ToJsonString(), "before": yaml.safe_load(c.before),
            "after": yaml.safe_load(c.after)} for c in reply.changes]
    render(args, doc, lambda: table([("AT", "PIPELINE", "ACTOR", "PEER"),
                                     *((c["at"], c["pipeline"], c["actor"], c["peer"])
                                       for c in doc)]) if doc else None)
    return 0


def _pressure_rows(snapshot: Any) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = [
        ("PIPELINE", "STAGE", "LEVEL", "PRESSURE", "LAMBDA/S", "MU/S (N, CS2)", "QUEUE",
         "RT99 MS",
         "ADMIT", "CUTOFF", "CONC", "WAIT MS (N)", "SHED", "SIGNAL AGES")]
    for p in snapshot.pipelines:
        level = word(admin_pb2.PressureLevel, p.level)
        rows.append((p.pipeline, f"[{p.bottleneck or '-'}]", level, "",
                     f"{p.arrival_rate:.1f}", "", str(p.in_flight), "", f"{p.fraction:.0%}",
                     f"{p.cutoff:.2f}", str(p.concurrency or "-"),
                     f"{p.entry_wait_ms} ({p.entry_waiting})" if p.entry_wait_ms else "-",
                     str(p.shed_total), ""))
        for s in p.stages:
            level = word(admin_pb2.PressureLevel, s.level)
            if s.reason:
                level += f" ({word(admin_pb2.OverloadReason, s.reason)})"
            rows.append(("", s.name, level, f"{s.pressure:.2f}", f"{s.arrival_rate:.1f}",
                         f"{s.capacity:.1f} ({s.capacity_samples}, {s.service_cs2:.2f})",
                         f"{s.queue:.0f}", f"{s.rt99_ms:.1f}", "", "", "", "",
                         "", _ages(s.signals)))
    return rows


SOURCES = {"access_log": "log", "envoy_stats": "envoy", "triton_metrics": "triton"}


def _ages(signals: Any) -> str:
    """'log 0.95s envoy 0.20s': each source's age, marked when it is stale."""
    parts = []
    for age in signals:
        shown = "none" if age.age_s < 0 else f"{age.age_s:.2f}s"
        source = word(admin_pb2.SignalSource, age.source)
        parts.append(f"{SOURCES.get(source, source)} {shown}"
                     + (" STALE" if age.stale else ""))
    return " ".join(parts) or "-"


def cmd_pressure_watch(args: argparse.Namespace) -> int:
    live = sys.stdout.isatty() and args.output == "table"
    request = admin_pb2.WatchPressureRequest(pipeline=args.pipeline,
                                             interval_ms=max(0, args.interval_ms),
                                             count=max(0, args.count))
    with admin_call(args, "WatchPressure") as call:
        for snapshot in call(request):
            # A stream: one json line (NDJSON) or one yaml document per snapshot.
            if args.output == "json":
                print(json.dumps(message_dict(snapshot)), flush=True)
                continue
            if args.output == "yaml":
                print("---\n" + dump(message_dict(snapshot), "yaml"), flush=True)
                continue
            rows = table(_pressure_rows(snapshot))
            # On a terminal the table is redrawn in place; otherwise appended.
            print(("\x1b[H\x1b[2J" if live else "") + rows + ("" if live else "\n"),
                  flush=True)
    return 0


def _load(path: str, what: str) -> Any:
    text = read_text(path, what)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UsageError(f"{path}: invalid YAML: {str(exc).splitlines()[0]}") from None


def cmd_simulate(args: argparse.Namespace) -> int:
    from sitsmesh.chains.pipeline import pipeline_from
    from sitsmesh.pressure.simulate import profile_from, simulate, summary
    from sitsmesh.pressure.thresholds import thresholds_from

    doc = _load(args.pipeline, "the pipeline")
    if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
        raise UsageError(f"{args.pipeline}: a pipeline needs a name and stages")
    pipeline = pipeline_from(doc["name"], doc, args.pipeline)
    body = _load(args.thresholds, "the thresholds") if args.thresholds else {}
    thresholds = thresholds_from(body or {}, args.thresholds or "defaults")
    profile = profile_from(_load(args.load, "the load profile"), pipeline, args.load)
    policies = [thresholds.policy]
    if args.compare:
        policies += [p for p in ("sitsmesh", "seed", "off") if p != thresholds.policy]
    runs = {}
    for policy in policies:
        chosen = thresholds_from({**thresholds.to_body(), "policy": policy})
        seconds = simulate(pipeline, chosen, profile)
        runs[policy] = (seconds, summary(seconds))
    if args.output in ("json", "yaml"):
        render(args, {policy: {**result, "seconds": [
            {"t": s.at, "offered": s.offered, "admitted": s.admitted, "shed": s.shed,
             "goodput": s.good, "p99_ms": round(s.p99_ms, 1), "fraction": s.fraction}
            for s in seconds]} for policy, (seconds, result) in runs.items()}, None)
        return 0
    seconds, _ = runs[policies[0]]
    print(f"policy {policies[0]}, per second:")
    rows: list[tuple[str, ...]] = [
        ("T", "OFFERED", "ADMITTED", "SHED %", "GOODPUT", "P99 MS", "ADMIT")]
    rows += [(str(s.at), str(s.offered), str(s.admitted),
              f"{s.shed / s.offered:.0%}" if s.offered else "-", str(s.good),
              f"{s.p99_ms:.0f}", f"{s.fraction:.0%}") for s in seconds]
    print(table(rows))
    print("\nsummary:")
    # LATE BY OTHERS: protected requests late although the stages, serving protected
    # work alone, would have served them in time (the controller's share of lateness).
    rows = [("POLICY", "GOODPUT/S", "P99 MS", "SHED %", "LATE BY OTHERS",
             "SUCCESS BY PRIORITY")]
    for policy, (_, result) in runs.items():
        by = ", ".join(f"p{p} {v:.1%}" for p, v in result["success_by_priority"].items())
        rows.append((policy, f"{result['goodput_rps']:.1f}", f"{result['p99_ms']:.0f}",
                     f"{result['shed_fraction']:.0%}",
                     f"{result['protected_late_by_others']:.1%}", by))
    print(table(rows))
    return 0
