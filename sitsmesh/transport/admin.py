"""sitsmesh.admin.v1.Admin servicer: protobuf in, domain state out."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from grpc import aio

from sitsmesh import __version__, logs
from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.authz.model import ApiKey, Tenant
from sitsmesh.authz.state import AuthzState
from sitsmesh.config import Settings
from sitsmesh.errors import SitsmeshError
from sitsmesh.ratelimit.reload import ConfigManager, version_of
from sitsmesh.state import StateStore
from sitsmesh.status import Serving, StatusBoard
from sitsmesh.transport.errors import grpc_status

_log = logs.get("sitsmesh.admin")

_STATES = {
    Serving.SERVING: admin_pb2.SERVING,
    Serving.NOT_SERVING: admin_pb2.NOT_SERVING,
    Serving.DRAINING: admin_pb2.DRAINING,
}


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, settings: Settings, board: StatusBoard, store: StateStore,
                 bound: dict[str, str], *, ratelimit: ConfigManager,
                 authz: AuthzState) -> None:
        self._settings = settings
        self._authz = authz
        self._ratelimit = ratelimit
        self._board = board
        self._store = store
        self._bound = bound

    async def GetStatus(
        self, request: admin_pb2.GetStatusRequest, context: aio.ServicerContext[Any, Any]
    ) -> admin_pb2.GetStatusResponse:
        started = Timestamp()
        started.FromNanoseconds(int(self._board.started_at * 1e9))
        return admin_pb2.GetStatusResponse(
            version=__version__,
            uptime_seconds=self._board.uptime(),
            started_at=started,
            services=[
                admin_pb2.ServiceStatus(name=s.name, server=s.server, state=_STATES[s.state])
                for s in self._board.services()
            ],
            config_version=self._settings.config_version,
            state_revision=await self._store.revision(),
            data_addr=self._bound["data"],
            admin_addr=self._bound["admin"],
            metrics_addr=self._bound["metrics"],
            workers=[
                admin_pb2.WorkerStatus(index=w.index, pid=w.pid, alive=w.alive,
                                       restarts=w.restarts)
                for w in self._board.workers()
            ],
        )

    @staticmethod
    async def _guard(context: aio.ServicerContext[Any, Any], call: Any) -> Any:
        """Await a domain call; its errors become the matching gRPC status, in one place."""
        try:
            return await call
        except SitsmeshError as exc:
            await context.abort(grpc_status(exc.code), exc.message)
            raise

    async def ApplyRateLimitConfig(
        self, request: admin_pb2.ApplyRateLimitConfigRequest,
        context: aio.ServicerContext[Any, Any],
    ) -> admin_pb2.ApplyRateLimitConfigResponse:
        if not request.files:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no files to apply")
        names = [f.name or f"file{i}" for i, f in enumerate(request.files)]
        config, domains = await self._guard(context, self._ratelimit.apply(
            [(n, f.yaml) for n, f in zip(names, request.files, strict=True)],
            dry_run=request.dry_run))
        _log.info("rate-limit config applied" if not request.dry_run
                  else "rate-limit config dry run passed", domains=domains)
        return admin_pb2.ApplyRateLimitConfigResponse(
            domains=domains, config_version=version_of(config), applied=not request.dry_run)

    async def GetRateLimitConfig(
        self, request: admin_pb2.GetRateLimitConfigRequest,
        context: aio.ServicerContext[Any, Any],
    ) -> admin_pb2.GetRateLimitConfigResponse:
        config = self._ratelimit.holder.current
        return admin_pb2.GetRateLimitConfigResponse(
            domains=[admin_pb2.RateLimitDomain(domain=d, source=config.sources[d],
                                               yaml=config.texts[d])
                     for d in sorted(config.domains)],
            config_version=self._ratelimit.version)

    async def DeleteRateLimitConfig(
        self, request: admin_pb2.DeleteRateLimitConfigRequest,
        context: aio.ServicerContext[Any, Any],
    ) -> admin_pb2.DeleteRateLimitConfigResponse:
        deleted = await self._guard(context, self._ratelimit.delete(request.domain))
        if not deleted:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no rate-limit domain '{request.domain}' applied through the API")
        return admin_pb2.DeleteRateLimitConfigResponse()

    # --- tenants and API keys --------------------------------------------

    async def CreateTenant(self, request: admin_pb2.Tenant,
                           context: aio.ServicerContext[Any, Any]) -> admin_pb2.Tenant:
        tenant = await self._guard(context, self._authz.create_tenant(
            request.name, _tenant_body(request)))
        _log.info("tenant created", tenant=tenant.name)
        return _tenant_pb(tenant)

    async def UpdateTenant(self, request: admin_pb2.Tenant,
                           context: aio.ServicerContext[Any, Any]) -> admin_pb2.Tenant:
        tenant = await self._guard(context, self._authz.update_tenant(
            request.name, _tenant_body(request)))
        _log.info("tenant updated", tenant=tenant.name)
        return _tenant_pb(tenant)

    async def GetTenant(self, request: admin_pb2.GetTenantRequest,
                        context: aio.ServicerContext[Any, Any]) -> admin_pb2.Tenant:
        return _tenant_pb(await self._guard(context, self._authz.get_tenant(request.name)))

    async def ListTenants(self, request: admin_pb2.ListTenantsRequest,
                          context: aio.ServicerContext[Any, Any]
                          ) -> admin_pb2.ListTenantsResponse:
        tenants = await self._guard(context, self._authz.list_tenants())
        return admin_pb2.ListTenantsResponse(tenants=[_tenant_pb(t) for t in tenants])

    async def DeleteTenant(self, request: admin_pb2.DeleteTenantRequest,
                           context: aio.ServicerContext[Any, Any]
                           ) -> admin_pb2.DeleteTenantResponse:
        await self._guard(context, self._authz.delete_tenant(request.name))
        _log.info("tenant deleted", tenant=request.name)
        return admin_pb2.DeleteTenantResponse()

    async def CreateApiKey(self, request: admin_pb2.CreateApiKeyRequest,
                           context: aio.ServicerContext[Any, Any]
                           ) -> admin_pb2.CreateApiKeyResponse:
        expires = (request.expires_at.ToNanoseconds() / 1e9
                   if request.HasField("expires_at") else None)
        key, secret = await self._guard(context, self._authz.create_key(
            request.tenant, name=request.name, expires_at=expires))
        _log.info("api key created", key_id=key.id, tenant=key.tenant)  # never the secret
        return admin_pb2.CreateApiKeyResponse(key=_key_pb(key), secret=secret)

    async def ListApiKeys(self, request: admin_pb2.ListApiKeysRequest,
                          context: aio.ServicerContext[Any, Any]
                          ) -> admin_pb2.ListApiKeysResponse:
        keys = await self._guard(context, self._authz.list_keys(request.tenant))
        return admin_pb2.ListApiKeysResponse(keys=[_key_pb(k) for k in keys])

    async def RevokeApiKey(self, request: admin_pb2.RevokeApiKeyRequest,
                           context: aio.ServicerContext[Any, Any]) -> admin_pb2.ApiKey:
        key = await self._guard(context, self._authz.revoke_key(request.id))
        _log.info("api key revoked", key_id=key.id, tenant=key.tenant)
        return _key_pb(key)


def _tenant_body(request: admin_pb2.Tenant) -> dict[str, Any]:
    return {"models": list(request.models), "priority": request.priority,
            "max_priority": request.max_priority, "max_concurrency": request.max_concurrency,
            "labels": dict(request.labels)}


def _tenant_pb(tenant: Tenant) -> admin_pb2.Tenant:
    return admin_pb2.Tenant(name=tenant.name, models=list(tenant.models),
                            priority=tenant.priority, max_priority=tenant.max_priority,
                            max_concurrency=tenant.max_concurrency, labels=dict(tenant.labels))


def _timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def _key_pb(key: ApiKey) -> admin_pb2.ApiKey:
    message = admin_pb2.ApiKey(id=key.id, tenant=key.tenant, name=key.name,
                               created_at=_timestamp(key.created_at), revoked=key.revoked)
    if key.expires_at is not None:
        message.expires_at.CopyFrom(_timestamp(key.expires_at))
    return message
