"""What `--workers N` cannot do yet, refused by name instead of answered wrong.

A request's Check and its access-log entry reach whichever worker process the
kernel hands each Envoy connection to. Pipelines (backpressure, latency chains)
and per-tenant concurrency caps both count a request from its Check to its
access-log entry, and their counts live in one process, so with several
workers they would shed too little, never see a chain whole, and hold slots
until the hold timeout. Without shared runtime state (shared_runtime=redis,
which lifts these refusals) they need --workers 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from sitsmesh.errors import FailedPreconditionError, StartupError

WHY = ("needs --workers 1: a request's Check and its access-log entry can reach different "
       "worker processes, and their counts are not shared between workers")


def refuse_pipeline(name: str) -> FailedPreconditionError:
    return FailedPreconditionError(f"pipeline {name}: backpressure and latency chains {WHY}")


def refuse_cap(tenant: str) -> FailedPreconditionError:
    return FailedPreconditionError(f"tenant {tenant}: max_concurrency {WHY}; set it to 0 or "
                                   "serve with --workers 1")


def refuse_budget(tenant: str) -> FailedPreconditionError:
    return FailedPreconditionError(
        f"token budget {tenant}: with --workers N and the memory counter store each worker "
        "would spend its own budget, and a stream's end can reach another worker than its "
        "reservation; serve with --ratelimit-store redis, or with --workers 1")


def check_budgets(workers: int, memory: bool, budgets: Iterable[str]) -> None:
    """At start: stored token budgets need shared counters under --workers N."""
    if workers <= 1 or not memory:
        return
    named = sorted(budgets)
    if named:
        raise StartupError(f"--workers {workers}: the state holds token budgets of "
                           f"{', '.join(named)}, which need --ratelimit-store redis with "
                           "several workers (in memory each worker spends its own); use "
                           "Redis, serve with --workers 1, or delete them first")


def check_state(workers: int, pipelines: Mapping[str, object],
                caps: Iterable[tuple[str, int]]) -> None:
    """At start: the stored pipelines and caps must not need one process."""
    if workers <= 1:
        return
    capped = sorted(name for name, cap in caps if cap > 0)
    if pipelines or capped:
        named = [f"pipelines {', '.join(sorted(pipelines))}"] if pipelines else []
        named += [f"tenants with max_concurrency {', '.join(capped)}"] if capped else []
        raise StartupError(f"--workers {workers}: the state holds {' and '.join(named)}, which "
                           f"{WHY}; serve with --workers 1, or delete them first")
