"""Tenants, API keys and token budgets in the state store, and the snapshot the request
path reads.

Every write goes to the store first; then the snapshot is rebuilt whole and
swapped in. Other processes (workers, replicas) notice the store's revision
change within the watch interval.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from sitsmesh import logs
from sitsmesh.authz.admission import AdmissionPolicy
from sitsmesh.authz.check import AuthzSnapshot
from sitsmesh.authz.keypolicy import KEYPOLICY_KIND, key_policy_from
from sitsmesh.authz.model import (
    APIKEY_KIND,
    TENANT_KIND,
    ApiKey,
    InvalidObject,
    Tenant,
    apikey_from,
    digest,
    new_key,
    new_uid,
    tenant_from,
)
from sitsmesh.budgets.model import BUDGET_KIND, TokenBudget, budget_from
from sitsmesh.errors import ConflictError, NotFoundError
from sitsmesh.state import Delete, Put, StateStore
from sitsmesh.state.watch import RevisionFollower

_log = logs.get("sitsmesh.authz.directory")


class TenantDirectory(RevisionFollower):
    def __init__(self, state: StateStore, clock: Callable[[], float] = time.time) -> None:
        super().__init__(state)
        self._clock = clock
        self.snapshot = AuthzSnapshot()
        # tenant -> its TokenBudget; swapped whole with the snapshot, never changed in place.
        self.budgets: Mapping[str, TokenBudget] = MappingProxyType({})
        self._listeners: list[Callable[[AuthzSnapshot, AdmissionPolicy], None]] = []
        self._budget_listeners: list[Callable[[Mapping[str, TokenBudget]], None]] = []

    def on_change(self, listener: Callable[[AuthzSnapshot, AdmissionPolicy], None]) -> None:
        self._listeners.append(listener)

    def on_budgets(self, listener: Callable[[Mapping[str, TokenBudget]], None]) -> None:
        """`listener(budgets)` after every rebuild, as on_change's."""
        self._budget_listeners.append(listener)

    async def _rebuild(self) -> None:
        tenants: dict[str, Tenant] = {}
        for record in await self._state.list(TENANT_KIND):
            try:
                tenants[record.name] = tenant_from(record.name, record.body)
            except InvalidObject as exc:  # written by a newer or older version: skip, say so
                _log.error("stored tenant is invalid; ignoring it", error=exc.message)
        keys = {r.name: apikey_from(r.name, r.body) for r in await self._state.list(APIKEY_KIND)}
        budgets: dict[str, TokenBudget] = {}
        for record in await self._state.list(BUDGET_KIND):
            try:
                budgets[record.name] = budget_from(record.name, record.body)
            except InvalidObject as exc:  # as a tenant's: skipped (so unbudgeted), said
                _log.error("stored token budget is invalid; ignoring it", error=exc.message)
        self.snapshot = AuthzSnapshot(tenants, keys)
        self.budgets = MappingProxyType(budgets)
        policy = AdmissionPolicy({t.name: t.max_concurrency for t in tenants.values()})
        for listener in self._listeners:
            listener(self.snapshot, policy)
        for budget_listener in self._budget_listeners:
            budget_listener(self.budgets)

    # --- admin operations -------------------------------------------------

    async def create_tenant(self, name: str, body: dict[str, Any]) -> Tenant:
        tenant = tenant_from(name, {**body, "uid": new_uid()})  # never the caller's
        await self._state.create(TENANT_KIND, name, tenant.to_body())
        await self.refresh()
        return tenant

    async def update_tenant(self, name: str, body: dict[str, Any]) -> Tenant:
        record = await self._state.get(TENANT_KIND, name)
        if record is None:
            raise NotFoundError(f"tenant {name} does not exist")
        tenant = tenant_from(name, {**body, "uid": record.body.get("uid", "")})
        await self._state.put(TENANT_KIND, name, tenant.to_body(),
                              expect_revision=record.revision)
        await self.refresh()
        return tenant

    async def get_tenant(self, name: str) -> Tenant:
        record = await self._state.get(TENANT_KIND, name)
        if record is None:
            raise NotFoundError(f"tenant {name} does not exist")
        return tenant_from(name, record.body)

    async def get_budget(self, tenant: str) -> TokenBudget | None:
        """The tenant's budget as stored now (None: it has none)."""
        record = await self._state.get(BUDGET_KIND, tenant)
        return budget_from(tenant, record.body) if record is not None else None

    async def list_tenants(self) -> list[Tenant]:
        return [tenant_from(r.name, r.body) for r in await self._state.list(TENANT_KIND)]

    async def delete_tenant(self, name: str) -> int:
        """Delete the tenant and revoke its keys in one transaction; returns how many keys
        it revoked. (A key made for it in between is bound to its uid, so it is dead too.)"""
        record = await self._state.get(TENANT_KIND, name)
        if record is None:
            raise NotFoundError(f"tenant {name} does not exist")
        keys = [r for r in await self._state.list(APIKEY_KIND)
                if r.body.get("tenant") == name and not r.body.get("revoked")]
        await self._state.apply([
            Delete(TENANT_KIND, name),
            *(Put(APIKEY_KIND, r.name, {**r.body, "revoked": True},
                  expect_revision=r.revision) for r in keys)])
        await self.refresh()
        return len(keys)

    async def create_key(self, tenant: str, *, name: str = "",
                         expires_at: float | None = None) -> tuple[ApiKey, str]:
        record = await self._state.get(TENANT_KIND, tenant)
        if record is None:
            raise NotFoundError(f"tenant {tenant} does not exist")
        if expires_at is not None and expires_at <= self._clock():
            raise InvalidObject("expires_at is in the past")
        policy = await self._state.get(KEYPOLICY_KIND, tenant)
        if policy is not None:
            key_policy_from(tenant, policy.body).check_issue(
                expires_at, self._clock(), await self.list_keys(tenant))
        key_id, secret = new_key()
        key = ApiKey(key_id, tenant, digest(secret), self._clock(), expires_at, False, name,
                     str(record.body.get("uid", "")))
        try:
            await self._state.create(APIKEY_KIND, key_id, key.to_body())
        except ConflictError:  # 48 random bits collided; vanishingly rare, refuse cleanly
            raise ConflictError("key id collision; try again") from None
        await self.refresh()
        return key, secret

    async def list_keys(self, tenant: str = "") -> list[ApiKey]:
        keys = [apikey_from(r.name, r.body) for r in await self._state.list(APIKEY_KIND)]
        return [k for k in keys if not tenant or k.tenant == tenant]

    async def revoke_key(self, key_id: str) -> ApiKey:
        record = await self._state.get(APIKEY_KIND, key_id)
        if record is None:
            raise NotFoundError(f"API key {key_id} does not exist")
        key = apikey_from(key_id, {**record.body, "revoked": True})
        await self._state.put(APIKEY_KIND, key_id, key.to_body(),
                              expect_revision=record.revision)
        await self.refresh()
        return key
