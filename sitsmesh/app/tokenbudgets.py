"""Token budgets where Check is served: the ledger (the rate limiter's store: memory, or
the shared Redis), the gate Check reserves through, and the settling of each finished
token stream. Its `admin_ledger` is what `tenants usage` reads."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from sitsmesh.app.background import HOUSEKEEPING_S, Background
from sitsmesh.app.components import AuthzComponent
from sitsmesh.app.tls import redis_url
from sitsmesh.app.tokens import TokensComponent
from sitsmesh.budgets.gate import BudgetGate
from sitsmesh.budgets.ledger import BudgetLedger
from sitsmesh.budgets.memory import MemoryLedger
from sitsmesh.budgets.metrics import BudgetMetrics
from sitsmesh.budgets.prompt import PromptCounter
from sitsmesh.config import Settings
from sitsmesh.telemetry.decisions import Telemetry


def ledger_for(settings: Settings) -> BudgetLedger:
    """The rate limiter's store decides: with the shared Redis every worker and replica
    spends from the same counters, in memory each process from its own."""
    if settings.ratelimit_store == "memory":
        return MemoryLedger()
    # Imported here: redis-py loads only where the shared store is configured.
    from sitsmesh.budgets.redis_ledger import RedisLedger

    return RedisLedger.from_url(redis_url(settings),
                                timeout_s=settings.redis_timeout_ms / 1000)


class TokenBudgetsComponent:
    def __init__(self, settings: Settings, authz: AuthzComponent, tokens: TokensComponent,
                 registry: CollectorRegistry | None, *, serve: bool,
                 telemetry: Telemetry | None = None) -> None:
        self.gate: BudgetGate | None = None
        # What `tenants usage` reads: the gate's own ledger where Check runs here, the
        # shared Redis from a supervisor (its workers' in-memory ledgers are theirs).
        self.admin_ledger: BudgetLedger | None = None
        self._background = Background()
        if not serve or authz.authorizer is None:
            if settings.ratelimit_store != "memory":
                self.admin_ledger = ledger_for(settings)
            return
        directory = authz.directory
        self.gate = BudgetGate(ledger_for(settings), lambda: directory.budgets,
                               fail_open=settings.on_store_error == "allow",
                               hold_s=settings.token_budget_hold_seconds,
                               charge_after=settings.budget_charging == "charge_after",
                               require=settings.budget_required,
                               counter=PromptCounter(settings.budget_tokenizers)
                               if settings.budget_tokenizers else None,
                               metrics=BudgetMetrics(registry, settings.metrics_max_tenants),
                               on_settled=None if telemetry is None else (
                                   lambda report, reserved, charged: telemetry.settled(
                                       report.request_id, report.tenant, report.model,
                                       reserved, charged)))
        self.admin_ledger = self.gate.ledger
        authz.budgets = self.gate
        tokens.settle = self.gate.settle_later

    async def start(self) -> None:
        gate = self.gate
        if gate is None:
            return

        async def expire() -> None:
            while True:
                await asyncio.sleep(HOUSEKEEPING_S)
                await gate.expire()

        self._background.spawn(expire())

    async def stop(self) -> None:
        await self._background.stop()
        if self.gate is not None:
            await self.gate.close()
        elif self.admin_ledger is not None:
            await self.admin_ledger.close()
