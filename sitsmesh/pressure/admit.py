"""The shedding rule Check applies to a decision; pure, shared with the simulator."""

from __future__ import annotations

from sitsmesh.pressure.controller import Decision

LEVEL, CONCURRENCY = "admission_level", "concurrency"
BURST_S = 0.1  # the budget holds at most this long's worth of admissions


class Budget:
    """Admissions the bottleneck can take now: a token bucket refilled at the decision's
    admit rate while the level sheds, and spent by every admitted request.

    The level says *who* goes first (lowest priorities); the budget says whether
    anyone has to go *now*. A request under the level still gets in while there is
    budget, so when arrivals fall below capacity shedding stops with the next
    request, not after a rate estimate has caught up with the drop. One per pipeline
    and process: plain floats, no lock (one event loop owns it).
    """

    __slots__ = ("last", "tokens")

    def __init__(self) -> None:
        self.tokens = 0.0
        self.last = 0.0

    def refill(self, now: float, rate: float) -> None:
        burst = max(1.0, rate * BURST_S)
        tokens = self.tokens + (now - self.last) * rate
        self.tokens = tokens if tokens < burst else burst
        self.last = now


def shed_reason(decision: Decision | None, priority: int, u: float, in_flight: int, *,
                budget: Budget | None = None, now: float = 0.0) -> str:
    """Why this request is shed ('' to admit). `u` is the request's own uniform draw in
    [0, 1): it places the request inside its priority, so a level between two
    priorities sheds only part of one. With a `budget`, the level sheds only when the
    budget is spent (see Budget); the caller spends it on every admission (`admitted`)."""
    if decision is None or priority >= decision.protected_from:
        return ""
    if decision.cutoff > 0 and priority + u < decision.cutoff:
        if budget is None or decision.admit_rate <= 0:
            return LEVEL
        budget.refill(now, decision.admit_rate)
        if budget.tokens < 1.0:
            return LEVEL
    if decision.concurrency and in_flight >= decision.concurrency:
        return CONCURRENCY
    return ""


def admitted(decision: Decision | None, budget: Budget, now: float) -> None:
    """An admitted request spends the budget while the level is in force (protected
    priorities too: they use the same capacity)."""
    if decision is not None and decision.cutoff > 0 and decision.admit_rate > 0:
        budget.refill(now, decision.admit_rate)
        # No debt: what was admitted past the budget is a queue, and the concurrency cap
        # answers for queues; a debt would go on shedding after the arrivals fell.
        budget.tokens = max(0.0, budget.tokens - 1.0)
