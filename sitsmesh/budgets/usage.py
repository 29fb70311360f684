"""What a tenant's budget has used: one row per counter an operator can name (the
tenant's, each unrevoked key's, each literal model's), read from the ledger at once."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from sitsmesh import globs
from sitsmesh.budgets.ledger import BudgetLedger
from sitsmesh.budgets.model import Counter, Limit, TokenBudget

# A tenant may hold 100,000 keys and 50,000 models: one answer reads at most this many
# counters (one ledger round trip, one admin message), and says when it stopped.
MAX_ROWS = 1000


@dataclass(frozen=True, slots=True)
class Usage:
    index: int
    limit: Limit
    subject: str
    used: int
    remaining: int
    reset_s: float


def _counter(everything: TokenBudget, index: int, key_id: str, model: str) -> Counter:
    # Through counters() so the key is spelled in one place; `everything` counts every
    # model, so each limit has its counter there whatever its globs.
    return everything.counters(key_id, model)[index]


async def usage(budget: TokenBudget, key_ids: Sequence[str], models: Sequence[str],
                ledger: BudgetLedger, now: float, *,
                max_rows: int = MAX_ROWS) -> tuple[list[Usage], bool]:
    """Each limit's counters: `each: tenant` one (subject: the tenant), `each: api_key` one
    per id of `key_ids`, `each: model` one per model of `models` without glob characters
    that the limit counts; in that order, the first `max_rows`, and whether there were
    more."""
    everything = dataclasses.replace(budget, limits=tuple(
        dataclasses.replace(limit, models=("*",)) for limit in budget.limits))
    literal = [m for m in models if globs.shape(m) == "exact"]

    def subjects() -> Iterator[tuple[int, str, Counter]]:
        for i, limit in enumerate(budget.limits):
            if limit.each == "tenant":
                yield i, budget.tenant, _counter(everything, i, "", "")
            elif limit.each == "api_key":
                yield from ((i, key, _counter(everything, i, key, "")) for key in key_ids)
            else:
                yield from ((i, model, _counter(everything, i, "", model))
                            for model in literal if limit.counts(model))

    rows = list(itertools.islice(subjects(), max_rows + 1))
    truncated = len(rows) > max_rows
    rows = rows[:max_rows]
    used = await ledger.usage([counter for _, _, counter in rows], now) if rows else []
    return [Usage(i, budget.limits[i], subject, spent, max(0, counter.limit - spent),
                  counter.window_s - now % counter.window_s)
            for (i, subject, counter), spent in zip(rows, used, strict=True)], truncated
