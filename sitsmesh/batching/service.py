"""Profile, recommend, apply and auto-tune a model's dynamic batching.

It drives the configured Triton endpoints through the swap manager (which owns
them), keeps curves, automatic-mode settings and an audit of every change in the
state store, and reads the stage's rate and SLA from the pressure runtime. No
grpc here; the admin transport translates.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from sitsmesh import logs
from sitsmesh.batching.auto import AUTO_KIND, AutoPolicy, AutoSettings
from sitsmesh.batching.curve import (
    CURVE_KIND,
    Curve,
    InvalidCurve,
    Point,
    curve_from,
)
from sitsmesh.batching.profile import ProfilePlan, measure
from sitsmesh.batching.recommend import (
    Batching,
    Recommendation,
    batching_of,
    predict,
    recommend,
    saturated_capacity,
)
from sitsmesh.chains.pipeline import Pipeline, Stage
from sitsmesh.errors import Code, NotFoundError, SitsmeshError
from sitsmesh.pressure.stages import OVERLOADED, StagePressure
from sitsmesh.state import StateStore
from sitsmesh.swap.contract import ServerError
from sitsmesh.swap.machine import ConfigChange
from sitsmesh.swap.manager import RunningSwap, SwapManager
from sitsmesh.swap.override import SwapOptions, probe_inputs, swap_override, with_versions
from sitsmesh.swap.record import SwapRecord

_log = logs.get("sitsmesh.batching")

AUDIT_KIND = "batching-audit"
DEFAULT_SIZES = (1, 2, 4, 8, 16, 32)
PRODUCTION_RATE = 20.0       # items/s a production profile sends unless told
MAX_PRODUCTION_RATE = 1000.0
WATCH_S = 3.0
AUTO_EVERY_S = 1.0
AUTOMATIC = "sitsmesh (automatic)"


class BatchingRefused(SitsmeshError):
    code = Code.FAILED_PRECONDITION


class StageSource(Protocol):
    """What the batching service reads of the pressure runtime."""

    def stages_of(self, model: str) -> list[tuple[Pipeline, Stage]]: ...

    def stage_view(self, pipeline: str, stage: str) -> StagePressure | None: ...

    def set_capacity(self, model: str, slots: int, rate: float, service_s: float) -> None: ...


@dataclass(frozen=True, slots=True)
class Tuning:
    recommendation: Recommendation
    batching: Batching          # what is (or would be) applied
    pipeline: str
    stage: str
    swap: RunningSwap | None    # None for a dry run or nothing to change


class BatchingService:
    def __init__(self, swaps: SwapManager, state: StateStore, stages: StageSource | None, *,
                 clock: Callable[[], float] = time.time, auto_watch_s: float = WATCH_S) -> None:
        self._swaps = swaps
        self._auto_watch_s = auto_watch_s
        self._state = state
        self._stages = stages
        self._clock = clock
        self._policy = AutoPolicy()
        self._profiling: set[str] = set()

    # --- profile ---------------------------------------------------------

    async def profile(self, model: str, endpoint: str, plan: ProfilePlan, *,
                      production: bool, allow_production: bool,
                      progress: Callable[[Point], None] = lambda point: None) -> Curve:
        if not model:
            raise InvalidCurve("model is required")
        plan.validate()
        name, prod, sandbox = self._swaps.servers(endpoint)
        if production and not allow_production:
            raise BatchingRefused("a production profile sends real load to the serving model: "
                                  "pass allow_production (--yes-production) to consent")
        if not production and sandbox is None:
            raise BatchingRefused(f"endpoint {name} has no preflight sandbox to profile on; "
                                  "configure preflight_url or profile production with "
                                  "consent at a bounded rate")
        if model in self._profiling or self._swaps.running(model):
            raise BatchingRefused(f"{model} is being profiled or swapped; one at a time")
        self._profiling.add(model)
        try:
            return await self._profile(model, name, prod, sandbox, plan=plan,
                                      production=production, progress=progress)
        except ServerError as exc:
            raise BatchingRefused(f"profile of {model}: {exc.message}") from None
        finally:
            self._profiling.discard(model)

    async def _profile(self, model: str, name: str, prod: Any, sandbox: Any, *,
                       plan: ProfilePlan, production: bool,
                       progress: Callable[[Point], None]) -> Curve:
        from sitsmesh.triton.client import instance_count  # tritonclient only where used

        config = await prod.model_config(model)
        largest = int(config.get("max_batch_size", 0) or 0)
        if largest <= 1:
            raise BatchingRefused(f"model {model} has max_batch_size {largest}: it cannot "
                                  "batch, so there is no curve to measure")
        sizes = tuple(s for s in plan.batch_sizes if s <= largest)
        if len(sizes) < 2:
            raise InvalidCurve(f"batch sizes {list(plan.batch_sizes)}: at least two must be "
                               f"within the model's max_batch_size {largest}")
        plan = replace(plan, batch_sizes=sizes)
        probe = probe_inputs(config, SwapOptions())
        instances = instance_count(config)
        if production:
            rate = plan.max_rate or PRODUCTION_RATE
            if rate > MAX_PRODUCTION_RATE:
                raise InvalidCurve(f"max_rate {rate:g} is over {MAX_PRODUCTION_RATE:g} "
                                   "items/s for a production profile")
            plan = replace(plan, max_rate=rate)
            curve = await measure(prod, model, probe, plan, instances=instances,
                                  max_batch_size=largest, endpoint=name, source="production",
                                  progress=progress)
        else:
            # The sandbox runs the serving version without dynamic batching, so each
            # request is one execute() of exactly its batch size.
            ready = await prod.ready_versions(model)
            if not ready:
                raise BatchingRefused(f"model {model} has no READY version on {name}")
            bare = {k: v for k, v in config.items() if k != "dynamic_batching"}
            await sandbox.load(model, with_versions(swap_override(bare, SwapOptions()),
                                                    [max(ready)]), 300.0)
            try:
                curve = await measure(sandbox, model, probe, plan, instances=instances,
                                      max_batch_size=largest, endpoint=name,
                                      source="preflight", progress=progress)
            finally:
                try:
                    await sandbox.unload(model)
                except ServerError as exc:
                    _log.warning("profile cleanup failed", model=model, error=exc.message)
        await self._state.put(CURVE_KIND, model, curve.to_body())
        _log.info("batching profile stored", model=model, endpoint=name,
                  source=curve.source, points=len(curve.points))
        return curve

    async def curve(self, model: str) -> Curve:
        record = await self._state.get(CURVE_KIND, model)
        if record is None:
            raise NotFoundError(f"no batching curve for model {model!r}: run "
                                f"'sitsmesh models profile {model}' first")
        return curve_from(record.body)

    # --- recommend and apply -----------------------------------------------

    def _stage(self, model: str, pipeline: str) -> tuple[str, Stage | None]:
        if self._stages is None:
            return pipeline, None
        found = [(p, s) for p, s in self._stages.stages_of(model)
                 if not pipeline or p.name == pipeline]
        if not found:
            if pipeline:
                raise NotFoundError(f"pipeline {pipeline!r} has no stage serving {model}")
            return "", None
        if len(found) > 1:
            raise InvalidCurve(f"{model} serves stages of several pipelines ("
                               + ", ".join(sorted(p.name for p, _ in found))
                               + "): name one with pipeline")
        return found[0][0].name, found[0][1]

    async def plan(self, model: str, endpoint: str, *, rate: float = 0.0, sla_ms: float = 0.0,
                   pipeline: str = "", batching: Batching | None = None) -> Tuning:
        """The recommendation (or the given batching, predicted) without changing
        anything."""
        curve = await self.curve(model)
        _, prod, _ = self._swaps.servers(endpoint)
        try:
            current = batching_of(await prod.model_config(model))
        except ServerError as exc:
            raise BatchingRefused(f"reading {model}'s config: {exc.message}") from None
        pipe, stage = self._stage(model, pipeline)
        source = "given"
        if not rate and stage is not None and self._stages is not None:
            view = self._stages.stage_view(pipe, stage.name)
            if view is not None and view.arrival_rate > 0:
                rate, source = view.arrival_rate, "live"
        if not rate:
            rate, source = 0.5 * curve.capacity(curve.points[0].batch_size), "assumed"
        if not sla_ms:
            if stage is None or stage.sla_p99_ms is None:
                raise InvalidCurve(f"no SLA for {model}: its stage sets no sla_p99_ms; give "
                                   "sla_ms")
            sla_ms = stage.sla_p99_ms
        found = recommend(curve, current, rate=rate, sla_ms=sla_ms, rate_source=source)
        if batching is not None:
            chosen = predict(curve, batching, rate, sla_ms / 1000)
            found = replace(found, proposed=chosen,
                            capacity=saturated_capacity(curve, batching),
                            reason=f"{batching.label()} as given: predicted p99 "
                                   f"{chosen.p99_ms:.1f} ms at {rate:.1f} items/s")
        return Tuning(found, found.proposed.batching, pipe, stage.name if stage else "", None)

    async def tune(self, model: str, endpoint: str, options: SwapOptions, *, actor: str,
                   rate: float = 0.0, sla_ms: float = 0.0, pipeline: str = "",
                   batching: Batching | None = None, watch_s: float = WATCH_S,
                   automatic: bool = False, traceparent: str = "") -> Tuning:
        tuning = await self.plan(model, endpoint, rate=rate, sla_ms=sla_ms, pipeline=pipeline,
                                 batching=batching)
        found = tuning.recommendation
        if found.proposed.batching == found.current.batching:
            return tuning
        if not found.proposed.stable and batching is None:
            raise BatchingRefused(found.reason)
        curve = await self.curve(model)
        stage = tuning.stage
        change = ConfigChange(
            tuning.batching.block(), capacity=found.capacity, sla_ms=found.sla_ms,
            watch_s=watch_s, live_p99=self._live_p99(tuning.pipeline, stage))
        handle = self._swaps.begin(model, 0, endpoint, options, traceparent, change=change)
        previous = found.current.batching
        applied = tuning.batching

        async def finish() -> None:
            assert handle.task is not None
            record = await asyncio.shield(handle.task)
            await self._audit(model, actor, previous=previous, applied=applied, found=found,
                              record=record, automatic=automatic, pipeline=tuning.pipeline)
            if record.state == "succeeded" and self._stages is not None:
                items = applied.batch_items(curve.max_batch_size)
                self._stages.set_capacity(model, curve.instances * items, found.capacity,
                                          curve.service_s(items))

        asyncio.get_running_loop().create_task(finish())
        return replace(tuning, swap=handle)

    def _live_p99(self, pipeline: str, stage: str) -> Callable[[], float | None]:
        source = self._stages

        def read() -> float | None:
            if source is None or not stage:
                return None
            view = source.stage_view(pipeline, stage)
            return view.rt99_ms if view is not None and view.rt99_ms > 0 else None

        return read

    async def _audit(self, model: str, actor: str, *, previous: Batching, applied: Batching,
                     found: Recommendation, record: SwapRecord, automatic: bool,
                     pipeline: str) -> None:
        at = self._clock()
        name = f"{at:017.6f}-{secrets.token_hex(4)}"
        body = {"id": name, "model": model, "actor": actor, "at": at,
                "previous": _batching_body(previous), "batching": _batching_body(applied),
                "reason": found.reason, "swap_id": record.id, "outcome": record.state,
                "automatic": automatic, "pipeline": pipeline, "rate": found.rate}
        await self._state.put(AUDIT_KIND, name, body)
        _log.info("batching change", **{k: v for k, v in body.items()
                                        if k not in ("previous", "batching")},
                  previous=previous.label(), batching=applied.label())

    async def changes(self, model: str = "") -> list[dict[str, Any]]:
        records = await self._state.list(AUDIT_KIND)
        return [r.body for r in records if not model or r.body.get("model") == model]

    # --- automatic mode ----------------------------------------------------

    async def auto_settings(self, pipeline: str) -> AutoSettings:
        record = await self._state.get(AUTO_KIND, pipeline)
        if record is None:
            return AutoSettings(pipeline)
        body = record.body
        return AutoSettings(pipeline, bool(body.get("enabled")), float(body.get("hold_s", 30)),
                            float(body.get("cooldown_s", 300)))

    async def set_auto(self, settings: AutoSettings, actor: str) -> AutoSettings:
        if not settings.pipeline:
            raise InvalidCurve("pipeline is required")
        settings.validate()
        await self._state.put(AUTO_KIND, settings.pipeline, settings.to_body())
        at = self._clock()
        name = f"{at:017.6f}-{secrets.token_hex(4)}"
        await self._state.put(AUDIT_KIND, name,
                              {"id": name, "model": "", "actor": actor, "at": at,
                               "pipeline": settings.pipeline,
                               "reason": f"automatic tuning {'on' if settings.enabled else 'off'}"
                                         f" (hold {settings.hold_s:g} s, cool-down "
                                         f"{settings.cooldown_s:g} s)",
                               "automatic": False})
        _log.info("batching auto mode", pipeline=settings.pipeline, enabled=settings.enabled,
                  actor=actor)
        return settings

    async def auto_step(self, models: Sequence[str]) -> list[str]:
        """One look at every staged model of a pipeline in automatic mode; the models it
        began re-tuning."""
        begun: list[str] = []
        if self._stages is None:
            return begun
        for model in models:
            for pipeline, stage in self._stages.stages_of(model):
                settings = await self.auto_settings(pipeline.name)
                if not settings.enabled or self._swaps.running(model):
                    continue
                record = await self._state.get(CURVE_KIND, model)
                view = self._stages.stage_view(pipeline.name, stage.name)
                if record is None or view is None:
                    continue
                curve = curve_from(record.body)
                now = self._clock()
                if not self._policy.due(model, curve, view.arrival_rate,
                                        overloaded=view.level == OVERLOADED, now=now,
                                        settings=settings):
                    continue
                self._policy.tuned(model, curve, view.arrival_rate, now)
                try:
                    tuning = await self.tune(model, "", SwapOptions(), actor=AUTOMATIC,
                                             pipeline=pipeline.name, automatic=True,
                                             watch_s=self._auto_watch_s)
                except SitsmeshError as exc:
                    _log.warning("automatic re-tune not started", model=model,
                                 pipeline=pipeline.name, error=exc.message)
                    continue
                if tuning.swap is not None:
                    begun.append(model)
        return begun


def _batching_body(batching: Batching) -> dict[str, Any]:
    return {"enabled": batching.enabled, "preferred_batch_size": list(batching.preferred),
            "max_queue_delay_microseconds": batching.max_queue_delay_us or 0}


def batching_from_body(body: dict[str, Any] | None) -> Batching:
    if not body or not body.get("enabled"):
        return Batching()
    return Batching(tuple(int(s) for s in body.get("preferred_batch_size", [])),
                    int(body.get("max_queue_delay_microseconds", 0)))
