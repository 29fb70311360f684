"""What one variant's requests say, against the issue's targets.

Requests are bucketed by the second they were SENT in. Goodput = answered 200 within
the SLA. A shed is a 429 (sitsmesh) or a 503 (adaptive_concurrency's "reached
concurrency limit", or Envoy's own overflow): an answer that says "not now".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from load import HIGH, LOW, Result, phase, total_s
from stack import VariantRun

GRID_S = 0.1
# The targets (bench, each scenario, flush 20 ms and 1 s).
FALSE_SHED_MAX = 0.005
GOODPUT_TARGET = 0.95
HIGH_TARGET = 0.999
ADMISSION_S = 2.0
LOW_AFTER_TARGET = 0.995


def nearest_rank(values: Sequence[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]


def good(r: Result, sla_ms: float) -> bool:
    return r.status == 200 and r.seconds * 1000 <= sla_ms


def shed(r: Result) -> bool:
    return r.status in (429, 503)


def within(results: Sequence[Result], lo: float, hi: float) -> list[Result]:
    return [r for r in results if lo <= r.sent < hi]


def p99_ms(results: Sequence[Result]) -> float | None:
    ok = [r.seconds * 1000 for r in results if r.status == 200]
    return nearest_rank(ok, 99) if ok else None


def success(results: Sequence[Result], priority: int, sla_ms: float) -> float | None:
    mine = [r for r in results if r.priority == priority]
    return sum(good(r, sla_ms) for r in mine) / len(mine) if mine else None


def full_admission_s(results: Sequence[Result]) -> float | None:
    """From the drop to 0.5x: the first T on the grid after which no request sent is
    shed until the phase ends. None when the last second of the phase still sheds."""
    lo, hi = phase("recovery")
    late = [r.sent for r in within(results, lo, hi) if shed(r)]
    if not late:
        return 0.0
    last = max(late) - lo
    if last >= hi - lo - 1.0:
        return None
    return math.floor(last / GRID_S + 1) * GRID_S


@dataclass
class Summary:
    key: str
    label: str
    flush: str
    requests: int
    false_shed: float | None      # share of the calm phase's requests shed
    goodput_2x: float
    goodput_2x_pct: float
    p99_2x_ms: float | None
    p99_all_ms: float | None
    high_all: float | None
    low_all: float | None
    admission_s: float | None     # after the drop: time to full admission
    low_after: float | None       # after the drop: low priority served within the SLA
    shed: int
    timeouts: int
    other_errors: int
    lag_p99_ms: float
    lag_max_ms: float
    drained_after_s: float
    settled_before_s: float | None
    codes: dict[str, int]
    # When each high-priority request that missed was sent (s from the start), and its
    # latency (ms; None when shed or failed): is it the onset, or the steady overload?
    high_missed: list[tuple[float, float | None]] = field(default_factory=list)


def summarise(run: VariantRun, capacity: float, sla_ms: float) -> Summary:
    rs = run.results
    lo2, hi2 = phase("2x")
    calm = within(rs, *phase("calm"))
    hold = within(rs, lo2, hi2)
    after = within(rs, *phase("recovery"))
    goodput_2x = sum(good(r, sla_ms) for r in hold) / (hi2 - lo2)
    codes: dict[str, int] = {}
    for r in rs:
        label = f"{r.status} {r.code}".strip()
        codes[label] = codes.get(label, 0) + 1
    lags = [r.lag * 1000 for r in rs] or [0.0]
    return Summary(
        key=run.variant.key, label=run.variant.label, flush=run.flush, requests=len(rs),
        false_shed=sum(shed(r) for r in calm) / len(calm) if calm else None,
        goodput_2x=goodput_2x, goodput_2x_pct=100 * goodput_2x / capacity,
        p99_2x_ms=p99_ms(hold), p99_all_ms=p99_ms(rs),
        high_all=success(rs, HIGH, sla_ms), low_all=success(rs, LOW, sla_ms),
        admission_s=full_admission_s(rs), low_after=success(after, LOW, sla_ms),
        shed=sum(shed(r) for r in rs), timeouts=sum(r.status == 0 for r in rs),
        other_errors=sum(r.status not in (0, 200) and not shed(r) for r in rs),
        lag_p99_ms=nearest_rank(lags, 99), lag_max_ms=max(lags),
        drained_after_s=run.drained_s, settled_before_s=run.settled_s,
        codes=dict(sorted(codes.items(), key=lambda kv: -kv[1])),
        high_missed=[(round(r.sent, 3), round(r.seconds * 1000, 1) if r.status == 200
                      else None) for r in rs if r.priority == HIGH and not good(r, sla_ms)])


@dataclass
class Second:
    offered: int
    goodput: int
    p99_ms: float | None
    shed: int
    timeouts: int


def per_second(run: VariantRun, sla_ms: float) -> list[Second]:
    out = []
    for s in range(math.ceil(total_s())):
        rs = within(run.results, s, s + 1)
        out.append(Second(len(rs), sum(good(r, sla_ms) for r in rs), p99_ms(rs),
                          sum(shed(r) for r in rs), sum(r.status == 0 for r in rs)))
    return out


def target_checks(summaries: Sequence[Summary], sla_ms: float, key: str = "sitsmesh"
                  ) -> list[tuple[str, bool, str]]:
    """(target, met, the numbers) for sitsmesh (`key`: on that many replicas, like
    "sitsmesh-x2") in one scenario and flush setting; adaptive_concurrency on as many
    replicas if it ran so, else the one that ran."""
    by = {s.key: s for s in summaries}
    suffix = key[len("sitsmesh"):]
    sm, ac = by.get(key), by.get("adaptive" + suffix) or by.get("adaptive")
    if sm is None:
        return []
    out = [(f"false sheds at 0.5x <= {FALSE_SHED_MAX:.1%}",
            sm.false_shed is not None and sm.false_shed <= FALSE_SHED_MAX,
            fmt_pct(sm.false_shed, 2))]
    if ac is not None:
        out.append(("goodput at 2x >= adaptive_concurrency's", sm.goodput_2x >= ac.goodput_2x,
                    f"{sm.goodput_2x:.1f} vs {ac.goodput_2x:.1f} rps"))
    out += [
        (f"goodput at 2x >= {GOODPUT_TARGET:.0%} of capacity",
         sm.goodput_2x_pct >= 100 * GOODPUT_TARGET, f"{sm.goodput_2x_pct:.1f} %"),
        (f"admitted p99 at 2x <= SLA {sla_ms:g} ms",
         sm.p99_2x_ms is not None and sm.p99_2x_ms <= sla_ms, f"{fmt_ms(sm.p99_2x_ms)} ms"),
        (f"high-priority success >= {HIGH_TARGET:.1%} (whole run)",
         sm.high_all is not None and sm.high_all >= HIGH_TARGET, fmt_pct(sm.high_all, 2)),
        (f"full admission <= {ADMISSION_S:g} s after the drop",
         sm.admission_s is not None and sm.admission_s <= ADMISSION_S,
         fmt_s(sm.admission_s)),
        (f"low priority served after the drop >= {LOW_AFTER_TARGET:.1%}",
         sm.low_after is not None and sm.low_after >= LOW_AFTER_TARGET,
         fmt_pct(sm.low_after, 1)),
    ]
    return out


def fmt_pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f} %"


def fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def fmt_s(x: float | None) -> str:
    return "never" if x is None else f"{x:.1f} s"
