"""The swap protocol as one state machine over two ModelServers (production, preflight).

precheck -> preflight -> load+warm -> verify -> promote -> drain -> retire, and
rollback on any failure or timeout once production was touched. Every step is
written to the swap's record before and after it runs. No grpc here: the
servers come in through sitsmesh.swap.contract, the clock and sleep are
injected, and progress leaves through `emit`.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sitsmesh import logs
from sitsmesh.swap.contract import Answer, ModelServer, ServerError, Tensor, VersionState
from sitsmesh.swap.override import (
    InvalidSwapInput,
    SwapOptions,
    probe_inputs,
    swap_override,
    with_versions,
)
from sitsmesh.swap.record import (
    FAILED,
    ROLLED_BACK,
    SUCCEEDED,
    Step,
    SwapHistory,
    SwapRecord,
)

_log = logs.get("sitsmesh.swap")

PROGRESS = {"precheck": 0.05, "preflight": 0.3, "load": 0.5, "verify": 0.65,
            "promote": 0.75, "drain": 0.9, "retire": 1.0, "rollback": 1.0}
PROBE_TIMEOUT_S = 10.0
DRAIN_POLL_S = 0.2


@dataclass(frozen=True, slots=True)
class SwapEvent:
    swap_id: str
    phase: str
    state: str          # running, ok, failed, skipped
    message: str
    fraction: float     # overall progress, 0..1
    at: float
    detail: tuple[tuple[str, Any], ...] = ()


class _Failed(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(slots=True)
class Hooks:
    """Where a swap reports what metrics record; all optional."""

    phase_seconds: Callable[[str, float], None] = lambda phase, seconds: None
    warmup_seconds: Callable[[float], None] = lambda seconds: None
    first_request_seconds: Callable[[float], None] = lambda seconds: None


@dataclass(frozen=True, slots=True)
class ConfigChange:
    """A swap of the serving version's config rather than of its version: a new
    dynamic_batching block. Triton keeps a model's config per model, not per version,
    so the new config cannot serve beside the old as another version; instead Triton's
    reload loads and warms new instances beside the serving ones and moves traffic to
    them once they are ready. The swap vets the config on the sandbox first, verifies it
    against the prediction, and reloads the old config (warm too) if it falls short."""

    dynamic_batching: dict[str, Any] | None   # the block to put in force; None removes it
    capacity: float = 0.0          # predicted items/s saturated; 0 = not checked
    sla_ms: float = 0.0            # the stage's p99 SLA: the live check's bound (0 = none)
    watch_s: float = 0.0           # how long the live p99 is watched after the reload
    live_p99: Callable[[], float | None] = lambda: None   # the stage's measured p99 (ms)


BURST_PER_BATCH = 4   # the capacity check sends this many largest batches' worth at once
CAPACITY_SHARE = 0.5  # ... and wants at least this share of the predicted capacity


class Swap:
    def __init__(self, record: SwapRecord, prod: ModelServer, preflight: ModelServer | None,
                 options: SwapOptions, history: SwapHistory, *,
                 emit: Callable[[SwapEvent], None],
                 clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 hooks: Hooks | None = None,
                 pressure: Callable[[str], str] | None = None,
                 change: ConfigChange | None = None) -> None:
        self.record = record
        self._change = change
        self._original: dict[str, Any] = {}   # a config change's rollback: the old config
        # Why the backpressure controller says a swap should wait ("" when it need not).
        self._pressure = pressure or (lambda model: "")
        self._prod = prod
        self._preflight = preflight
        self._options = options
        self._history = history
        self._emit = emit
        self._clock = clock
        self._sleep = sleep
        self._hooks = hooks or Hooks()
        self._override: dict[str, Any] = {}
        self._probe: list[Tensor] = []
        self._baseline_s = 0.0
        self._touched_prod = False

    # --- running -------------------------------------------------------

    async def run(self) -> SwapRecord:
        record = self.record
        record.started_at = record.started_at or self._clock()
        await self._history.save(record)
        phases: list[tuple[str, Callable[[Step], Awaitable[str]]]] = [
            ("precheck", self._precheck), ("preflight", self._run_preflight),
            ("load", self._load), ("verify", self._verify), ("promote", self._promote),
            ("drain", self._drain), ("retire", self._retire)]
        try:
            for phase, body in phases:
                await self._phase(phase, body)
        except _Failed as failure:
            await self._fail(failure.message)
        else:
            record.state = SUCCEEDED
            record.ended_at = self._clock()
            await self._history.save(record)
            _log.info("swap succeeded", swap_id=record.id, model=record.model,
                      from_version=record.from_version, to_version=record.to_version,
                      seconds=round(record.ended_at - record.started_at, 3))
        return record

    async def _phase(self, phase: str, body: Callable[[Step], Awaitable[str]]) -> None:
        record = self.record
        step = Step(phase, "running", self._clock())
        record.phase = phase
        record.steps.append(step)
        await self._history.save(record)
        self._event(step)
        _log.info("swap phase started", swap_id=record.id, model=record.model, phase=phase)
        try:
            outcome = await body(step)
        except _Failed as failure:
            self._finish(step, "failed", failure.message)
            await self._history.save(record)
            _log.warning("swap phase failed", swap_id=record.id, model=record.model,
                         phase=phase, error=failure.message)
            raise
        except ServerError as exc:
            message = f"{phase}: {exc.message}"
            self._finish(step, "failed", message)
            await self._history.save(record)
            _log.warning("swap phase failed", swap_id=record.id, model=record.model,
                         phase=phase, error=message)
            raise _Failed(message) from None
        self._finish(step, "skipped" if outcome.startswith("skipped") else "ok", outcome)
        await self._history.save(record)
        _log.info("swap phase done", swap_id=record.id, model=record.model, phase=phase,
                  result=step.state, message=outcome)

    def _finish(self, step: Step, state: str, message: str) -> None:
        step.state, step.message, step.ended_at = state, message, self._clock()
        self._hooks.phase_seconds(step.phase, step.ended_at - step.started_at)
        self._event(step)

    def _event(self, step: Step) -> None:
        fraction = PROGRESS[step.phase] if step.state != "running" else (
            max((PROGRESS[s.phase] for s in self.record.steps if s.state != "running"),
                default=0.0))
        self._emit(SwapEvent(self.record.id, step.phase, step.state,
                             step.message, fraction, self._clock(),
                             tuple(sorted(step.detail.items()))))

    async def _fail(self, message: str) -> None:
        record = self.record
        record.error = message
        if self._touched_prod and record.from_version is not None:
            try:
                await self._phase("rollback", self._rollback)
            except _Failed as failure:
                record.error = f"{message}; rollback failed: {failure.message}"
                record.state = FAILED
            else:
                record.state = ROLLED_BACK
        else:
            record.state = FAILED
        record.ended_at = self._clock()
        await self._history.save(record)
        _log.warning("swap ended without promoting", swap_id=record.id, model=record.model,
                     state=record.state, error=record.error)

    # --- phases --------------------------------------------------------

    async def _precheck(self, step: Step) -> str:
        record, prod, options = self.record, self._prod, self._options
        model, target = record.model, record.to_version
        known = await self._settled(prod, model)
        if not known:
            raise _Failed(f"model {model} is not in the repository of {prod.label}")
        ready = [v.version for v in known if v.state == "READY" and v.version]
        if not ready:
            raise _Failed(f"model {model} has no READY version on {prod.label}; a swap "
                          "replaces a serving version, so load one first")
        current = max(ready)
        record.from_version = current
        if self._change is not None:
            record.to_version = target = current
        elif target == current:
            raise _Failed(f"version {target} of {model} is already serving on {prod.label}")
        for version in known:
            if version.version == target and version.state == "UNAVAILABLE" and version.reason:
                step.detail["last_load_error"] = version.reason
        pending = await prod.pending(model)
        if pending is not None:
            queued = sum(pending.values())
            step.detail["pending"] = queued
            if queued > options.max_pending:
                raise _Failed(f"{queued} requests are pending on {model} at {prod.label} "
                              f"(max_pending {options.max_pending}): retry when the pressure "
                              "drops")
        busy = self._pressure(model)
        if busy:
            raise _Failed(f"{model} is under pressure ({busy}): a swap adds load; retry "
                          "when it drops")
        try:
            config = await prod.model_config(model)
            self._override = swap_override(self._changed(config), options)
            self._original = swap_override(config, options)
            self._probe = probe_inputs(config, options)
        except InvalidSwapInput as exc:
            raise _Failed(str(exc)) from None
        step.detail["warmup_added"] = not config.get("model_warmup")
        answers = await self._probes(prod, current, options.verify_probes, "serving version")
        self._baseline_s = statistics.median(a.seconds for a in answers)
        step.detail["baseline_p50_ms"] = round(self._baseline_s * 1000, 3)
        return (f"{model} v{current} serving on {prod.label}, steady p50 "
                f"{self._baseline_s * 1000:.1f} ms; target v{target}")

    async def _settled(self, server: ModelServer, model: str) -> list[VersionState]:
        """The model's versions once none is LOADING or UNLOADING (say, after a swap that
        was interrupted): a new load would make Triton fail the running one."""
        deadline = self._clock() + self._options.load_timeout_s
        while True:
            known = [v for v in await server.index() if v.model == model]
            moving = [v for v in known if v.state in ("LOADING", "UNLOADING")]
            if not moving:
                return known
            if self._clock() >= deadline:
                raise _Failed(f"v{moving[0].version} of {model} stayed {moving[0].state} on "
                              f"{server.label} for {self._options.load_timeout_s:g} s")
            await self._sleep(DRAIN_POLL_S)

    async def _run_preflight(self, step: Step) -> str:
        sandbox = self._preflight
        if sandbox is None:
            # Triton 2.51 can die (SIGSEGV) when a warmup fails: without a sandbox, the
            # candidate's first run is on production.
            _log.warning("swap without preflight: the candidate is unvetted",
                         swap_id=self.record.id, model=self.record.model)
            return ("skipped: no preflight endpoint configured; the candidate warms up "
                    "on production first")
        record, options = self.record, self._options
        model, target = record.model, record.to_version
        started = self._clock()
        try:
            await sandbox.load(model, with_versions(self._override, [target]),
                               options.load_timeout_s)
            if target not in await sandbox.ready_versions(model):
                raise _Failed(f"preflight: v{target} did not become READY on {sandbox.label}")
            step.detail["load_ms"] = round((self._clock() - started) * 1000, 1)
            answers = await self._probes(sandbox, target, options.verify_probes,
                                         "preflight candidate")
            self._gate_warm(answers, "preflight", self._delay_s() + self._bound(answers)
                            if self._change is not None else None)
            if self._change is not None:
                await self._check_capacity(sandbox, step, "preflight")
            step.detail["first_ms"] = round(answers[0].seconds * 1000, 3)
            step.detail["p50_ms"] = round(statistics.median(a.seconds for a in answers) * 1000, 3)
        except ServerError as exc:
            if exc.unreachable:
                raise _Failed(f"preflight: {sandbox.label} went down while vetting v{target} "
                              f"({exc.message}); the candidate may crash Triton, so it was not "
                              "loaded into production") from None
            raise _Failed(f"preflight: {exc.message}") from None
        finally:
            await self._quietly(sandbox.unload(model))
        return (f"v{target} loaded, warmed and verified on {sandbox.label}: first probe "
                f"{step.detail['first_ms']} ms, p50 {step.detail['p50_ms']} ms")

    async def _load(self, step: Step) -> str:
        record, prod = self.record, self._prod
        model, target, current = record.model, record.to_version, self._current
        self._touched_prod = True
        started = self._clock()
        await prod.load(model, with_versions(self._override, sorted({current, target})),
                        self._options.load_timeout_s)
        seconds = self._clock() - started
        ready = await prod.ready_versions(model)
        if target not in ready:
            reasons = [v.reason for v in await prod.index()
                       if v.model == model and v.version == target and v.reason]
            raise _Failed(f"v{target} did not become READY on {prod.label}"
                          + (f": {reasons[0]}" if reasons else ""))
        if current not in ready:
            raise _Failed(f"v{current} stopped serving during the load on {prod.label}")
        self._hooks.warmup_seconds(seconds)
        step.detail["load_ms"] = round(seconds * 1000, 1)
        if self._change is not None:
            return (f"v{current} reloaded with the new config, its new instances warmed "
                    f"beside the serving ones, in {seconds:.2f} s")
        return f"v{target} loaded and warmed beside v{current} in {seconds:.2f} s"

    async def _verify(self, step: Step) -> str:
        record, options = self.record, self._options
        answers = await self._probes(self._prod, record.to_version, options.verify_probes,
                                     "new version")
        p50 = statistics.median(a.seconds for a in answers)
        step.detail["first_ms"] = round(answers[0].seconds * 1000, 3)
        step.detail["p50_ms"] = round(p50 * 1000, 3)
        # A batching config may hold a lone request for its queue delay: that is the
        # config working, not the version being slow.
        limit = (self._baseline_s * options.max_latency_ratio + options.latency_slack_ms / 1000
                 + self._delay_s())
        step.detail["limit_ms"] = round(limit * 1000, 3)
        if p50 > limit:
            raise _Failed(f"verify: v{record.to_version} p50 {p50 * 1000:.1f} ms is over "
                          f"{limit * 1000:.1f} ms ({options.max_latency_ratio:g}x the serving "
                          f"version's {self._baseline_s * 1000:.1f} ms + "
                          f"{options.latency_slack_ms:g} ms)")
        self._gate_warm(answers, "verify", limit)
        checked = ""
        if self._change is not None:
            checked = await self._verify_change(step)
        return (f"{len(answers)} probes ok: first {answers[0].seconds * 1000:.1f} ms, "
                f"p50 {p50 * 1000:.1f} ms (limit {limit * 1000:.1f} ms){checked}")

    async def _verify_change(self, step: Step) -> str:
        """The reloaded config is the one sent, it batches as predicted, and the stage's
        live p99 stays within its SLA for the watch window."""
        change, prod, model = self._change, self._prod, self.record.model
        assert change is not None
        in_force = (await prod.model_config(model)).get("dynamic_batching")
        if not _same_batching(in_force, change.dynamic_batching):
            raise _Failed(f"verify: Triton serves dynamic_batching {in_force} after the "
                          f"reload, not {change.dynamic_batching}")
        text = ""
        if self._preflight is None:
            text += await self._check_capacity(prod, step, "verify")
        if change.watch_s > 0 and change.sla_ms > 0:
            await self._sleep(change.watch_s)
            live = change.live_p99()
            if live is not None:
                step.detail["live_p99_ms"] = round(live, 1)
                if live > change.sla_ms:
                    raise _Failed(f"verify: the stage's p99 is {live:.1f} ms after the change, "
                                  f"over its {change.sla_ms:g} ms SLA")
                text += f"; live p99 {live:.1f} ms within {change.sla_ms:g} ms"
        return text

    async def _check_capacity(self, server: ModelServer, step: Step, phase: str) -> str:
        """A burst of single-item requests is served at a good share of the predicted
        capacity: the batches form as the curve says they will."""
        change = self._change
        assert change is not None
        block = change.dynamic_batching
        if not change.capacity or block is None:
            return ""
        largest = max(block.get("preferred_batch_size") or [1])
        count = max(8, BURST_PER_BATCH * largest)
        started = self._clock()
        answers = await asyncio.gather(*(self._probe_once(server, self.record.to_version)
                                         for _ in range(count)))
        seconds = max(self._clock() - started, *(a.seconds for a in answers), 1e-6)
        rate = count / seconds
        step.detail["burst_items_per_s"] = round(rate, 1)
        step.detail["predicted_items_per_s"] = round(change.capacity, 1)
        if rate < CAPACITY_SHARE * change.capacity:
            raise _Failed(f"{phase}: a burst of {count} requests was served at {rate:.0f} "
                          f"items/s, under {CAPACITY_SHARE:g}x the predicted "
                          f"{change.capacity:.0f}: the batches do not form as predicted")
        return f"; burst {rate:.0f} items/s (predicted {change.capacity:.0f})"

    async def _promote(self, step: Step) -> str:
        record, prod = self.record, self._prod
        target, current = record.to_version, self._current
        if self._change is not None:
            answer = await self._probe_once(prod, None)
            self._hooks.first_request_seconds(answer.seconds)
            step.detail["first_request_ms"] = round(answer.seconds * 1000, 3)
            return (f"traffic on the new config since the reload; an unversioned request "
                    f"{answer.seconds * 1000:.1f} ms")
        if target < current:
            # Unversioned requests go to the highest READY version, so an older target
            # takes the traffic only once the newer one is unloaded. Triton finishes the
            # requests already on it.
            await prod.load(record.model, with_versions(self._override, [target]),
                            self._options.load_timeout_s)
        answer = await self._probe_once(prod, None)
        if answer.version != target:
            raise _Failed(f"promote: unversioned requests still reach v{answer.version}, "
                          f"not v{target}")
        self._hooks.first_request_seconds(answer.seconds)
        step.detail["first_request_ms"] = round(answer.seconds * 1000, 3)
        how = f"v{current} unloaded" if target < current else "highest READY version"
        return (f"unversioned traffic on v{target} ({how}); first request "
                f"{answer.seconds * 1000:.1f} ms")

    async def _drain(self, step: Step) -> str:
        record, prod = self.record, self._prod
        current = self._current
        if self._change is not None:
            # The old instances finish what they hold and unload inside Triton.
            await self._settled(prod, record.model)
            return "the old config's instances finished and unloaded"
        deadline = self._clock() + self._options.drain_timeout_s
        last: int | None = None
        while True:
            if current not in await prod.ready_versions(record.model):
                return f"v{current} is unloaded; nothing left to drain"
            counts = await prod.request_counts(record.model)
            pending = await prod.pending(record.model)
            queued = (pending or {}).get(current, 0)
            done = counts.get(current, 0)
            step.detail.update(finished=done, pending=queued)
            if queued == 0 and done == last:
                return f"v{current} idle: {done} requests finished, none pending"
            last = done
            if self._clock() >= deadline:
                raise _Failed(f"drain: v{current} still busy after "
                              f"{self._options.drain_timeout_s:g} s ({queued} pending)")
            await self._sleep(DRAIN_POLL_S)

    async def _retire(self, step: Step) -> str:
        record, prod = self.record, self._prod
        current, target = self._current, record.to_version
        if self._change is not None:
            return f"skipped: v{current} serves on with the new config"
        if target < current:
            return f"skipped: v{current} was unloaded at promote"
        await prod.load(record.model, with_versions(self._override, [target]),
                        self._options.load_timeout_s)
        ready = await prod.ready_versions(record.model)
        if target not in ready:
            raise _Failed(f"retire: v{target} is not READY after unloading v{current}")
        # The load returns while the old version is still UNLOADING (its instances
        # finish and shut down); the swap is done when it is gone.
        deadline = self._clock() + self._options.drain_timeout_s
        while any(v.model == record.model and v.version == current
                  and v.state in ("READY", "UNLOADING") for v in await prod.index()):
            if self._clock() >= deadline:
                raise _Failed(f"retire: v{current} still unloading after "
                              f"{self._options.drain_timeout_s:g} s")
            await self._sleep(DRAIN_POLL_S / 4)
        return f"v{current} unloaded; v{target} serves alone"

    async def _rollback(self, step: Step) -> str:
        record, prod = self.record, self._prod
        current = self._current
        config = self._original if self._change is not None else self._override
        await prod.load(record.model, with_versions(config, [current]),
                        self._options.load_timeout_s)
        ready = await prod.ready_versions(record.model)
        if current not in ready:
            raise _Failed(f"v{current} is not READY after the rollback")
        if self._change is not None:
            return f"v{current} serving with its old config again (reloaded warm)"
        return f"v{record.to_version} unloaded; v{current} serving"

    # --- helpers -------------------------------------------------------

    def _changed(self, config: dict[str, Any]) -> dict[str, Any]:
        """The config the swap puts in force: a config change's batching, or as it is."""
        if self._change is None:
            return config
        if int(config.get("max_batch_size", 0) or 0) <= 1:
            raise InvalidSwapInput(f"model {config.get('name')!r} has max_batch_size "
                                   f"{config.get('max_batch_size', 0)}: Triton batches "
                                   "nothing for it")
        changed = {k: v for k, v in config.items() if k != "dynamic_batching"}
        if self._change.dynamic_batching is not None:
            changed["dynamic_batching"] = dict(self._change.dynamic_batching)
        return changed

    def _delay_s(self) -> float:
        block = self._change.dynamic_batching if self._change is not None else None
        return int((block or {}).get("max_queue_delay_microseconds", 0) or 0) / 1e6

    def _bound(self, answers: list[Answer]) -> float:
        options = self._options
        return (statistics.median(a.seconds for a in answers) * options.max_latency_ratio
                + options.latency_slack_ms / 1000)

    @property
    def _current(self) -> int:
        assert self.record.from_version is not None
        return self.record.from_version

    async def _probe_once(self, server: ModelServer, version: int | None) -> Answer:
        try:
            return await server.infer(self.record.model, version, self._probe, PROBE_TIMEOUT_S)
        except ServerError as exc:
            if exc.unreachable:
                raise
            which = f"v{version}" if version is not None else "unversioned"
            raise _Failed(f"probe to {which} on {server.label} failed: {exc.message}") from None

    async def _probes(self, server: ModelServer, version: int, count: int,
                      what: str) -> list[Answer]:
        answers = []
        for _ in range(count):
            answer = await self._probe_once(server, version)
            if answer.version != version:
                raise _Failed(f"{what}: a probe to v{version} was answered by "
                              f"v{answer.version}")
            answers.append(answer)
        return answers

    def _gate_warm(self, answers: list[Answer], phase: str, limit: float | None = None) -> None:
        """The first request must not pay for the context: warmup ran, or it did not work."""
        options = self._options
        steady = statistics.median(a.seconds for a in answers[1:] or answers)
        bound = max(limit or 0.0,
                    steady * options.max_latency_ratio + options.latency_slack_ms / 1000)
        first = answers[0].seconds
        if first > bound:
            raise _Failed(f"{phase}: the first request took {first * 1000:.1f} ms against a "
                          f"steady {steady * 1000:.1f} ms (bound {bound * 1000:.1f} ms): the "
                          "version was not warm when it became READY")

    @staticmethod
    async def _quietly(call: Awaitable[None]) -> None:
        try:
            await call
        except ServerError as exc:
            _log.warning("preflight cleanup failed", error=exc.message)


def _same_batching(in_force: Any, sent: dict[str, Any] | None) -> bool:
    """Triton's protobuf JSON gives int64 as strings and defaults as absent."""
    if not in_force and not sent:
        return True
    if not in_force or not sent:
        return False
    return (int(in_force.get("max_queue_delay_microseconds", 0) or 0)
            == int(sent.get("max_queue_delay_microseconds", 0) or 0)
            and [int(x) for x in in_force.get("preferred_batch_size", []) or []]
            == [int(x) for x in sent.get("preferred_batch_size", []) or []])
