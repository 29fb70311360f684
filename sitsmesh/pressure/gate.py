"""The request path's side of backpressure: count arrivals, apply the published decision.

Check calls `admit` on every request; it reads the current snapshot (swapped
in whole by the controller each tick), bumps plain counters and returns at
once. No I/O, no locks: sheds are tallied here and turned into metrics and
log samples off the request path.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sitsmesh.chains.pipeline import Pipeline
from sitsmesh.globs import NONE, Globs
from sitsmesh.pressure.admit import CONCURRENCY, LEVEL, Budget, admitted, shed_reason
from sitsmesh.pressure.controller import Decision, Snapshot
from sitsmesh.pressure.entryqueue import EntryQueue, Waiter
from sitsmesh.pressure.signals import PipelineSignals, Signals

_GOLDEN = 0.6180339887498949
MAX_ROUTES = 10_000


@dataclass(frozen=True, slots=True)
class Shed:
    pipeline: str
    reason: str
    retry_after_s: int
    message: str


# Gate.admit's answer when it does not enforce and Envoy's quota will refuse the request:
# let it through Check, and hold nothing for it.
UNHELD = Shed("", "", 0, "")
# Gate.admit's answer when the pipeline is at its in-flight cap and its decision holds
# such requests at the entry: the caller asks `hold_at_entry` for a place in the queue.
WAIT = Shed("", CONCURRENCY, 0, "")
# Waiters a pipeline keeps besides those it can let in within their wait (entryqueue).
MIN_WAITING = 8


class PressureGate:
    __slots__ = ("_budgets", "_clock", "_globs", "_governed", "_governs", "_names",
                 "_old_routes", "_old_tenant_routes", "_pipelines", "_routes",
                 "_tenant_routes", "_u", "enforce", "queue", "samples", "sheds", "signals",
                 "snapshot", "wall_offset")

    def __init__(self, signals: Signals,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.signals = signals
        self.snapshot = Snapshot()
        self._clock = clock
        self._pipelines: dict[str, PipelineSignals] = {}
        self._budgets: dict[str, Budget] = {}
        # Every pipeline's model globs, compiled: group i is self._names[i]'s.
        self._globs: Globs | None = None
        self._names: tuple[str, ...] = ()
        # model -> pipeline, in two generations: past MAX_ROUTES the older one is dropped,
        # so a stream of unseen names cannot make the models in use miss every time.
        self._routes: dict[str, str] = {}
        self._old_routes: dict[str, str] = {}
        # Pipeline -> the tenant globs it governs, compiled; only pipelines that list them
        # (the rest govern every tenant). Decisions cached per (pipeline, tenant), and
        # routes per (tenant, model) where the model's first pipeline does not govern it,
        # each bounded like the model routes.
        self._governs: dict[str, Globs] = {}
        self._governed: dict[tuple[str, str], bool] = {}
        self._tenant_routes: dict[tuple[str, str], str] = {}
        self._old_tenant_routes: dict[tuple[str, str], str] = {}
        # A low-discrepancy sequence places each request inside its priority: a level
        # of 2.3 sheds exactly 30 % of priority 2, with no random-number call.
        self._u = 0.0
        # (pipeline, stage, priority, reason) -> count, and the last request of each.
        self.sheds: dict[tuple[str, str, int, str], int] = {}
        self.samples: dict[tuple[str, str], tuple[str, str, int]] = {}
        # Wall-clock seconds minus monotonic ones: access-log times are wall clock.
        self.wall_offset = 0.0
        # False: count, never shed (Envoy sheds, on the quotas RLQS assigns it).
        self.enforce = True
        self.queue = EntryQueue(self.room, self._waited)

    def set_pipelines(self, pipelines: Mapping[str, Pipeline]) -> None:
        self._pipelines = {name: self.signals.pipeline(name) for name in pipelines}
        self._budgets = {name: self._budgets.get(name) or Budget() for name in pipelines}
        globs = Globs(p.models for p in pipelines.values())
        self._globs = globs if globs else None
        self._names = tuple(p.name for p in pipelines.values())
        self._routes, self._old_routes = {}, {}
        self._governs = {name: Globs([p.tenants]) for name, p in pipelines.items()
                         if p.tenants is not None}
        self._governed = {}
        self._tenant_routes, self._old_tenant_routes = {}, {}
        self.queue.wake_all()  # a pipeline gone lets its waiters in (nothing caps them)

    def governs(self, pipeline: str, tenant: str) -> bool:
        """Whether `pipeline` admits, sheds and counts requests of `tenant`."""
        patterns = self._governs.get(pipeline)
        if patterns is None:
            return True
        key = (pipeline, tenant)
        found = self._governed.get(key)
        if found is None:
            found = bool(tenant) and patterns.matches(tenant)
            if len(self._governed) >= MAX_ROUTES:
                self._governed.clear()
            self._governed[key] = found
        return found

    def pipeline_of(self, hint: str, model: str, tenant: str) -> str:
        """`pipeline_for` for a request of `tenant`: only a pipeline that governs the
        tenant, so no team's pipeline admits, sheds or counts another team's requests
        (a hint naming one is ignored, as a made-up hint is)."""
        found = self.pipeline_for(hint, model)
        if not self._governs or not found or self.governs(found, tenant):
            return found
        if hint and hint in self._pipelines:
            found = self.pipeline_for("", model)
            if not found or self.governs(found, tenant):
                return found
        # The model's first pipeline is another team's: the first that governs the tenant.
        key = (tenant, model)
        cached = self._tenant_routes.get(key)
        if cached is None:
            cached = self._old_tenant_routes.get(key)
            if cached is None:
                globs = self._globs
                cached = "" if globs is None else next(
                    (self._names[g] for g in globs.groups(model)
                     if self.governs(self._names[g], tenant)), "")
            if len(self._tenant_routes) >= MAX_ROUTES:
                self._old_tenant_routes, self._tenant_routes = self._tenant_routes, {}
            self._tenant_routes[key] = cached
        return cached

    def pipeline_for(self, hint: str, model: str) -> str:
        """The pipeline a request enters: named by the hint header, or by its model.

        A hint that names no pipeline falls back to the model: a made-up name must
        not take a request out of its model's pipeline, and past its shedding."""
        if hint and hint in self._pipelines:
            return hint
        globs = self._globs
        if not model or globs is None:
            return ""
        found = self._routes.get(model)
        if found is None:
            found = self._old_routes.get(model)
            if found is None:
                # The first pipeline, in catalog order, with a glob that matches.
                index = globs.first(model)
                found = self._names[index] if index != NONE else ""
            if len(self._routes) >= MAX_ROUTES:
                self._old_routes, self._routes = self._routes, {}
            self._routes[model] = found
        return found

    def admit(self, pipeline: str, priority: int, request_id: str,
              tenant: str) -> Shed | None:
        """Count the arrival; None to admit (and the caller holds it in flight)."""
        signals = self._pipelines[pipeline]
        signals.arrive(priority)
        decision: Decision | None = self.snapshot.decisions.get(pipeline)
        self._u = u = (self._u + _GOLDEN) % 1.0
        # Held requests whose access-log entries are still on the way are most likely
        # done: the controller says how many.
        in_flight = signals.in_flight - (decision.in_flight_offset if decision else 0)
        budget = self._budgets[pipeline]
        # The clock only while a level sheds: the budget is spent then, and only then.
        now = self._clock() if decision is not None and decision.cutoff > 0 else 0.0
        reason = shed_reason(decision, priority, u, in_flight, budget=budget, now=now)
        if not self.enforce and reason and decision is not None:
            # Envoy sheds on its quotas: what they carry of the level it sheds there, so
            # it is not counted in flight here (held, a request Envoy refused in a
            # millisecond read as queued at the bottleneck). Quotas carry no in-flight cap.
            if reason == LEVEL:
                signals.shed += 1
                return UNHELD
            reason = ""
        if not reason or decision is None:
            signals.admitted += 1
            admitted(decision, budget, now)
            return None
        if reason == CONCURRENCY and decision.wait_s > 0:
            return WAIT
        return self._refuse(pipeline, decision, priority, request_id, tenant, reason=reason)

    def _refuse(self, pipeline: str, decision: Decision, priority: int, request_id: str,
                tenant: str, *, reason: str) -> Shed:
        self._pipelines[pipeline].shed += 1
        key = (pipeline, decision.bottleneck, priority, reason)
        self.sheds[key] = self.sheds.get(key, 0) + 1
        self.samples[pipeline, reason] = (request_id, tenant, priority)
        return Shed(pipeline, reason, decision.retry_after_s,
                    f"pipeline {pipeline} is shedding load at stage "
                    f"{decision.bottleneck or '-'} ({reason}, priority {priority})")

    def hold_at_entry(self, pipeline: str, priority: int, request_id: str, tenant: str, *,
                      on_grant: Callable[[], None], on_leave: Callable[[], object]
                      ) -> Waiter | Shed:
        """After WAIT: a place in the entry's queue, or the refusal when it is full (it
        holds what the pipeline can let in within the wait, and MIN_WAITING more)."""
        decision = self.snapshot.decisions[pipeline]
        rate = decision.admit_rate or decision.arrival_rate
        most = MIN_WAITING + math.ceil(rate * decision.wait_s)

        def grant() -> None:
            signals = self._pipelines.get(pipeline)
            if signals is not None:
                signals.admitted += 1
                budget = self._budgets[pipeline]
                current = self.snapshot.decisions.get(pipeline)
                admitted(current, budget, self._clock() if current is not None and
                         current.cutoff > 0 else 0.0)
            on_grant()

        waiter = self.queue.hold(pipeline, priority, decision.wait_s, most, on_grant=grant,
                                 on_leave=on_leave)
        if waiter is None:
            return self._refuse(pipeline, decision, priority, request_id, tenant,
                                reason=CONCURRENCY)
        waiter.request_id, waiter.tenant = request_id, tenant
        return waiter

    def room(self, pipeline: str) -> bool:
        """Whether the pipeline takes one more request in flight now (its cap)."""
        decision = self.snapshot.decisions.get(pipeline)
        signals = self._pipelines.get(pipeline)
        if decision is None or signals is None or not decision.concurrency:
            return True
        return signals.in_flight - decision.in_flight_offset < decision.concurrency

    def _waited(self, waiter: Waiter) -> None:
        """A held request waited its time: refused, as it would have been at once."""
        decision = self.snapshot.decisions.get(waiter.pipeline)
        if decision is not None and waiter.pipeline in self._pipelines:
            waiter.refusal = self._refuse(waiter.pipeline, decision, waiter.priority,
                                          waiter.request_id, waiter.tenant,
                                          reason=CONCURRENCY)
        else:
            waiter.refusal = Shed(waiter.pipeline, CONCURRENCY, 1,
                                  f"pipeline {waiter.pipeline} had no room in time")

    def started(self, pipeline: str, admitted: float) -> None:
        """An admitted request is held in flight from `admitted` (monotonic seconds)."""
        signals = self._pipelines.get(pipeline)
        if signals is not None:  # (a waiter let in as its pipeline went away: not counted)
            signals.hold(admitted)

    def ended(self, pipeline: str, admitted: float, ended_wall: float | None,
              now: float) -> None:
        """Its end: at `ended_wall` (wall clock, from its access-log entry), or None when
        the hold timed out; `now` is when sitsmesh learned it."""
        signals = self._pipelines.get(pipeline)
        if signals is not None:
            ended = ended_wall - self.wall_offset if ended_wall is not None else None
            signals.unhold(admitted, ended, now)
            if self.queue.waiting:
                self.queue.wake(pipeline)

    def rate_limited(self, pipeline: str) -> None:
        """An arrival seen by ShouldRateLimit (an adaptive rule of this pipeline)."""
        signals = self._pipelines.get(pipeline)
        if signals is not None:
            signals.rl_arrivals += 1

    def fraction(self, pipeline: str) -> float:
        """The admitted fraction adaptive rate limits scale by (1.0 when unknown)."""
        decision = self.snapshot.decisions.get(pipeline)
        return decision.fraction if decision is not None else 1.0
