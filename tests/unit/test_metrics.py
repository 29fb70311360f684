"""The per-RPC interceptor on an in-process grpc.aio server, for every handler shape."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc import aio
from prometheus_client import CollectorRegistry

from sitsmesh.app.metrics import RpcMetrics
from sitsmesh.transport.errors import refuse


async def _unary(request: bytes, context: aio.ServicerContext[Any, Any]) -> bytes:
    if request == b"deny":
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "no")
    if request == b"refuse":
        refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
    if request == b"boom":
        raise RuntimeError("boom")
    return request


async def _gen(request: bytes, context: aio.ServicerContext[Any, Any]) -> AsyncIterator[bytes]:
    for _ in range(3):
        yield request
    if request == b"refuse":
        refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "full")


async def _writer(request: bytes, context: aio.ServicerContext[Any, Any]) -> None:
    await context.write(request)
    await context.write(request)


async def _client_stream(requests: AsyncIterator[bytes],
                         context: aio.ServicerContext[Any, Any]) -> bytes:
    return b"".join([r async for r in requests])


METHODS: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
    "Unary": grpc.unary_unary_rpc_method_handler(_unary),
    "Gen": grpc.unary_stream_rpc_method_handler(_gen),
    "Writer": grpc.unary_stream_rpc_method_handler(_writer),
    "Collect": grpc.stream_unary_rpc_method_handler(_client_stream),
}
HANDLERS = grpc.method_handlers_generic_handler("test.Svc", METHODS)
TYPES = {"Unary": "unary", "Gen": "server_stream", "Writer": "server_stream",
         "Collect": "client_stream"}


@pytest.fixture(params=["interceptor", "registrar-generic", "registrar-registered"])
async def served(request: pytest.FixtureRequest
                 ) -> AsyncIterator[tuple[aio.Channel, CollectorRegistry]]:
    registry = CollectorRegistry()
    metrics = RpcMetrics(registry)
    if request.param == "interceptor":
        server = aio.server(interceptors=[metrics.interceptor()])
        server.add_generic_rpc_handlers((HANDLERS,))
    else:
        server = aio.server()
        registrar = metrics.registrar(server)
        if request.param == "registrar-generic":
            registrar.add_generic_rpc_handlers((HANDLERS,))
        else:
            registrar.add_registered_method_handlers("test.Svc", METHODS)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel, registry
    await server.stop(0)


def _count(registry: CollectorRegistry, method: str, code: str) -> float:
    value = registry.get_sample_value("grpc_server_handled_total", {
        "grpc_service": "test.Svc", "grpc_method": method, "grpc_code": code,
        "grpc_type": TYPES[method]})
    return value or 0.0


async def test_counts_codes_and_latency_for_every_handler_shape(
    served: tuple[aio.Channel, CollectorRegistry],
) -> None:
    channel, registry = served
    unary: aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary("/test.Svc/Unary")
    assert await unary(b"hi") == b"hi"
    assert await unary(b"hi") == b"hi"
    for payload, code in ((b"deny", grpc.StatusCode.PERMISSION_DENIED),
                          (b"refuse", grpc.StatusCode.RESOURCE_EXHAUSTED),
                          (b"boom", grpc.StatusCode.UNKNOWN)):
        with pytest.raises(aio.AioRpcError) as err:
            await unary(payload)
        assert err.value.code() == code
    gen: aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream("/test.Svc/Gen")
    writer: aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream("/test.Svc/Writer")
    assert [m async for m in gen(b"x")] == [b"x"] * 3
    # A refusal after some replies: the client has them, then the status set.
    refused = gen(b"refuse")
    assert [await refused.read() for _ in range(3)] == [b"refuse"] * 3
    assert await refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await refused.details() == "full"
    assert [m async for m in writer(b"y")] == [b"y"] * 2

    async def chunks() -> AsyncIterator[bytes]:
        for part in (b"a", b"b"):
            yield part

    collect: aio.StreamUnaryMultiCallable[bytes, bytes] = channel.stream_unary("/test.Svc/Collect")
    assert await collect(chunks()) == b"ab"

    assert _count(registry, "Unary", "OK") == 2
    assert _count(registry, "Unary", "PERMISSION_DENIED") == 1
    assert _count(registry, "Unary", "UNKNOWN") == 1
    assert _count(registry, "Unary", "RESOURCE_EXHAUSTED") == 1
    assert _count(registry, "Gen", "RESOURCE_EXHAUSTED") == 1
    assert _count(registry, "Gen", "OK") == 1
    assert _count(registry, "Writer", "OK") == 1
    assert _count(registry, "Collect", "OK") == 1
    assert registry.get_sample_value("grpc_server_handling_seconds_count", {
        "grpc_service": "test.Svc", "grpc_method": "Unary", "grpc_type": "unary"}) == 5
