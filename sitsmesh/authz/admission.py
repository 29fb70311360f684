"""Admission: can the pipeline take this request now?

The request path reads a policy snapshot that another component swaps in and
updates plain dicts; no I/O and no locks. Two rules: a static per-tenant
concurrency cap, and the backpressure decision of the request's pipeline
(sitsmesh.pressure.gate). Both count a request from Check to its end: the
access-log entry with the same x-request-id, or a hold timeout when no access
log arrives.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from sitsmesh.pressure.gate import PressureGate


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """The swappable snapshot: per-tenant concurrency caps (0 = no cap)."""

    caps: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Verdict:
    admit: bool
    reason: str = ""
    retry_after_s: float = 0.0
    code: str = "over_capacity"


ADMIT = Verdict(True)


class Admission:
    __slots__ = ("_clock", "_held", "_hold_s", "_in_flight", "gate", "policy")

    def __init__(self, policy: AdmissionPolicy, *, hold_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic,
                 gate: PressureGate | None = None) -> None:
        self.policy = policy
        self.gate = gate
        self._hold_s = hold_s
        self._clock = clock
        self._in_flight: dict[str, int] = {}
        # request id -> (tenant counted or "", pipeline counted or "", release deadline);
        # dict order is arrival order.
        self._held: dict[str, tuple[str, str, float]] = {}

    def admit(self, tenant: str, model: str, priority: int, pipeline: str,
              request_id: str) -> Verdict:
        cap = self.policy.caps.get(tenant, 0)
        if cap > 0 and self._in_flight.get(tenant, 0) >= cap:
            return Verdict(False, f"tenant {tenant} is at its concurrency cap of {cap}", 1.0)
        gate = self.gate
        entered = gate.pipeline_for(pipeline, model) if gate is not None else ""
        if gate is not None and entered:
            shed = gate.admit(entered, priority, request_id, tenant)
            if shed is not None:
                return Verdict(False, shed.message, float(shed.retry_after_s), shed.reason)
        if not request_id or request_id in self._held:
            # Without a unique id the end of the request cannot be matched; a retried
            # Check for the same id must not count twice.
            return ADMIT
        counted = tenant if cap > 0 else ""
        if counted:
            self._in_flight[tenant] = self._in_flight.get(tenant, 0) + 1
        if counted or entered:
            now = self._clock()
            if gate is not None and entered:
                gate.started(entered, now)
            self._held[request_id] = (counted, entered, now + self._hold_s)
        return ADMIT

    def release(self, request_id: str, ended_wall: float | None = None) -> bool:
        """The request ended (its access-log entry came): at `ended_wall`, wall clock."""
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        self._drop(held, ended_wall)
        return True

    def expire(self) -> int:
        """Release holds past their deadline (the access log never came)."""
        now = self._clock()
        expired = 0
        for request_id, held in list(self._held.items()):
            if held[2] > now:
                break  # arrival order: later holds expire later
            del self._held[request_id]
            self._drop(held, None)
            expired += 1
        return expired

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)

    def _drop(self, held: tuple[str, str, float], ended_wall: float | None) -> None:
        tenant, pipeline, deadline = held
        if tenant:
            left = self._in_flight.get(tenant, 0) - 1
            if left > 0:
                self._in_flight[tenant] = left
            else:
                self._in_flight.pop(tenant, None)
        if pipeline and self.gate is not None:
            self.gate.ended(pipeline, deadline - self._hold_s, ended_wall, self._clock())
