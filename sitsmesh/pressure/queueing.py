"""Queueing estimates for one stage: arrival rate, capacity, utilisation, tail latency.

Pure arithmetic on rates the controller measured; no state of its own.
"""

from __future__ import annotations

import math

P99_FACTOR = math.log(100)  # 4.605: the M/M/1 response time's 99th percentile is this / (mu - lam)


def mm1_p99(lam: float, mu: float) -> float:
    """R99 of an M/M/1 queue in seconds; infinite when it is not stable."""
    if mu <= lam or mu <= 0:
        return math.inf
    return P99_FACTOR / (mu - lam)


def rate_for_p99(mu: float, sla_s: float) -> float:
    """The highest arrival rate whose M/M/1 R99 stays within the SLA (0 if none does)."""
    if mu <= 0 or sla_s <= 0:
        return 0.0
    return max(0.0, mu - P99_FACTOR / sla_s)


def seed_depth(base: int, *, rt99_s: float, sla_s: float | None, fill: float, qps: float,
               capacity: float) -> float:
    """The seed design's adaptive queue depth: it grows the queue under overload."""
    if sla_s is not None and rt99_s > 2 * sla_s and fill > 0.7 and capacity > 0:
        return base * (1 + 0.3 * qps / capacity)
    return float(base)


def ewma(previous: float | None, sample: float, dt: float, tau: float) -> float:
    """An exponentially weighted average whose memory is `tau` seconds whatever the tick."""
    if previous is None:
        return sample
    alpha = 1 - math.exp(-dt / tau) if tau > 0 else 1.0
    return previous + alpha * (sample - previous)


# Chance queues: Poisson arrivals at CALM_LOAD of capacity make a queue past
# chance_queue(cs2, tail) only `tail` of the time (Kingman's heavy-traffic tail);
# about 13 queued for fixed service times and 27 for exponential ones at 0.1 %.
CALM_LOAD = 0.75        # a margin over the 70 % that must never see a shed: the tail formula is
                         # a heavy-traffic approximation, optimistic at moderate load


def chance_queue(cs2: float, tail: float, batch: float = 1.0) -> float:
    """The queue length (in calls) Poisson arrivals at CALM_LOAD of capacity pass only
    `tail` of the time, for service times of squared coefficient of variation `cs2`.

    A fan-out sends `batch` calls at once: the calls arrive in clumps, with `batch`
    times the variance of Poisson arrivals (the ca² of Kingman's formula), so its
    chance queues are that much longer."""
    return math.log(CALM_LOAD / tail) * (batch + cs2) / (2 * (1 - CALM_LOAD))
