"""Prometheus series of token budgets: what Check decided, how reservations ended, and
the tokens charged by tenant, model and kind.

Tenant and model names come from the admin API and from requests Check allowed, but a
fleet can hold thousands: the first `max_labels` of each get a label, the rest count as
`other` (as sitsmesh_authz_decisions_total does for tenants).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

OTHER = "other"
DECISIONS = ("reserved", "refused", "bad_request", "no_budget", "store_error_allowed",
             "store_error_denied")
SETTLEMENTS = ("settled", "unmatched", "settle_failed", "settle_dropped", "expired")


class BudgetMetrics:
    __slots__ = ("_charged", "_decisions", "_disagreed", "_max", "_models", "_overrun",
                 "_settlements", "_tenants")

    def __init__(self, registry: CollectorRegistry | None, max_labels: int = 100) -> None:
        self._decisions = Counter(
            "sitsmesh_token_budget_requests_total",
            "Requests a token budget governed, by what Check decided: reserved, refused "
            "(429), bad_request (400: the body could not be estimated), no_budget (403: "
            "budget_required and the tenant has none), or the ledger away "
            "(store_error_allowed, store_error_denied).", ["outcome"],
            registry=registry)
        self._settlements = Counter(
            "sitsmesh_token_budget_settlements_total",
            "How reservations ended: settled with what the stream produced, unmatched "
            "(a report with no reservation: another hop settled it), settle_failed, "
            "settle_dropped (too many waiting), expired (the stream's end never came: "
            "charged at the estimate).", ["outcome"], registry=registry)
        self._charged = Counter(
            "sitsmesh_token_budget_tokens_total",
            "Tokens charged to token budgets when streams ended, by tenant, model and "
            "kind (input, output, cached).", ["tenant", "model", "kind"],
            registry=registry)
        self._overrun = Counter(
            "sitsmesh_token_budget_overrun_tokens_total",
            "Weighed tokens charged past what was reserved (the estimate was short).",
            registry=registry)
        self._disagreed = Counter(
            "sitsmesh_token_budget_usage_short_tokens_total",
            "Output tokens a stream's usage reported fewer than the content events seen "
            "(each carries at least one): charged as counted, the difference counted here.",
            registry=registry)
        for outcome in DECISIONS:
            self._decisions.labels(outcome)
        for outcome in SETTLEMENTS:
            self._settlements.labels(outcome)
        self._max = max_labels
        self._tenants: set[str] = set()
        self._models: set[str] = set()

    def decided(self, outcome: str) -> None:
        self._decisions.labels(outcome).inc()

    def settled(self, outcome: str, count: int = 1) -> None:
        self._settlements.labels(outcome).inc(count)

    def disagreed(self, tokens: int) -> None:
        self._disagreed.inc(tokens)

    def charged(self, tenant: str, model: str, tokens: tuple[int, int, int],
                overrun: int) -> None:
        """`tokens`: prompt, completion and cached prompt tokens."""
        prompt, completion, cached = tokens
        tenant, model = _label(self._tenants, tenant, self._max), \
            _label(self._models, model, self._max)
        cached = min(cached, prompt)
        for kind, count in (("input", prompt - cached), ("output", completion),
                            ("cached", cached)):
            if count:
                self._charged.labels(tenant, model, kind).inc(count)
        if overrun > 0:
            self._overrun.inc(overrun)


def _label(seen: set[str], name: str, bound: int) -> str:
    if name in seen:
        return name
    if len(seen) >= bound or not name:
        return OTHER if name else "-"
    seen.add(name)
    return name
