"""Ownership by content: what an operator writes must stay inside its scopes, not only
the name of the object it writes. A tenant's models, a token budget's limit models, a
pipeline's models, stage models and governed tenants, and the reserved `sitsmesh.io/`
labels are each checked here.

A glob an operator writes is *within* a scope entry when every name it can match is
matched by the entry, decided conservatively: the entry is `*`; or the two are
identical; or the written value has no glob characters and the entry matches it; or the
entry is a literal prefix followed by one `*` (`team-a-*`) and the written glob starts
with that prefix. Anything else (`team-a*` against `team-a-*`, `[ab]-x` against `a-*`)
is refused even where a cleverer comparison might allow it.

What an object already holds may be kept: only the references a write adds are judged,
so an operator can change its tenant's priority without the models an admin granted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from sitsmesh.access.credentials import Credential, within
from sitsmesh.budgets.model import TokenBudget
from sitsmesh.chains.pipeline import Pipeline

RESERVED_PREFIX = "sitsmesh.io/"
MANAGED_BY = "sitsmesh.io/managed-by"
# A refusal names at most this many problems, and says how many more: gRPC's status
# message travels in a 16 KiB trailer, and a refusal past it reaches the client as
# RESOURCE_EXHAUSTED instead of PERMISSION_DENIED.
MAX_NAMED = 20
MAX_VALUE_CHARS = 80


def in_scope(credential: Credential, scope: str, pattern: str) -> bool:
    if credential.role == "admin":
        return True
    return any(within(pattern, entry) for entry in credential.scopes.get(scope, ()))


def short(value: str) -> str:
    """A written value as a refusal quotes it: long ones cut, so the message stays small."""
    if len(value) <= MAX_VALUE_CHARS:
        return value
    return f"{value[:MAX_VALUE_CHARS]}... ({len(value)} characters)"


def bounded(problems: Sequence[str], limit: int = MAX_NAMED) -> str:
    """Problems joined with '; ', at most `limit` of them, then how many more."""
    shown = "; ".join(problems[:limit])
    more = len(problems) - limit
    return f"{shown}; and {more} more" if more > 0 else shown


def references(credential: Credential, scope: str, written: Iterable[tuple[str, str]],
               kept: Iterable[str] = ()) -> list[str]:
    """A problem for each (where, value) written outside the credential's `scope`, except
    values the object already held (`kept`)."""
    if credential.role == "admin":
        return []
    before = frozenset(kept)
    return [f"{where} '{short(value)}' is not within its {scope} scope"
            for where, value in written if value not in before
            and not in_scope(credential, scope, value)]


def labels(credential: Credential, written: Mapping[str, str],
           kept: Mapping[str, str], where: str = "labels") -> list[str]:
    """The `sitsmesh.io/` namespace is reserved: an operator may set only
    `sitsmesh.io/managed-by=<its credential name>` (the value `apply --prune -l` selects
    on, so no team can mark its objects as another's, or make them another's to prune).
    Labels already on the object may be kept."""
    if credential.role == "admin":
        return []
    problems = []
    for key, value in written.items():
        if not key.startswith(RESERVED_PREFIX) or kept.get(key) == value:
            continue
        if key == MANAGED_BY and value == credential.name:
            continue
        problems.append(f"{where} '{short(key)}={short(value)}' is reserved: only admins set "
                        f"{RESERVED_PREFIX} labels, and an operator only "
                        f"{MANAGED_BY}={credential.name}")
    return problems


def refusal(credential: Credential, resource: str, problems: Sequence[str]) -> str | None:
    """None when there is no problem; otherwise one bounded sentence naming them."""
    if not problems:
        return None
    return (f"credential '{credential.name}' ({credential.role}) may not write {resource}: "
            f"{bounded(problems)}")


def tenant_problems(credential: Credential, models: Sequence[str],
                    tenant_labels: Mapping[str, str], *, before_models: Sequence[str] = (),
                    before_labels: Mapping[str, str] | None = None) -> list[str]:
    """What `credential` may not give a tenant of these models and labels; `before_*`:
    what the stored tenant holds."""
    problems = references(credential, "models",
                          ((f"models[{i}]", m) for i, m in enumerate(models)), before_models)
    return problems + labels(credential, tenant_labels, before_labels or {})


def tenant(credential: Credential, name: str, models: Sequence[str],
           tenant_labels: Mapping[str, str], *, before_models: Sequence[str] = (),
           before_labels: Mapping[str, str] | None = None) -> str | None:
    """Why `credential` may not give tenant `name` these models and labels (None: it may)."""
    return refusal(credential, f"tenant '{name}'", tenant_problems(
        credential, models, tenant_labels, before_models=before_models,
        before_labels=before_labels))


def budget_problems(credential: Credential, written: TokenBudget,
                    before: TokenBudget | None) -> list[str]:
    """What `credential` may not write of this token budget: each limit's models globs
    must be within its models scope, as a tenant's models must (the default `*` too),
    apart from globs the stored budget (`before`) already holds."""
    kept = [m for limit in before.limits for m in limit.models] if before is not None else ()
    return references(credential, "models", (
        (f"limits[{i}].models[{j}]", m)
        for i, limit in enumerate(written.limits) for j, m in enumerate(limit.models)), kept)


def pipeline_problems(credential: Credential, written: Pipeline,
                      before: Pipeline | None) -> list[str]:
    """What `credential` may not write of this pipeline: its models, its stages' Triton
    models and the tenants it governs must be within the credential's scopes, apart from
    what the stored pipeline (`before`) already holds."""
    if credential.role == "admin":
        return []
    kept_models = (*before.models, *before.triton_models()) if before is not None else ()
    problems = references(credential, "models",
                          ((f"models[{i}]", m) for i, m in enumerate(written.models)),
                          kept_models)
    problems += references(credential, "models", (
        (f"stages[{i}].triton_model", s.triton_model)
        for i, s in enumerate(written.stages) if s.triton_model), kept_models)
    if written.tenants is None:
        problems.append("it would govern every tenant's requests: an operator's pipeline "
                        "governs tenants within its tenants scope, and it has none")
    else:
        kept = before.tenants if before is not None and before.tenants is not None else ()
        problems += references(credential, "tenants", (
            (f"tenants[{i}]", t) for i, t in enumerate(written.tenants)), kept)
    return problems


def pipeline(credential: Credential, written: Pipeline, before: Pipeline | None) -> str | None:
    """Why `credential` may not write this pipeline's content (None: it may)."""
    return refusal(credential, f"pipeline '{written.name}'",
                   pipeline_problems(credential, written, before))


def governed_default(credential: Credential) -> list[str] | None:
    """The tenants a pipeline governs when its writer leaves `tenants` out: an admin's,
    every tenant's (None); an operator's, its tenants scope (empty without one)."""
    if credential.role == "admin":
        return None
    # Without a tenants scope: None too, which `pipeline` then refuses with the reason.
    return sorted(credential.scopes.get("tenants", ())) or None


def models_of(credential: Credential, resource: str, models: Iterable[str]) -> str | None:
    """Why `credential` may not act on `resource`, which reaches these models (automatic
    batching of a pipeline's stage models), None when every one is within its scope."""
    problems = references(credential, "models", (("model", m) for m in models))
    return refusal(credential, resource, problems)
