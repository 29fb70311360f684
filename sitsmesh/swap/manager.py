"""Runs swaps: one at a time per model, in the background, with progress fanned out.

A swap outlives the call that started it: when the CLI is interrupted the
swap still finishes (or rolls back), and its record tells how it ended.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram

from sitsmesh import logs
from sitsmesh.config import TritonEndpoint
from sitsmesh.errors import Code, NotFoundError, SitsmeshError
from sitsmesh.swap.contract import ModelServer, ServerError, VersionState
from sitsmesh.swap.machine import ConfigChange, Hooks, Swap, SwapEvent
from sitsmesh.swap.override import InvalidSwapInput, SwapOptions
from sitsmesh.swap.record import (
    FAILED,
    INTERRUPTED,
    ROLLED_BACK,
    SUCCEEDED,
    SwapHistory,
    SwapRecord,
    new_id,
)

_log = logs.get("sitsmesh.swap")

ServerFactory = Callable[[str, str, str], ModelServer]
PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
FIRST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class SwapRefused(SitsmeshError):
    code = Code.FAILED_PRECONDITION


class SwapInvalid(SitsmeshError):
    code = Code.INVALID_ARGUMENT


@dataclass(slots=True)
class _Endpoint:
    config: TritonEndpoint
    server: ModelServer
    preflight: ModelServer | None


@dataclass(slots=True)
class RunningSwap:
    swap: Swap
    events: asyncio.Queue[SwapEvent | None] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[SwapRecord] | None = None
    traceparent: str = ""  # of the admin call that started it ("": none)

    async def stream(self) -> AsyncIterator[SwapEvent]:
        """Progress events until the swap ends."""
        while (event := await self.events.get()) is not None:
            yield event


@dataclass(frozen=True, slots=True)
class EndpointModels:
    endpoint: str
    versions: tuple[VersionState, ...]
    error: str = ""


# A swap its precheck turned down (under pressure, already serving, nothing to replace)
# changed nothing: counted apart from failures, so an alert on failures stays quiet.
REFUSED = "refused"


def outcome_of(record: SwapRecord) -> str:
    """The `outcome` label of a finished swap."""
    if record.state == FAILED and record.phase == "precheck":
        return REFUSED
    return record.state


class SwapMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.phase = Histogram("sitsmesh_swap_phase_seconds", "Duration of each swap phase.",
                               ["phase"], registry=registry, buckets=PHASE_BUCKETS)
        self.warmup = Histogram("sitsmesh_swap_warmup_seconds",
                                "Load of the new version, warmup included, in production.",
                                registry=registry, buckets=PHASE_BUCKETS)
        self.first = Histogram("sitsmesh_swap_first_request_seconds",
                               "Latency of the first unversioned request after promote.",
                               registry=registry, buckets=FIRST_BUCKETS)
        self.outcomes = Counter("sitsmesh_swaps_total", "Swaps by how they ended.",
                                ["outcome"], registry=registry)
        # Every outcome shows from the start at 0, so the first failure is an increase
        # an alert sees, not a series that appears already at 1.
        for outcome in (SUCCEEDED, FAILED, ROLLED_BACK, INTERRUPTED, REFUSED):
            self.outcomes.labels(outcome)

    def hooks(self) -> Hooks:
        return Hooks(phase_seconds=lambda phase, s: self.phase.labels(phase).observe(s),
                     warmup_seconds=self.warmup.observe,
                     first_request_seconds=self.first.observe)


class SwapManager:
    def __init__(self, endpoints: Sequence[TritonEndpoint], history: SwapHistory,
                 factory: ServerFactory, registry: CollectorRegistry | None, *,
                 clock: Callable[[], float] = time.time,
                 pressure: Callable[[str], str] | None = None) -> None:
        self._pressure = pressure
        self._endpoints = {
            e.name: _Endpoint(e, factory(e.name, e.url, e.metrics_url),
                              factory(f"{e.name}-preflight", e.preflight_url, "")
                              if e.preflight_url else None)
            for e in endpoints}
        self.history = history
        self._metrics = SwapMetrics(registry)
        self._clock = clock
        self._running: dict[str, RunningSwap] = {}
        # Called with each swap's record (and its caller's traceparent) once it ended,
        # rolled back or was interrupted: tracing turns it into spans.
        self.on_end: Callable[[SwapRecord, str], None] | None = None

    async def start(self) -> None:
        for record in await self.history.mark_interrupted(self._clock()):
            _log.warning("swap was interrupted by a restart", swap_id=record.id,
                         model=record.model, phase=record.phase)
            self._metrics.outcomes.labels(INTERRUPTED).inc()

    async def stop(self) -> None:
        tasks = [r.task for r in self._running.values() if r.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if tasks:
            await self.history.mark_interrupted(self._clock())
        for endpoint in self._endpoints.values():
            await endpoint.server.close()
            if endpoint.preflight is not None:
                await endpoint.preflight.close()

    def _endpoint(self, name: str) -> _Endpoint:
        if not self._endpoints:
            raise SwapRefused("no Triton endpoint is configured (set triton or --triton-url)")
        if not name:
            if len(self._endpoints) > 1:
                raise SwapInvalid("several Triton endpoints are configured; name one of: "
                                  + ", ".join(sorted(self._endpoints)))
            return next(iter(self._endpoints.values()))
        if name not in self._endpoints:
            raise NotFoundError(f"no Triton endpoint named {name!r} (configured: "
                                f"{', '.join(sorted(self._endpoints)) or 'none'})")
        return self._endpoints[name]

    async def list_models(self, endpoint: str = "") -> list[EndpointModels]:
        if endpoint:
            chosen = [self._endpoint(endpoint)]
        else:
            chosen = [self._endpoints[n] for n in sorted(self._endpoints)]
        result = []
        for item in chosen:
            try:
                versions = tuple(await item.server.index())
            except ServerError as exc:
                result.append(EndpointModels(item.config.name, (), exc.message))
            else:
                result.append(EndpointModels(item.config.name, versions))
        return result

    def servers(self, endpoint: str) -> tuple[str, ModelServer, ModelServer | None]:
        """(endpoint name, production server, preflight sandbox or None) for `endpoint`
        ("" when only one is configured)."""
        chosen = self._endpoint(endpoint)
        return chosen.config.name, chosen.server, chosen.preflight

    def running(self, model: str) -> bool:
        return model in self._running

    def begin(self, model: str, target: int, endpoint: str,
              options: SwapOptions, traceparent: str = "", *,
              change: ConfigChange | None = None) -> RunningSwap:
        """Start a swap in the background; raises before anything runs if it may not.
        With `change`, the serving version's config changes instead (target is ignored)."""
        if not model:
            raise SwapInvalid("model is required")
        if change is not None:
            target = max(target, 1)  # the precheck sets it to the serving version
        if target < 1:
            raise SwapInvalid(f"target_version must be a version number >= 1, got {target}")
        try:
            options.validate()
        except InvalidSwapInput as exc:
            raise SwapInvalid(str(exc)) from None
        chosen = self._endpoint(endpoint)
        running = self._running.get(model)
        if running is not None:
            raise SwapRefused(f"swap {running.swap.record.id} is already running on model "
                              f"{model} (phase {running.swap.record.phase}); one swap per "
                              "model at a time")
        body = _options_body(options)
        if change is not None:
            body["dynamic_batching"] = change.dynamic_batching
        record = SwapRecord(new_id(), model, chosen.config.name, target,
                            started_at=self._clock(), options=body)
        queue: asyncio.Queue[SwapEvent | None] = asyncio.Queue()
        swap = Swap(record, chosen.server, chosen.preflight, options, self.history,
                    emit=queue.put_nowait, clock=self._clock, hooks=self._metrics.hooks(),
                    pressure=self._pressure, change=change)
        handle = RunningSwap(swap, queue, traceparent=traceparent)
        self._running[model] = handle
        handle.task = asyncio.get_running_loop().create_task(self._run(model, handle))
        _log.info("swap started", swap_id=record.id, model=model, endpoint=chosen.config.name,
                  to_version=target)
        return handle

    async def _run(self, model: str, handle: RunningSwap) -> SwapRecord:
        try:
            record = await handle.swap.run()
            self._metrics.outcomes.labels(outcome_of(record)).inc()
            return record
        finally:
            self._running.pop(model, None)
            handle.events.put_nowait(None)
            if self.on_end is not None:
                self.on_end(handle.swap.record, handle.traceparent)

    async def get(self, swap_id: str) -> SwapRecord:
        return await self.history.get(swap_id)

    async def recent(self, model: str = "", limit: int = 50) -> list[SwapRecord]:
        return await self.history.recent(model, limit)


def _options_body(options: SwapOptions) -> dict[str, object]:
    return {"warmup_count": options.warmup_count, "warmup_data": options.warmup_data,
            "verify_probes": options.verify_probes,
            "max_latency_ratio": options.max_latency_ratio,
            "latency_slack_ms": options.latency_slack_ms,
            "drain_timeout_s": options.drain_timeout_s, "load_timeout_s": options.load_timeout_s,
            "max_pending": options.max_pending, "sample_inputs": sorted(options.sample)}

