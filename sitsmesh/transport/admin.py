"""sitsmesh.admin.v1.Admin servicer: protobuf in, domain state out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import yaml
from grpc import aio

from sitsmesh import __version__, logs
from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.authz.model import ApiKey, Tenant
from sitsmesh.authz.state import AuthzState
from sitsmesh.chains.assembler import Assembler, Hop
from sitsmesh.chains.pipeline import Pipeline
from sitsmesh.chains.state import PipelineState
from sitsmesh.config import Settings
from sitsmesh.errors import SitsmeshError
from sitsmesh.pressure.runtime import PressureRuntime
from sitsmesh.pressure.state import ThresholdsState
from sitsmesh.ratelimit.reload import ConfigManager, version_of
from sitsmesh.state import StateStore
from sitsmesh.status import Serving, StatusBoard
from sitsmesh.swap.manager import SwapManager
from sitsmesh.transport.errors import grpc_status
from sitsmesh.transport.pressureadmin import PressureAdmin
from sitsmesh.transport.stamps import timestamp
from sitsmesh.transport.swapadmin import SwapAdmin

_log = logs.get("sitsmesh.admin")

_STATES = {
    Serving.SERVING: admin_pb2.SERVING,
    Serving.NOT_SERVING: admin_pb2.NOT_SERVING,
    Serving.DRAINING: admin_pb2.DRAINING,
}


class ChainAdmin:
    """Pipelines and latency chains on the admin API (mixed into AdminServicer)."""

    _pipelines: PipelineState
    _assembler: Assembler | None
    _guard: Any
    _document: Any

    async def ApplyPipeline(self, request: admin_pb2.ApplyPipelineRequest,
                            context: aio.ServicerContext[Any, Any]) -> admin_pb2.Pipeline:
        source = request.source or "pipeline"
        doc = await self._document(context, request.yaml, source)
        if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{source}: a pipeline needs a name and stages")
        pipeline = await self._guard(context, self._pipelines.apply(doc["name"], doc, source))
        _log.info("pipeline applied", pipeline=pipeline.name)
        return _pipeline_pb(pipeline)

    async def GetPipeline(self, request: admin_pb2.GetPipelineRequest,
                          context: aio.ServicerContext[Any, Any]) -> admin_pb2.Pipeline:
        return _pipeline_pb(await self._guard(context, self._pipelines.get(request.name)))

    async def ListPipelines(self, request: admin_pb2.ListPipelinesRequest,
                            context: aio.ServicerContext[Any, Any]
                            ) -> admin_pb2.ListPipelinesResponse:
        await self._guard(context, self._pipelines.refresh())
        return admin_pb2.ListPipelinesResponse(pipelines=[
            _pipeline_pb(p) for _, p in sorted(self._pipelines.pipelines.items())])

    async def DeletePipeline(self, request: admin_pb2.DeletePipelineRequest,
                             context: aio.ServicerContext[Any, Any]
                             ) -> admin_pb2.DeletePipelineResponse:
        await self._guard(context, self._pipelines.delete(request.name))
        _log.info("pipeline deleted", pipeline=request.name)
        return admin_pb2.DeletePipelineResponse()

    async def GetLatencyChain(self, request: admin_pb2.GetLatencyChainRequest,
                              context: aio.ServicerContext[Any, Any]) -> admin_pb2.LatencyChain:
        window = request.window or "1m"
        if window not in WINDOWS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"window must be one of {', '.join(WINDOWS)}, got {window!r}")
        if self._assembler is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "latency chains are assembled with --workers 1: the entries "
                                "of one request could reach different worker processes")
            raise AssertionError("unreachable")
        report = self._assembler.report(request.pipeline, WINDOWS[window])
        if report is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"pipeline {request.pipeline} does not exist")
            raise AssertionError("unreachable")
        reply = admin_pb2.LatencyChain(
            pipeline=report.pipeline, window=window, chains=report.chains,
            incomplete=report.incomplete, failed=report.failed, e2e_p50_ms=report.e2e_p50_ms,
            e2e_p99_ms=report.e2e_p99_ms, bottleneck=report.bottleneck)
        for stage in report.stages:
            entry = reply.stages.add(name=stage.name, p50_ms=stage.p50_ms, p90_ms=stage.p90_ms,
                                     p99_ms=stage.p99_ms, attributed_ms=stage.attributed_ms,
                                     share_of_e2e_p99=stage.share_of_e2e_p99)
            if stage.ttfb_p99_ms is not None:
                entry.ttfb_p99_ms = stage.ttfb_p99_ms
            if stage.total_p99_ms is not None:
                entry.total_p99_ms = stage.total_p99_ms
            if stage.queue_p99_ms is not None:
                entry.queue_p99_ms = stage.queue_p99_ms
        return reply

    async def ReportStageLatency(self, request_iterator: AsyncIterator[admin_pb2.StageLatency],
                                 context: aio.ServicerContext[Any, Any]
                                 ) -> admin_pb2.ReportStageLatencyResponse:
        accepted = rejected = 0
        async for report in request_iterator:
            start = report.start.ToNanoseconds() / 1e9
            end = report.end.ToNanoseconds() / 1e9
            if (self._assembler is None or not report.request_id or not report.stage
                    or not report.HasField("start") or end < start):
                rejected += 1
                continue
            ttfb = (report.first_byte.ToNanoseconds() / 1e9 - start
                    if report.HasField("first_byte") else None)
            self._assembler.add(Hop(report.request_id, start, end - start, ttfb=ttfb,
                                    pipeline=report.pipeline, stage=report.stage))
            accepted += 1
        return admin_pb2.ReportStageLatencyResponse(accepted=accepted, rejected=rejected)



class AdminServicer(ChainAdmin, SwapAdmin, PressureAdmin, admin_pb2_grpc.AdminServicer):
    def __init__(self, settings: Settings, board: StatusBoard, store: StateStore,
                 bound: dict[str, str], *, ratelimit: ConfigManager,
                 authz: AuthzState, pipelines: PipelineState,
                 assembler: Assembler | None, swaps: SwapManager,
                 thresholds: ThresholdsState, pressure: PressureRuntime | None) -> None:
        self._settings = settings
        self._swaps = swaps
        self._thresholds = thresholds
        self._pressure = pressure
        self._pipelines = pipelines
        self._assembler = assembler
        self._authz = authz
        self._ratelimit = ratelimit
        self._board = board
        self._store = store
        self._bound = bound

    async def GetStatus(
        self, request: admin_pb2.GetStatusRequest, context: aio.ServicerContext[Any, Any]
    ) -> admin_pb2.GetStatusResponse:
        started = timestamp(self._board.started_at)
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

    @staticmethod
    async def _document(context: aio.ServicerContext[Any, Any], text: str, source: str) -> Any:
        """A YAML document from an admin request; malformed YAML is INVALID_ARGUMENT."""
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{source}: invalid YAML: {str(exc).splitlines()[0]}")
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



def _key_pb(key: ApiKey) -> admin_pb2.ApiKey:
    message = admin_pb2.ApiKey(id=key.id, tenant=key.tenant, name=key.name,
                               created_at=timestamp(key.created_at), revoked=key.revoked)
    if key.expires_at is not None:
        message.expires_at.CopyFrom(timestamp(key.expires_at))
    return message


WINDOWS = {"1m": 60, "5m": 300}


def _pipeline_pb(pipeline: Pipeline) -> admin_pb2.Pipeline:
    body = {"name": pipeline.name, **pipeline.to_body()}
    return admin_pb2.Pipeline(name=pipeline.name, yaml=yaml.safe_dump(body, sort_keys=False))
