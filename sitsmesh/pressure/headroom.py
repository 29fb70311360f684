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
    Fixed times (cs2 0) keep the whole mean queue; exponential ones about a third of a
    ten-call queue."""
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
