"""Overload on real Envoy: no control vs Envoy adaptive_concurrency vs seed vs sitsmesh,
in three pipelines (scenarios.py), each at access-log flush 20 ms and 1 s (Envoy's and
Istio's default).

Everything is started (and stopped, also on failure) by this script on free
127.0.0.1 ports in a temporary directory. Per scenario: its stages (a tritonserver,
or sitsmesh.dev.stagesvc services in this process), one `sitsmesh serve` with the
pipeline applied by `sitsmesh pipelines apply` and thresholds by `sitsmesh thresholds
set` (only the policy and what an SRE knows of plain stages: parallelism, fanout), a
tenant and an API key. Per variant and flush setting, a fresh Envoy with one listener
per hop (topology.py); the variants differ only in the admission decision (stack.py).

First the capacity is measured: `--capacity-workers` closed-loop callers through a
no-control Envoy for `--capacity-s` seconds after 1 s of warm-up. Then every variant,
at every flush setting, gets the same open-loop load, scaled by that capacity:
Poisson arrivals (seeded; the same plan for every variant of a round) at 0.5x for
6 s, 2x for 8 s, 0.5x for 8 s (load.py); `--high-share` of them send `x-priority: 9`,
the others 0; callers give up after `--timeout-s`. Before each variant the stages'
queues drain.

Per variant (analysis.py): false sheds at 0.5x (requests answered 429/503 in the
first phase), goodput within the SLA at 2x (rps and % of capacity), admitted p99 at
2x, high-priority success, and after the drop to 0.5x the time to full admission (no
more sheds) and the share of low priority served within the SLA. The issue's
targets are checked for sitsmesh and printed (reported, not enforced), with the
per-second tables, sitsmesh's decisions every tick and adaptive_concurrency's
gradient controller. One PNG per scenario: `--png-dir`/overload-<scenario>.png.

With `--replicas 1,2` the variants that sitsmesh's controller decides (seed, sitsmesh)
run once per replica count, the others on the first count only, on the same stages,
capacity and load plans. Each count gets its own sitsmesh (N >= 2: N replicas sharing
one state dir and, through a redis-server, the controller, holds and hops; every Envoy
lists them all), fresh in every round and stopped before the next count's starts, so
the counts alternate through a noisy machine's ups and downs. Each such sitsmesh first
gets the closed loop the capacity is measured with (the first one's measurement sets
the capacity; the others' are printed).

    .venv/bin/python bench/overload/run.py [--scenarios triton,twohop,fanout]
        [--flush 0.02s,1s] [--variants none,adaptive,seed,sitsmesh] [--rounds 1]
        [--replicas 1] [--service-ms 20] [--distribution fixed] [--fanout 2]
        [--sla-ms 250] [--seed 1] [--json FILE] [--replot FILE]

`--distribution` is one of the simulator's (fixed, exp, lognormal, bimodal: the same
draws, sitsmesh.pressure.loadprofile.service_time); `--fanout N` makes `feat` call `model`
N times, on N workers, so the fanout scenario's capacity stays 50 rps at 20 ms. Several
distributions and fan-outs in one table: matrix.py.

One scenario at one flush setting takes about 2 minutes; all of it about 13.
Exit status 1 if a scenario fails to start or to run (the others still run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import analysis
import grpc
import load
import plot
import report
import scenarios
import stack as stk
import topology

from sitsmesh.dev import stagesvc as stages

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
Rounds = list[dict[str, list[stk.VariantRun]]]  # per round: flush -> the variants' runs
REPLICAS_NOTE = (
    "A variant on N >= 2 replicas (labelled xN) runs on N `sitsmesh serve` processes on one "
    "SQLite state dir with `--shared-runtime redis` on one redis-server; every Envoy lists "
    "all of them as endpoints of its sitsmesh cluster. Admin calls and WatchPressure (the "
    "controller tables: the leader's published decision) go to the first replica.")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])

    def listed(flag: str, value: str, known: Sequence[str] | None) -> list[str]:
        items = [k.strip() for k in value.split(",") if k.strip()]
        unknown = [k for k in items if known is not None and k not in known]
        if unknown or not items:
            p.error(f"{flag}: unknown {unknown}; choose from {', '.join(known or [])}")
        return items

    p.add_argument("--scenarios", default=",".join(scenarios.SCENARIOS),
                   help=f"comma-separated, in this order (default {','.join(scenarios.SCENARIOS)})")
    p.add_argument("--flush", default="0.02s,1s",
                   help="access-log flush intervals, comma-separated (default 0.02s,1s)")
    p.add_argument("--variants", default=",".join(stk.VARIANTS),
                   help=f"comma-separated, run in this order (default {','.join(stk.VARIANTS)})")
    p.add_argument("--replicas", default="1",
                   help="sitsmesh replica counts, comma-separated, run in this order "
                        f"(1..{stk.MAX_REPLICAS}; default 1)")
    p.add_argument("--service-ms", type=float, default=20.0,
                   help="the bottleneck's service time (default 20)")
    p.add_argument("--distribution", choices=stages.DISTRIBUTIONS, default="fixed",
                   help="service times of the plain bottleneck stages (default fixed)")
    p.add_argument("--fanout", type=int, default=2,
                   help="the fanout scenario's calls to model per request, and model's "
                        "workers (1..16; default 2)")
    p.add_argument("--sla-ms", type=float, default=250.0, help="stage SLA p99 (default 250)")
    p.add_argument("--timeout-s", type=float, default=2.0,
                   help="callers give up after this (default 2)")
    p.add_argument("--high-share", type=float, default=0.3,
                   help="share of requests at priority 9 (default 0.3)")
    p.add_argument("--seed", type=int, default=1,
                   help="seed of the arrivals (round r uses seed + r - 1) and service times")
    p.add_argument("--capacity", type=float, default=0.0,
                   help="capacity in requests/s for every scenario; 0 = measure (default)")
    p.add_argument("--capacity-s", type=float, default=4.0,
                   help="closed-loop measurement length (default 4)")
    p.add_argument("--capacity-workers", type=int, default=4,
                   help="closed-loop callers (default 4)")
    p.add_argument("--entry-wait-ms", type=int, default=None,
                   help="the sitsmesh policy's entry_wait_ms threshold (default: sitsmesh's)")
    p.add_argument("--rounds", type=int, default=1, help="repeat everything (default 1)")
    p.add_argument("--plot-round", type=int, default=1,
                   help="the round the PNGs show (default 1)")
    p.add_argument("--png-dir", type=Path, default=HERE,
                   help="where overload-<scenario>.png go (default bench/overload)")
    p.add_argument("--json", type=Path, default=None,
                   help="also write summaries, per-second numbers and ticks as JSON here")
    p.add_argument("--replot", type=Path, default=None,
                   help="only draw the PNGs again from a --json file of an earlier run")
    args = p.parse_args(argv)
    args.scenario_list = [scenarios.SCENARIOS[k] for k in
                          listed("--scenarios", args.scenarios, list(scenarios.SCENARIOS))]
    args.flush_list = listed("--flush", args.flush, None)
    for flush in args.flush_list:
        try:
            stk.flush_seconds(flush)
        except ValueError as exc:
            p.error(f"--flush: {exc}")
    args.variant_list = [stk.VARIANTS[k] for k in
                         listed("--variants", args.variants, list(stk.VARIANTS))]
    counts = listed("--replicas", args.replicas, None)
    if (not all(c.isdigit() and 1 <= int(c) <= stk.MAX_REPLICAS for c in counts)
            or len(set(counts)) != len(counts)):
        p.error(f"--replicas: distinct counts within 1..{stk.MAX_REPLICAS}, not {args.replicas}")
    args.replica_list = [int(c) for c in counts]
    if args.rounds < 1 or args.plot_round < 1 or args.rounds > 20:
        p.error("--rounds must be within 1..20 and --plot-round >= 1")
    if not 0 <= args.high_share <= 1:
        p.error("--high-share must be within 0..1")
    if not 1 <= args.fanout <= 16:
        p.error("--fanout must be within 1..16")
    args.opts = scenarios.Options(args.service_ms, args.distribution, args.sla_ms, args.seed,
                                  args.fanout)
    return args


def git_head() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=REPO, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "sitsmesh", "filters"],
                               capture_output=True, text=True, cwd=REPO, check=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" (sitsmesh/ or filters/ modified)" if dirty else "")


def tails(tmp: Path) -> list[str]:
    out = []
    for log in sorted(tmp.rglob("*.log")):
        with contextlib.suppress(OSError):
            text = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            if text:
                out.append(f"--- last lines of {log.name} ---\n{text}")
    return out


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_scenario(scenario: scenarios.Scenario, args: argparse.Namespace, tmp: Path
                 ) -> tuple[scenarios.Backend, float, Rounds, list[str]]:
    """The stages, then per replica count (and, with several counts, per round) a
    sitsmesh and its variants' runs; returns the capacity, the runs and notes on the
    closed loops that only warmed a sitsmesh up."""
    opts = args.opts
    every = list(range(1, args.rounds + 1))
    # One count: one sitsmesh for every round, as without --replicas.
    units = ([(args.replica_list[0], every)] if len(args.replica_list) == 1 else
             [(count, [rnd]) for rnd in every for count in args.replica_list])
    with contextlib.ExitStack() as exits:
        backend = scenario.start(tmp, exits, opts)
        if args.entry_wait_ms is not None:
            backend.top["entry_wait_ms"] = args.entry_wait_ms
        capacity = args.capacity if args.capacity > 0 else 0.0
        rounds: Rounds = [{flush: [] for flush in args.flush_list} for _ in every]
        notes: list[str] = []
        for count, rnds in units:
            variants = [stk.replicated(v, count) for v in args.variant_list
                        if count == args.replica_list[0] or v.policy != "off"]
            if not variants:
                continue
            with contextlib.ExitStack() as mine:  # one sitsmesh at a time
                tag = "" if len(units) == 1 else f"-r{rnds[0]}"
                stack = stk.start_sitsmesh(tmp, backend, mine, count, tag)
                if args.capacity <= 0:
                    measured, median = stk.measure_capacity(
                        stack, args.capacity_workers, args.capacity_s, args.timeout_s)
                    if not capacity:
                        capacity = measured
                        say(f"[{scenario.key}] capacity measured: {capacity:.1f} rps closed "
                            f"loop ({args.capacity_workers} callers, median latency "
                            f"{median:.0f} ms; nominal {backend.nominal_rps:.0f} rps)")
                    else:
                        notes.append(f"round {rnds[0]}, {count} replica(s), warmed up by the "
                                     f"same closed loop: {measured:.1f} rps, median latency "
                                     f"{median:.0f} ms (the load plans use {capacity:.1f} rps)")
                        say(f"[{scenario.key}] {notes[-1]}")
                for rnd in rnds:
                    plan = load.schedule(capacity, args.high_share, args.seed + rnd - 1)
                    for flush in args.flush_list:
                        for variant in variants:
                            rounds[rnd - 1][flush].append(
                                run_one(scenario.key, stack, variant, flush, plan, rnd,
                                        capacity, args))
        return backend, capacity, rounds, notes


def run_one(key: str, stack: stk.Stack, variant: stk.Variant, flush: str,
            plan: Sequence[tuple[float, int]], rnd: int, capacity: float,
            args: argparse.Namespace) -> stk.VariantRun:
    began = time.monotonic()
    one = stk.run_variant(stack, variant, flush, plan, args.timeout_s)
    s = analysis.summarise(one, capacity, args.sla_ms)
    say(f"[{key}] round {rnd} flush {flush} {variant.label:<21} "
        f"false sheds {analysis.fmt_pct(s.false_shed, 2)}  goodput 2x "
        f"{s.goodput_2x:5.1f} rps ({s.goodput_2x_pct:3.0f} %)  p99 2x "
        f"{analysis.fmt_ms(s.p99_2x_ms):>5} ms  high "
        f"{analysis.fmt_pct(s.high_all, 2)}  admission "
        f"{analysis.fmt_s(s.admission_s)}  low after "
        f"{analysis.fmt_pct(s.low_after)}  ({time.monotonic() - began:.0f} s)")
    return one


def print_scenario(scenario: scenarios.Scenario, backend: scenarios.Backend, capacity: float,
                   rounds: Rounds, notes: Sequence[str], args: argparse.Namespace
                   ) -> dict[str, list[analysis.Summary]]:
    """The scenario's tables; returns the plotted round's summaries per flush."""
    tag = scenario.tag(args.opts)
    print(f"\n## {scenario.heading(args.opts)}\n\n{backend.describe}; capacity {capacity:.1f} rps "
          f"(nominal {backend.nominal_rps:.0f}); bottleneck stage `{backend.bottleneck}`; "
          f"thresholds set: `{backend.thresholds_flow('sitsmesh')}`")
    if args.replica_list != [1]:
        print(f"\nsitsmesh replica counts, in this order: {args.replica_list}. "
              f"{REPLICAS_NOTE}" + "".join(f"\n\n- {n}" for n in notes))
    shown = min(args.plot_round, len(rounds)) - 1
    out: dict[str, list[analysis.Summary]] = {}
    for flush in args.flush_list:
        per_round = [[analysis.summarise(r, capacity, args.sla_ms) for r in rnd[flush]]
                     for rnd in rounds]
        out[flush] = per_round[shown]
        runs = rounds[shown][flush]
        print(f"\n### {tag}, access-log flush {flush} (round {shown + 1})\n")
        print(report.summary_table(per_round[shown]))
        print()
        print("\n".join(report.targets(per_round[shown], args.sla_ms)))
        if len(rounds) > 1:
            print(f"\n{tag}, flush {flush}, over {len(rounds)} rounds:\n")
            print(report.spread_table(per_round))
            print("\n".join(["", *report.rounds_met(per_round, args.sla_ms)]))
        print(f"\nPer second sent (goodput / admitted p99 / shed), {tag}, "
              f"flush {flush}:\n")
        print(report.seconds_table(runs, args.sla_ms))
        for r in runs:
            if r.variant.policy == "sitsmesh":
                print(f"\n{r.variant.label} controller per second ({tag}, flush "
                      f"{flush}; stage columns: {backend.bottleneck}):\n")
                print(report.controller_table(r, args.sla_ms))
            if r.variant.adaptive:
                print(f"\nadaptive_concurrency per second ({tag}, flush {flush}):\n")
                print(report.adaptive_table(r))
        print("\nNotes:\n")
        for s in per_round[shown]:
            codes = ", ".join(f"{k}: {v}" for k, v in s.codes.items())
            settled = ("did not admit everything within 30 s before it"
                       if s.settled_before_s is None
                       else f"admitted everything {s.settled_before_s:.1f} s before it")
            print(f"- {s.label}: statuses {codes}; client start lag p99 {s.lag_p99_ms:.1f} ms,"
                  f" max {s.lag_max_ms:.1f} ms; sitsmesh {settled}; the stages drained "
                  f"{s.drained_after_s:.1f} s after it")
        for r in runs:
            if r.variant.policy == "sitsmesh":
                for note in report.controller_notes(r, capacity):
                    print(f"- {r.variant.label} controller: {note}")
            if r.replicas:
                print(f"- {r.variant.label}: {report.replica_note(r.replicas)}")
    return out


def draw(scenario_key: str, title: str, capacity: float,
         seconds: dict[str, dict[str, list[analysis.Second]]], args: argparse.Namespace) -> Path:
    path: Path = args.png_dir / f"overload-{scenario_key}.png"
    plot.plot(title, seconds, capacity, args.sla_ms, path)
    return path


def replot(path: Path, args: argparse.Namespace) -> int:
    doc = json.loads(path.read_text())
    for key, sc in doc["scenarios"].items():
        rounds = sc["rounds"]
        shown = rounds[min(args.plot_round, len(rounds)) - 1]
        seconds = {flush: {v: [analysis.Second(**x) for x in secs]
                           for v, secs in per["seconds"].items()}
                   for flush, per in shown.items()}
        out = draw(key, sc["title"], float(sc["capacity"]), seconds, args)
        print(f"plot of {key} from {path} (commit {doc.get('commit', '?')}): {out}")
    return 0


def as_json(capacity: float, title: str, rounds: Rounds, sla_ms: float) -> dict[str, Any]:
    return {"title": title, "capacity": capacity, "rounds": [{
        flush: {"summaries": [asdict(analysis.summarise(r, capacity, sla_ms)) for r in runs],
                "seconds": {r.variant.key: [asdict(x) for x in analysis.per_second(r, sla_ms)]
                            for r in runs},
                "ticks": {r.variant.key: [{"t": round(t - r.t0, 3), **d} for t, d in r.pressure]
                          for r in runs}}
        for flush, runs in rnd.items()} for rnd in rounds]}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot is not None:
        return replot(args.replot, args)
    started = time.monotonic()
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    head_before = git_head()
    print(f"# Overload, {stamp}, commit {head_before}\n\nSLA {args.sla_ms:g} ms; client "
          f"timeout {args.timeout_s:g} s; {args.high_share:.0%} priority 9; Poisson arrivals, "
          f"seed {args.seed}; profile: {load.describe_profile()}; {args.rounds} round(s); "
          f"{os.cpu_count()} CPUs; Envoy stats flush {topology.STATS_FLUSH}")
    overview: list[tuple[str, str, float, Sequence[analysis.Summary]]] = []
    doc: dict[str, Any] = {"at": stamp, "commit": head_before, "scenarios": {}}
    failed = False
    for scenario in args.scenario_list:
        with tempfile.TemporaryDirectory(prefix=f"bench-overload-{scenario.key}-") as name:
            tmp = Path(name)
            try:
                backend, capacity, rounds, notes = run_scenario(scenario, args, tmp)
            except (stk.BenchError, RuntimeError, TimeoutError, OSError, ValueError,
                    grpc.RpcError, subprocess.SubprocessError) as exc:
                failed = True
                detail = "\n".join([f"{type(exc).__name__}: {exc}", *tails(tmp)])
                print(f"\n## {scenario.heading(args.opts)}\n\nFAILED: {exc}")
                say(f"FAILED {scenario.key}: {detail}")
                continue
        summaries = print_scenario(scenario, backend, capacity, rounds, notes, args)
        overview += [(scenario.tag(args.opts), flush, capacity, s)
                     for flush, s in summaries.items()]
        shown = rounds[min(args.plot_round, len(rounds)) - 1]
        png = draw(scenario.key, scenario.heading(args.opts), capacity,
                   {flush: {r.variant.key: analysis.per_second(r, args.sla_ms) for r in runs}
                    for flush, runs in shown.items()}, args)
        print(f"\n- plot: {png}")
        doc["scenarios"][scenario.key] = as_json(capacity, scenario.heading(args.opts),
                                                 rounds, args.sla_ms)
    head_after = git_head()
    if head_after != head_before:
        print(f"\nHEAD moved during the run: {head_before} at the start, {head_after} at the "
              "end (each sitsmesh serve ran the code of its start)")
    print("\n## Overview: sitsmesh against the targets\n")
    print(report.overview(overview, args.sla_ms))
    print(f"\n{time.monotonic() - started:.0f} s in all")
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
