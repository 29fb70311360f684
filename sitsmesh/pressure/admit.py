"""The shedding rule Check applies to a decision; pure, shared with the simulator."""

from __future__ import annotations

from sitsmesh.pressure.controller import Decision

LEVEL, CONCURRENCY = "admission_level", "concurrency"


def shed_reason(decision: Decision | None, priority: int, u: float, in_flight: int) -> str:
    """Why this request is shed ('' to admit). `u` is the request's own uniform draw in
    [0, 1): it places the request inside its priority, so a level between two
    priorities sheds only part of one."""
    if decision is None or priority >= decision.protected_from:
        return ""
    if decision.cutoff > 0 and priority + u < decision.cutoff:
        return LEVEL
    if decision.concurrency and in_flight >= decision.concurrency:
        return CONCURRENCY
    return ""
