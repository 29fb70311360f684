"""Dynamic batching's pure parts: the curve, its knee and front, the batcher simulation and
the recommendation, automatic mode's policy, and config swaps on the Triton double.
The real Triton runs in tests/integration/test_batching_triton.py."""

from __future__ import annotations

import asyncio
import copy
import math
from typing import Any

import pytest

from sitsmesh.batching.auto import AutoPolicy, AutoSettings, region
from sitsmesh.batching.curve import (
    CURVE_KIND,
    Curve,
    InvalidCurve,
    Point,
    batch_sizes,
    curve_from,
    knee,
    pareto,
)
from sitsmesh.batching.profile import ProfilePlan, batched, measure
from sitsmesh.batching.recommend import (
    Batching,
    batching_of,
    recommend,
    saturated_capacity,
    simulate,
)
from sitsmesh.batching.service import AUTOMATIC, BatchingRefused, BatchingService
from sitsmesh.chains.pipeline import Pipeline, Stage
from sitsmesh.config import TritonEndpoint
from sitsmesh.dev.batch_model import execute_ms
from sitsmesh.errors import NotFoundError
from sitsmesh.pressure.runtime import PressureRuntime
from sitsmesh.pressure.stages import StagePressure
from sitsmesh.state.sqlite import SqliteStore
from sitsmesh.swap.contract import Tensor
from sitsmesh.swap.machine import ConfigChange, Swap, SwapEvent
from sitsmesh.swap.manager import SwapManager
from sitsmesh.swap.override import SwapOptions
from sitsmesh.swap.record import FAILED, ROLLED_BACK, SUCCEEDED, SwapHistory, SwapRecord
from sitsmesh.triton.client import execute_slots
from tests.unit.test_swap import Clock, FakeTriton, _nosleep

SIZES = (1, 2, 4, 8, 16, 32)


@pytest.fixture
async def history(tmp_path: Any) -> Any:
    store = SqliteStore(tmp_path / "state.db")
    yield SwapHistory(store)
    await store.close()


def _ms(items: int) -> float:
    return execute_ms(items, overhead_ms=20.0, item_ms=0.5, knee_items=16)



def _curve(points: list[tuple[int, float]], instances: int = 1) -> Curve:
    """From (batch size, execute ms): throughput and latencies as a quiet server gives."""
    return Curve("m", "prod", "preflight", instances, 32, instances, 0.0,
                 tuple(Point(b, instances * b / (ms / 1000), ms, ms * 1.05, 20)
                       for b, ms in points))


MODEL = _curve([(b, _ms(b)) for b in SIZES])


def test_the_knee_is_where_the_curve_bends() -> None:
    assert knee(MODEL.points) == 16  # flat past 16 items, as the model is built
    # The design's A10 table (B=1 42, 8 286, 16 341, 32 345 QPS): the bend is at 8, past
    # it 2x the batch buys 19 % more.
    design = [Point(b, qps, 1, p99, 10) for b, qps, p99 in
              ((1, 42, 23.1), (8, 286, 31.7), (16, 341, 48.2), (32, 345, 92.5))]
    assert knee(design) == 8
    # Still rising straight: no bend, the largest size.
    straight = [Point(b, 10.0 * b, 1, 1, 10) for b in SIZES]
    assert knee(straight) == 32
    # Past a peak, the peak.
    falling = [Point(1, 10, 1, 1, 10), Point(2, 30, 1, 1, 10), Point(4, 20, 1, 1, 10)]
    assert knee(falling) == 2


def test_the_pareto_front_drops_what_another_beats_on_both() -> None:
    points = [Point(1, 40, 1, 20, 10), Point(2, 80, 1, 21, 10), Point(4, 70, 1, 30, 10),
              Point(8, 300, 1, 40, 10)]
    assert [p.batch_size for p in pareto(points)] == [1, 2, 8]


def test_service_time_interpolates_and_grows_past_the_last_size() -> None:
    assert MODEL.service_s(1) == pytest.approx(0.0205)
    assert MODEL.service_s(12) == pytest.approx((_ms(8) + _ms(16)) / 2000)
    assert MODEL.service_s(64) == pytest.approx(2 * MODEL.service_s(32))
    assert MODEL.capacity(16) == pytest.approx(16 / 0.028)


def test_a_stored_curve_round_trips_and_a_bad_one_names_its_field() -> None:
    assert curve_from(MODEL.to_body()) == MODEL
    body = MODEL.to_body()
    body["points"][2]["p99_ms"] = -1
    with pytest.raises(InvalidCurve, match=r"points\[2\]\.p99_ms must be a positive"):
        curve_from(body)
    body = MODEL.to_body()
    body["points"] = body["points"][::-1]
    with pytest.raises(InvalidCurve, match="distinct and ascending"):
        curve_from(body)
    with pytest.raises(InvalidCurve, match="2-16 measurements"):
        curve_from({**MODEL.to_body(), "points": []})


@pytest.mark.parametrize(("text", "message"), [
    ("1,x", "whole numbers"), ("4", "2-16 sizes"), ("0,2", "at least 1"),
    ("1,64", "over the model's max_batch_size 32")])
def test_batch_sizes_are_checked(text: str, message: str) -> None:
    with pytest.raises(InvalidCurve, match=message):
        batch_sizes(text, 32)
    assert batch_sizes("8, 1,2,2", 32) == (1, 2, 8)


def test_the_simulation_collapses_past_capacity_and_batching_lifts_it() -> None:
    untuned = simulate(MODEL, Batching(), 150.0)
    assert untuned[1] == math.inf  # 150 items/s against ~49 one at a time
    _, p99, served, mean_batch = simulate(MODEL, Batching((8, 16), 10_000), 150.0)
    assert p99 < 0.1 and served == pytest.approx(150, rel=0.1) and mean_batch > 2
    # Below capacity a single item runs about its own service time.
    assert simulate(MODEL, Batching(), 5.0)[0] == pytest.approx(0.0205, rel=0.1)
    # Seeded: the same answer twice.
    assert simulate(MODEL, Batching((16,), 2000), 300.0) == simulate(
        MODEL, Batching((16,), 2000), 300.0)


def test_recommend_batches_above_the_unbatched_capacity_within_the_sla() -> None:
    found = recommend(MODEL, Batching(), rate=150.0, sla_ms=100.0)
    assert not found.current.stable
    assert found.proposed.batching.enabled and found.changes
    assert found.proposed.p99_ms <= 100 and found.proposed.headroom >= 1.5
    assert found.capacity == pytest.approx(saturated_capacity(MODEL, found.proposed.batching))
    assert "within the 100 ms SLA" in found.reason and "knee of the curve at batch 16" in \
        found.reason
    # A pick is the one with the most headroom: none of the candidates that fit has more.
    assert all(p.headroom <= found.proposed.headroom for p in found.candidates
               if p.stable and p.p99_ms <= 100)


def test_recommend_keeps_what_serves_a_light_load_best() -> None:
    found = recommend(MODEL, Batching(), rate=2.0, sla_ms=200.0)
    assert not found.changes
    assert found.reason.startswith("keep no dynamic batching")


def test_recommend_says_so_when_nothing_meets_the_sla() -> None:
    found = recommend(MODEL, Batching(), rate=2000.0, sla_ms=50.0)
    assert "no config keeps p99 within 50 ms" in found.reason
    assert "more instances" in found.reason
    with pytest.raises(InvalidCurve, match="SLA"):
        recommend(MODEL, Batching(), rate=10.0, sla_ms=0)


def test_batching_is_read_from_a_triton_config() -> None:
    assert batching_of({"max_batch_size": 32}) == Batching()
    assert batching_of({"max_batch_size": 32, "dynamic_batching": {
        "preferred_batch_size": [8, 16], "max_queue_delay_microseconds": "10000"}}) == \
        Batching((8, 16), 10_000)
    assert batching_of({"max_batch_size": 0, "dynamic_batching": {}}) == Batching()
    assert Batching((8, 16), 10_000).block() == {
        "max_queue_delay_microseconds": 10_000, "preferred_batch_size": [8, 16]}
    assert Batching().block() is None


def test_auto_policy_holds_cools_down_and_never_acts_under_overload() -> None:
    policy, settings = AutoPolicy(), AutoSettings("p", True, hold_s=30, cooldown_s=300)
    low, high = 5.0, 300.0
    assert region(MODEL, low) == 0 and region(MODEL, high) > 0
    assert not policy.due("m", MODEL, low, overloaded=False, now=0, settings=settings)
    # The rate moves to another region: only after the hold.
    assert not policy.due("m", MODEL, high, overloaded=False, now=1, settings=settings)
    assert not policy.due("m", MODEL, high, overloaded=False, now=30, settings=settings)
    # Overload resets the hold and never tunes.
    assert not policy.due("m", MODEL, high, overloaded=True, now=40, settings=settings)
    assert not policy.due("m", MODEL, high, overloaded=False, now=41, settings=settings)
    assert not policy.due("m", MODEL, high, overloaded=False, now=70, settings=settings)
    assert policy.due("m", MODEL, high, overloaded=False, now=72, settings=settings)
    policy.tuned("m", MODEL, high, now=72)
    # Back down: held long enough, but inside the cool-down.
    assert not policy.due("m", MODEL, low, overloaded=False, now=80, settings=settings)
    assert not policy.due("m", MODEL, low, overloaded=False, now=200, settings=settings)
    assert policy.due("m", MODEL, low, overloaded=False, now=373, settings=settings)
    with pytest.raises(InvalidCurve, match="hold_s"):
        AutoSettings("p", True, hold_s=0).validate()


async def test_profile_measures_each_size_and_paces_production() -> None:
    server = FakeTriton()
    server.ready = {1: True}
    probe = [Tensor("INPUT0", "FP32", (1, 4), (0.0,) * 4)]
    assert batched(probe, 8)[0].shape == (8, 4) and len(batched(probe, 8)[0].values) == 32
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    seen: list[Point] = []
    curve = await measure(server, "m", probe, ProfilePlan((1, 4), requests=5, max_rate=10.0),
                          instances=1, max_batch_size=32, endpoint="prod", source="production",
                          clock=Clock(), sleep=sleep, progress=seen.append)
    assert [p.batch_size for p in curve.points] == [1, 4] == [p.batch_size for p in seen]
    assert all(p.requests == 5 for p in curve.points)
    # 10 items/s: a 4-item request every 0.4 s at most.
    assert max(slept) == pytest.approx(0.39, abs=0.02)
    with pytest.raises(InvalidCurve, match="requests must be"):
        ProfilePlan((1, 2), requests=1).validate()


def _batching_triton() -> FakeTriton:
    server = FakeTriton()
    server.config = copy.deepcopy(server.config) | {"max_batch_size": 32}
    server.ready = {1: True}
    return server


async def _change(history: SwapHistory, prod: FakeTriton, change: ConfigChange,
                  preflight: FakeTriton | None = None) -> SwapRecord:
    events: list[SwapEvent] = []
    record = SwapRecord("swp_batch", "m", "prod", 1)
    swap = Swap(record, prod, preflight, SwapOptions(verify_probes=5), history,
                emit=events.append, clock=Clock(), sleep=_nosleep, change=change)
    return await swap.run()


BLOCK: dict[str, Any] = {"preferred_batch_size": [8, 16], "max_queue_delay_microseconds": 2000}


async def test_a_config_change_reloads_the_serving_version_warm_and_verifies(
        history: Any) -> None:
    prod, sandbox = _batching_triton(), _batching_triton()
    record = await _change(history, prod, ConfigChange(BLOCK), preflight=sandbox)
    assert record.state == SUCCEEDED, record.error
    assert record.from_version == record.to_version == 1
    assert prod.config["dynamic_batching"] == BLOCK and prod.config["model_warmup"]
    # The sandbox vetted the same config first, then let it go.
    assert sandbox.loads[0]["dynamic_batching"] == BLOCK and sandbox.ready == {}
    assert [s.state for s in record.steps if s.phase == "retire"] == ["skipped"]


async def test_a_config_change_over_the_sla_is_rolled_back_to_the_old_config(
        history: Any) -> None:
    prod = _batching_triton()
    change = ConfigChange(BLOCK, sla_ms=100, watch_s=3, live_p99=lambda: 250.0)
    record = await _change(history, prod, change)
    assert record.state == ROLLED_BACK
    assert "p99 is 250.0 ms after the change, over its 100 ms SLA" in record.error
    assert "dynamic_batching" not in prod.config and prod.ready == {1: True}


async def test_a_config_change_that_does_not_batch_as_predicted_is_rolled_back(
        history: Any) -> None:
    prod = _batching_triton()
    # The double answers each request in 2 ms one at a time: nowhere near 100k items/s.
    record = await _change(history, prod, ConfigChange(BLOCK, capacity=100_000.0))
    assert record.state == ROLLED_BACK
    assert "the batches do not form as predicted" in record.error


async def test_a_model_that_cannot_batch_is_refused_untouched(history: Any) -> None:
    prod = FakeTriton()
    prod.ready = {1: True}
    record = await _change(history, prod, ConfigChange(BLOCK))
    assert record.state == FAILED and "max_batch_size" in record.error
    assert prod.loads == []



class Stages:
    """The pressure runtime as the batching service reads it: one stage serving m."""

    def __init__(self) -> None:
        self.stage = Stage("model", "upstream_cluster", "triton", sla_p99_ms=100.0,
                           triton_model="m")
        self.pipeline = Pipeline("infer", (self.stage,))
        self.rate, self.level = 2.0, "ok"
        self.capacity: list[tuple[str, int, float, float]] = []

    def stages_of(self, model: str) -> list[tuple[Pipeline, Stage]]:
        return [(self.pipeline, self.stage)] if model == "m" else []

    def stage_view(self, pipeline: str, stage: str) -> StagePressure:
        return StagePressure(stage, self.level, 0.1, self.rate, 48.0, 0.1, 0, 0, 30.0, 30.0,
                             10.0, False)

    def set_capacity(self, model: str, slots: int, rate: float, service_s: float) -> None:
        self.capacity.append((model, slots, rate, service_s))


async def test_auto_mode_retunes_after_the_hold_never_under_overload_and_audits(
        tmp_path: Any) -> None:
    store = SqliteStore(tmp_path / "state.db")
    servers: list[FakeTriton] = []

    def factory(name: str, url: str, metrics: str) -> FakeTriton:
        servers.append(_batching_triton())
        return servers[-1]

    manager = SwapManager([TritonEndpoint("prod", "127.0.0.1:1")], SwapHistory(store),
                          factory, None)
    now = [1000.0]
    stages = Stages()
    service = BatchingService(manager, store, stages, clock=lambda: now[0], auto_watch_s=0)
    await store.put(CURVE_KIND, "m", MODEL.to_body())
    try:
        assert await service.auto_step(["m"]) == []  # off until a pipeline opts in
        await service.set_auto(AutoSettings("infer", True, hold_s=5, cooldown_s=60), "ops")
        assert await service.auto_step(["m"]) == []  # light load: the config stands
        stages.rate = 300.0
        assert await service.auto_step(["m"]) == []  # moved: the hold starts
        now[0] += 6
        stages.level = "overloaded"
        assert await service.auto_step(["m"]) == []  # never while overloaded
        stages.level = "ok"
        assert await service.auto_step(["m"]) == []  # the hold starts over
        now[0] += 6
        assert await service.auto_step(["m"]) == ["m"]
        while manager.running("m"):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the audit is written after the swap's end
        record = (await manager.recent("m"))[0]
        assert record.state == SUCCEEDED, record.error
        assert servers[0].config["dynamic_batching"]["preferred_batch_size"]
        # The controller takes the new capacity at once: instances x the largest batch.
        model, slots, rate, service_s = stages.capacity[-1]
        assert model == "m" and slots > 1 and rate == pytest.approx(MODEL.capacity(slots))
        assert service_s == pytest.approx(MODEL.service_s(slots))
        change = next(c for c in await service.changes("m") if c.get("swap_id") == record.id)
        assert change["automatic"] and change["actor"] == AUTOMATIC
        assert change["outcome"] == SUCCEEDED and change["pipeline"] == "infer"
        # Inside the cool-down nothing more, however the rate moves.
        stages.rate = 2.0
        now[0] += 30
        assert await service.auto_step(["m"]) == []
        assert await service.auto_step(["m"]) == []
    finally:
        await manager.stop()
        await store.close()


async def test_tune_refuses_without_a_curve_or_an_sla(tmp_path: Any) -> None:
    store = SqliteStore(tmp_path / "state.db")
    manager = SwapManager([TritonEndpoint("prod", "127.0.0.1:1")], SwapHistory(store),
                          lambda *names: _batching_triton(), None)
    service = BatchingService(manager, store, None)
    try:
        with pytest.raises(NotFoundError, match="models profile m"):
            await service.plan("m", "")
        await store.put(CURVE_KIND, "m", MODEL.to_body())
        with pytest.raises(InvalidCurve, match="no SLA for m"):
            await service.plan("m", "")
        tuning = await service.plan("m", "", sla_ms=100)
        assert tuning.recommendation.rate_source == "assumed"
        with pytest.raises(BatchingRefused, match="consent"):
            await service.profile("m", "", ProfilePlan((1, 2)), production=True,
                                  allow_production=False)
        with pytest.raises(BatchingRefused, match="no preflight sandbox"):
            await service.profile("m", "", ProfilePlan((1, 2)), production=False,
                                  allow_production=False)
    finally:
        await manager.stop()
        await store.close()


def test_the_controller_takes_a_batching_change_s_capacity_at_once() -> None:
    now = [100.0]
    runtime = PressureRuntime(None, clock=lambda: now[0], wall=lambda: now[0] + 1e6)
    stage = Stage("model", "upstream_cluster", "triton", sla_p99_ms=100.0, triton_model="m")
    runtime.set_pipelines({"infer": Pipeline("infer", (stage,))})
    assert runtime.tick().decisions["infer"].stages[0].capacity == 0  # nothing learned yet
    runtime.set_capacity("m", 16, 571.0, 0.028)
    now[0] += 0.1
    view = runtime.tick().decisions["infer"].stages[0]
    assert view.capacity == pytest.approx(571.0)
    assert runtime.stages_of("m") == [(runtime.stages_of("m")[0][0], stage)]


def test_execute_slots_count_the_batch_a_standing_queue_forms() -> None:
    base: dict[str, Any] = {"max_batch_size": 32,
                            "instance_group": [{"count": 2, "kind": "KIND_CPU"}]}
    assert execute_slots(base) == 2
    assert execute_slots(base | {"dynamic_batching": {"preferred_batch_size": [8, 16]}}) == 32
    assert execute_slots(base | {"dynamic_batching": {}}) == 64
    assert execute_slots({"max_batch_size": 0, "dynamic_batching": {}}) == 1
