"""Admission: can the pipeline take this request now?

The request path reads a policy snapshot that another component swaps in and
updates plain dicts; no I/O and no locks. Two rules: a static per-tenant
concurrency cap, and the backpressure decision of the request's pipeline
(sitsmesh.pressure.gate). Both count a request from Check to its end: the
access-log entry with the same x-request-id, or a hold timeout when no access
log arrives.

Every admit is counted. Holds are reference-counted by request id: N Checks
with one id hold N slots, each access-log entry for the id releases the oldest
one, and the hold timeout releases the rest. A client that repeats an id (or
sends none) therefore cannot get past a cap; it only keeps its own slots
busy longer. A request without an id cannot be matched to its end at all: it
is held until its hold timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from sitsmesh.pressure.entryqueue import Waiter
from sitsmesh.pressure.gate import UNHELD, WAIT, PressureGate


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
    # Admitted once the pipeline has room: the caller awaits it (pressure.entryqueue).
    waiting: Waiter | None = None


ADMIT = Verdict(True)


class Admission:
    __slots__ = ("_clock", "_held", "_hold_s", "_ids", "_in_flight", "gate", "others",
                 "policy")

    def __init__(self, policy: AdmissionPolicy, *, hold_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic,
                 gate: PressureGate | None = None) -> None:
        self.policy = policy
        self.gate = gate
        self._hold_s = hold_s
        self._clock = clock
        self._in_flight: dict[str, int] = {}
        # In flight at the other replicas and workers, per tenant (sitsmesh.shared.admission
        # swaps it in; empty when this process counts alone).
        self.others: dict[str, int] = {}
        # (request id, n) -> (tenant counted or "", pipeline counted or "", release
        # deadline); dict order is arrival order, and so deadline order.
        self._held: dict[tuple[str, int], tuple[str, str, float]] = {}
        # request id -> [n of its oldest live hold, n of its next one]: an id's live
        # holds are always a contiguous range, since both its releases (oldest first)
        # and its timeouts (arrival order) take them from the front.
        self._ids: dict[str, list[int]] = {}

    def admit(self, tenant: str, model: str, priority: int, pipeline: str,
              request_id: str) -> Verdict:
        cap = self.policy.caps.get(tenant, 0)
        if cap > 0 and self._in_flight.get(tenant, 0) + self.others.get(tenant, 0) >= cap:
            return Verdict(False, f"tenant {tenant} is at its concurrency cap of {cap}", 1.0)
        gate = self.gate
        entered = gate.pipeline_of(pipeline, model, tenant) if gate is not None else ""
        if gate is not None and entered:
            shed = gate.admit(entered, priority, request_id, tenant)
            if shed is UNHELD:
                return ADMIT  # Envoy's quota refuses it (--admission rlqs): nothing to hold
            if shed is WAIT:
                counted = tenant if cap > 0 else ""
                held = gate.hold_at_entry(
                    entered, priority, request_id, tenant,
                    on_grant=lambda: self._hold(counted, entered, request_id),
                    on_leave=lambda: self.release(request_id))
                if isinstance(held, Waiter):
                    return Verdict(True, waiting=held)
                shed = held
            if shed is not None:
                return Verdict(False, shed.message, float(shed.retry_after_s), shed.reason)
        self._hold(tenant if cap > 0 else "", entered, request_id)
        return ADMIT

    def _hold(self, counted: str, entered: str, request_id: str) -> None:
        """Count an admitted request until its end: against `counted`'s cap, in
        `entered`'s pipeline."""
        if counted:
            self._in_flight[counted] = self._in_flight.get(counted, 0) + 1
        if counted or entered:
            now = self._clock()
            if self.gate is not None and entered:
                self.gate.started(entered, now)
            ids = self._ids.get(request_id)
            if ids is None:
                self._ids[request_id] = ids = [0, 0]
            self._held[request_id, ids[1]] = (counted, entered, now + self._hold_s)
            ids[1] += 1

    def release(self, request_id: str, ended_wall: float | None = None) -> bool:
        """The request ended (its access-log entry came): at `ended_wall`, wall clock.
        Releases the oldest hold of the id; an id-less request waits for its timeout."""
        ids = self._ids.get(request_id) if request_id else None
        if ids is None:
            return False
        held = self._held.pop((request_id, ids[0]))
        self._advance(request_id, ids)
        self._drop(held, ended_wall)
        return True

    def expire(self) -> int:
        """Release holds past their deadline (the access log never came)."""
        now = self._clock()
        due: list[tuple[str, int]] = []
        for key, held in self._held.items():
            if held[2] > now:
                break  # arrival order: later holds expire later
            due.append(key)
        for key in due:
            held = self._held.pop(key)
            # All older holds of this id are gone already: this one is its front.
            self._advance(key[0], self._ids[key[0]])
            self._drop(held, None)
        return len(due)

    def held(self) -> int:
        return len(self._held)

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)

    def _advance(self, request_id: str, ids: list[int]) -> None:
        ids[0] += 1
        if ids[0] == ids[1]:
            del self._ids[request_id]

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
