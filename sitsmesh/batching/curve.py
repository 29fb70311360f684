"""A model's measured throughput/latency curve over batch size, its knee and Pareto front.

Pure data and arithmetic: the profiler (sitsmesh.batching.profile) measures the
points, the state store keeps them as a record body, the recommender reads them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sitsmesh.errors import Code, SitsmeshError

CURVE_KIND = "batching-curve"
MAX_POINTS = 16
MAX_BATCH = 4096
PLATEAU = 0.97  # within 3 % of the best throughput counts as the same


class InvalidCurve(SitsmeshError):
    code = Code.INVALID_ARGUMENT


@dataclass(frozen=True, slots=True)
class Point:
    batch_size: int
    throughput: float     # items per second, all instances together
    p50_ms: float         # one request of `batch_size` items, end to end
    p99_ms: float
    requests: int         # how many the point is measured over


@dataclass(frozen=True, slots=True)
class Curve:
    model: str
    endpoint: str
    source: str                   # preflight or production: where it was measured
    instances: int                # requests the model executes at once
    max_batch_size: int
    concurrency: int              # requests in flight while measuring
    measured_at: float
    points: tuple[Point, ...]     # by batch size, ascending

    def service_s(self, items: int) -> float:
        """One execute() of `items` items, in seconds: linear between the measured sizes,
        proportional past the largest (the device is full there)."""
        points = self.points
        if items <= points[0].batch_size:
            return points[0].p50_ms / 1000
        for low, high in itertools.pairwise(points):
            if items <= high.batch_size:
                share = (items - low.batch_size) / (high.batch_size - low.batch_size)
                return (low.p50_ms + share * (high.p50_ms - low.p50_ms)) / 1000
        last = points[-1]
        return last.p50_ms / 1000 * items / last.batch_size

    def capacity(self, batch: int) -> float:
        """Items/s with every instance busy on batches of `batch`."""
        return self.instances * batch / self.service_s(batch)

    def to_body(self) -> dict[str, Any]:
        return {"model": self.model, "endpoint": self.endpoint, "source": self.source,
                "instances": self.instances, "max_batch_size": self.max_batch_size,
                "concurrency": self.concurrency, "measured_at": self.measured_at,
                "points": [{"batch_size": p.batch_size, "throughput": p.throughput,
                            "p50_ms": p.p50_ms, "p99_ms": p.p99_ms, "requests": p.requests}
                           for p in self.points]}


def _positive(value: Any, where: str, *, whole: bool = False) -> Any:
    kinds = (int,) if whole else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0 \
            or not math.isfinite(value):
        raise InvalidCurve(f"{where} must be a positive {'whole ' if whole else ''}number")
    return value


def curve_from(body: Mapping[str, Any]) -> Curve:
    """A stored curve, checked: a bad record names its field instead of failing later."""
    raw = body.get("points")
    if not isinstance(raw, list) or not 2 <= len(raw) <= MAX_POINTS:
        raise InvalidCurve(f"curve: points must be a list of 2-{MAX_POINTS} measurements")
    points = []
    for i, item in enumerate(raw):
        where = f"curve: points[{i}]"
        if not isinstance(item, Mapping):
            raise InvalidCurve(f"{where} must be a mapping")
        points.append(Point(
            batch_size=_positive(item.get("batch_size"), f"{where}.batch_size", whole=True),
            throughput=float(_positive(item.get("throughput"), f"{where}.throughput")),
            p50_ms=float(_positive(item.get("p50_ms"), f"{where}.p50_ms")),
            p99_ms=float(_positive(item.get("p99_ms"), f"{where}.p99_ms")),
            requests=_positive(item.get("requests"), f"{where}.requests", whole=True)))
    sizes = [p.batch_size for p in points]
    if sizes != sorted(set(sizes)):
        raise InvalidCurve("curve: batch sizes must be distinct and ascending")
    return Curve(model=str(body.get("model", "")), endpoint=str(body.get("endpoint", "")),
                 source=str(body.get("source", "")),
                 instances=_positive(body.get("instances"), "curve: instances", whole=True),
                 max_batch_size=_positive(body.get("max_batch_size"),
                                          "curve: max_batch_size", whole=True),
                 concurrency=_positive(body.get("concurrency"), "curve: concurrency",
                                       whole=True),
                 measured_at=float(body.get("measured_at", 0.0)), points=tuple(points))


def batch_sizes(text: str, max_batch_size: int) -> tuple[int, ...]:
    """`--batch-sizes 1,2,4,8`: distinct, ascending, each within the model's max."""
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise InvalidCurve(f"batch sizes {text!r}: use whole numbers separated by commas") \
            from None
    if len(sizes) < 2 or len(sizes) > MAX_POINTS:
        raise InvalidCurve(f"batch sizes {text!r}: give 2-{MAX_POINTS} sizes")
    if sizes[0] < 1:
        raise InvalidCurve(f"batch sizes {text!r}: each must be at least 1")
    if sizes[-1] > max_batch_size:
        raise InvalidCurve(f"batch size {sizes[-1]} is over the model's max_batch_size "
                           f"{max_batch_size}")
    return tuple(sizes)


def knee(points: Sequence[Point]) -> int:
    """The batch size B* past which more batching buys little throughput (Kneedle).

    Both axes scaled to 0..1, the knee is the measured point farthest above the chord
    from the first point to the last: where the concave throughput curve bends. On a
    curve that keeps rising straight there is no bend and the largest size is returned;
    past a peak (throughput falling) the peak itself is the knee."""
    if len(points) < 2:
        raise InvalidCurve("a knee needs at least two measured batch sizes")
    top = max(p.throughput for p in points)
    # A plateau stays in (it is what the bend leads to); a real fall past the peak does not.
    last = max(i for i, p in enumerate(points) if p.throughput >= PLATEAU * top)
    considered = points[:last + 1]
    if len(considered) < 3:
        return considered[-1].batch_size
    x0, x1 = considered[0].batch_size, considered[-1].batch_size
    y0, y1 = considered[0].throughput, considered[-1].throughput
    if y1 <= y0:
        return considered[0].batch_size

    def lift(p: Point) -> float:
        return (p.throughput - y0) / (y1 - y0) - (p.batch_size - x0) / (x1 - x0)

    best = max(considered, key=lift)
    return best.batch_size if lift(best) > 0.05 else considered[-1].batch_size


def pareto(points: Sequence[Point]) -> tuple[Point, ...]:
    """The points no other beats on both throughput (higher) and p99 (lower)."""
    front = [p for p in points
             if not any(q is not p and q.throughput >= p.throughput and q.p99_ms <= p.p99_ms
                        and (q.throughput > p.throughput or q.p99_ms < p.p99_ms)
                        for q in points)]
    return tuple(sorted(front, key=lambda p: p.batch_size))
