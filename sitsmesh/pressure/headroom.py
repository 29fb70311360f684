"""How much of a stage low priority may fill under pressure.

Protected priorities are never shed, so on a FIFO stage they wait behind whatever
was admitted before them. The cap that lower priorities meet counts every request
in flight, protected ones too: the more of the stage high priority holds, the less
low priority may add, and a high-priority request never finds more than the cap
ahead of it. The cap is sized to the tail of the service times, not their mean,
from a spread that is only trusted as far as the samples behind it go: low
priority pays for every estimation error, high priority for none.

Pure functions on plain numbers: the controller and the simulator share them.
"""

from __future__ import annotations

import math

# How far into the tail of the service times the cap keeps a request behind it within
# the SLA: z of the normal 99.9 % quantile, the high-priority target.
TAIL_Z = 3.09
# The spread of n service times is itself uncertain (relative standard error about
# sqrt(2 / n) for normal data, more for heavy tails): until many samples back it, the
# cap assumes the spread at this many standard errors above what was measured.
SPREAD_Z = 2.0


def tail_queue(mean_queue: float, cs2: float) -> float:
    """The queue (in calls) that still drains within the SLA at the tail, not on average.

    `mean_queue` calls drain within the SLA's waiting share on average; k calls of
    service times with squared coefficient of variation `cs2` take k means, give or take
    sqrt(k cs2) means, so this is the largest k with k + TAIL_Z sqrt(k cs2) <= mean_queue.
    Fixed times (cs2 0) keep the whole mean queue; exponential ones 5 calls of a
    12-call room. A normal approximation: for exponential times such a queue overruns
    its room about 0.8 % of the time rather than 0.1 % (the sum is skewed right); the
    simulator's results, not this figure, are what the cap was tuned by."""
    if mean_queue <= 0 or cs2 <= 0:
        return max(0.0, mean_queue)
    spread = TAIL_Z * math.sqrt(cs2)
    root = (-spread + math.sqrt(spread * spread + 4 * mean_queue)) / 2
    return root * root


def cautious_spread(cs2: float, samples: int) -> float:
    """`cs2` raised by its own uncertainty: few samples, a wider assumed spread."""
    if samples <= 1:
        return max(cs2, 1.0)
    return cs2 * (1 + SPREAD_Z * math.sqrt(2 / samples))


# A step in arrivals, seen before the rates confirm it: the CUSUM of Check's arrivals
# over the capacity the stage may have, per tick, floored at zero. Past the thresholds'
# `step_alarm_s` of capacity-seconds (at least STEP_ALARM_MIN requests) the calm cap,
# sized for the chance queues of 75 % load, gives way to the SLA-sized one; the
# tail-sized cap waits for the surge to be confirmed (see the controller). A lower
# alarm catches a step sooner and also takes more bursts of 70 % load for steps, and
# sheds there (bench/RESULTS.md, issue 29, has both sides measured).
STEP_ALARM_MIN = 3.0
BOUND_Z = 1.0
MIN_CS2 = 0.05   # a spread measured as nil still leaves a rate learned from few samples


def capacity_bound(mu: float, cs2: float, samples: int) -> float:
    """The most the stage may serve, given `samples` service times of spread `cs2`
    behind its learned capacity `mu`: a mean of n such times is off by about
    sqrt(cs2 / n) of itself. Arrivals count as a step only past this, so a capacity
    learned from a few dozen noisy times (off by a third) does not read 70 % load as
    a step: low priority is not shed for the estimate's own error."""
    return mu * (1 + BOUND_Z * math.sqrt(max(cs2, MIN_CS2) / max(samples, 1)))


def cusum(previous: float, arrived: float, capacity: float, dt: float,
          alarm_s: float) -> float:
    """One tick of the CUSUM of arrivals over capacity, held at twice the alarm so that
    it clears within a few ticks of the arrivals falling."""
    statistic = previous + arrived - capacity * dt
    return min(max(0.0, statistic), 2 * alarm(capacity, alarm_s))


def alarm(capacity: float, alarm_s: float) -> float:
    """The excess, in requests, that counts as a step."""
    return max(STEP_ALARM_MIN, alarm_s * capacity)
