"""Who may call: per-service allowlists of mTLS client identities. (The admin API's
credentials and roles: sitsmesh.transport.adminaccess.)"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import grpc
from grpc import aio

from sitsmesh import logs
from sitsmesh.errors import Code, SitsmeshError
from sitsmesh.transport.errors import abort
from sitsmesh.transport.handlers import behaviour

_log = logs.get("sitsmesh.admin.auth")


# --- Who may call: identities from the mTLS peer certificate ------------------------
# grpc puts every subjectAltName of a verified client certificate here (URI SANs such
# as SPIFFE ids, DNS names); absent on plaintext or server-only TLS connections.
SAN_PROPERTY = "x509_subject_alternative_name"
_REFUSAL_LOG_EVERY_S = 10.0


class PermissionDeniedError(SitsmeshError):
    """The caller proved who it is, or could not, and is not on the service's allowlist."""

    code = Code.PERMISSION_DENIED


def peer_identities(context: aio.ServicerContext[Any, Any]) -> tuple[str, ...]:
    """The SANs of the caller's verified client certificate; () without mTLS."""
    sans = context.auth_context().get(SAN_PROPERTY) or ()
    return tuple(s.decode(errors="replace") for s in sans)


class CallerGate:
    """Per-service allowlists of client identities (`services`: full gRPC service name ->
    identities). Services not named pass unchecked (health, reflection).

    Handlers are wrapped once, as they register, so a call pays about 2 us (the peer's
    SANs from its TLS context and a set lookup, measured), no interceptor. The SANs are
    read per call, not cached by peer address: an address can come back on another
    connection with another certificate. `on_refuse(service)` counts each refusal.
    """

    def __init__(self, services: Mapping[str, Iterable[str]],
                 on_refuse: Callable[[str], None] = lambda service: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._allowed = {name: frozenset(i.encode() for i in ids)
                         for name, ids in services.items()}
        self._on_refuse = on_refuse
        self._clock = clock
        self._logged: dict[str, float] = {}

    def registrar(self, server: Any) -> GatedRegistrar:
        return GatedRegistrar(server, self)

    def guard(self, method: str, handler: grpc.RpcMethodHandler[Any, Any]
              ) -> grpc.RpcMethodHandler[Any, Any]:
        """`handler`, refusing callers off its service's allowlist; unchanged if the
        service has none."""
        service = method.lstrip("/").rpartition("/")[0]
        allowed = self._allowed.get(service)
        if allowed is None:
            return handler

        def permitted(context: aio.ServicerContext[Any, Any]) -> bool:
            # peer_identities() is the SANs when the certificate has any (else its CN,
            # which is no identity here); ~1 us, where auth_context() costs 5-8 us
            # because it copies every property, the PEM certificate included.
            if context.peer_identity_key() != SAN_PROPERTY:
                return False
            sans = context.peer_identities()
            return sans is not None and not allowed.isdisjoint(sans)

        async def refuse(context: aio.ServicerContext[Any, Any]) -> None:
            self._refused(service, context)
            await abort(context, PermissionDeniedError(
                f"{service}: caller {_describe(context)} is not on this service's "
                "allowlist"))

        return _wrap(handler, permitted, refuse)

    def _refused(self, service: str, context: aio.ServicerContext[Any, Any]) -> None:
        self._on_refuse(service)
        # A flood of refused calls must not become a flood of log lines.
        now = self._clock()
        if now - self._logged.get(service, -_REFUSAL_LOG_EVERY_S) >= _REFUSAL_LOG_EVERY_S:
            self._logged[service] = now
            _log.warning("data-plane call refused", service=service, peer=context.peer(),
                         identities=list(peer_identities(context)))


def _describe(context: aio.ServicerContext[Any, Any]) -> str:
    identities = peer_identities(context)
    return ", ".join(identities) if identities else "without a client certificate"


def _wrap(handler: grpc.RpcMethodHandler[Any, Any],
          permitted: Callable[[aio.ServicerContext[Any, Any]], bool],
          refuse: Callable[[aio.ServicerContext[Any, Any]], Awaitable[None]]
          ) -> grpc.RpcMethodHandler[Any, Any]:
    inner, factory = behaviour(handler)
    if inspect.isasyncgenfunction(inner):
        async def gen_behavior(request: Any, context: Any) -> Any:
            if not permitted(context):
                await refuse(context)
            async for item in inner(request, context):
                yield item

        return factory(gen_behavior, handler.request_deserializer,
                       handler.response_serializer)

    async def behavior(request: Any, context: Any) -> Any:
        if not permitted(context):
            await refuse(context)
        return await inner(request, context)

    return factory(behavior, handler.request_deserializer, handler.response_serializer)


class GatedRegistrar:
    """Stands in for an aio.Server while services register; guards what they add."""

    def __init__(self, server: Any, gate: CallerGate) -> None:
        self._server = server
        self._gate = gate

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(tuple(_GatedGeneric(h, self._gate)
                                                    for h in handlers))

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        self._server.add_registered_method_handlers(
            service, {name: self._gate.guard(f"/{service}/{name}", handler)
                      for name, handler in handlers.items()})


class _GatedGeneric(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler, gate: CallerGate) -> None:
        self._inner = inner
        self._gate = gate
        self._cache: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails
                ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method: str = handler_call_details.method
        cached = self._cache.get(method)
        if cached is not None:
            return cached
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        cached = self._cache[method] = self._gate.guard(method, handler)
        return cached
