"""The process's one in-flight byte budget (sitsmesh/transport/budget.py), and the data
services charging their request messages to it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from grpc import aio

from sitsmesh import logs
from sitsmesh.app.background import DataService
from sitsmesh.config import Settings
from sitsmesh.transport.authz import SERVICE_NAME as AUTHZ_SERVICE
from sitsmesh.transport.budget import ByteBudget, default_capacity, memory_limit
from sitsmesh.transport.budgetwrap import BudgetedRegistrar
from sitsmesh.transport.checklimits import busy as check_busy
from sitsmesh.transport.ratelimit import SERVICE_NAME as RATELIMIT_SERVICE

_log = logs.get("sitsmesh.budget")


def budget(settings: Settings) -> ByteBudget:
    """The process's one in-flight byte budget, shared by the data and admin servers.
    With the RLQS process beside it, the two split the default (sized from the one
    memory limit they share); a budget set in the settings is each process's."""
    limit = memory_limit()
    share = 2 if settings.rlqs_addr is not None else 1
    capacity = settings.inflight_budget_bytes or default_capacity(limit) // share
    _log.info("in-flight byte budget", bytes=capacity, memory_limit=limit,
              large_message_lag_ms=settings.large_message_lag_ms)
    return ByteBudget(capacity, settings.large_message_lag_ms / 1000)


def budgeted(settings: Settings, budget: ByteBudget, services: list[DataService], *,
             loop_share: bool = True) -> list[DataService]:
    """`services`, each charging its request messages to `budget` (innermost: a caller
    the gate refuses is never charged, and the RPC metrics count budget refusals).
    loop_share False: large messages are charged bytes only, not paced for the loop's
    time (see BudgetedRegistrar)."""
    check = f"/{AUTHZ_SERVICE}/Check"
    unparsed = {check: settings.max_check_message_bytes,
                f"/{RATELIMIT_SERVICE}/ShouldRateLimit": settings.max_ratelimit_message_bytes}

    def add(service: DataService) -> Callable[[aio.Server], None]:
        def register(server: aio.Server) -> None:
            service.add_to_server(BudgetedRegistrar(  # type: ignore[arg-type]
                server, budget, settings.max_message_bytes, {check: check_busy}, unparsed,
                loop_share=loop_share))

        return register

    return [dataclasses.replace(s, add_to_server=add(s)) for s in services]
