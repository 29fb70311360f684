"""Wrapping every handler a service registers so that its request messages are charged to
the process's ByteBudget (see sitsmesh/transport/budget.py for why and how)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from time import perf_counter
from typing import Any

import grpc
from grpc.aio import EOF

from sitsmesh.transport.budget import (
    FIRST_HOLD_S,
    FIRST_WAIT_S,
    LARGE_BYTES,
    MIB,
    READ_AHEAD,
    ByteBudget,
    cost,
)
from sitsmesh.transport.errors import refuse
from sitsmesh.transport.handlers import behaviour

Refusal = Callable[[str, Any], Any]
"""(why, context) -> a reply for a unary call refused by the budget; None: refuse with
RESOURCE_EXHAUSTED."""


class BudgetedRegistrar:
    """Stands in for a server (or another registrar) while services register: every
    handler is wrapped so its request messages are charged to `budget`."""

    def __init__(self, server: Any, budget: ByteBudget, stream_first: int = 4 * MIB,
                 refusals: dict[str, Refusal] | None = None,
                 refused_unparsed: dict[str, int] | None = None, *,
                 loop_share: bool = True) -> None:
        self._server = server
        # False: large messages are charged bytes only, never paced for the loop's time
        # (the admin API, whose handlers parse large YAML off the loop already; paced,
        # a viewer's refused write answered "busy" instead of PERMISSION_DENIED).
        self._loop_share = loop_share
        self._budget = budget
        self._first = stream_first
        self._refusals = refusals or {}
        # method -> the length past which its own deserializer refuses a message
        # unparsed: such a message costs nothing to refuse, so it is not charged.
        self._unparsed = refused_unparsed or {}
        self._wrapped: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(tuple(_Generic(h, self) for h in handlers))

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        self._server.add_registered_method_handlers(
            service, {name: self.wrapped(f"/{service}/{name}", handler)
                      for name, handler in handlers.items()})

    def wrapped(self, method: str, handler: grpc.RpcMethodHandler[Any, Any]
                ) -> grpc.RpcMethodHandler[Any, Any]:
        cached = self._wrapped.get(method)
        if cached is None:
            cached = self._wrapped[method] = _wrap(
                handler, self._budget, self._first, self._refusals.get(method),
                self._unparsed.get(method, 1 << 62), loop_share=self._loop_share)
        return cached


class _Generic(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler, registrar: BudgetedRegistrar) -> None:
        self._inner = inner
        self._registrar = registrar

    def service(self, handler_call_details: grpc.HandlerCallDetails
                ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        return self._registrar.wrapped(handler_call_details.method, handler)


def _refuse(refusal: Refusal | None, why: str, context: Any) -> Any:
    if refusal is None:
        refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, why)
    return refusal(why, context)


def _over(budget: ByteBudget) -> str:
    # The same text every time: a refusal flood must stay cheap (see checklimits.busy).
    return (f"server busy: request bytes in flight over the budget of {budget.capacity} "
            "(inflight_budget_bytes); retry")


def _paced(budget: ByteBudget) -> str:
    return (f"server busy: messages over {LARGE_BYTES} bytes wait while the event loop is "
            f"over {budget.lag.limit_s * 1000:g} ms behind (large_message_lag_ms); retry")


def _wrap(handler: grpc.RpcMethodHandler[Any, Any], budget: ByteBudget, first: int,
          refusal: Refusal | None, unparsed: int, *,
          loop_share: bool = True) -> grpc.RpcMethodHandler[Any, Any]:
    inner, factory = behaviour(handler)
    parse = handler.request_deserializer or (lambda data: data)
    serialize = handler.response_serializer
    if handler.request_streaming:
        return _wrap_stream(inner, factory, parse=parse, serialize=serialize, budget=budget,
                            first=first, loop_share=loop_share)

    over, paced = _over(budget), _paced(budget)

    def admit(size: int) -> tuple[str, int]:
        """('', bytes charged) if a message of `size` may be parsed, else (why not, 0)."""
        if size > unparsed:
            return "", 0  # its deserializer refuses it from its length alone
        large = size > LARGE_BYTES
        if large and loop_share and budget.lag.behind():
            budget.note_refused()
            return paced, 0
        charge = cost(size)
        if not budget.take(charge, large):
            return over, 0
        return "", charge

    if inspect.isasyncgenfunction(inner):
        async def gen_behavior(data: bytes, context: Any) -> Any:
            why, charged = admit(len(data))
            if why:
                del data
                refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, why)
            try:
                request = parse(data)
                del data
                async for item in inner(request, context):
                    yield item
            finally:
                budget.give(charged)

        return factory(gen_behavior, None, serialize)

    async def unary(data: bytes, context: Any) -> Any:
        why, charged = admit(len(data))
        if why:
            del data
            return _refuse(refusal, why, context)
        started = perf_counter() if loop_share and charged > LARGE_BYTES else 0.0
        if charged > LARGE_BYTES and not loop_share:
            budget.lag.note_large()
        try:
            request = parse(data)
            del data
            return await inner(request, context)
        finally:
            budget.give(charged)
            if started:
                budget.lag.spent(perf_counter() - started)

    return factory(unary, None, serialize)


# `_Metered._charge`'s answer for a stream message the budget has no room for.
_REFUSED = object()


class _Metered:
    """A stream's request iterator. Its first read waits (FIRST_WAIT_S at most) for room
    for the largest message the port takes, and holds it until the message is in or for
    FIRST_HOLD_S: a read takes the message whole, whatever its size, so a crowd of new
    streams sending the largest messages at once is admitted a budget's worth at a time
    (200 streams of 3.7 MB: 265 MB RSS, 480 MB without). From then on each message is
    charged READ_AHEAD times its length (gRPC reads the next meanwhile) until the handler
    asks for the next. A message that does not fit ends the stream at once."""

    __slots__ = ("_budget", "_context", "_first", "_held", "_large", "_loop_share",
                 "_parse", "_read", "_started")

    def __init__(self, inner: AsyncIterator[bytes], parse: Callable[[bytes], Any],
                 budget: ByteBudget, context: Any, first: int, *, loop_share: bool) -> None:
        # The call's own read() where there is one: gRPC's request iterator is an async
        # generator around it, a layer more on every message (~5 us of the ~60 a
        # message costs in gRPC aio, measured on the ext_proc path).
        read = getattr(context, "read", None)
        self._read: Callable[[], Awaitable[Any]] = read if read is not None \
            else inner.__anext__
        self._loop_share = loop_share
        self._parse = parse
        self._budget = budget
        self._first = first
        self._started = False
        self._held = 0
        self._large = False
        self._context = context

    def __aiter__(self) -> _Metered:
        return self

    async def __anext__(self) -> Any:
        budget = self._budget
        if self._large:
            # The last message was large (its parse is charged to the loop's large
            # share): read on once large work may run again. Charging it the whole time
            # until this read, other tasks' included, paced 100 RLQS streams of 100 KB
            # reports into a standstill: each waited here holding its charge, the
            # budget stayed full, and new streams were refused.
            self._large = False
            await budget.lag.caught_up()
        if self._held:
            # Given back only now, after any wait above: while large work is paced, the
            # budget a waiting stream keeps stops others' large messages being taken
            # (given back before the wait, the full soak's RSS peaked at 798-931 MB
            # instead of 517-524, 20 s runs).
            budget.give(self._held)
            self._held = 0
        if self._started:
            data: Any = await self._read()
            if data is EOF:
                raise StopAsyncIteration
            message = self._charge(data)
        else:
            self._started = True
            if not await budget.hold(self._first, FIRST_WAIT_S):
                message = _REFUSED
            else:
                data = await self._first_message()
                if data is EOF:
                    raise StopAsyncIteration
                message = self._charge(data)
                del data
        if message is _REFUSED:
            refuse(self._context, grpc.StatusCode.RESOURCE_EXHAUSTED, _over(budget))
        return message

    async def _first_message(self) -> Any:
        """The first message (bytes, or EOF), holding the room taken for it until it is
        in or for FIRST_HOLD_S, whichever comes first."""
        read = asyncio.ensure_future(self._read())
        try:
            try:
                await asyncio.wait((read,), timeout=FIRST_HOLD_S)
            finally:
                self._budget.give(self._first)
            return await read
        except BaseException:
            read.cancel()  # the call ended, or this task was cancelled, meanwhile
            raise

    def _charge(self, data: bytes) -> Any:
        """The parsed message, or _REFUSED when the budget has no room for it."""
        size = len(data)
        charge = max(READ_AHEAD * size, cost(size))
        if not self._budget.take(charge, size > LARGE_BYTES):
            return _REFUSED
        self._held = charge
        if size <= LARGE_BYTES:
            return self._parse(data)
        if not self._loop_share:
            self._budget.lag.note_large()
            return self._parse(data)
        self._large = True
        started = perf_counter()
        message = self._parse(data)
        self._budget.lag.spent(perf_counter() - started)
        return message

    def close(self) -> None:
        if self._held:
            self._budget.give(self._held)
            self._held = 0


def _wrap_stream(inner: Callable[..., Any], factory: Any, *, parse: Callable[[bytes], Any],
                 serialize: Any, budget: ByteBudget, first: int, loop_share: bool
                 ) -> grpc.RpcMethodHandler[Any, Any]:
    if inspect.isasyncgenfunction(inner):
        async def gen_behavior(requests: AsyncIterator[bytes], context: Any) -> Any:
            metered = _Metered(requests, parse, budget, context, first, loop_share=loop_share)
            try:
                async for item in inner(metered, context):
                    yield item
            finally:
                metered.close()

        return factory(gen_behavior, None, serialize)  # type: ignore[no-any-return]

    async def stream(requests: AsyncIterator[bytes], context: Any) -> Any:
        metered = _Metered(requests, parse, budget, context, first, loop_share=loop_share)
        try:
            return await inner(metered, context)
        finally:
            metered.close()

    return factory(stream, None, serialize)  # type: ignore[no-any-return]

