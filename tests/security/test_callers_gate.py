"""CallerGate's decision, on its own (test doubles for the gRPC context): who passes,
who is refused and counted, and that services without an allowlist are left alone."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from sitsmesh.transport.auth import SAN_PROPERTY, CallerGate
from sitsmesh.transport.errors import Refused

SERVICE = "envoy.service.accesslog.v3.AccessLogService"
METHOD = f"/{SERVICE}/StreamAccessLogs"


class Context:
    def __init__(self, *sans: str) -> None:
        self._auth = {SAN_PROPERTY: [s.encode() for s in sans]} if sans else {}
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth

    def peer_identity_key(self) -> str | None:
        return SAN_PROPERTY if self._auth else None

    def peer_identities(self) -> list[bytes] | None:
        return self._auth.get(SAN_PROPERTY)

    def peer(self) -> str:
        return "ipv4:10.0.0.9:40000"

    def set_code(self, code: grpc.StatusCode) -> None:
        self.aborted = (code, "")

    def set_details(self, details: str) -> None:
        assert self.aborted is not None
        self.aborted = (self.aborted[0], details)


def _gate(refused: list[str]) -> CallerGate:
    return CallerGate({SERVICE: ["spiffe://a/envoy", "spiffe://a/gw"]}, refused.append)


async def _unary(request: Any, context: Any) -> str:
    return "answered"


def _call(handler: grpc.RpcMethodHandler[Any, Any], context: Context) -> Any:
    call: Any = handler.unary_unary  # the doubles stand in for grpc's own types
    return asyncio.run(call(None, context))


@pytest.mark.parametrize("sans", [("spiffe://a/envoy",), ("dns.example", "spiffe://a/gw")])
def test_a_listed_identity_is_answered(sans: tuple[str, ...]) -> None:
    refused: list[str] = []
    handler = _gate(refused).guard(METHOD, grpc.unary_unary_rpc_method_handler(_unary))
    assert _call(handler, Context(*sans)) == "answered"
    assert refused == []


@pytest.mark.parametrize("sans", [(), ("spiffe://a/intruder",), ("spiffe://a/envoy/x",)])
def test_anyone_else_is_refused_and_counted(sans: tuple[str, ...]) -> None:
    refused: list[str] = []
    handler = _gate(refused).guard(METHOD, grpc.unary_unary_rpc_method_handler(_unary))
    context = Context(*sans)
    with pytest.raises(Refused):
        _call(handler, context)
    assert context.aborted is not None
    assert context.aborted[0] == grpc.StatusCode.PERMISSION_DENIED
    assert "is not on this service's allowlist" in context.aborted[1]
    assert refused == [SERVICE]


def test_streaming_handlers_are_refused_before_they_read_anything() -> None:
    read: list[object] = []

    async def stream(requests: AsyncIterator[object], context: Any) -> str:
        async for item in requests:
            read.append(item)
        return "done"

    handler = _gate([]).guard(METHOD, grpc.stream_unary_rpc_method_handler(stream))
    call: Any = handler.stream_unary

    async def requests() -> AsyncIterator[object]:
        yield "entry"

    with pytest.raises(Refused):
        asyncio.run(call(requests(), Context("spiffe://a/intruder")))
    assert read == []
    assert asyncio.run(call(requests(), Context("spiffe://a/envoy"))) == "done"


def test_services_without_an_allowlist_keep_their_handler() -> None:
    handler: grpc.RpcMethodHandler[Any, Any] = grpc.unary_unary_rpc_method_handler(_unary)
    assert _gate([]).guard("/grpc.health.v1.Health/Check", handler) is handler
