"""Issue 29's scenario matrix on real Envoy: run.py once per service-time distribution and
fan-out, then one table over all of them.

Each combination is one ordinary run.py run (its options pass through: --scenarios,
--flush, --variants, --replicas, --rounds, ...) with `--distribution` and `--fanout`
set; only scenarios that --fanout shapes run again for the second and later fan-outs.
Each run's full report, JSON and plots go to `--out-dir` (default: a new temporary
directory, printed); stdout gets the one table: a row per (scenario, distribution,
fan-out, flush, sitsmesh replicas) with, for sitsmesh and adaptive_concurrency, the
median and the range (min-max) over the rounds of analysis.py's figures, and per
issue-29 target in how many rounds sitsmesh met it (analysis.target_checks).

The "service alone > SLA" column is not measured: it is the share of requests whose
own draws at the bottleneck (one per call: `fanout` of them in the fanout scenario)
already exceed the SLA, from 100 000 seeded draws of the same distribution
(stagesvc.ServiceTime). No admission control can serve those in time, so it bounds
the high-priority success any variant can reach.

    .venv/bin/python bench/overload/matrix.py --distributions fixed,exp,lognormal,bimodal
        --fanouts 2,4 [--out-dir DIR] [run.py options, e.g. --scenarios fanout --rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import analysis
import run
import scenarios

from sitsmesh.dev import stagesvc as stages

FLOOR_DRAWS = 100_000
SHORT = ("false sheds", "vs adaptive", "goodput", "p99", "high prio", "admission",
         "low after")  # target_checks' targets, in its order
OWN = ("--distribution", "--fanout", "--json", "--png-dir", "--replot")


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--distributions", default="fixed,exp,lognormal,bimodal",
                   help="comma-separated, of " + ",".join(stages.DISTRIBUTIONS))
    p.add_argument("--fanouts", default="2,4", help="comma-separated (default 2,4)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="each run's report, JSON and plots (default: a new temporary dir)")
    args, rest = p.parse_known_args(argv)
    args.dist_list = [d.strip() for d in args.distributions.split(",") if d.strip()]
    if not args.dist_list or set(args.dist_list) - set(stages.DISTRIBUTIONS):
        p.error(f"--distributions: choose from {', '.join(stages.DISTRIBUTIONS)}")
    fans = [f.strip() for f in args.fanouts.split(",") if f.strip()]
    if not fans or not all(f.isdigit() and 1 <= int(f) <= 16 for f in fans):
        p.error("--fanouts: integers within 1..16")
    args.fanout_list = list(dict.fromkeys(int(f) for f in fans))
    if clash := [a for a in rest if a.split("=", 1)[0] in OWN]:
        p.error(f"{clash[0]} is set by the matrix itself")
    return args, rest


def without(argv: Sequence[str], flag: str) -> list[str]:
    """`argv` without `flag` and its value (as `flag value` or `flag=value`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def combos(dists: Sequence[str], fanouts: Sequence[int], chosen: Sequence[scenarios.Scenario]
           ) -> list[tuple[str, int, list[str]]]:
    """(distribution, fan-out, scenario keys) per run: a scenario --fanout does not shape
    runs with the first fan-out only."""
    out = []
    for dist in dists:
        for i, fan in enumerate(fanouts):
            keys = [s.key for s in chosen if i == 0 or s.fans_out]
            if keys:
                out.append((dist, fan, keys))
    return out


def service_floor(scenario: str, dist: str, fanout: int, service_ms: float,
                  sla_ms: float, seed: int) -> float | None:
    """The share of requests whose own bottleneck draws exceed the SLA (see the docstring);
    None for Triton's model, whose service time is fixed by the demo model."""
    if scenario == "triton":
        return None
    calls = fanout if scenarios.SCENARIOS[scenario].fans_out else 1
    times = stages.ServiceTime(service_ms, dist, seed)
    sla_s = sla_ms / 1000
    over = sum(any(times.next() > sla_s for _ in range(calls)) for _ in range(FLOOR_DRAWS))
    return over / FLOOR_DRAWS


def spread(values: Sequence[float | None], fmt: Callable[[float], str]) -> str:
    """Median, and (min-max) when the rounds differ."""
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    mid, lo, hi = statistics.median(known), min(known), max(known)
    missing = f", {len(values) - len(known)}x none" if len(known) < len(values) else ""
    rng = f" ({fmt(lo)}-{fmt(hi)})" if hi > lo else ""
    return f"{fmt(mid)}{rng}{missing}" if rng or missing else fmt(mid)


FIGURES: list[tuple[str, Callable[[analysis.Summary], float | None], Callable[[float], str]]] = [
    ("high prio ok", lambda s: s.high_all, lambda v: analysis.fmt_pct(v, 2)),
    ("false sheds 0.5x", lambda s: s.false_shed, lambda v: analysis.fmt_pct(v, 2)),
    ("goodput 2x (% cap)", lambda s: s.goodput_2x_pct, lambda v: f"{v:.0f} %"),
    ("admitted p99 2x (ms)", lambda s: s.p99_2x_ms, analysis.fmt_ms),
    ("full admission (s)", lambda s: s.admission_s, lambda v: f"{v:.1f}"),
    ("low prio after drop", lambda s: s.low_after, analysis.fmt_pct),
]


def met_cell(rounds: Sequence[Sequence[analysis.Summary]], key: str, sla_ms: float) -> str:
    checks = [analysis.target_checks(r, sla_ms, key) for r in rounds]
    if not checks or not checks[0]:
        return "-"
    # Without adaptive_concurrency in the run there is no comparison with it.
    short = SHORT if len(checks[0]) == len(SHORT) else [n for n in SHORT if n != "vs adaptive"]
    n = len(checks)
    counts = [sum(c[i][1] for c in checks) for i in range(len(short))]
    missed = [f"{name} {k}/{n}" for name, k in zip(short, counts, strict=True) if k < n]
    whole = sum(k == n for k in counts)
    return f"{whole}/{len(short)}" + (f"; missed: {', '.join(missed)}" if missed else "")


def rows(doc: dict[str, Any], dist: str, fanout: int, opts: dict[str, Any]) -> list[str]:
    out = []
    for key, sc in doc["scenarios"].items():
        fan = str(fanout) if scenarios.SCENARIOS[key].fans_out else "-"
        floor = service_floor(key, dist, fanout, opts["service_ms"], opts["sla_ms"],
                              opts["seed"])
        floor_txt = "-" if floor is None else analysis.fmt_pct(floor, 3)
        flushes = list(sc["rounds"][0])
        for flush in flushes:
            per_round = [[analysis.Summary(**s) for s in rnd[flush]["summaries"]]
                         for rnd in sc["rounds"]]
            keys = [s.key for s in per_round[0] if s.key.startswith("sitsmesh")]
            for key_sm in keys or ["sitsmesh"]:
                suffix = key_sm[len("sitsmesh"):]
                replicas = suffix[2:] if suffix else "1"
                cells = []
                for base in ("sitsmesh", "adaptive"):
                    # adaptive_concurrency runs on the first replica count only.
                    mine = [by.get(base + suffix) or (by.get(base) if base == "adaptive"
                                                      else None)
                            for by in ({s.key: s for s in r} for r in per_round)]
                    for _, get, fmt in FIGURES:
                        cells.append("-" if not any(mine) else
                                     spread([get(s) if s else None for s in mine], fmt))
                out.append(f"| {key} | {dist} | {fan} | {flush} | {replicas} | "
                           f"{len(per_round)} | {floor_txt} | " + " | ".join(cells)
                           + f" | {met_cell(per_round, key_sm, opts['sla_ms'])} |")
    return out


def header() -> list[str]:
    names = [n for n, _, _ in FIGURES]
    cols = ([f"sitsmesh {n}" for n in names] + [f"adaptive_concurrency {n}" for n in names])
    return ["| scenario | distribution | fan-out | flush | replicas | rounds "
            "| service alone > SLA (expected) | " + " | ".join(cols)
            + " | sitsmesh targets met in every round |",
            "|---|---|---:|---|---:|---:|---:|" + "---:|" * len(cols) + "---|"]


def main(argv: Sequence[str] | None = None) -> int:
    args, rest = parse_args(argv)
    base = run.parse_args(rest)  # refuses a bad pass-through option before anything runs
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="overload-matrix-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    began = time.monotonic()
    lines = header()
    failed = []
    opts = {"service_ms": base.service_ms, "sla_ms": base.sla_ms, "seed": base.seed}
    for dist, fan, keys in combos(args.dist_list, args.fanout_list, base.scenario_list):
        name = f"{dist}-fanout{fan}"
        report_path, json_path = out_dir / f"{name}.md", out_dir / f"{name}.json"
        png_dir = out_dir / name
        png_dir.mkdir(exist_ok=True)
        argv_one = [*without(rest, "--scenarios"), "--scenarios", ",".join(keys),
                    "--distribution", dist, "--fanout", str(fan), "--json", str(json_path),
                    "--png-dir", str(png_dir)]
        run.say(f"[matrix] {name}: run.py {shlex.join(argv_one)}")
        with report_path.open("w") as fh, contextlib.redirect_stdout(fh):
            status = run.main(argv_one)
        if status or not json_path.exists():
            failed.append(name)
        if json_path.exists():
            lines += rows(json.loads(json_path.read_text()), dist, fan, opts)
    table = "\n".join(lines)
    text = (f"Overload matrix, {stamp}, commit {run.git_head()}; "
            f"{time.monotonic() - began:.0f} s; reports in {out_dir}\n\n{table}\n"
            + (f"\nFAILED (see their reports): {', '.join(failed)}\n" if failed else ""))
    (out_dir / "matrix.md").write_text(text)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
