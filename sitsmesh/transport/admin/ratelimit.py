"""Rate-limit configs on the admin API: apply (or dry-run), read back, delete."""

from __future__ import annotations

from typing import Any

from grpc import aio

from sitsmesh import logs
from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.errors import InvalidArgumentError, NotFoundError
from sitsmesh.ratelimit.reload import ConfigManager, version_of

_log = logs.get("sitsmesh.admin")


class RateLimitAdmin:
    RPCS = ("ApplyRateLimitConfig", "GetRateLimitConfig", "DeleteRateLimitConfig")

    def __init__(self, config: ConfigManager) -> None:
        self._config = config

    async def ApplyRateLimitConfig(self, request: admin_pb2.ApplyRateLimitConfigRequest,
                                   context: aio.ServicerContext[Any, Any]
                                   ) -> admin_pb2.ApplyRateLimitConfigResponse:
        if not request.files:
            raise InvalidArgumentError("no files to apply")
        names = [f.name or f"file{i}" for i, f in enumerate(request.files)]
        config, domains = await self._config.apply(
            [(n, f.yaml) for n, f in zip(names, request.files, strict=True)],
            dry_run=request.dry_run)
        _log.info("rate-limit config applied" if not request.dry_run
                  else "rate-limit config dry run passed", domains=domains)
        return admin_pb2.ApplyRateLimitConfigResponse(
            domains=domains, config_version=version_of(config), applied=not request.dry_run)

    async def GetRateLimitConfig(self, request: admin_pb2.GetRateLimitConfigRequest,
                                 context: aio.ServicerContext[Any, Any]
                                 ) -> admin_pb2.GetRateLimitConfigResponse:
        config = self._config.holder.current
        return admin_pb2.GetRateLimitConfigResponse(
            domains=[admin_pb2.RateLimitDomain(domain=d, source=config.sources[d],
                                               yaml=config.texts[d])
                     for d in sorted(config.domains)],
            config_version=self._config.version)

    async def DeleteRateLimitConfig(self, request: admin_pb2.DeleteRateLimitConfigRequest,
                                    context: aio.ServicerContext[Any, Any]
                                    ) -> admin_pb2.DeleteRateLimitConfigResponse:
        if not await self._config.delete(request.domain):
            raise NotFoundError(
                f"no rate-limit domain '{request.domain}' applied through the API")
        return admin_pb2.DeleteRateLimitConfigResponse()
