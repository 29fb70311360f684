"""The swap protocol against a model-server double that keeps Triton's rules.

The double: a load sets the version set from the override's version policy;
the highest READY version answers unversioned requests; a version loaded
without `model_warmup` answers its first request slowly (cold); a changed
config (anything but version_policy) reloads the versions that stay. The
real Triton runs in tests/integration/test_swap_triton.py.
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest

from sitsmesh.config import TritonEndpoint
from sitsmesh.state.sqlite import SqliteStore
from sitsmesh.swap.contract import Answer, ServerError, Tensor, VersionState
from sitsmesh.swap.machine import Swap, SwapEvent
from sitsmesh.swap.manager import SwapManager, SwapRefused, outcome_of
from sitsmesh.swap.override import (
    InvalidSwapInput,
    SwapOptions,
    probe_inputs,
    swap_override,
    warmup_samples,
    with_versions,
)
from sitsmesh.swap.record import SwapHistory, SwapRecord

CONFIG: dict[str, Any] = {
    "name": "m", "backend": "python",
    "version_policy": {"specific": {"versions": ["1"]}},
    "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": ["4"]}],
    "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": ["4"]}],
}
FAST, COLD = 0.002, 0.4


class FakeTriton:
    def __init__(self, label: str = "fake", versions: tuple[int, ...] = (1,)) -> None:
        self.label = label
        self.config = copy.deepcopy(CONFIG)
        self.ready: dict[int, bool] = {v: False for v in versions}  # version -> warm
        self.repository = {1, 2, 3}
        self.loads: list[dict[str, Any]] = []
        self.fail_load: set[int] = set()
        self.slow: dict[int, float] = {}
        self.never_warm: set[int] = set()
        self.busy: set[int] = set()          # versions whose finished count keeps moving
        self.down = False
        self.down_on_load = False
        self.pending_now: dict[int, int] | None = {}
        self.counts: dict[int, int] = {}

    def _check(self) -> None:
        if self.down:
            raise ServerError(f"{self.label} unreachable", unreachable=True)

    async def index(self) -> list[VersionState]:
        self._check()
        return [VersionState("m", v, "READY") for v in sorted(self.ready)] or [
            VersionState("m", 0, "UNAVAILABLE")]

    async def model_config(self, model: str) -> dict[str, Any]:
        self._check()
        return copy.deepcopy(self.config)

    async def load(self, model: str, config: dict[str, Any], timeout_s: float) -> None:
        self._check()
        if self.down_on_load:
            self.down = True
            raise ServerError(f"{self.label} unreachable during loading", unreachable=True)
        self.loads.append(config)
        wanted = {int(v) for v in config["version_policy"]["specific"]["versions"]}
        changed = {k: v for k, v in config.items() if k != "version_policy"} != {
            k: v for k, v in self.config.items() if k != "version_policy"}
        warm = bool(config.get("model_warmup"))
        ready = {}
        for version in sorted(wanted):
            if version in self.fail_load or version not in self.repository:
                continue
            stays = version in self.ready and not changed
            ready[version] = (self.ready[version] if stays
                              else warm and version not in self.never_warm)
        self.ready = ready
        self.config = copy.deepcopy(config)

    async def unload(self, model: str) -> None:
        self._check()
        self.ready = {}

    async def ready_versions(self, model: str) -> list[int]:
        self._check()
        return sorted(self.ready)

    async def infer(self, model: str, version: int | None, inputs: list[Tensor],
                    timeout_s: float) -> Answer:
        self._check()
        chosen = max(self.ready) if version is None else version
        if chosen not in self.ready:
            raise ServerError(f"version {chosen} not ready")
        seconds = self.slow.get(chosen, FAST)
        if not self.ready[chosen]:
            self.ready[chosen] = True
            seconds = COLD
        self.counts[chosen] = self.counts.get(chosen, 0) + 1
        return Answer(chosen, seconds)

    async def request_counts(self, model: str) -> dict[int, int]:
        self._check()
        for version in self.busy:
            self.counts[version] = self.counts.get(version, 0) + 1
        return dict(self.counts)

    async def pending(self, model: str) -> dict[int, int] | None:
        self._check()
        return self.pending_now

    async def close(self) -> None:
        pass


async def _nosleep(seconds: float) -> None:
    await asyncio.sleep(0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 0.01
        return self.now


@pytest.fixture
async def history(tmp_path: Path) -> Any:
    store = SqliteStore(tmp_path / "state.db")
    yield SwapHistory(store)
    await store.close()


async def _swap(history: SwapHistory, prod: FakeTriton, target: int,
                preflight: FakeTriton | None = None,
                options: SwapOptions | None = None) -> tuple[SwapRecord, list[SwapEvent]]:
    events: list[SwapEvent] = []
    record = SwapRecord("swp_test", "m", "prod", target)
    swap = Swap(record, prod, preflight, options or SwapOptions(verify_probes=5), history,
                emit=events.append, clock=Clock(), sleep=_nosleep)
    return await swap.run(), events


def _phases(record: SwapRecord) -> list[tuple[str, str]]:
    return [(s.phase, s.state) for s in record.steps]


async def test_upgrade_loads_beside_verifies_promotes_drains_and_retires(history: Any) -> None:
    prod = FakeTriton()
    prod.ready = {1: True}
    record, events = await _swap(history, prod, 2)
    assert record.state == "succeeded", record.error
    assert record.from_version == 1
    assert _phases(record) == [("precheck", "ok"), ("preflight", "skipped"), ("load", "ok"),
                               ("verify", "ok"), ("promote", "ok"), ("drain", "ok"),
                               ("retire", "ok")]
    assert sorted(prod.ready) == [2]
    policies = [c["version_policy"]["specific"]["versions"] for c in prod.loads]
    assert policies == [[1, 2], [2]]
    # Every load of the swap sends the same config apart from the version policy.
    bodies = [{k: v for k, v in c.items() if k != "version_policy"} for c in prod.loads]
    assert bodies[0] == bodies[1] and bodies[0]["model_warmup"]
    promote = record.step("promote")
    assert promote is not None
    assert promote.detail["first_request_ms"] == pytest.approx(FAST * 1000)
    assert events[-1].phase == "retire" and events[-1].fraction == 1.0
    assert (await history.get("swp_test")).state == "succeeded"


async def test_downgrade_moves_traffic_by_unloading_the_newer_version(history: Any) -> None:
    prod = FakeTriton()
    await prod.load("m", with_versions(swap_override(CONFIG, SwapOptions()), [3]), 1)
    record, _ = await _swap(history, prod, 2)
    assert record.state == "succeeded", record.error
    assert record.from_version == 3
    policies = [c["version_policy"]["specific"]["versions"] for c in prod.loads[1:]]
    assert policies == [[2, 3], [2]]  # load beside, then promote by unloading v3
    assert ("retire", "skipped") in _phases(record)
    assert sorted(prod.ready) == [2]


async def test_a_version_that_never_gets_ready_is_rolled_back(history: Any) -> None:
    prod = FakeTriton()
    prod.ready = {1: True}
    prod.fail_load = {2}
    record, _ = await _swap(history, prod, 2)
    assert record.state == "rolled_back" and outcome_of(record) == "rolled_back"
    assert "v2 did not become READY" in record.error
    assert _phases(record)[-2:] == [("load", "failed"), ("rollback", "ok")]
    assert sorted(prod.ready) == [1]


async def test_a_slow_new_version_fails_verify_and_is_rolled_back(history: Any) -> None:
    prod = FakeTriton()
    prod.ready = {1: True}
    prod.slow = {2: 0.05}
    record, _ = await _swap(history, prod, 2)
    assert record.state == "rolled_back"
    assert record.error.startswith("verify: v2 p50 50.0 ms is over 9.0 ms")
    assert sorted(prod.ready) == [1]


async def test_a_cold_first_request_fails_verify(history: Any) -> None:
    prod = FakeTriton()
    prod.ready = {1: True}
    prod.never_warm = {2}
    record, _ = await _swap(history, prod, 2)
    assert record.state == "rolled_back"
    assert "the first request took 400.0 ms" in record.error
    assert "not warm" in record.error


async def test_preflight_that_dies_keeps_the_candidate_out_of_production(
        history: Any) -> None:
    prod, sandbox = FakeTriton(), FakeTriton("sandbox", ())
    prod.ready = {1: True}
    sandbox.down_on_load = True
    record, _ = await _swap(history, prod, 2, preflight=sandbox)
    assert record.state == "failed"
    assert "sandbox went down while vetting v2" in record.error
    assert prod.loads == []  # production was never touched
    assert ("rollback", "ok") not in _phases(record)


async def test_preflight_vets_then_production_swaps(history: Any) -> None:
    prod, sandbox = FakeTriton(), FakeTriton("sandbox", ())
    prod.ready = {1: True}
    record, _ = await _swap(history, prod, 2, preflight=sandbox)
    assert record.state == "succeeded", record.error
    assert [c["version_policy"]["specific"]["versions"] for c in sandbox.loads] == [[2]]
    assert sandbox.ready == {}  # unloaded after vetting
    assert ("preflight", "ok") in _phases(record)


async def test_preflight_catches_a_cold_candidate(history: Any) -> None:
    prod, sandbox = FakeTriton(), FakeTriton("sandbox", ())
    prod.ready = {1: True}
    sandbox.never_warm = {2}
    record, _ = await _swap(history, prod, 2, preflight=sandbox)
    assert record.state == "failed"
    assert record.error.startswith("preflight: the first request took 400.0 ms")
    assert prod.loads == []


async def test_precheck_refusals_touch_nothing(history: Any) -> None:
    prod = FakeTriton()
    prod.ready = {1: True}
    record, _ = await _swap(history, prod, 1)
    assert record.state == "failed"
    assert record.error == "version 1 of m is already serving on fake"
    prod.pending_now = {1: 100}
    record, _ = await _swap(history, prod, 2)
    assert "100 requests are pending on m at fake (max_pending 64)" in record.error
    assert prod.loads == []
    # Counted apart from failures: nothing changed, so the swap-failure alert stays quiet.
    assert outcome_of(record) == "refused"


async def test_a_swap_waits_while_the_controller_sees_the_model_overloaded(
        history: Any) -> None:
    prod = FakeTriton()
    prod.ready = {1: True}
    record = SwapRecord("swp_busy", "m", "prod", 2)
    swap = Swap(record, prod, None, SwapOptions(verify_probes=5), history,
                emit=lambda event: None, clock=Clock(), sleep=_nosleep,
                pressure=lambda model: "stage demo/model is overloaded")
    done = await swap.run()
    assert done.state == "failed"
    assert done.error == ("m is under pressure (stage demo/model is overloaded): a swap adds "
                          "load; retry when it drops")
    assert prod.loads == []
    assert outcome_of(done) == "refused"


async def test_server_gone_mid_swap_fails_with_the_reason(history: Any) -> None:
    prod = FakeTriton()
    prod.ready = {1: True}
    prod.down_on_load = True
    record, _ = await _swap(history, prod, 2)
    assert record.state == "failed" and outcome_of(record) == "failed"
    assert record.error.startswith("load: fake unreachable during loading; rollback failed:")


async def test_drain_times_out_when_the_old_version_stays_busy(history: Any) -> None:
    prod = FakeTriton()
    prod.ready = {1: True}
    prod.busy = {1}
    record, _ = await _swap(history, prod, 2, options=SwapOptions(verify_probes=5,
                                                                   drain_timeout_s=0.1))
    assert record.state == "rolled_back"
    assert record.error.startswith("drain: v1 still busy after 0.1 s")
    assert sorted(prod.ready) == [1]


async def test_manager_refuses_a_second_swap_and_closes_interrupted_ones(
        history: Any) -> None:
    servers: dict[str, FakeTriton] = {}

    def factory(name: str, url: str, metrics: str) -> FakeTriton:
        server = servers[name] = FakeTriton(name)
        server.ready = {1: True}
        return server

    await history.save(SwapRecord("swp_old", "m", "prod", 2, state="running",
                                  phase="load", started_at=1.0))
    manager = SwapManager([TritonEndpoint("prod", "127.0.0.1:1")], history, factory, None)
    await manager.start()
    old = await history.get("swp_old")
    assert old.state == "interrupted"
    assert "sitsmesh stopped during load" in old.error
    first = manager.begin("m", 2, "", SwapOptions(verify_probes=5))
    with pytest.raises(SwapRefused, match=r"swap swp_\w+ is already running on model m"):
        manager.begin("m", 3, "", SwapOptions())
    events = [e async for e in first.stream()]
    assert events[-1].phase == "retire"
    assert first.task is not None and (await first.task).state == "succeeded"
    second = manager.begin("m", 3, "prod", SwapOptions(verify_probes=5))
    assert second.task is not None and (await second.task).state == "succeeded"
    assert [r.to_version for r in await manager.recent("m")] == [3, 2, 2]
    await manager.stop()


def test_warmup_and_probes_follow_the_model_inputs() -> None:
    config = {"name": "b", "max_batch_size": 8, "input": [
        {"name": "ids", "data_type": "TYPE_INT64", "dims": ["-1"]},
        {"name": "text", "data_type": "TYPE_STRING", "dims": ["2"]}]}
    [sample] = warmup_samples(config, SwapOptions(warmup_count=3, warmup_data="random"))
    assert sample["count"] == 3 and sample["batch_size"] == 1
    assert sample["inputs"]["ids"] == {"data_type": "TYPE_INT64", "dims": [1],
                                       "random_data": True}
    assert sample["inputs"]["text"] == {"data_type": "TYPE_STRING", "dims": [2],
                                        "zero_data": True}
    ids, text = probe_inputs(config, SwapOptions())
    assert (ids.datatype, ids.shape, ids.values) == ("INT64", (1, 1), (0,))
    assert (text.datatype, text.shape, text.values) == ("BYTES", (1, 2), (b"", b""))
    with pytest.raises(InvalidSwapInput, match=r"sample for ids has 3 values; the input "
                       r"takes shape \[1, 1\] \(1 values\)"):
        probe_inputs(config, SwapOptions(sample={"ids": (1, 2, 3)}))
    with pytest.raises(InvalidSwapInput, match="sample names unknown inputs: nope"):
        probe_inputs(config, SwapOptions(sample={"nope": (1,)}))
    with pytest.raises(InvalidSwapInput, match="declares no inputs"):
        warmup_samples({"name": "x"}, SwapOptions())


def test_a_model_with_its_own_warmup_keeps_it() -> None:
    own = {**CONFIG, "model_warmup": [{"name": "mine", "batch_size": 1, "inputs": {}}]}
    assert swap_override(own, SwapOptions())["model_warmup"] == own["model_warmup"]
    assert with_versions(own, [3, 1, 3])["version_policy"] == {"specific": {"versions": [1, 3]}}


@pytest.mark.parametrize(("options", "message"), [
    (SwapOptions(warmup_count=0), "warmup_count must be 1-1000, got 0"),
    (SwapOptions(warmup_data="ones"), "warmup_data must be zero or random, got 'ones'"),
    (SwapOptions(verify_probes=0), "verify_probes must be 1-10000, got 0"),
    (SwapOptions(max_latency_ratio=0.5), "max_latency_ratio must be at least 1, got 0.5"),
    (SwapOptions(drain_timeout_s=-1), "drain_timeout_s must be 0-3600, got -1"),
])
def test_bad_options_are_named(options: SwapOptions, message: str) -> None:
    with pytest.raises(InvalidSwapInput, match=message):
        options.validate()
