"""`sitsmesh pipelines ...` and `sitsmesh chain show`: pipelines and their latency chains."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.cli.chainhtml import render as render_html
from sitsmesh.cli.common import (
    EXIT_FAILED,
    Subcommands,
    UsageError,
    add_common_admin,
    all_pages,
    call_admin,
    die,
    examples,
    message_dict,
    read_text,
    render,
    table,
)


def add_commands(sub: Subcommands) -> None:
    pipelines = sub.add_parser("pipelines", help="manage pipelines (admin API)", **examples(
        "sitsmesh pipelines apply demo.yaml",
        "sitsmesh pipelines list -o json",
        "sitsmesh pipelines get demo > demo.yaml")).add_subparsers(
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

    chain = sub.add_parser("chain", help="latency chains (admin API)", **examples(
        "sitsmesh chain show demo",
        "sitsmesh chain show demo --window 5m -o yaml",
        "sitsmesh chain show demo -o html --out chain.html")).add_subparsers(
        dest="chain_command", required=True)
    p = chain.add_parser("show", help="per-stage latency and the bottleneck of a pipeline")
    p.add_argument("pipeline")
    p.add_argument("--window", choices=("1m", "5m"), default="1m")
    p.add_argument("--out", metavar="FILE",
                   help="with --output html: write the page here instead of to stdout")
    add_common_admin(p, outputs=("table", "json", "yaml", "html"))
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
                           admin_pb2.ApplyPipelineRequest(yaml=text, source=str(path))).pipeline
        render(args, message_dict(reply), f"applied pipeline {reply.name}")
    elif action == "get":
        reply = call_admin(args, "GetPipeline",
                           admin_pb2.GetPipelineRequest(name=args.name)).pipeline
        render(args, message_dict(reply), reply.yaml.rstrip("\n"))
    elif action == "list":
        reply = all_pages(lambda r: call_admin(args, "ListPipelines", r),
                          admin_pb2.ListPipelinesRequest(), "pipelines")
        render(args, message_dict(reply), "\n".join(p.name for p in reply.pipelines) or None)
    else:
        call_admin(args, "DeletePipeline", admin_pb2.DeletePipelineRequest(name=args.name))
        render(args, {"deleted": {"pipeline": args.name}}, f"deleted pipeline {args.name}")
    return 0


SLOWEST_SHOWN = 5  # rows of the table's "slowest" section; json and html have them all
TOKEN_FIELDS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
REQUEST_TOKEN_FIELDS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
STREAM_FIELDS = ("ttft_ms", "itl_p50_ms", "itl_p99_ms")


def cmd_chain_show(args: argparse.Namespace) -> int:
    if args.out and args.output != "html":
        raise UsageError("--out goes with --output html")
    reply = call_admin(args, "GetLatencyChain", admin_pb2.GetLatencyChainRequest(
        pipeline=args.pipeline, window=args.window)).chain
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
        if s.token_streams:
            stage["tokens"] = {name: getattr(s, name) for name in TOKEN_FIELDS
                               if s.HasField(name)}
            stage["tokens"].update(streams=s.token_streams, output_tokens=s.output_tokens,
                                   stalls=s.stalls)
            if s.HasField("stall_max_ms"):
                stage["tokens"]["stall_max_ms"] = s.stall_max_ms
        if reply.token_chains:
            stage.update(ttft_attributed_ms=s.ttft_attributed_ms, ttft_share=s.ttft_share)
        stages.append(stage)
    doc = {"pipeline": reply.pipeline, "window": reply.window, "chains": reply.chains,
           "incomplete": reply.incomplete, "failed": reply.failed,
           "e2e_p50_ms": reply.e2e_p50_ms,
           "e2e_p99_ms": reply.e2e_p99_ms, "bottleneck": reply.bottleneck, "stages": stages,
           "slowest": [_slow_chain(c) for c in reply.slowest],
           "histograms": [{"name": h.name, "buckets": [{"le_ms": b.le_ms, "count": b.count}
                                                       for b in h.buckets]}
                          for h in reply.histograms]}
    if reply.token_chains or reply.token_reports_dropped:
        doc["tokens"] = {name: getattr(reply, name) for name in REQUEST_TOKEN_FIELDS
                         if reply.HasField(name)}
        doc["tokens"].update(chains=reply.token_chains, ttft_owner=reply.ttft_owner,
                             reports_dropped=reply.token_reports_dropped)
    if args.output in ("json", "yaml"):
        render(args, doc, None)
        return 0
    if args.output == "html":
        return _write_html(render_html(doc), args.out)
    print(f"pipeline {reply.pipeline}, last {reply.window}: {reply.chains} chains "
          f"({reply.incomplete} incomplete); end to end p50 {reply.e2e_p50_ms:.1f} ms, "
          f"p99 {reply.e2e_p99_ms:.1f} ms; bottleneck: {reply.bottleneck or '-'}")
    rows = [("STAGE", "P50 ms", "P90 ms", "P99 ms", "TTFB99 ms", "SLOWEST-1% ms", "SHARE")]
    rows += [(s["name"], f"{s['p50_ms']:.1f}", f"{s['p90_ms']:.1f}", f"{s['p99_ms']:.1f}",
              f"{s['ttfb_p99_ms']:.1f}" if "ttfb_p99_ms" in s else "-",
              f"{s['attributed_ms']:.1f}", f"{s['share_of_e2e_p99']:.0%}") for s in stages]
    print(table(rows))
    streamed = [s for s in stages if "tokens" in s]
    if streamed:
        tokens = [("TOKEN STREAMS", "STREAMS", "TTFT50 ms", "TTFT99 ms", "TPOT50 ms",
                   "TPOT99 ms", "TOKENS", "STALLS", "LONGEST STALL ms")]
        tokens += [(s["name"], str(t["streams"]), *(f"{t[n]:.1f}" if n in t else "-"
                                                  for n in TOKEN_FIELDS),
                    str(t["output_tokens"]), str(t["stalls"]),
                    f"{t['stall_max_ms']:.0f}" if "stall_max_ms" in t else "-")
                   for s in streamed for t in (s["tokens"],)]
        print()
        print(table(tokens))
    if "tokens" in doc:
        print()
        print(_request_tokens(doc["tokens"], stages))
    if doc["slowest"]:
        # TTFT and stalls where the pipeline streams: the table stays as it was elsewhere.
        streams = any("ttft_ms" in c for c in doc["slowest"])
        slow = [(f"SLOWEST (of {len(doc['slowest'])})", "E2E ms",
                 *(("TTFT ms", "STALLS") if streams else ()), "TRACE ID", "REQUEST ID")]
        slow += [("", f"{c['e2e_ms']:.1f}",
                  *((f"{c['ttft_ms']:.1f}" if "ttft_ms" in c else "-", _stalls(c))
                    if streams else ()),
                  _printable(c["trace_id"]) or "-",
                  _printable(c["request_id"])) for c in doc["slowest"][:SLOWEST_SHOWN]]
        print()
        print(table(slow))
    return 0


def _slow_chain(chain: admin_pb2.SlowChain) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "request_id": chain.request_id, "trace_id": chain.trace_id, "e2e_ms": chain.e2e_ms,
        "failed": chain.failed, "stages": [_slow_stage(s) for s in chain.stages]}
    if chain.HasField("ttft_ms"):
        doc.update(ttft_ms=chain.ttft_ms, ttft_owner=chain.ttft_owner)
    return doc


def _slow_stage(s: admin_pb2.SlowChainStage) -> dict[str, Any]:
    doc: dict[str, Any] = {"name": s.name, "offset_ms": s.offset_ms, "own_ms": s.own_ms,
                           "total_ms": s.total_ms}
    if s.HasField("ttft_part_ms"):
        doc["ttft_part_ms"] = s.ttft_part_ms
    if s.HasField("stream"):
        stream = s.stream
        doc["stream"] = {name: getattr(stream, name) for name in STREAM_FIELDS
                         if stream.HasField(name)}
        doc["stream"].update(
            output_tokens=stream.output_tokens, tokens_per_s=stream.tokens_per_s,
            stall_count=stream.stall_count, end=stream.end,
            stalls=[{"after_ms": t.after_ms, "length_ms": t.length_ms} for t in stream.stalls])
    return doc


def _stalls(chain: dict[str, Any]) -> str:
    """`llm 2000 ms @+310 ms`: each stall of the chain, with its stage, length and when."""
    named = [f"{_printable(s['name'])} {t['length_ms']:.0f} ms @+{t['after_ms']:.0f} ms"
             for s in chain["stages"] for t in s.get("stream", {}).get("stalls", [])]
    return ", ".join(named) or "-"


def _request_tokens(tokens: dict[str, Any], stages: list[dict[str, Any]]) -> str:
    def ms(name: str) -> str:
        return f"{tokens[name]:.1f}" if name in tokens else "-"

    owner = tokens["ttft_owner"]
    part = next((s for s in stages if s["name"] == owner), None)
    owned = (f" ({part['ttft_attributed_ms']:.1f} ms, {part['ttft_share']:.0%})"
             if part is not None and "ttft_attributed_ms" in part else "")
    return (f"requests with tokens: {tokens['chains']}; TTFT p50 {ms('ttft_p50_ms')} ms, "
            f"p99 {ms('ttft_p99_ms')} ms; ITL p50 {ms('itl_p50_ms')} ms, "
            f"p99 {ms('itl_p99_ms')} ms; TTFT owner in the slowest 1 %: "
            f"{_printable(owner) or '-'}{owned}")


def _printable(text: str) -> str:
    """Request ids are the sender's: escape what a terminal would act on (ESC, CR...)."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def _write_html(page: str, out: str | None) -> int:
    if not out:
        sys.stdout.write(page)
        return 0
    try:
        Path(out).write_text(page, encoding="utf-8")
    except OSError as exc:
        return die(f"{out}: cannot write: {exc.strerror or exc}", EXIT_FAILED)
    print(f"wrote {out}")
    return 0
