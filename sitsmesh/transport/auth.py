"""Bearer-token check for every admin RPC."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from grpc import aio

from sitsmesh import logs
from sitsmesh.errors import UnauthenticatedError
from sitsmesh.transport.errors import abort

# Discovery and liveness carry no secrets and must work for probes and grpcurl.
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

_log = logs.get("sitsmesh.admin.auth")
_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")

_UNAUTHENTICATED = UnauthenticatedError(
    "admin API needs 'authorization: Bearer <token>' with a valid token")


class BearerTokenInterceptor(aio.ServerInterceptor):
    def __init__(self, token: str, on_reject: Callable[[], None] = lambda: None) -> None:
        self._expected = token.encode()
        self._on_reject = on_reject
        self._deny: grpc.RpcMethodHandler[Any, Any] = grpc.unary_unary_rpc_method_handler(
            self._unauthenticated)
        self._deny_stream_in: grpc.RpcMethodHandler[Any, Any] = (
            grpc.stream_unary_rpc_method_handler(self._unauthenticated))

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails],
                               Awaitable[grpc.RpcMethodHandler[_Req, _Resp] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Req, _Resp] | None:
        method: str = handler_call_details.method
        if method.startswith(EXEMPT_PREFIXES):
            return await continuation(handler_call_details)
        presented = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                raw = value.encode() if isinstance(value, str) else value
                scheme, _, credential = raw.partition(b" ")
                if scheme.lower() == b"bearer":
                    presented = credential.strip()
                break
        # compare_digest: the time taken must not reveal how much of the token matched.
        if presented and hmac.compare_digest(presented, self._expected):
            return await continuation(handler_call_details)
        reason = "missing" if not presented else "wrong"
        self._on_reject()
        _log.warning("admin call rejected", method=method, reason=f"{reason} bearer token")
        handler = await continuation(handler_call_details)
        if handler is not None and handler.request_streaming:
            return self._deny_stream_in
        return self._deny

    @staticmethod
    async def _unauthenticated(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        await abort(context, _UNAUTHENTICATED)
