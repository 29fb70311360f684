"""Tenants, API keys and token usage on the admin API; a key's secret leaves only in
CreateApiKey's reply."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from grpc import aio

from sitsmesh import logs, workerguard
from sitsmesh.access import content
from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.authz.directory import TenantDirectory
from sitsmesh.authz.model import ApiKey, Tenant
from sitsmesh.budgets.ledger import BudgetLedger
from sitsmesh.budgets.usage import usage
from sitsmesh.errors import FailedPreconditionError, NotFoundError
from sitsmesh.transport.admin.common import timestamp
from sitsmesh.transport.admin.paging import (
    PageTokens,
    check_mask,
    page,
    page_size,
    scope_of,
    trimmed,
)
from sitsmesh.transport.adminaccess import credential
from sitsmesh.transport.auth import PermissionDeniedError

_log = logs.get("sitsmesh.admin")


class TenantAdmin:
    RPCS = ("CreateTenant", "UpdateTenant", "GetTenant", "ListTenants", "DeleteTenant",
            "CreateApiKey", "ListApiKeys", "RevokeApiKey", "GetTokenUsage")

    def __init__(self, directory: TenantDirectory, tokens: PageTokens, *,
                 workers: int = 1, ledger: BudgetLedger | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        """`ledger`: where token budgets are spent (None: budgets are not enabled)."""
        self._directory = directory
        self._tokens = tokens
        self._workers = workers
        self._ledger = ledger
        self._clock = clock

    def _guard(self, request: admin_pb2.Tenant) -> None:
        if self._workers > 1 and request.max_concurrency > 0:
            raise workerguard.refuse_cap(request.name)

    async def _owns(self, method: str, request: admin_pb2.Tenant, *, exists: bool) -> None:
        """The tenant's models and labels, by content, within the caller's scopes (what
        the stored tenant already holds may stay)."""
        who = credential()
        if who is None or who.role == "admin":
            return
        before: Tenant | None = None
        if exists:
            try:
                before = await self._directory.get_tenant(request.name)
            except NotFoundError:
                before = None  # UpdateTenant answers NOT_FOUND itself
        # Up to a 4 MB message of models: judged off the event loop, which serves Check.
        reason = await asyncio.to_thread(
            content.tenant, who, request.name, list(request.models), dict(request.labels),
            before_models=before.models if before is not None else (),
            before_labels=before.labels if before is not None else None)
        if reason is not None:
            raise PermissionDeniedError(f"{method}: {reason}")

    async def CreateTenant(self, request: admin_pb2.CreateTenantRequest,
                           context: aio.ServicerContext[Any, Any]
                           ) -> admin_pb2.CreateTenantResponse:
        self._guard(request.tenant)
        await self._owns("CreateTenant", request.tenant, exists=False)
        tenant = await self._directory.create_tenant(request.tenant.name,
                                                     _tenant_body(request.tenant))
        _log.info("tenant created", tenant=tenant.name)
        return admin_pb2.CreateTenantResponse(tenant=_tenant_pb(tenant))

    async def UpdateTenant(self, request: admin_pb2.UpdateTenantRequest,
                           context: aio.ServicerContext[Any, Any]
                           ) -> admin_pb2.UpdateTenantResponse:
        self._guard(request.tenant)
        await self._owns("UpdateTenant", request.tenant, exists=True)
        tenant = await self._directory.update_tenant(request.tenant.name,
                                                     _tenant_body(request.tenant))
        _log.info("tenant updated", tenant=tenant.name)
        return admin_pb2.UpdateTenantResponse(tenant=_tenant_pb(tenant))

    async def GetTenant(self, request: admin_pb2.GetTenantRequest,
                        context: aio.ServicerContext[Any, Any]) -> admin_pb2.GetTenantResponse:
        mask = check_mask(request.read_mask, admin_pb2.Tenant)
        return admin_pb2.GetTenantResponse(
            tenant=trimmed(_tenant_pb(await self._directory.get_tenant(request.name)), mask))

    async def ListTenants(self, request: admin_pb2.ListTenantsRequest,
                          context: aio.ServicerContext[Any, Any]
                          ) -> admin_pb2.ListTenantsResponse:
        size = page_size(request.page_size)
        mask = check_mask(request.read_mask, admin_pb2.Tenant)
        tenants, token = await page(self._tokens, scope_of("ListTenants"),
                                    await self._directory.list_tenants(), lambda t: t.name,
                                    size=size, token=request.page_token)
        return admin_pb2.ListTenantsResponse(
            tenants=[trimmed(_tenant_pb(t), mask) for t in tenants], next_page_token=token)

    async def DeleteTenant(self, request: admin_pb2.DeleteTenantRequest,
                           context: aio.ServicerContext[Any, Any]
                           ) -> admin_pb2.DeleteTenantResponse:
        revoked = await self._directory.delete_tenant(request.name)
        _log.info("tenant deleted", tenant=request.name, keys_revoked=revoked)
        return admin_pb2.DeleteTenantResponse()

    async def CreateApiKey(self, request: admin_pb2.CreateApiKeyRequest,
                           context: aio.ServicerContext[Any, Any]
                           ) -> admin_pb2.CreateApiKeyResponse:
        expires = (request.expires_at.ToNanoseconds() / 1e9
                   if request.HasField("expires_at") else None)
        key, secret = await self._directory.create_key(request.tenant, name=request.name,
                                                       expires_at=expires)
        _log.info("api key created", key_id=key.id, tenant=key.tenant)  # never the secret
        return admin_pb2.CreateApiKeyResponse(key=_key_pb(key), secret=secret)

    async def ListApiKeys(self, request: admin_pb2.ListApiKeysRequest,
                          context: aio.ServicerContext[Any, Any]
                          ) -> admin_pb2.ListApiKeysResponse:
        size = page_size(request.page_size)
        mask = check_mask(request.read_mask, admin_pb2.ApiKey)
        keys, token = await page(self._tokens, scope_of("ListApiKeys", request.tenant),
                                 await self._directory.list_keys(request.tenant),
                                 lambda k: k.id, size=size, token=request.page_token)
        return admin_pb2.ListApiKeysResponse(keys=[trimmed(_key_pb(k), mask) for k in keys],
                                             next_page_token=token)

    async def RevokeApiKey(self, request: admin_pb2.RevokeApiKeyRequest,
                           context: aio.ServicerContext[Any, Any]
                           ) -> admin_pb2.RevokeApiKeyResponse:
        key = await self._directory.revoke_key(request.id)
        _log.info("api key revoked", key_id=key.id, tenant=key.tenant)
        return admin_pb2.RevokeApiKeyResponse(key=_key_pb(key))

    async def GetTokenUsage(self, request: admin_pb2.GetTokenUsageRequest,
                            context: aio.ServicerContext[Any, Any]
                            ) -> admin_pb2.GetTokenUsageResponse:
        if self._ledger is None:
            raise FailedPreconditionError("token budgets are not enabled")
        tenant = await self._directory.get_tenant(request.tenant)
        budget = await self._directory.get_budget(tenant.name)
        if budget is None:
            raise NotFoundError(f"tenant {tenant.name} has no TokenBudget")
        keys = sorted(k.id for k in await self._directory.list_keys(tenant.name)
                      if not k.revoked)
        rows, truncated = await usage(budget, keys, tenant.models, self._ledger,
                                      self._clock())
        return admin_pb2.GetTokenUsageResponse(tenant=tenant.name, truncated=truncated, usage=[
            admin_pb2.TokenUsage(limit_index=u.index, per=u.limit.per, each=u.limit.each,
                                 tokens=u.limit.tokens, models=list(u.limit.models),
                                 subject=u.subject, used=u.used, remaining=u.remaining,
                                 reset_s=u.reset_s) for u in rows])


def _tenant_body(request: admin_pb2.Tenant) -> dict[str, Any]:
    return {"models": list(request.models), "priority": request.priority,
            "max_priority": request.max_priority, "max_concurrency": request.max_concurrency,
            "labels": dict(request.labels)}


def _tenant_pb(tenant: Tenant) -> admin_pb2.Tenant:
    return admin_pb2.Tenant(name=tenant.name, models=list(tenant.models),
                            priority=tenant.priority, max_priority=tenant.max_priority,
                            max_concurrency=tenant.max_concurrency, labels=dict(tenant.labels))


def _key_pb(key: ApiKey) -> admin_pb2.ApiKey:
    message = admin_pb2.ApiKey(id=key.id, tenant=key.tenant, name=key.name,
                               created_at=timestamp(key.created_at), revoked=key.revoked)
    if key.expires_at is not None:
        message.expires_at.CopyFrom(timestamp(key.expires_at))
    return message
