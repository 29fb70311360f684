"""Dynamic batching on the admin API: protobuf in, BatchingService calls, protobuf out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from grpc import aio

from sitsmesh.access import content
from sitsmesh.admin.enums import label
from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.batching.auto import AutoSettings
from sitsmesh.batching.curve import Curve, InvalidCurve, Point, knee, pareto
from sitsmesh.batching.profile import ProfilePlan
from sitsmesh.batching.recommend import Batching, Prediction, Recommendation
from sitsmesh.batching.service import (
    DEFAULT_SIZES,
    WATCH_S,
    BatchingService,
    batching_from_body,
)
from sitsmesh.chains.catalog import PipelineCatalog
from sitsmesh.transport.admin.common import timestamp
from sitsmesh.transport.admin.paging import PageTokens, newest_first, page, page_size, scope_of
from sitsmesh.transport.admin.pressure import ACTOR_METADATA, MAX_ACTOR
from sitsmesh.transport.admin.swaps import SwapAdmin, options_from
from sitsmesh.transport.adminaccess import caller, credential
from sitsmesh.transport.auth import PermissionDeniedError

_TARGETS = {"preflight": admin_pb2.PROFILE_TARGET_PREFLIGHT,
            "production": admin_pb2.PROFILE_TARGET_PRODUCTION}
_SOURCES = {"live": admin_pb2.RATE_SOURCE_LIVE, "given": admin_pb2.RATE_SOURCE_GIVEN,
            "assumed": admin_pb2.RATE_SOURCE_ASSUMED}


def point_pb(point: Point) -> admin_pb2.BatchPoint:
    return admin_pb2.BatchPoint(batch_size=point.batch_size, throughput=point.throughput,
                                p50_ms=point.p50_ms, p99_ms=point.p99_ms,
                                requests=point.requests)


def curve_pb(curve: Curve) -> admin_pb2.BatchingCurve:
    return admin_pb2.BatchingCurve(
        model=curve.model, endpoint=curve.endpoint,
        target=_TARGETS.get(curve.source, admin_pb2.PROFILE_TARGET_UNSPECIFIED),
        instances=curve.instances, max_batch_size=curve.max_batch_size,
        concurrency=curve.concurrency, measured_at=timestamp(curve.measured_at),
        points=[point_pb(p) for p in curve.points], knee=knee(curve.points),
        pareto=[p.batch_size for p in pareto(curve.points)])


def batching_pb(batching: Batching) -> admin_pb2.DynamicBatching:
    return admin_pb2.DynamicBatching(enabled=batching.enabled,
                                     preferred_batch_size=list(batching.preferred),
                                     max_queue_delay_microseconds=batching.max_queue_delay_us
                                     or 0)


def batching_of_pb(message: admin_pb2.DynamicBatching) -> Batching:
    if not message.enabled:
        return Batching()
    sizes = tuple(int(s) for s in message.preferred_batch_size)
    if any(s < 1 for s in sizes) or list(sizes) != sorted(set(sizes)) or len(sizes) > 16:
        raise InvalidCurve("preferred_batch_size: at most 16 distinct ascending sizes >= 1")
    if message.max_queue_delay_microseconds > 10_000_000:
        raise InvalidCurve("max_queue_delay_microseconds must be at most 10000000 (10 s)")
    return Batching(sizes, int(message.max_queue_delay_microseconds))


def _prediction_pb(prediction: Prediction) -> admin_pb2.BatchingPrediction:
    stable = prediction.stable
    return admin_pb2.BatchingPrediction(
        batching=batching_pb(prediction.batching), p99_ms=prediction.p99_ms if stable else 0,
        p50_ms=prediction.p50_ms if stable else 0, throughput=prediction.throughput,
        mean_batch=prediction.mean_batch, headroom=prediction.headroom, stable=stable)


def recommendation_pb(found: Recommendation, pipeline: str,
                      stage: str) -> admin_pb2.BatchingRecommendation:
    return admin_pb2.BatchingRecommendation(
        model=found.model, rate=found.rate, rate_source=_SOURCES[found.rate_source],
        sla_ms=found.sla_ms, knee=found.knee, current=_prediction_pb(found.current),
        proposed=_prediction_pb(found.proposed), capacity=found.capacity,
        reason=found.reason, changes=found.changes, pipeline=pipeline, stage=stage)


def _auto_pb(settings: AutoSettings) -> admin_pb2.AutoTuning:
    return admin_pb2.AutoTuning(pipeline=settings.pipeline, enabled=settings.enabled,
                                hold_s=settings.hold_s, cooldown_s=settings.cooldown_s)


def _actor(context: aio.ServicerContext[Any, Any]) -> str:
    claimed = str(dict(context.invocation_metadata() or ()).get(ACTOR_METADATA, "")
                  or "")[:MAX_ACTOR]
    return caller() + (f" (on behalf of {claimed})" if claimed else "")


class BatchingAdmin:
    RPCS = ("ProfileModel", "GetModelProfile", "TuneModel", "SetAutoTuning", "GetAutoTuning",
            "ListBatchingChanges")

    def __init__(self, batching: BatchingService, tokens: PageTokens, *,
                 pipelines: PipelineCatalog | None = None) -> None:
        self._batching = batching
        self._tokens = tokens
        self._pipelines = pipelines

    async def ProfileModel(self, request: admin_pb2.ProfileModelRequest,
                           context: aio.ServicerContext[Any, Any]
                           ) -> AsyncIterator[admin_pb2.ProfileModelResponse]:
        sizes = tuple(int(s) for s in request.batch_sizes) or DEFAULT_SIZES
        if len(sizes) > 16 or len(set(sizes)) != len(sizes) or min(sizes) < 1:
            raise InvalidCurve("batch_sizes: at most 16 distinct sizes, each >= 1")
        plan = ProfilePlan(tuple(sorted(sizes)), concurrency=request.concurrency,
                           requests=request.requests or 40, seconds=request.seconds or 10.0,
                           max_rate=request.max_rate)
        points: asyncio.Queue[Point] = asyncio.Queue()
        task = asyncio.get_running_loop().create_task(self._batching.profile(
            request.model, request.endpoint, plan,
            production=request.target == admin_pb2.PROFILE_TARGET_PRODUCTION,
            allow_production=request.allow_production, progress=points.put_nowait))
        try:
            while not task.done() or not points.empty():
                getter = asyncio.ensure_future(points.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield admin_pb2.ProfileModelResponse(point=point_pb(getter.result()))
                else:
                    getter.cancel()
            curve = task.result()
        finally:
            if not task.done():
                task.cancel()  # the caller went away: a profile is not worth finishing
        yield admin_pb2.ProfileModelResponse(curve=curve_pb(curve))

    async def GetModelProfile(self, request: admin_pb2.GetModelProfileRequest,
                              context: aio.ServicerContext[Any, Any]
                              ) -> admin_pb2.GetModelProfileResponse:
        return admin_pb2.GetModelProfileResponse(
            curve=curve_pb(await self._batching.curve(request.model)))

    async def TuneModel(self, request: admin_pb2.TuneModelRequest,
                        context: aio.ServicerContext[Any, Any]
                        ) -> AsyncIterator[admin_pb2.TuneModelResponse]:
        given = batching_of_pb(request.batching) if request.HasField("batching") else None
        if request.rate < 0 or request.sla_ms < 0:
            raise InvalidCurve("rate and sla_ms must be >= 0")
        watch = request.watch_s if request.HasField("watch_s") else WATCH_S
        if not 0 <= watch <= 600:
            raise InvalidCurve("watch_s must be 0-600")
        if request.dry_run:
            tuning = await self._batching.plan(request.model, request.endpoint,
                                               rate=request.rate, sla_ms=request.sla_ms,
                                               pipeline=request.pipeline, batching=given)
        else:
            traceparent = next((str(v) for k, v in context.invocation_metadata() or ()
                                if k == "traceparent"), "")
            tuning = await self._batching.tune(
                request.model, request.endpoint, options_from(request.options),
                actor=_actor(context), rate=request.rate, sla_ms=request.sla_ms,
                pipeline=request.pipeline, batching=given, watch_s=watch,
                traceparent=traceparent)
        yield admin_pb2.TuneModelResponse(recommendation=recommendation_pb(
            tuning.recommendation, tuning.pipeline, tuning.stage))
        if tuning.swap is not None:
            async for progress in SwapAdmin.follow(tuning.swap):
                yield admin_pb2.TuneModelResponse(progress=progress)

    async def SetAutoTuning(self, request: admin_pb2.SetAutoTuningRequest,
                            context: aio.ServicerContext[Any, Any]
                            ) -> admin_pb2.SetAutoTuningResponse:
        wanted = request.auto_tuning
        who = credential()
        found = (self._pipelines.pipelines.get(wanted.pipeline)
                 if self._pipelines is not None else None)
        if who is not None and found is not None and wanted.enabled:
            # Automatic batching re-tunes the pipeline's stage models: each one must be
            # the caller's, whoever put it in the pipeline.
            reason = content.models_of(who, f"pipeline '{wanted.pipeline}' (automatic "
                                       "batching of its stage models)", found.triton_models())
            if reason is not None:
                raise PermissionDeniedError(f"SetAutoTuning: {reason}")
        settings = AutoSettings(wanted.pipeline, wanted.enabled, wanted.hold_s or 30.0,
                                wanted.cooldown_s or 300.0)
        done = await self._batching.set_auto(settings, _actor(context))
        return admin_pb2.SetAutoTuningResponse(auto_tuning=_auto_pb(done))

    async def GetAutoTuning(self, request: admin_pb2.GetAutoTuningRequest,
                            context: aio.ServicerContext[Any, Any]
                            ) -> admin_pb2.GetAutoTuningResponse:
        if not request.pipeline:
            raise InvalidCurve("pipeline is required")
        settings = await self._batching.auto_settings(request.pipeline)
        return admin_pb2.GetAutoTuningResponse(auto_tuning=_auto_pb(settings))

    async def ListBatchingChanges(self, request: admin_pb2.ListBatchingChangesRequest,
                                  context: aio.ServicerContext[Any, Any]
                                  ) -> admin_pb2.ListBatchingChangesResponse:
        changes, token = await page(
            self._tokens, scope_of("ListBatchingChanges", request.model),
            await self._batching.changes(request.model),
            lambda c: newest_first(float(c.get("at", 0)), str(c.get("id", ""))),
            size=page_size(request.page_size), token=request.page_token)
        return admin_pb2.ListBatchingChangesResponse(
            changes=[_change_pb(c) for c in changes], next_page_token=token)


def _change_pb(body: dict[str, Any]) -> admin_pb2.BatchingChange:
    message = admin_pb2.BatchingChange(
        model=str(body.get("model", "")), actor=str(body.get("actor", "")),
        at=timestamp(float(body.get("at", 0))), reason=str(body.get("reason", "")),
        swap_id=str(body.get("swap_id", "")), automatic=bool(body.get("automatic")),
        pipeline=str(body.get("pipeline", "")), rate=float(body.get("rate", 0)))
    if "batching" in body:
        message.previous.CopyFrom(batching_pb(batching_from_body(body.get("previous"))))
        message.batching.CopyFrom(batching_pb(batching_from_body(body.get("batching"))))
    if body.get("outcome"):
        message.outcome = admin_pb2.SwapState.Value(  # type: ignore[assignment]
            label(admin_pb2.SwapState, str(body["outcome"])))
    return message
