"""Backpressure on the admin API: thresholds (get, set with audit) and the pressure stream."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from grpc import aio

from sitsmesh.admin.enums import label
from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from sitsmesh.pressure.controller import Decision, Snapshot
from sitsmesh.pressure.ledger import Change, ThresholdLedger
from sitsmesh.pressure.runtime import PressureRuntime
from sitsmesh.transport.admin.common import read_yaml, timestamp, yaml_text
from sitsmesh.transport.admin.paging import (
    PageTokens,
    check_mask,
    newest_first,
    page,
    page_size,
    scope_of,
    trimmed,
)
from sitsmesh.transport.adminaccess import caller

ACTOR_METADATA = "x-sitsmesh-actor"
MAX_ACTOR = 200


def pipeline_pb(decision: Decision, in_flight: int, shed: int,
                waiting: int = 0) -> admin_pb2.PipelinePressure:
    message = admin_pb2.PipelinePressure(
        pipeline=decision.pipeline, policy=label(admin_pb2.PressurePolicy, decision.policy),
        fraction=decision.fraction, cutoff=decision.cutoff, concurrency=decision.concurrency,
        protected_from=decision.protected_from, retry_after_s=decision.retry_after_s,
        bottleneck=decision.bottleneck,
        level=label(admin_pb2.PressureLevel, decision.level),
        arrival_rate=decision.arrival_rate, in_flight=max(0, in_flight), shed_total=shed,
        entry_wait_ms=round(decision.wait_s * 1000), entry_waiting=waiting)
    for s in decision.stages:
        message.stages.add(name=s.name, level=label(admin_pb2.PressureLevel, s.level),
                           pressure=s.pressure,
                           arrival_rate=s.arrival_rate, capacity=s.capacity,
                           utilisation=s.utilisation, queue=s.queue, queue_fill=s.queue_fill,
                           rt99_ms=s.rt99_ms, predicted_p99_ms=s.predicted_p99_ms,
                           headroom_rps=s.headroom_rps, stale=s.stale,
                           capacity_samples=s.capacity_samples, service_cs2=s.service_cs2,
                           reason=label(admin_pb2.OverloadReason, s.reason),
                           signals=[admin_pb2.SignalAge(
                               source=label(admin_pb2.SignalSource, a.source), age_s=a.age_s,
                               stale=a.stale) for a in s.signals])
    return message


class PressureAdmin:
    RPCS = ("GetThresholds", "SetThresholds", "ListThresholdChanges", "WatchPressure")

    def __init__(self, thresholds: ThresholdLedger, runtime: PressureRuntime | None,
                 tokens: PageTokens) -> None:
        """`runtime` is None where this process does not run the controller."""
        self._tokens = tokens
        self._thresholds = thresholds
        self._pressure = runtime

    async def GetThresholds(self, request: admin_pb2.GetThresholdsRequest,
                            context: aio.ServicerContext[Any, Any]
                            ) -> admin_pb2.GetThresholdsResponse:
        _require_pipeline(request.pipeline)
        thresholds, default = await self._thresholds.get(request.pipeline)
        return admin_pb2.GetThresholdsResponse(thresholds=admin_pb2.PipelineThresholds(
            pipeline=request.pipeline, yaml=yaml_text(thresholds.to_body()),
            is_default=default))

    async def SetThresholds(self, request: admin_pb2.SetThresholdsRequest,
                            context: aio.ServicerContext[Any, Any]
                            ) -> admin_pb2.SetThresholdsResponse:
        source = request.source or "thresholds"
        _require_pipeline(request.pipeline)
        body = await read_yaml(request.yaml, source) if request.yaml.strip() else {}
        metadata = dict(context.invocation_metadata() or ())
        # The audit names the credential the call authenticated as; the header is only
        # a note of whom it says it acts for.
        claimed = str(metadata.get(ACTOR_METADATA, "") or "")[:MAX_ACTOR]
        actor = caller() + (f" (on behalf of {claimed})" if claimed else "")
        thresholds = await self._thresholds.set(
            request.pipeline, body, source=source, actor=actor, peer=context.peer(),
            dry_run=request.dry_run)
        return admin_pb2.SetThresholdsResponse(thresholds=admin_pb2.PipelineThresholds(
            pipeline=request.pipeline, yaml=yaml_text(thresholds.to_body()), is_default=False))

    async def ListThresholdChanges(self, request: admin_pb2.ListThresholdChangesRequest,
                                   context: aio.ServicerContext[Any, Any]
                                   ) -> admin_pb2.ListThresholdChangesResponse:
        size = page_size(request.page_size)
        mask = check_mask(request.read_mask, admin_pb2.ThresholdChange)
        changes, token = await page(
            self._tokens, scope_of("ListThresholdChanges", request.pipeline),
            await self._thresholds.changes(request.pipeline, 0), _change_key, size=size,
            token=request.page_token)
        return admin_pb2.ListThresholdChangesResponse(changes=[trimmed(
            admin_pb2.ThresholdChange(pipeline=c.pipeline, actor=c.actor, peer=c.peer,
                                      at=timestamp(c.at), before=yaml_text(c.before),
                                      after=yaml_text(c.after)), mask) for c in changes],
            next_page_token=token)

    async def WatchPressure(self, request: admin_pb2.WatchPressureRequest,
                            context: aio.ServicerContext[Any, Any]
                            ) -> AsyncIterator[admin_pb2.WatchPressureResponse]:
        runtime = self._pressure
        if runtime is None:
            raise FailedPreconditionError(
                "the backpressure controller runs with --workers 1: its signals come from "
                "the process that serves Check and the access logs")
        if request.pipeline and request.pipeline not in runtime.controller.pipelines:
            raise NotFoundError(f"pipeline {request.pipeline} does not exist")
        sent, last = 0, 0.0
        interval = request.interval_ms / 1000
        async for snapshot in runtime.watch():
            now = time.monotonic()
            if interval and now - last < interval:
                continue
            last = now
            yield self._snapshot_pb(runtime, snapshot, request.pipeline)
            sent += 1
            if request.count and sent >= request.count:
                return

    @staticmethod
    def _snapshot_pb(runtime: PressureRuntime, snapshot: Snapshot,
                     only: str) -> admin_pb2.WatchPressureResponse:
        message = admin_pb2.WatchPressureResponse(at=timestamp(time.time()))
        for name in sorted(snapshot.decisions):
            if only and name != only:
                continue
            signals = runtime.signals.pipeline(name)
            message.pipelines.append(pipeline_pb(snapshot.decisions[name], signals.in_flight,
                                                 signals.shed, runtime.gate.queue.queued(name)))
        return message


def _change_key(change: Change) -> str:
    # Changes have no id: two at the same instant are told apart by what they were.
    what = json.dumps([change.pipeline, change.actor, change.peer, change.before,
                       change.after], sort_keys=True, default=str)
    return newest_first(change.at, hashlib.sha256(what.encode()).hexdigest()[:16])


def _require_pipeline(pipeline: str) -> None:
    if not pipeline:
        raise InvalidArgumentError("pipeline is required")
