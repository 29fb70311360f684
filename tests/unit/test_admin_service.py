"""The Admin servicer's assembly from areas, and its one mapping of domain errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from sitsmesh.app.background import Background
from sitsmesh.errors import (
    ConflictError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    SitsmeshError,
)
from sitsmesh.transport.admin.common import read_yaml
from sitsmesh.transport.admin.service import METHODS, AdminServicer, guarded
from sitsmesh.transport.errors import MAX_MESSAGE_BYTES, Refused, bounded


class _Context:
    """Records the status a handler aborts with, as grpc.aio does by raising."""

    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None

    def set_code(self, code: grpc.StatusCode) -> None:
        self.status = (code, "")

    def set_details(self, details: str) -> None:
        assert self.status is not None
        self.status = (self.status[0], details)


class _Everything:
    """One area answering every RPC; each handler returns its own name."""

    RPCS = METHODS

    def __getattr__(self, name: str) -> Any:
        async def handler(request: Any, context: Any) -> str:
            return name

        return handler


class _Part:
    def __init__(self, *rpcs: str) -> None:
        self.RPCS = rpcs

    def __getattr__(self, name: str) -> Any:
        async def handler(request: Any, context: Any) -> str:
            return name

        return handler


def test_every_rpc_is_bound_to_its_area() -> None:
    servicer = AdminServicer(_Everything())
    assert asyncio.run(servicer.GetStatus(None, _Context())) == "GetStatus"  # type: ignore[attr-defined]
    assert asyncio.run(servicer.WatchPressure(None, _Context())) == "WatchPressure"  # type: ignore[attr-defined]


def test_an_rpc_nobody_answers_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="no servicer answers GetStatus"):
        AdminServicer(_Part(*(m for m in METHODS if m != "GetStatus")))


def test_an_rpc_answered_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="GetStatus is answered by both _Everything and _Part"):
        AdminServicer(_Everything(), _Part("GetStatus"))


def test_a_name_that_is_not_an_admin_rpc_is_refused() -> None:
    with pytest.raises(ValueError, match=r"_Part\.Frobnicate is not an Admin RPC"):
        AdminServicer(_Everything(), _Part("Frobnicate"))


@pytest.mark.parametrize(("error", "code"), [
    (InvalidArgumentError("bad"), grpc.StatusCode.INVALID_ARGUMENT),
    (NotFoundError("bad"), grpc.StatusCode.NOT_FOUND),
    (ConflictError("bad"), grpc.StatusCode.ALREADY_EXISTS),
    (FailedPreconditionError("bad"), grpc.StatusCode.FAILED_PRECONDITION),
])
def test_domain_errors_become_their_status_in_unary_handlers(error: SitsmeshError,
                                                             code: grpc.StatusCode) -> None:
    async def handler(request: Any, context: Any) -> Any:
        raise error

    context = _Context()
    with pytest.raises(Refused):
        asyncio.run(guarded(handler)(None, context))
    assert context.status == (code, "bad")


def test_domain_errors_become_their_status_in_streams_after_items() -> None:
    async def handler(request: Any, context: Any) -> AsyncIterator[int]:
        yield 1
        raise NotFoundError("pipeline p does not exist")

    async def drain(context: _Context) -> list[int]:
        return [item async for item in guarded(handler)(None, context)]

    context = _Context()
    with pytest.raises(Refused):
        asyncio.run(drain(context))
    assert context.status == (grpc.StatusCode.NOT_FOUND, "pipeline p does not exist")


def test_other_exceptions_are_not_dressed_up_as_domain_errors() -> None:
    async def handler(request: Any, context: Any) -> Any:
        raise RuntimeError("bug")

    context = _Context()
    with pytest.raises(RuntimeError, match="bug"):
        asyncio.run(guarded(handler)(None, context))
    assert context.status is None


def test_malformed_yaml_is_an_invalid_argument_naming_the_source() -> None:
    with pytest.raises(InvalidArgumentError, match=r"^p.yaml: invalid YAML: "):
        asyncio.run(read_yaml("a: [1, 2", "p.yaml"))
    assert asyncio.run(read_yaml("a: 1", "p.yaml")) == {"a": 1}


def test_background_runs_periodic_ticks_and_stops_them_all() -> None:
    ticks: list[int] = []

    async def scenario() -> tuple[int, int]:
        background = Background()
        background.every(0.001, lambda: ticks.append(1))
        forever = asyncio.Event()
        background.spawn(forever.wait())  # type: ignore[arg-type]
        while len(ticks) < 3:
            await asyncio.sleep(0.001)
        await background.stop()
        seen = len(ticks)
        await asyncio.sleep(0.01)
        return seen, len(ticks)

    seen, later = asyncio.run(scenario())
    assert seen >= 3
    assert later == seen  # nothing ticks after stop()


def test_a_status_message_is_bounded_to_fit_grpc_s_trailer() -> None:
    assert bounded("short") == "short"
    long = bounded("é" * 10_000)
    assert len(long.encode()) <= MAX_MESSAGE_BYTES
    assert long.endswith(" more bytes cut)")
