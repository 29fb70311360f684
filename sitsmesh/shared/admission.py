"""Tenant concurrency caps counted over every replica and worker.

Each process keeps counting the requests it admitted and holds (no I/O on the
request path) and, every tick, reports its per-tenant in-flight counts on the
hop bus. Every process sums the latest report of each *other* process into
`Admission.others`, which its cap check adds to its own count. A report older
than STALE_S (its process died or lost Redis) stops counting. Between two
reports the processes together can overshoot a cap by what they admit in one
tick; a cap is a bound on concurrency, not a lock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from sitsmesh.authz.admission import Admission
from sitsmesh.shared.hopbus import HopBus
from sitsmesh.shared.lease import holder_id

TICK_S = 0.1
STALE_S = 2.0


class SharedAdmission:
    def __init__(self, admission: Admission, bus: HopBus, *, me: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._admission = admission
        self._bus = bus
        self.me = me or holder_id()
        self._clock = clock
        # process -> (when its report came, {tenant: in flight there})
        self._reports: dict[str, tuple[float, dict[str, int]]] = {}
        self._last: dict[str, int] = {}
        bus.on("t", self.apply)

    def report(self) -> None:
        """This process's in-flight count per capped tenant (0 once, when one drains)."""
        admission = self._admission
        counts = {tenant: admission.in_flight(tenant) for tenant, cap
                  in admission.policy.caps.items() if cap > 0}
        counts = {t: n for t, n in counts.items() if n or self._last.get(t)}
        if counts or self._last:
            self._bus.publish(["t", self.me, counts])
        self._last = {t: n for t, n in counts.items() if n}

    def apply(self, event: list[Any]) -> None:
        _, process, counts = event
        if not isinstance(process, str) or not isinstance(counts, dict):
            raise ValueError("a report is ['t', process, {tenant: in flight}]")
        if any(counts.values()):
            self._bus.holds_seen()  # held requests, this process's too: send releases
        if process == self.me:
            return
        self._reports[process] = (self._clock(), {str(t): int(n) for t, n in counts.items()})
        self._sum()

    def _sum(self) -> None:
        now = self._clock()
        others: dict[str, int] = {}
        for process, (at, counts) in list(self._reports.items()):
            if now - at > STALE_S:
                del self._reports[process]
                continue
            for tenant, count in counts.items():
                if count > 0:
                    others[tenant] = others.get(tenant, 0) + count
        self._admission.others = others  # swapped whole: the request path reads it as is

    async def run(self) -> None:
        while True:
            self.report()
            self._sum()  # ages out reports even when none arrive
            await asyncio.sleep(TICK_S)
