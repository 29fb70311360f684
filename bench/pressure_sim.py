"""The backpressure controller in the simulator over issue 29's scenarios: service-time
distributions x fan-out x access-log flush, several seeds each, against the issue's
targets (a baseline to measure the controller's changes by).

The scenario is tests/unit/test_pressure.py's: one stage at 20 ms mean per call,
capacity 50 pipeline requests/s (fan-out f: f servers, f calls per request), SLA
250 ms, 30 % of requests at priority 9 (never shed); 25/s (0.5x) for 6 s, then 100/s
(2x) until 20 s, then 25/s again until 30 s. The 1 s flush is Envoy's and Istio's
default access-log flush, with the stats sink every 0.25 s that sitsmesh's Envoy
configs set; the 20 ms flush has no stats sink. Per run:
- high priority on time: priority-9 requests served within the SLA, whole run; and
  "late by others": those late although the stage, serving priority 9 alone, would
  have served them in time with the very same service times (the controller's share;
  the rest is the distribution's own tail, which no admission control removes);
- false sheds at 0.5x: requests shed in the first 6 s, before any overload;
- goodput at 2x: requests/s within the SLA from 8 s to 20 s, against capacity (50/s);
- admitted p99 during the overload; low priority served within 2 s after the drop.

    PYTHONPATH=. .venv/bin/python bench/pressure_sim.py [--seeds 5] [--fanouts 1,2,4]
        [--entry-waits 0,100]
    PYTHONPATH=. .venv/bin/python bench/pressure_sim.py --step-alarms 0.06,0.12,5
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from sitsmesh.chains.pipeline import pipeline_from
from sitsmesh.pressure.simulate import SERVICE_KINDS, profile_from, simulate, summary
from sitsmesh.pressure.thresholds import thresholds_from

PIPELINE = pipeline_from("demo", {"stages": [
    {"name": "model", "match": {"upstream_cluster": "triton"}, "sla_p99_ms": 250}]})
CAPACITY = 50.0
STEPS = [(0, 25), (5.9, 25), (6, 100), (20, 100), (20.1, 25)]
FLUSHES = ((0.02, 0.0), (1.0, 0.25))   # (access-log flush, stats flush) seconds


def thresholds(fanout: int, wait_ms: int = 0) -> Any:
    return thresholds_from({"policy": "sitsmesh", "entry_wait_ms": wait_ms, "stages": {
        "model": {"queue_capacity": 32, "parallelism": fanout, "fanout": fanout}}})


def one(kind: str, fanout: int, flush: tuple[float, float], seed: int,
        wait_ms: int = 0) -> dict[str, float]:
    profile = profile_from({"duration_s": 30, "steps": [{"at_s": t, "rps": r} for t, r in STEPS],
                            "priorities": {0: 0.7, 9: 0.3}, "service_ms": {"model": 20},
                            "service": kind, "sla_ms": 250, "seed": seed,
                            "log_flush_s": flush[0], "stats_flush_s": flush[1]}, PIPELINE)
    seconds = simulate(PIPELINE, thresholds(fanout, wait_ms), profile)

    def tally(rows: Sequence[Any], priority: int) -> tuple[int, int]:
        pairs = [s.by_priority.get(priority, [0, 0]) for s in rows]
        return sum(o for o, _ in pairs), sum(g for _, g in pairs)

    offered9, good9 = tally(seconds, 9)
    calm = [s for s in seconds if s.at < 6]
    overload = [s for s in seconds if 8 <= s.at < 20]
    after = [s for s in seconds if 22 <= s.at < 30]
    offered0, good0 = tally(after, 0)
    return {"high_on_time": good9 / offered9 if offered9 else 1.0,
            "by_others": sum(s.late_by_others for s in seconds) / max(1, offered9),
            "alone": sum(s.late_alone for s in seconds) / max(1, offered9),
            "false_shed": sum(s.shed for s in calm) / max(1, sum(s.offered for s in calm)),
            "goodput": statistics.fmean(s.good for s in overload) / CAPACITY,
            "p99_ms": max(s.p99_ms for s in overload),
            "low_after": good0 / offered0 if offered0 else 1.0}


def onset_late(kind: str, alarm_s: float, seed: int) -> tuple[int, int]:
    """(late by others, protected) in the first 2 s of the step, fan-out 1, 20 ms flush."""
    profile = profile_from({"duration_s": 30, "steps": [{"at_s": t, "rps": r} for t, r in STEPS],
                            "priorities": {0: 0.7, 9: 0.3}, "service_ms": {"model": 20},
                            "service": kind, "sla_ms": 250, "seed": seed,
                            "log_flush_s": 0.02}, PIPELINE)
    seconds = [s for s in simulate(PIPELINE, replace(thresholds(1), step_alarm_s=alarm_s),
                                   profile) if 6 <= s.at < 8]
    return sum(s.late_by_others for s in seconds), sum(s.protected for s in seconds)


def seventy_shed(kind: str, flush: float, alarm_s: float, seed: int) -> float:
    """The shed share at a steady 70 % of capacity for 60 s (tests/unit/
    test_pressure_signals.py's no-false-shed case: exponential times get the 400 ms SLA
    they meet at that load)."""
    sla = 250 if kind == "fixed" else 400
    pipeline = pipeline_from("plain", {"stages": [
        {"name": "svc", "match": {"upstream_cluster": "svc"}, "sla_p99_ms": sla}]})
    profile = profile_from({"duration_s": 60, "steps": [{"at_s": 0, "rps": 35}],
                            "priorities": {0: 0.7, 9: 0.3}, "service_ms": {"svc": 20},
                            "service": kind, "log_flush_s": flush, "seed": seed}, pipeline)
    chosen = thresholds_from({"stages": {"svc": {"parallelism": 1}},
                              "step_alarm_s": alarm_s})
    return float(summary(simulate(pipeline, chosen, profile))["shed_fraction"])


def sweep(alarms: Sequence[float], seeds: int) -> None:
    print("| step_alarm_s | onset: late by others / protected | sheds at 70 % load: worst run |")
    print("|---:|---:|---:|")
    for alarm_s in alarms:
        pairs = [onset_late(kind, alarm_s, seed) for kind in ("exp", "lognormal", "bimodal")
                 for seed in range(1, seeds + 1)]
        worst = max(seventy_shed(kind, flush, alarm_s, seed) for kind in ("fixed", "exp")
                    for flush in (0.02, 1.0) for seed in (1, 2, 3))
        print(f"| {alarm_s:g} | {sum(p[0] for p in pairs)} / {sum(p[1] for p in pairs)} | "
              f"{worst:.2%} |", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--fanouts", default="1,2,4")
    p.add_argument("--kinds", default=",".join(SERVICE_KINDS))
    p.add_argument("--entry-waits", default="0",
                   help="entry_wait_ms values to run each cell with (paired seeds)")
    p.add_argument("--step-alarms", default="",
                   help="instead: sweep step_alarm_s over these values (onset against 70 %%)")
    args = p.parse_args(argv)
    if args.step_alarms:
        sweep([float(a) for a in args.step_alarms.split(",")], args.seeds)
        return 0
    waits = [int(w) for w in args.entry_waits.split(",")]
    print("| service | fan-out | log flush | entry wait ms | high on time (min, median) "
          "| high late by others (max) | high late alone (max) | false sheds at 0.5x (max) "
          "| goodput at 2x / capacity (min, median) | overload p99 ms (max) "
          "| low priority after the drop (min) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kind in args.kinds.split(","):
        for fanout in (int(f) for f in args.fanouts.split(",")):
            for flush, wait in ((f, w) for f in FLUSHES for w in waits):
                runs = [one(kind, fanout, flush, seed, wait)
                        for seed in range(1, args.seeds + 1)]
                high = [r["high_on_time"] for r in runs]
                good = [r["goodput"] for r in runs]
                print(f"| {kind} | {fanout} | {flush[0]:g} s | {wait} | {min(high):.2%}, "
                      f"{statistics.median(high):.2%} | "
                      f"{max(r['by_others'] for r in runs):.2%} | "
                      f"{max(r['alone'] for r in runs):.2%} | "
                      f"{max(r['false_shed'] for r in runs):.2%} | "
                      f"{min(good):.2f}, {statistics.median(good):.2f} | "
                      f"{max(r['p99_ms'] for r in runs):.0f} | "
                      f"{min(r['low_after'] for r in runs):.2%} |", flush=True)
    print("\nTargets (issue 29): high priority on time >= 99.9 % in every run (here: late "
          "by others <= 0.1 %, the rest being the distribution's own tail); false sheds at "
          "0.5x <= 0.5 %; goodput at 2x >= 0.95; p99 <= 250 ms; >= 99.5 % of low priority "
          "within 2 s of the drop.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
