"""The blocking client: `with Client(addr, token) as admin: admin.tenants()`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.client.base import DEFAULT_TIMEOUT_S, Tls, bearer, error_from, mask


class Client:
    """The admin API of one sitsmesh, blocking. Every call carries the bearer token and a
    deadline: `timeout` seconds unless the call's `deadline` says otherwise (streams have
    none unless asked). Every failure is an AdminError. List methods iterate over every
    page."""

    def __init__(self, target: str, token: str, *, tls: Tls | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, actor: str = "") -> None:
        self._metadata = bearer(token) + ((("x-sitsmesh-actor", actor),) if actor else ())
        self._timeout = timeout
        self._channel = (grpc.secure_channel(target, tls.credentials(), options=tls.options())
                         if tls is not None else grpc.insecure_channel(target))
        self.stub = admin_pb2_grpc.AdminServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def call(self, method: str, request: Any, *, deadline: float | None = None) -> Any:
        """Any unary RPC by name, e.g. call("GetRateLimitConfig", GetRateLimitConfigRequest())."""
        try:
            return getattr(self.stub, method)(request, metadata=self._metadata,
                                              timeout=deadline or self._timeout)
        except grpc.RpcError as exc:
            raise error_from(exc, method) from None

    def stream(self, method: str, request: Any, *,
               deadline: float | None = None) -> Iterator[Any]:
        """Any server-streaming RPC by name, its replies as they come."""
        call = getattr(self.stub, method)(request, metadata=self._metadata, timeout=deadline)
        try:
            yield from call
        except grpc.RpcError as exc:
            raise error_from(exc, method) from None
        finally:
            # A caller that stops iterating ends the stream on the server too.
            call.cancel()

    def _pages(self, method: str, request: Any, field: str) -> Iterator[Any]:
        while True:
            reply = self.call(method, request)
            yield from getattr(reply, field)
            if not reply.next_page_token:
                return
            request.page_token = reply.next_page_token

    def status(self) -> admin_pb2.GetStatusResponse:
        reply: admin_pb2.GetStatusResponse = self.call("GetStatus", admin_pb2.GetStatusRequest())
        return reply

    def create_tenant(self, tenant: admin_pb2.Tenant) -> admin_pb2.Tenant:
        reply: admin_pb2.CreateTenantResponse = self.call(
            "CreateTenant", admin_pb2.CreateTenantRequest(tenant=tenant))
        return reply.tenant

    def update_tenant(self, tenant: admin_pb2.Tenant) -> admin_pb2.Tenant:
        reply: admin_pb2.UpdateTenantResponse = self.call(
            "UpdateTenant", admin_pb2.UpdateTenantRequest(tenant=tenant))
        return reply.tenant

    def get_tenant(self, name: str, *fields: str) -> admin_pb2.Tenant:
        """The tenant; only `fields` of it when named."""
        reply: admin_pb2.GetTenantResponse = self.call(
            "GetTenant", admin_pb2.GetTenantRequest(name=name, read_mask=mask(fields)))
        return reply.tenant

    def delete_tenant(self, name: str) -> None:
        self.call("DeleteTenant", admin_pb2.DeleteTenantRequest(name=name))

    def tenants(self, *fields: str, page_size: int = 0) -> Iterator[admin_pb2.Tenant]:
        """Every tenant, page by page (`page_size` per call; the server's default when 0)."""
        return self._pages("ListTenants", admin_pb2.ListTenantsRequest(
            page_size=page_size, read_mask=mask(fields)), "tenants")

    def create_api_key(self, tenant: str, name: str = "", *,
                       expires_at: float | None = None) -> tuple[admin_pb2.ApiKey, str]:
        """The key's record and its secret (shown this once)."""
        request = admin_pb2.CreateApiKeyRequest(tenant=tenant, name=name)
        if expires_at is not None:
            stamp = Timestamp()
            stamp.FromNanoseconds(int(expires_at * 1e9))
            request.expires_at.CopyFrom(stamp)
        reply: admin_pb2.CreateApiKeyResponse = self.call("CreateApiKey", request)
        return reply.key, reply.secret

    def api_keys(self, tenant: str = "", *fields: str,
                 page_size: int = 0) -> Iterator[admin_pb2.ApiKey]:
        return self._pages("ListApiKeys", admin_pb2.ListApiKeysRequest(
            tenant=tenant, page_size=page_size, read_mask=mask(fields)), "keys")

    def revoke_api_key(self, key_id: str) -> admin_pb2.ApiKey:
        reply: admin_pb2.RevokeApiKeyResponse = self.call(
            "RevokeApiKey", admin_pb2.RevokeApiKeyRequest(id=key_id))
        return reply.key

    def apply_pipeline(self, yaml: str, source: str = "") -> admin_pb2.Pipeline:
        reply: admin_pb2.ApplyPipelineResponse = self.call(
            "ApplyPipeline", admin_pb2.ApplyPipelineRequest(yaml=yaml, source=source))
        return reply.pipeline

    def get_pipeline(self, name: str, *fields: str) -> admin_pb2.Pipeline:
        reply: admin_pb2.GetPipelineResponse = self.call(
            "GetPipeline", admin_pb2.GetPipelineRequest(name=name, read_mask=mask(fields)))
        return reply.pipeline

    def pipelines(self, *fields: str, page_size: int = 0) -> Iterator[admin_pb2.Pipeline]:
        return self._pages("ListPipelines", admin_pb2.ListPipelinesRequest(
            page_size=page_size, read_mask=mask(fields)), "pipelines")

    def delete_pipeline(self, name: str) -> None:
        self.call("DeletePipeline", admin_pb2.DeletePipelineRequest(name=name))

    def latency_chain(self, pipeline: str, window: str = "1m") -> admin_pb2.LatencyChain:
        reply: admin_pb2.GetLatencyChainResponse = self.call(
            "GetLatencyChain", admin_pb2.GetLatencyChainRequest(pipeline=pipeline,
                                                                window=window))
        return reply.chain

    def get_thresholds(self, pipeline: str) -> admin_pb2.PipelineThresholds:
        reply: admin_pb2.GetThresholdsResponse = self.call(
            "GetThresholds", admin_pb2.GetThresholdsRequest(pipeline=pipeline))
        return reply.thresholds

    def set_thresholds(self, pipeline: str, yaml: str, *, dry_run: bool = False,
                       source: str = "") -> admin_pb2.PipelineThresholds:
        reply: admin_pb2.SetThresholdsResponse = self.call(
            "SetThresholds", admin_pb2.SetThresholdsRequest(
                pipeline=pipeline, yaml=yaml, dry_run=dry_run, source=source))
        return reply.thresholds

    def watch_pressure(self, pipeline: str = "", *, count: int = 0, interval_ms: int = 0,
                       deadline: float | None = None
                       ) -> Iterator[admin_pb2.WatchPressureResponse]:
        return self.stream("WatchPressure", admin_pb2.WatchPressureRequest(
            pipeline=pipeline, count=count, interval_ms=interval_ms), deadline=deadline)

    def swap_model(self, model: str, target_version: int, *, endpoint: str = "",
                   options: admin_pb2.SwapOptions | None = None,
                   deadline: float | None = None) -> Iterator[admin_pb2.SwapModelResponse]:
        """The swap's progress; the last reply carries the finished record (`.swap`)."""
        return self.stream("SwapModel", admin_pb2.SwapModelRequest(
            model=model, target_version=target_version, endpoint=endpoint, options=options),
            deadline=deadline)

    def swaps(self, model: str = "", *fields: str,
              page_size: int = 0) -> Iterator[admin_pb2.SwapRecord]:
        """Every swap (of `model`, when given), newest first."""
        return self._pages("ListSwaps", admin_pb2.ListSwapsRequest(
            model=model, page_size=page_size, read_mask=mask(fields)), "swaps")

    def threshold_changes(self, pipeline: str = "", *fields: str,
                          page_size: int = 0) -> Iterator[admin_pb2.ThresholdChange]:
        """Every thresholds change (of `pipeline`, when given), newest first."""
        return self._pages("ListThresholdChanges", admin_pb2.ListThresholdChangesRequest(
            pipeline=pipeline, page_size=page_size, read_mask=mask(fields)), "changes")

    def get_swap(self, swap_id: str) -> admin_pb2.SwapRecord:
        reply: admin_pb2.GetSwapResponse = self.call("GetSwap",
                                                     admin_pb2.GetSwapRequest(id=swap_id))
        return reply.swap
