"""Choose a model's dynamic batching from its measured curve, the live arrival rate and the
stage's SLA, and say why.

Each candidate (preferred sizes, max queue delay) is run through a small seeded
simulation of Triton's dynamic batcher: Poisson arrivals of single-item
requests, `instances` executors, a batch leaves when an executor is free and
either the largest preferred size is queued or the oldest request waited the
delay; a batch of b items takes the curve's service time for b. A closed form
(M/D/c with batching) gets the delay's effect wrong exactly where it matters, at
moderate load, so the recommender measures the model instead of assuming one.

The choice: among the configs whose predicted p99 at the current rate meets the
SLA, the one that stays within the SLA up to the highest multiple of that rate
(the most headroom), then the lowest p99. Pure: no I/O, seeded randomness.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sitsmesh.batching.curve import Curve, InvalidCurve, knee

DELAYS_US = (0, 500, 1000, 2000, 5000, 10_000, 20_000, 50_000)
HEADROOM_STEPS = (1.25, 1.5, 2.0, 3.0, 4.0)
SIM_ARRIVALS = 2000
SIM_MIN_SECONDS = 4.0
MAX_SIM_ARRIVALS = 6000
# A queue this many batches deep means the config cannot keep up: no stable p99.
UNSTABLE_QUEUE = 2000
# Serving less than this share of the offered rate over the run is falling behind.
KEEPS_UP = 0.9
MATERIAL = 0.1  # a p99 this much lower, at equal headroom, is worth a change


@dataclass(frozen=True, slots=True)
class Batching:
    """A dynamic_batching block; preferred () with delay None is 'no dynamic batching'."""

    preferred: tuple[int, ...] = ()
    max_queue_delay_us: int | None = None

    @property
    def enabled(self) -> bool:
        return self.max_queue_delay_us is not None

    def block(self) -> dict[str, Any] | None:
        """The model config's `dynamic_batching` in protobuf JSON form (None: absent)."""
        if not self.enabled:
            return None
        block: dict[str, Any] = {"max_queue_delay_microseconds": self.max_queue_delay_us}
        if self.preferred:
            block["preferred_batch_size"] = list(self.preferred)
        return block

    def batch_items(self, max_batch_size: int) -> int:
        """Items one execute takes while a queue stands: the largest preferred size, else
        the model's max (Triton sends what it has), 1 without dynamic batching."""
        if not self.enabled or max_batch_size <= 1:
            return 1
        return max(self.preferred) if self.preferred else max_batch_size

    def label(self) -> str:
        if not self.enabled:
            return "no dynamic batching"
        sizes = ",".join(map(str, self.preferred)) or "any"
        return f"preferred [{sizes}], delay {(self.max_queue_delay_us or 0) / 1000:g} ms"


def batching_of(config: dict[str, Any]) -> Batching:
    """The batching a Triton model config (protobuf JSON) has in force."""
    block = config.get("dynamic_batching")
    if block is None or int(config.get("max_batch_size", 0) or 0) <= 1:
        return Batching()
    sizes = tuple(int(s) for s in block.get("preferred_batch_size", []) or [])
    return Batching(sizes, int(block.get("max_queue_delay_microseconds", 0) or 0))


@dataclass(frozen=True, slots=True)
class Prediction:
    batching: Batching
    p99_ms: float            # inf when the config cannot keep up
    p50_ms: float
    throughput: float        # items/s served over the simulated time
    mean_batch: float
    headroom: float          # the largest tested multiple of the rate still within SLA

    @property
    def stable(self) -> bool:
        return math.isfinite(self.p99_ms)


@dataclass(frozen=True, slots=True)
class Recommendation:
    model: str
    rate: float               # items/s the choice was made for
    rate_source: str          # live, given or assumed
    sla_ms: float
    knee: int
    current: Prediction
    proposed: Prediction
    capacity: float           # items/s the proposed config serves saturated
    reason: str
    candidates: tuple[Prediction, ...] = field(default=())

    @property
    def changes(self) -> bool:
        return self.proposed.batching != self.current.batching


def simulate(curve: Curve, batching: Batching, rate: float, *, seed: int = 1,
             arrivals: int = SIM_ARRIVALS) -> tuple[float, float, float, float]:
    """(p50 s, p99 s, items/s served, mean batch) of `batching` at `rate` items/s.

    p99 is inf when the queue grows past UNSTABLE_QUEUE batches (overload)."""
    if rate <= 0:
        raise InvalidCurve("an arrival rate must be positive")
    rng = random.Random(seed)  # noqa: S311 - a seeded simulation, not a secret
    count = min(MAX_SIM_ARRIVALS, max(arrivals, int(rate * SIM_MIN_SECONDS)))
    times: list[float] = []
    now = 0.0
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    largest = curve.max_batch_size
    if batching.enabled:
        target = max(batching.preferred) if batching.preferred else largest
        delay = (batching.max_queue_delay_us or 0) / 1e6
        sizes = sorted(batching.preferred, reverse=True)
    else:
        target, delay, sizes = 1, 0.0, []
    free = [0.0] * curve.instances
    heapq.heapify(free)
    queue: deque[float] = deque()
    latencies: list[float] = []
    batches = 0
    nxt = 0
    while nxt < count or queue:
        at = heapq.heappop(free)
        if not queue:
            at = max(at, times[nxt])
        while nxt < count and times[nxt] <= at:
            queue.append(times[nxt])
            nxt += 1
        if len(queue) > UNSTABLE_QUEUE * max(1, target):
            return math.inf, math.inf, 0.0, 0.0
        if len(queue) < target and batching.enabled:
            # Wait for the batch to fill or the oldest request's delay, whichever first.
            deadline = queue[0] + delay
            needed = target - len(queue)
            fill = times[nxt + needed - 1] if nxt + needed - 1 < count else math.inf
            at = max(at, min(deadline, fill))
            while nxt < count and times[nxt] <= at:
                queue.append(times[nxt])
                nxt += 1
        take = _batch(len(queue), target, sizes, largest)
        done = at + curve.service_s(take)
        for _ in range(take):
            latencies.append(done - queue.popleft())
        batches += 1
        heapq.heappush(free, done)
    latencies.sort()
    span = max(free) - times[0] if free else 0.0
    served = len(latencies) / span if span > 0 else 0.0
    if served < KEEPS_UP * rate:
        # The backlog grew all along: its p99 is the run's length, not the config's.
        return math.inf, math.inf, served, len(latencies) / batches
    return (latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)],
            served, len(latencies) / batches)


def _batch(queued: int, target: int, preferred: Sequence[int], largest: int) -> int:
    """How many items leave: the largest preferred size that is queued, else what is
    queued up to the model's max (Triton sends what it has once the delay ran out)."""
    for size in preferred:
        if queued >= size:
            return size
    return max(1, min(queued, largest if target > 1 else 1))


def candidates(curve: Curve) -> list[Batching]:
    """Preferred sizes from the measured batch sizes, alone or with half of it beside
    (the design's [8, 16]), each with every delay on the grid; and no batching."""
    sizes = [p.batch_size for p in curve.points if 2 <= p.batch_size <= curve.max_batch_size]
    found: list[Batching] = [Batching()]
    for size in sizes:
        sets: list[tuple[int, ...]] = [(size,)]
        if size // 2 in sizes:
            sets.append((size // 2, size))
        for preferred in sets:
            found.extend(Batching(preferred, delay) for delay in DELAYS_US)
    return found


def predict(curve: Curve, batching: Batching, rate: float, sla_s: float,
            seed: int = 1) -> Prediction:
    p50, p99, served, mean_batch = simulate(curve, batching, rate, seed=seed)
    headroom = 0.0
    if p99 <= sla_s:
        headroom = 1.0
        for step in HEADROOM_STEPS:
            if simulate(curve, batching, rate * step, seed=seed)[1] > sla_s:
                break
            headroom = step
    return Prediction(batching, p99 * 1000, p50 * 1000, served, mean_batch, headroom)


def saturated_capacity(curve: Curve, batching: Batching) -> float:
    """Items/s the config serves with a standing queue: every batch at its largest."""
    return curve.capacity(batching.batch_items(curve.max_batch_size))


def recommend(curve: Curve, current: Batching, *, rate: float, sla_ms: float,
              rate_source: str = "live", seed: int = 1) -> Recommendation:
    if not sla_ms > 0:
        raise InvalidCurve("a p99 SLA in milliseconds is needed to tune batching (set the "
                           "stage's sla_p99_ms or give --sla-ms)")
    if not rate > 0:
        raise InvalidCurve("an arrival rate is needed to tune batching")
    sla_s = sla_ms / 1000
    now = predict(curve, current, rate, sla_s, seed)
    scored = [predict(curve, option, rate, sla_s, seed) for option in candidates(curve)
              if option != current]
    scored.append(now)
    fit = [p for p in scored if p.stable and p.p99_ms <= sla_ms]
    bend = knee(curve.points)
    if not fit:
        best = min(scored, key=lambda p: (not p.stable, p.p99_ms, -p.throughput))
        reason = (f"no config keeps p99 within {sla_ms:g} ms at {rate:.1f} items/s: the "
                  f"closest is {best.batching.label()} (p99 {_ms(best.p99_ms)}); the model "
                  f"needs more instances")
    else:
        # Most headroom, then lowest p99, then the smaller batch (less to lose on a change).
        best = min(fit, key=lambda p: (-p.headroom, p.p99_ms,
                                       max(p.batching.preferred, default=0)))
        # A reload costs a warmup and a moment of doubled instances: a change must buy
        # headroom or a p99 that is materially lower, not a rounding of the simulation.
        marginal = (now in fit and best.headroom <= now.headroom
                    and best.p99_ms > (1 - MATERIAL) * now.p99_ms)
        if best is now or best.batching == current or marginal:
            best = now
            reason = (f"keep {current.label()}: p99 {_ms(now.p99_ms)} within {sla_ms:g} ms "
                      f"at {rate:.1f} items/s with the most headroom "
                      f"({now.headroom:g}x the rate)")
        else:
            reason = (f"{best.batching.label()}: p99 {_ms(best.p99_ms)} at {rate:.1f} "
                      f"items/s (now {_ms(now.p99_ms)}), within the {sla_ms:g} ms SLA up to "
                      f"{best.headroom:g}x the rate (now "
                      f"{now.headroom:g}x); knee of the curve at batch {bend}")
    return Recommendation(curve.model, rate, rate_source, sla_ms, bend, now, best,
                          saturated_capacity(curve, best.batching), reason,
                          tuple(sorted(scored, key=lambda p: (-p.headroom, p.p99_ms))))


def _ms(value: float) -> str:
    return f"{value:.1f} ms" if math.isfinite(value) else "unbounded (overloaded)"
