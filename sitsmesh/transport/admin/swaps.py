"""Model hot swaps on the admin API: protobuf in, SwapManager calls, protobuf out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from grpc import aio

from sitsmesh.admin.enums import label, word
from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.swap.machine import SwapEvent
from sitsmesh.swap.manager import RunningSwap, SwapManager
from sitsmesh.swap.override import SwapOptions
from sitsmesh.swap.record import SwapRecord
from sitsmesh.transport.admin.common import timestamp
from sitsmesh.transport.admin.paging import (
    PageTokens,
    check_mask,
    newest_first,
    page,
    page_size,
    scope_of,
    trimmed,
)

_DEFAULTS = SwapOptions()


def options_from(message: admin_pb2.SwapOptions) -> SwapOptions:
    """Zero or unset means the default, as the proto documents."""
    return SwapOptions(
        warmup_count=message.warmup_count or _DEFAULTS.warmup_count,
        warmup_data=word(admin_pb2.WarmupData, message.warmup_data) or _DEFAULTS.warmup_data,
        sample={name: tuple(values.values) for name, values in message.sample.items()},
        verify_probes=message.verify_probes or _DEFAULTS.verify_probes,
        max_latency_ratio=message.max_latency_ratio or _DEFAULTS.max_latency_ratio,
        latency_slack_ms=(message.latency_slack_ms if message.HasField("latency_slack_ms")
                          else _DEFAULTS.latency_slack_ms),
        drain_timeout_s=message.drain_timeout_s or _DEFAULTS.drain_timeout_s,
        load_timeout_s=message.load_timeout_s or _DEFAULTS.load_timeout_s,
        max_pending=(message.max_pending if message.HasField("max_pending")
                     else _DEFAULTS.max_pending))


def record_pb(record: SwapRecord) -> admin_pb2.SwapRecord:
    message = admin_pb2.SwapRecord(
        id=record.id, model=record.model, endpoint=record.endpoint,
        to_version=record.to_version, state=label(admin_pb2.SwapState, record.state),
        phase=label(admin_pb2.SwapPhase, record.phase),
        error=record.error, started_at=timestamp(record.started_at))
    if record.from_version is not None:
        message.from_version = record.from_version
    if record.ended_at is not None:
        message.ended_at.CopyFrom(timestamp(record.ended_at))
    for step in record.steps:
        item = message.steps.add(phase=label(admin_pb2.SwapPhase, step.phase),
                                 state=label(admin_pb2.StepState, step.state),
                                 message=step.message,
                                 started_at=timestamp(step.started_at),
                                 detail={k: str(v) for k, v in step.detail.items()})
        if step.ended_at is not None:
            item.ended_at.CopyFrom(timestamp(step.ended_at))
    return message


def _event_pb(event: SwapEvent) -> admin_pb2.SwapModelResponse:
    return admin_pb2.SwapModelResponse(
        swap_id=event.swap_id, phase=label(admin_pb2.SwapPhase, event.phase),
        state=label(admin_pb2.StepState, event.state), message=event.message,
        progress=event.fraction, at=timestamp(event.at))


class SwapAdmin:
    RPCS = ("ListModels", "SwapModel", "GetSwap", "ListSwaps")

    def __init__(self, swaps: SwapManager, tokens: PageTokens) -> None:
        self._swaps = swaps
        self._tokens = tokens

    async def ListModels(self, request: admin_pb2.ListModelsRequest,
                         context: aio.ServicerContext[Any, Any]
                         ) -> admin_pb2.ListModelsResponse:
        endpoints = await self._swaps.list_models(request.endpoint)
        reply = admin_pb2.ListModelsResponse()
        for item in endpoints:
            if item.error:
                reply.errors.add(endpoint=item.endpoint, error=item.error)
            for v in sorted(item.versions, key=lambda v: (v.model, v.version)):
                reply.versions.add(endpoint=item.endpoint, model=v.model, version=v.version,
                                   state=v.state, reason=v.reason)
        return reply

    async def SwapModel(self, request: admin_pb2.SwapModelRequest,
                        context: aio.ServicerContext[Any, Any]
                        ) -> AsyncIterator[admin_pb2.SwapModelResponse]:
        # A caller's W3C traceparent parents the swap's span (when tracing is on).
        traceparent = next((str(v) for k, v in context.invocation_metadata() or ()
                            if k == "traceparent"), "")
        handle = self._swaps.begin(request.model, request.target_version, request.endpoint,
                                   options_from(request.options), traceparent)
        async for event in self.follow(handle):
            yield event

    @staticmethod
    async def follow(handle: RunningSwap) -> AsyncIterator[admin_pb2.SwapModelResponse]:
        """A running swap's progress, the last event carrying its finished record."""
        last: admin_pb2.SwapModelResponse | None = None
        async for event in handle.stream():
            if last is not None:
                yield last
            last = _event_pb(event)
        assert handle.task is not None
        # A caller that goes away cancels this stream, never the swap: shield the task.
        record = await asyncio.shield(handle.task)
        if last is None:
            # No step ran: the swap's outcome stands in for the step's state.
            step_state = {"running": "running", "succeeded": "ok"}.get(record.state, "failed")
            last = admin_pb2.SwapModelResponse(
                swap_id=record.id, phase=label(admin_pb2.SwapPhase, record.phase),
                state=label(admin_pb2.StepState, step_state), progress=1.0)
        last.swap.CopyFrom(record_pb(record))
        yield last

    async def GetSwap(self, request: admin_pb2.GetSwapRequest,
                      context: aio.ServicerContext[Any, Any]) -> admin_pb2.GetSwapResponse:
        return admin_pb2.GetSwapResponse(swap=record_pb(await self._swaps.get(request.id)))

    async def ListSwaps(self, request: admin_pb2.ListSwapsRequest,
                        context: aio.ServicerContext[Any, Any]) -> admin_pb2.ListSwapsResponse:
        size = page_size(request.page_size)
        mask = check_mask(request.read_mask, admin_pb2.SwapRecord)
        records, token = await page(
            self._tokens, scope_of("ListSwaps", request.model),
            await self._swaps.recent(request.model, 0), lambda r: newest_first(r.started_at, r.id),
            size=size, token=request.page_token)
        return admin_pb2.ListSwapsResponse(swaps=[trimmed(record_pb(r), mask) for r in records],
                                           next_page_token=token)
