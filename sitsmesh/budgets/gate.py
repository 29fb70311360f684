"""Token budgets at Check and at the stream's end: reserve the estimate, or refuse with
429 and OpenAI's x-ratelimit-*-tokens headers; settle with what the stream produced.

Check asks `reserve` for every request a tenant with a budget makes on an LLM route. The
estimate goes upstream in `x-sits-token-estimate` (its input tokens), so whichever
replica sees the stream's end (its access-log entry or ext_proc report, which log that
header and x-sits-tenant) can price what was produced without the reserving replica's
memory. `settle` charges: prompt from the stream's usage where it reported one, else
the estimate's; completion from the usage, else the tokens counted (a client abort or
upstream reset is charged what was produced); weighed as the budget says.

A ledger that fails (Redis away) is the rate limiter's outage setting: `allow` admits the
request without a reservation (counted), `deny` answers 503.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sitsmesh import logs
from sitsmesh.authz.check import Allowed, CheckInput, Denied
from sitsmesh.budgets.estimate import BadRequest, Estimate, estimate
from sitsmesh.budgets.ledger import AlreadyReserved, BudgetLedger
from sitsmesh.budgets.metrics import BudgetMetrics
from sitsmesh.budgets.model import ESTIMATE_HEADER, TokenBudget
from sitsmesh.budgets.prompt import PromptCounter
from sitsmesh.tokens.stream import TokenReport

# A reservation whose stream's end never comes is forgotten after this, charged at its
# estimate: longer than a generation runs (Envoy's stream_idle_timeout, 60 s, bounds its
# gaps, not its length; 10 min covers tens of thousands of tokens at reading pace).
HOLD_S = 600.0
MAX_PENDING_SETTLES = 10_000
TOKENIZE_INLINE_BYTES = 8192
_log = logs.get("sitsmesh.budgets")


@dataclass(frozen=True, slots=True)
class Reserved:
    """A reservation made: the headers it adds to the allowed request."""

    estimate: Estimate

    @property
    def headers(self) -> tuple[tuple[str, str], ...]:
        return ((ESTIMATE_HEADER, str(self.estimate.prompt)),)


def reset_text(seconds: float) -> str:
    """OpenAI's x-ratelimit-reset-tokens form: 6m0s, 1s, 250ms."""
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    whole = round(seconds)
    minutes, rest = divmod(whole, 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"


class BudgetGate:
    """`budgets()`: the tenants' budgets as they are now (the directory's view)."""

    def __init__(self, ledger: BudgetLedger, budgets: Callable[[], Mapping[str, TokenBudget]],
                 *, fail_open: bool = True, hold_s: float = HOLD_S,
                 charge_after: bool = False, require: bool = False,
                 counter: PromptCounter | None = None,
                 clock: Callable[[], float] = time.time,
                 metrics: BudgetMetrics | None = None,
                 on_settled: Callable[[TokenReport, int, int], None] | None = None) -> None:
        """`on_settled(report, reserved, charged)`: the decision log's hook."""
        self._ledger = ledger
        self._budgets = budgets
        self._fail_open = fail_open
        self._hold_s = hold_s
        # Charge after: reserve nothing, only refuse once the budget is spent (what
        # gateways that charge after the response do; kept to measure the difference).
        self._charge_after = charge_after
        # A tenant without a budget: unlimited (the default), or refused its LLM calls.
        self._require = require
        self._counter = counter if counter else None
        self._clock = clock
        self._metrics = metrics or BudgetMetrics(None)
        self._on_settled = on_settled
        self._settling: set[asyncio.Task[int | None]] = set()

    @property
    def ledger(self) -> BudgetLedger:
        return self._ledger

    def governs(self, allowed: Allowed) -> TokenBudget | Denied | None:
        """The budget a request spends from: its tenant's, on an LLM route; None where
        none applies (Check goes on as before, with no I/O), or a 403 for a tenant with
        no budget where one is required."""
        if allowed.request_class not in ("openai", "stream") or not allowed.model:
            return None
        budget = self._budgets().get(allowed.tenant)
        if budget is None and self._require:
            self._metrics.decided("no_budget")
            return Denied(403, "token_budget_missing",
                          f"tenant {allowed.tenant} has no token budget, and LLM calls "
                          "need one here (budget_required)", tenant=allowed.tenant)
        return budget

    async def reserve(self, budget: TokenBudget, allowed: Allowed, request: CheckInput
                      ) -> Reserved | Denied | None:
        """Reserved, a Denied (400 unestimable, 429 over a budget, 503 ledger away and
        fail-closed), or None: admitted without a reservation (no counter applies, or
        the ledger failed and the setting is fail-open)."""
        tenant, key_id, request_id = allowed.tenant, allowed.key_id, request.request_id
        counter = self._counter
        try:
            if counter is not None and len(request.body) > TOKENIZE_INLINE_BYTES:
                # A long prompt takes the tokenizer milliseconds: off the event loop (the
                # library releases the GIL), so other Checks go on meanwhile.
                guess = await asyncio.to_thread(estimate, request.path, request.body, budget,
                                                allowed.model, counter)
            else:
                guess = estimate(request.path, request.body, budget, allowed.model, counter)
        except BadRequest as exc:
            self._metrics.decided("bad_request")
            return Denied(400, "token_budget_bad_request", str(exc), tenant=tenant)
        counters = budget.counters(key_id, allowed.model)
        if not counters or not request_id:
            return None
        try:
            spent = await self._ledger.reserve(request_id, counters,
                                               0 if self._charge_after else guess.cost,
                                               self._clock(), self._hold_s)
        except AlreadyReserved:
            # A retry of the same request through the entry again: its first
            # reservation stands for it.
            return None
        except Exception as exc:  # any ledger failure is an outage
            _log.warning("token budget ledger failed", error=str(exc)[:200])
            if self._fail_open:
                self._metrics.decided("store_error_allowed")
                return None
            self._metrics.decided("store_error_denied")
            return Denied(503, "token_budget_unavailable",
                          "the token budget store is unavailable", 1.0, tenant=tenant)
        headers = (("x-ratelimit-limit-tokens", str(spent.limit)),
                   ("x-ratelimit-remaining-tokens", str(spent.remaining)),
                   ("x-ratelimit-reset-tokens", reset_text(spent.reset_s)))
        if not spent.ok:
            self._metrics.decided("refused")
            what = budget.describe(counters[spent.index].index, key_id, allowed.model)
            return Denied(429, "token_budget_exceeded",
                          f"token budget exceeded: {what}; this request needs about "
                          f"{guess.cost} tokens, {spent.remaining} are left",
                          spent.reset_s, tenant=tenant, headers=headers,
                          budget=what)
        self._metrics.decided("reserved")
        return Reserved(guess)

    def settle_later(self, report: TokenReport) -> None:
        """Settle a finished stream's reservation, off the caller's path."""
        if not report.tenant or not report.request_id or \
                report.tenant not in self._budgets():
            return
        if len(self._settling) >= MAX_PENDING_SETTLES:
            self._metrics.settled("settle_dropped")
            return
        task = asyncio.get_running_loop().create_task(self.settle(report))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def settle(self, report: TokenReport) -> int | None:
        """Charge what the stream produced; the reservation it replaced, or None."""
        budget = self._budgets().get(report.tenant)
        if budget is None:
            return None
        usage = report.usage
        prompt = usage.prompt_tokens if usage is not None else report.input_estimate
        cached = usage.cached_tokens if usage is not None else 0
        completion = report.summary.tokens
        counted = report.summary.counted
        if usage is not None and counted > completion:
            # Every content event carries at least one token: a usage below the events
            # seen is not the truth. The count stands; the difference is counted.
            self._metrics.disagreed(counted - completion)
            completion = counted
        actual = budget.weights.cost(prompt, completion, cached)
        try:
            reserved = await self._ledger.settle(report.request_id, actual, self._clock())
        except Exception as exc:  # the hold releases it later
            _log.warning("token budget settle failed", error=str(exc)[:200])
            self._metrics.settled("settle_failed")
            return None
        if reserved is None:
            # Another hop of the same request settled it, or it was never reserved
            # (no budget then, or the ledger was away).
            self._metrics.settled("unmatched")
            return None
        self._metrics.settled("settled")
        if self._on_settled is not None:
            self._on_settled(report, reserved, actual)
        self._metrics.charged(report.tenant, report.model, (prompt, completion, cached),
                              actual - reserved)
        return reserved

    async def expire(self) -> int:
        """Forget reservations past their hold (charged at their estimate)."""
        try:
            lost = await self._ledger.expire(self._clock())
        except Exception as exc:  # tried again next time
            _log.warning("token budget expiry failed", error=str(exc)[:200])
            return 0
        if lost:
            self._metrics.settled("expired", lost)
        return lost

    async def close(self) -> None:
        if self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)
        await self._ledger.close()
