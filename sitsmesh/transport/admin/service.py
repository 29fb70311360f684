"""The AdminService as one gRPC servicer made of area servicers, each error-mapped alike."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Protocol, cast

from grpc import aio

from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.errors import SitsmeshError
from sitsmesh.transport.errors import abort

METHODS = tuple(admin_pb2.DESCRIPTOR.services_by_name["AdminService"].methods_by_name)


class Area(Protocol):
    """A servicer for some of the AdminService RPCs; `RPCS` names the ones it answers."""

    @property
    def RPCS(self) -> tuple[str, ...]: ...


def guarded(handler: Callable[..., Any]) -> Callable[..., Any]:
    """The handler with its domain errors turned into gRPC status through the one table."""
    if inspect.isasyncgenfunction(handler):
        @functools.wraps(handler)
        async def stream(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
            try:
                async for item in handler(request, context):
                    yield item
            except SitsmeshError as exc:
                await abort(context, exc)

        return stream

    @functools.wraps(handler)
    async def unary(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        try:
            return await handler(request, context)
        except SitsmeshError as exc:
            await abort(context, exc)

    return unary


class AdminServicer:
    """Binds every AdminService RPC to the area that answers it; refuses gaps and overlaps at
    start, so a new RPC cannot ship unanswered."""

    def __init__(self, *areas: Area) -> None:
        owners: dict[str, str] = {}
        for area in areas:
            for name in area.RPCS:
                if name not in METHODS:
                    raise ValueError(f"{type(area).__name__}.{name} is not an Admin RPC")
                if name in owners:
                    raise ValueError(f"{name} is answered by both {owners[name]} and "
                                     f"{type(area).__name__}")
                owners[name] = type(area).__name__
                setattr(self, name, guarded(getattr(area, name)))
        missing = [name for name in METHODS if name not in owners]
        if missing:
            raise ValueError(f"no servicer answers {', '.join(missing)}")

    def add_to_server(self, server: aio.Server) -> None:
        # The generated registrar only looks the RPCs up by name, and every one is bound
        # on this instance; the cast stands in for the abstract base it is typed with.
        admin_pb2_grpc.add_AdminServiceServicer_to_server(
            cast(admin_pb2_grpc.AdminServiceServicer, self),
                                                   server)
