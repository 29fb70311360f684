"""`sitsmesh pipelines ...` and `sitsmesh chain show`: pipelines and their latency chains."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.cli.common import (
    EXIT_FAILED,
    Subcommands,
    UsageError,
    add_common_admin,
    call_admin,
    die,
    print_json,
    read_text,
)


def add_commands(sub: Subcommands) -> None:
    pipelines = sub.add_parser("pipelines", help="manage pipelines (admin API)").add_subparsers(
        dest="pipelines_command", required=True)
    p = pipelines.add_parser("apply", help="store a pipeline from a YAML file")
    p.add_argument("file", metavar="FILE.yaml")
    add_common_admin(p)
    p.set_defaults(func=cmd_pipelines)
    for action in ("get", "delete"):
        p = pipelines.add_parser(action, help=f"{action} a pipeline")
        p.add_argument("name")
        add_common_admin(p)
        p.set_defaults(func=cmd_pipelines)
    p = pipelines.add_parser("list", help="list pipelines")
    add_common_admin(p)
    p.set_defaults(func=cmd_pipelines)

    chain = sub.add_parser("chain", help="latency chains (admin API)").add_subparsers(
        dest="chain_command", required=True)
    p = chain.add_parser("show", help="per-stage latency and the bottleneck of a pipeline")
    p.add_argument("pipeline")
    p.add_argument("--window", choices=("1m", "5m"), default="1m")
    add_common_admin(p)
    p.set_defaults(func=cmd_chain_show)


def cmd_pipelines(args: argparse.Namespace) -> int:
    action = args.pipelines_command
    if action == "apply":
        path = Path(args.file)
        try:
            text = read_text(path)
        except UsageError as exc:  # an unreadable file fails `apply` (1), not usage (2)
            return die(str(exc), EXIT_FAILED)
        reply = call_admin(args, "ApplyPipeline",
                           admin_pb2.ApplyPipelineRequest(yaml=text, source=str(path)))
        print(f"applied pipeline {reply.name}")
    elif action == "get":
        reply = call_admin(args, "GetPipeline", admin_pb2.GetPipelineRequest(name=args.name))
        if args.output == "json":
            print_json(reply)
        else:
            print(reply.yaml, end="")
    elif action == "list":
        reply = call_admin(args, "ListPipelines", admin_pb2.ListPipelinesRequest())
        if args.output == "json":
            print_json(reply)
        else:
            for pipeline in reply.pipelines:
                print(pipeline.name)
    else:
        call_admin(args, "DeletePipeline", admin_pb2.DeletePipelineRequest(name=args.name))
        print(f"deleted pipeline {args.name}")
    return 0


def cmd_chain_show(args: argparse.Namespace) -> int:
    reply = call_admin(args, "GetLatencyChain", admin_pb2.GetLatencyChainRequest(
        pipeline=args.pipeline, window=args.window))
    stages = []
    for s in reply.stages:
        stage: dict[str, Any] = {"name": s.name, "p50_ms": s.p50_ms, "p90_ms": s.p90_ms,
                                 "p99_ms": s.p99_ms, "attributed_ms": s.attributed_ms,
                                 "share_of_e2e_p99": s.share_of_e2e_p99}
        if s.HasField("ttfb_p99_ms"):
            stage["ttfb_p99_ms"] = s.ttfb_p99_ms
        if s.HasField("total_p99_ms"):
            stage["total_p99_ms"] = s.total_p99_ms
        if s.HasField("queue_p99_ms"):
            stage["queue_p99_ms"] = s.queue_p99_ms
        stages.append(stage)
    doc = {"pipeline": reply.pipeline, "window": reply.window, "chains": reply.chains,
           "incomplete": reply.incomplete, "failed": reply.failed,
           "e2e_p50_ms": reply.e2e_p50_ms,
           "e2e_p99_ms": reply.e2e_p99_ms, "bottleneck": reply.bottleneck, "stages": stages}
    if args.output == "json":
        print(json.dumps(doc, indent=2))
        return 0
    print(f"pipeline {reply.pipeline}, last {reply.window}: {reply.chains} chains "
          f"({reply.incomplete} incomplete); end to end p50 {reply.e2e_p50_ms:.1f} ms, "
          f"p99 {reply.e2e_p99_ms:.1f} ms; bottleneck: {reply.bottleneck or '-'}")
    print("STAGE             P50 ms   P90 ms   P99 ms  TTFB99 ms  SLOWEST-1% ms  SHARE")
    for s in stages:
        ttfb = f"{s['ttfb_p99_ms']:.1f}" if "ttfb_p99_ms" in s else "-"
        print(f"{s['name']:<16} {s['p50_ms']:>7.1f}  {s['p90_ms']:>7.1f}  {s['p99_ms']:>7.1f}  "
              f"{ttfb:>9}  {s['attributed_ms']:>13.1f}  {s['share_of_e2e_p99']:>5.0%}")
    return 0
