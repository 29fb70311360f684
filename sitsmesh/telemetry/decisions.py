"""Every ext_authz and rate-limit decision, counted, timed and sampled into the decision
log: the servicers make one call per decision, and the rest happens here.

The request path only adds to a dict and observes one histogram child; the counts reach
prometheus-client and the log records reach stderr from `flush()`, once a second off
the request path (prometheus-client takes a lock per increment, a log line is I/O).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from sitsmesh.authz.check import Allowed, CheckInput, Denied
from sitsmesh.ratelimit.limiter import Decision, Descriptor
from sitsmesh.telemetry.decisionlog import DecisionLog

if TYPE_CHECKING:
    from sitsmesh.telemetry.tracing import Tracing

CHECK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                 0.25, 0.5, 1.0)
OTHER_TENANT = "other"      # tenants past max_tenants share this label
NO_TENANT = "none"          # refused before a tenant was known (no or a bad credential)
DEFAULT_MAX_TENANTS = 100


class AuthzMetrics:
    """`sitsmesh_authz_decisions_total{decision,reason,tenant}` and Check's latency by
    decision. Tenant names come from the admin API, not callers, but a directory can hold
    thousands: the first `max_tenants` seen get a label, the rest count as `other`."""

    __slots__ = ("_counter", "_latency", "_max_tenants", "_pending", "_tenants")

    def __init__(self, registry: CollectorRegistry | None,
                 max_tenants: int = DEFAULT_MAX_TENANTS) -> None:
        self._counter = Counter(
            "sitsmesh_authz_decisions_total",
            "ext_authz Check decisions: decision (allow, deny), reason (ok or the denial's "
            "code) and tenant (none before one is known, other past the label bound).",
            ["decision", "reason", "tenant"], registry=registry)
        histogram = Histogram("sitsmesh_authz_check_seconds",
                              "Time sitsmesh took to decide a Check, by decision.",
                              ["decision"], registry=registry, buckets=CHECK_BUCKETS)
        self._latency = {False: histogram.labels("allow"), True: histogram.labels("deny")}
        self._max_tenants = max_tenants
        self._tenants: set[str] = set()
        self._pending: dict[tuple[bool, str, str], int] = {}

    def record(self, denied: bool, reason: str, tenant: str, seconds: float) -> None:
        self._latency[denied].observe(seconds)
        key = (denied, reason, tenant)
        self._pending[key] = self._pending.get(key, 0) + 1

    def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for (denied, reason, tenant), count in pending.items():
            self._counter.labels("deny" if denied else "allow", reason,
                                 self._tenant_label(tenant)).inc(count)

    def _tenant_label(self, tenant: str) -> str:
        if not tenant:
            return NO_TENANT
        if tenant in self._tenants:
            return tenant
        if len(self._tenants) >= self._max_tenants:
            return OTHER_TENANT
        self._tenants.add(tenant)
        return tenant


class Telemetry:
    """The one hook the Check and ShouldRateLimit servicers call per decision.

    `started` is `time.perf_counter()` when the call arrived; `context` is the call's
    grpc context (tracing reads the caller's trace context from its metadata).
    """

    __slots__ = ("_authz", "log", "tracer")

    def __init__(self, authz: AuthzMetrics | None, log: DecisionLog | None) -> None:
        self._authz = authz
        self.log = log
        # OpenTelemetry spans, when tracing is on (sitsmesh.app.compose sets it).
        self.tracer: Tracing | None = None

    def check(self, request: CheckInput, decision: Allowed | Denied, started: float,
              context: Any = None) -> None:
        seconds = time.perf_counter() - started
        if isinstance(decision, Denied):
            denied, reason = True, decision.code
        else:
            denied, reason = False, "ok"
        if self._authz is not None:
            self._authz.record(denied, reason, decision.tenant, seconds)
        log = self.log
        if log is not None and log.wants(denied):
            log.authz(request, decision, seconds)
        if self.tracer is not None:
            self.tracer.check(request, decision, seconds, context)

    def settled(self, request_id: str, tenant: str, model: str, reserved: int,
                charged: int) -> None:
        """A token-budget reservation settled (sitsmesh/budgets/gate.py); logged as an
        allowed decision is."""
        log = self.log
        if log is not None and log.wants(False):
            log.settlement(request_id, tenant, model, reserved, charged)

    def refused(self, code: str, started: float) -> None:
        """A Check refused before it was read (too large, malformed, too many headers)."""
        if self._authz is not None:
            self._authz.record(True, code, "", time.perf_counter() - started)

    def ratelimit(self, domain: str, descriptors: list[Descriptor], decision: Decision | None,
                  started: float, *, error: str = "", context: Any = None) -> None:
        """`decision` None: the call failed with `error` (an unknown domain, a store
        error under fail-closed, a bad request)."""
        log = self.log
        if log is not None and log.wants(decision is None or decision.over):
            log.ratelimit(domain, descriptors, decision, time.perf_counter() - started, error)
        if self.tracer is not None:
            self.tracer.ratelimit(domain, descriptors, decision, time.perf_counter() - started,
                                  error=error, context=context)

    def flush(self) -> None:
        if self._authz is not None:
            self._authz.flush()
        if self.log is not None:
            self.log.flush()
