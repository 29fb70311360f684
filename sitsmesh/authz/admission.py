"""Admission: can the pipeline take this request now?

The request path reads a policy snapshot that another component swaps in and
updates plain dicts; no I/O and no locks. In this release the only rule is a
static per-tenant concurrency cap, counted from Check to the request's end:
the access-log entry with the same x-request-id, or a hold timeout when no
access log arrives.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """The swappable snapshot: per-tenant concurrency caps (0 = no cap)."""

    caps: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Verdict:
    admit: bool
    reason: str = ""
    retry_after_s: float = 0.0


ADMIT = Verdict(True)


class Admission:
    __slots__ = ("_clock", "_held", "_hold_s", "_in_flight", "policy")

    def __init__(self, policy: AdmissionPolicy, *, hold_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._hold_s = hold_s
        self._clock = clock
        self._in_flight: dict[str, int] = {}
        # request id -> (tenant, release deadline); dict order is arrival order.
        self._held: dict[str, tuple[str, float]] = {}

    def admit(self, tenant: str, model: str, priority: int, pipeline: str,
              request_id: str) -> Verdict:
        del model, priority, pipeline  # inputs of the backpressure rules to come
        cap = self.policy.caps.get(tenant, 0)
        if cap <= 0:
            return ADMIT
        current = self._in_flight.get(tenant, 0)
        if current >= cap:
            return Verdict(False, f"tenant {tenant} is at its concurrency cap of {cap}", 1.0)
        if not request_id or request_id in self._held:
            # Without a unique id the end of the request cannot be matched; a retried
            # Check for the same id must not count twice.
            return ADMIT
        self._in_flight[tenant] = current + 1
        self._held[request_id] = (tenant, self._clock() + self._hold_s)
        return ADMIT

    def release(self, request_id: str) -> bool:
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        self._drop(held[0])
        return True

    def expire(self) -> int:
        """Release holds past their deadline (the access log never came)."""
        now = self._clock()
        expired = 0
        for request_id, (tenant, deadline) in list(self._held.items()):
            if deadline > now:
                break  # arrival order: later holds expire later
            del self._held[request_id]
            self._drop(tenant)
            expired += 1
        return expired

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)

    def _drop(self, tenant: str) -> None:
        left = self._in_flight.get(tenant, 0) - 1
        if left > 0:
            self._in_flight[tenant] = left
        else:
            self._in_flight.pop(tenant, None)
