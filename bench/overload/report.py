"""Markdown tables: per variant, per second, sitsmesh's and adaptive_concurrency's
controllers, the targets, the spread over rounds and the overview of all scenarios."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from analysis import Summary, fmt_ms, fmt_pct, fmt_s, per_second, target_checks
from load import multiplier, phase, total_s
from stack import ReplicaShare, VariantRun, base_key


def summary_table(summaries: Sequence[Summary]) -> str:
    lines = ["| variant | requests | false sheds 0.5x | goodput 2x (rps) | goodput 2x (% cap) "
             "| admitted p99 2x (ms) | admitted p99 all (ms) | high prio ok | low prio ok "
             "| full admission after drop | low prio served after drop | shed | timed out "
             "| other errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summaries:
        lines.append(
            f"| {s.label} | {s.requests} | {fmt_pct(s.false_shed, 2)} | {s.goodput_2x:.1f} "
            f"| {s.goodput_2x_pct:.0f} % | {fmt_ms(s.p99_2x_ms)} | {fmt_ms(s.p99_all_ms)} "
            f"| {fmt_pct(s.high_all, 2)} | {fmt_pct(s.low_all)} | {fmt_s(s.admission_s)} "
            f"| {fmt_pct(s.low_after)} | {s.shed} | {s.timeouts} | {s.other_errors} |")
    return "\n".join(lines)


def sitsmesh_keys(summaries: Sequence[Summary]) -> list[tuple[str, str]]:
    """(key, label) of every sitsmesh variant that ran, on any number of replicas."""
    return [(s.key, s.label) for s in summaries if base_key(s.key) == "sitsmesh"]


def targets(summaries: Sequence[Summary], sla_ms: float) -> list[str]:
    out: list[str] = []
    for key, label in sitsmesh_keys(summaries):
        checks = target_checks(summaries, sla_ms, key)
        met = sum(ok for _, ok, _ in checks)
        out += [*([""] if out else []), f"{label} met {met} of {len(checks)} targets:", "",
                *(f"- {name}: {'met' if ok else '**not met**'} ({detail})"
                  for name, ok, detail in checks)]
    return out or ["- sitsmesh was not run: no targets checked"]


def seconds_table(runs: Sequence[VariantRun], sla_ms: float) -> str:
    per = {run.variant.key: per_second(run, sla_ms) for run in runs}
    head = ("| t (s) | load | offered | "
            + " | ".join(f"{r.variant.label}: good / p99 ms / shed" for r in runs) + " |")
    lines = [head, "|---:|---:|---:|" + "---:|" * len(runs)]
    first = per[runs[0].variant.key]
    for s in range(len(first)):
        cells = []
        for run in runs:
            sec = per[run.variant.key][s]
            extra = f" ({sec.timeouts} t/o)" if sec.timeouts else ""
            cells.append(f"{sec.goodput} / {fmt_ms(sec.p99_ms)} / {sec.shed}{extra}")
        lines.append(f"| {s}-{s + 1} | {multiplier(s + 0.5):.2f}x | {first[s].offered} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def controller_table(run: VariantRun, sla_ms: float) -> str:
    """sitsmesh's decisions per second of the run, beside what the client saw; the stage
    columns are the scenario's bottleneck stage."""
    secs = per_second(run, sla_ms)
    lines = ["| t (s) | offered | goodput | shed | fraction (min) | cutoff (max) "
             "| concurrency (min-max) | in flight (max) | lambda (max) | mu (mean) "
             "| queue (max) | rt99 ms (max) | level (worst) | bottleneck |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    order = {"ok": 0, "high": 1, "overloaded": 2, "stale": 3}
    for s, sec in enumerate(secs):
        ticks = [d for t, d in run.pressure if s <= t - run.t0 < s + 1]
        if not ticks:
            lines.append(f"| {s}-{s + 1} | {sec.offered} | {sec.goodput} | {sec.shed} "
                         "| - | - | - | - | - | - | - | - | - | - |")
            continue
        conc = [d["concurrency"] for d in ticks]
        named = sorted({d["bottleneck"] for d in ticks if d["bottleneck"]})
        lines.append(
            f"| {s}-{s + 1} | {sec.offered} | {sec.goodput} | {sec.shed} "
            f"| {min(d['fraction'] for d in ticks):.2f} "
            f"| {max(d['cutoff'] for d in ticks):.2f} | {min(conc)}-{max(conc)} "
            f"| {max(d['in_flight'] for d in ticks)} | {max(d['lam'] for d in ticks):.0f} "
            f"| {sum(d['mu'] for d in ticks) / len(ticks):.1f} "
            f"| {max(d['queue'] for d in ticks):.0f} "
            f"| {max(d['rt99_ms'] for d in ticks):.0f} "
            f"| {max((d['level'] for d in ticks), key=lambda x: order.get(x, 9))} "
            f"| {', '.join(named) or '-'} |")
    return "\n".join(lines)


def adaptive_table(run: VariantRun) -> str:
    lines = ["| t (s) | concurrency_limit (min-max) | min_rtt_msecs | sample_rtt_msecs (max) "
             "| rq_blocked (in the second) |", "|---:|---:|---:|---:|---:|"]
    prev_blocked = 0.0
    for s in range(math.ceil(total_s())):
        rows = [v for t, v in run.envoy_stats if s <= t - run.t0 < s + 1]
        if not rows:
            continue
        limits = [v.get("concurrency_limit", 0) for v in rows]
        blocked = max(v.get("rq_blocked", 0) for v in rows)
        lines.append(f"| {s}-{s + 1} | {min(limits):.0f}-{max(limits):.0f} "
                     f"| {rows[-1].get('min_rtt_msecs', 0):.0f} "
                     f"| {max(v.get('sample_rtt_msecs', 0) for v in rows):.0f} "
                     f"| {blocked - prev_blocked:.0f} |")
        prev_blocked = blocked
    return "\n".join(lines)


def controller_notes(run: VariantRun, capacity: float) -> list[str]:
    """What looks wrong in sitsmesh's own estimates of the bottleneck during the run."""
    ticks = [(t - run.t0, d) for t, d in run.pressure if 0 <= t - run.t0 <= total_s()]
    if not ticks:
        return []
    t_mu, top = max(ticks, key=lambda x: x[1]["mu"])
    t_cap, cap = max(ticks, key=lambda x: x[1]["concurrency"])
    low = [d["mu"] for t, d in ticks if phase("2x")[0] <= t < phase("2x")[1] and d["mu"]]
    out = [f"bottleneck capacity estimate (mu) peaked at {top['mu']:.0f} rps at "
           f"t={t_mu:.1f} s (measured capacity {capacity:.0f} rps; in the 2x phase it ranged "
           + (f"{min(low):.0f}-{max(low):.0f}" if low else "-")
           + f" rps); concurrency cap peaked at {cap['concurrency']} at t={t_cap:.1f} s"]
    wild = [(t, d) for t, d in ticks if d["mu"] > 2 * capacity]
    if wild:
        out.append(f"mu above 2x the measured capacity in {len(wild)} ticks, "
                   f"t={wild[0][0]:.1f}-{wild[-1][0]:.1f} s")
    return out


def _mmm(values: Sequence[float | None], fmt: Callable[[float], str]) -> str:
    known = sorted(v for v in values if v is not None)
    if not known:
        return "-"
    mid = known[len(known) // 2] if len(known) % 2 else (
        (known[len(known) // 2 - 1] + known[len(known) // 2]) / 2)
    missing = len(values) - len(known)
    extra = f" ({missing}x none)" if missing else ""
    return f"{fmt(known[0])} / {fmt(mid)} / {fmt(known[-1])}{extra}"


def spread_table(rounds: Sequence[Sequence[Summary]]) -> str:
    """Per variant, min / median / max over the rounds."""
    lines = [f"| variant (min / median / max of {len(rounds)} rounds) | false sheds 0.5x "
             "| goodput 2x (rps) | admitted p99 2x (ms) | high prio ok | full admission (s) "
             "| low prio served after drop |", "|---|---:|---:|---:|---:|---:|---:|"]
    for key in [s.key for s in rounds[0]]:
        rs = [next(s for s in r if s.key == key) for r in rounds]
        lines.append(
            f"| {rs[0].label} | {_mmm([s.false_shed for s in rs], lambda v: fmt_pct(v, 2))} "
            f"| {_mmm([s.goodput_2x for s in rs], lambda v: f'{v:.1f}')} "
            f"| {_mmm([s.p99_2x_ms for s in rs], lambda v: f'{v:.0f}')} "
            f"| {_mmm([s.high_all for s in rs], lambda v: fmt_pct(v, 2))} "
            f"| {_mmm([s.admission_s for s in rs], lambda v: f'{v:.1f}')} "
            f"| {_mmm([s.low_after for s in rs], fmt_pct)} |")
    return "\n".join(lines)


def rounds_met(rounds: Sequence[Sequence[Summary]], sla_ms: float) -> list[str]:
    out: list[str] = []
    keys = sitsmesh_keys(rounds[0]) if rounds else []
    for key, label in keys:
        checks = [target_checks(s, sla_ms, key) for s in rounds]
        indent = "  " if len(keys) > 1 else ""
        if indent:
            out.append(f"- {label}:")
        out += [f"{indent}- {name}: met in {sum(c[i][1] for c in checks)}/{len(checks)} "
                f"rounds ({'; '.join(c[i][2] for c in checks)})"
                for i, (name, _, _) in enumerate(checks[0])]
    return out


def replica_note(shares: Sequence[ReplicaShare]) -> str:
    """How the run spread over the replicas."""
    parts = [f"{r.name}{' (took the lease)' if r.leading else ''}: {r.calls} calls from "
             f"Envoy, {r.streams} of its streams open at the end, {r.sheds} sheds"
             for r in shares]
    return "per replica (calls: Checks plus one per stream): " + "; ".join(parts)


def overview(rows: Sequence[tuple[str, str, float, Sequence[Summary]]], sla_ms: float) -> str:
    """One line per scenario and flush: sitsmesh against the targets (first round)."""
    lines = ["| scenario | access-log flush | capacity (rps) | sitsmesh false sheds 0.5x "
             "| goodput 2x (rps, % cap) | adaptive_concurrency goodput 2x "
             "| admitted p99 2x (ms) | high prio ok | full admission | low prio after drop "
             "| targets met |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for title, flush, capacity, summaries in rows:
        by = {s.key: s for s in summaries}
        keys = sitsmesh_keys(summaries)
        if not keys:
            lines.append(f"| {title} | {flush} | {capacity:.1f} | - | - | - | - | - | - | - "
                         f"| - |")
        for key, label in keys:
            sm = by[key]
            ac = by.get("adaptive" + key[len("sitsmesh"):]) or by.get("adaptive")
            checks = target_checks(summaries, sla_ms, key)
            met = f"{sum(ok for _, ok, _ in checks)}/{len(checks)}"
            name = title if key == "sitsmesh" else f"{title}, {label}"
            lines.append(
                f"| {name} | {flush} | {capacity:.1f} | {fmt_pct(sm.false_shed, 2)} "
                f"| {sm.goodput_2x:.1f} ({sm.goodput_2x_pct:.0f} %) "
                f"| {f'{ac.goodput_2x:.1f}' if ac else '-'} | {fmt_ms(sm.p99_2x_ms)} "
                f"| {fmt_pct(sm.high_all, 2)} | {fmt_s(sm.admission_s)} "
                f"| {fmt_pct(sm.low_after)} | {met} |")
    return "\n".join(lines)
